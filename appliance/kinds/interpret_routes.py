"""The route a segment of speech takes to a target language, by quality, as plain data: the best path
first. Measured on the interpreter firmware (issue 39): Portuguese speech to English by Whisper base's
translate gave "The train leaves at 3 am", the pt-en pair "three in the afternoon"; so a pair wins.

1. Heard in the target language: spoken as heard.
2. A direct pair from the language heard to the target (pt -> en by Bergamot).
3. English as a pivot between two pairs (pt -> en -> X where there is no pt -> X).
4. Whisper's translate to English where no pair leaves the language (es, fr, it...), then the pair from
   English to the target where that is not English (es -> en -> pt).
Else there is no route: the segment is not spoken, its line says why.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from appliance.errors import BadRequest

PIVOT = "en"  # Whisper translates into it, and the firmware's pairs meet in it
ANY = "*"  # speech in any language no text route leaves


@dataclass(frozen=True, slots=True)
class Route:
    """How one segment heard in one language reaches the target."""

    whisper_translates: bool  # Whisper decodes the speech as English text (its translate task)
    pairs: tuple[tuple[str, str], ...]  # then these text pairs, in order (source, target)

    def steps(self, speech_to_text: str, voice: str) -> list[str]:
        """The models it goes through, as the answers name them."""
        heard = f"{speech_to_text} (translate)" if self.whisper_translates else speech_to_text
        return [heard, *(f"{s}-{t}" for s, t in self.pairs), voice]


def route(language: str, target: str, pairs: set[tuple[str, str]], multilingual: bool) -> Route | None:
    """The best route from speech heard in `language` to `target`; None where there is none."""
    if language == target:
        return Route(False, ())
    if (language, target) in pairs:
        return Route(False, ((language, target),))
    if (language, PIVOT) in pairs and (PIVOT, target) in pairs:
        return Route(False, ((language, PIVOT), (PIVOT, target)))
    if multilingual and language != PIVOT and (target == PIVOT or (PIVOT, target) in pairs):
        return Route(True, () if target == PIVOT else ((PIVOT, target),))
    return None


def asked(target: str | None, languages: str | None) -> tuple[str, ...]:
    """The targets a request asks for: one way to `target`, or conversation mode between the two
    `languages` ("en,pt"); none where it asks for neither. A 400 for languages that are not two."""
    if target:
        return (target.lower(),)
    if not languages:
        return ()
    found = tuple(dict.fromkeys(code.strip().lower() for code in languages.split(",")))
    if len(found) != 2:
        raise BadRequest(f"languages must be two language codes, as 'en,pt', got {languages[:40]!r}")
    return found


def target_of(targets: tuple[str, ...], heard: str) -> str:
    """The language a turn heard in `heard` goes into: one way, the one target; in conversation mode
    (two targets), the other one (a turn in neither goes into the first)."""
    return targets[1] if len(targets) == 2 and heard == targets[0] else targets[0]


def transcribed(targets: tuple[str, ...], pairs: set[tuple[str, str]], multilingual: bool) -> tuple[str, ...]:
    """The languages whose speech is transcribed on the way to its target (a text route leaves them);
    Whisper translates any other (sorted: Options are compared and hashed)."""
    sources = {*targets, PIVOT, *(s for s, _ in pairs)}
    found = [
        s for s in sources if (r := route(s, target_of(targets, s), pairs, multilingual)) and not r.whisper_translates
    ]
    return tuple(sorted(found))


def sources(targets: tuple[str, ...], pairs: set[tuple[str, str]]) -> list[str]:
    """The languages a text route may leave on the way to `targets`, then ANY."""
    return [*sorted({*targets, PIVOT, *(s for s, _ in pairs)}), ANY]


def routes_from(
    heard: list[str], target: Callable[[str], str], pairs: set[tuple[str, str]], multilingual: bool
) -> list[tuple[str, str, Route]]:
    """(language heard, its target, its route) for each of `heard` that a route leaves; ANY where
    Whisper's translate takes speech in any other language."""
    out = []
    for language in heard:
        found = route("" if language == ANY else language, target(language), pairs, multilingual)
        if found is not None and (language != ANY or found.whisper_translates):
            out.append((language, target(language), found))
    return out
