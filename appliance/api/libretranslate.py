"""LibreTranslate's routes on the firmware's translation models: `POST /translate`, `POST /detect` and
`GET /languages`, the API offline translation apps already script against.

`/detect` takes `q` and answers `[{"language", "confidence"}]`, best first, confidence 0 to 100 as
LibreTranslate's; `source: "auto"` on `/translate` detects each text's language and answers with
`detectedLanguage` beside `translatedText` (a list of them where `q` is a list), as LibreTranslate does.
Both ask the firmware's language identification model (kind `language_identification`).

`/translate` takes a JSON body or a form (urlencoded), as LibreTranslate does: `q` (a string, or a
list of strings in JSON), `source` and `target` (codes in any case: LibreTranslate lower-cases them),
`format` (`text`, or `html`: the text between tags translated, the tags kept, kinds/markup.py),
`alternatives` and `api_key` (the access gate's). The answer is `{"translatedText": ...}`, a string or a
list like `q`, with `alternatives` where more than 0 were asked: a list per text, always empty here,
as the engine (fxtranslate) gives one translation and no n-best.
`GET /frontend/settings` answers what LibreTranslate's frontend and clients read there, true of this box:
its character limit, whether keys are in use and needed by this caller, no suggestions and no files,
and the first pair as the default languages.
Each (source, target) pair is a model of the firmware (kind `text_translation`): a new pair is a new
firmware, nothing here changes.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Callable, Collection, Iterable, Mapping

from appliance.api.bodies import json_or_form
from appliance.api.routes import Route
from appliance.errors import BadRequest, NotFound
from appliance.kinds import markup
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import LanguageDetector, Translator
from appliance.kinds.text import MAX_TEXT_CHARS, checked_text
from appliance.protocol.messages import Request, Response, json_response

DETECT_CANDIDATES = 3  # /detect's answers, best first
FORMATS = ("text", "html")
FRONTEND_TIMEOUT_MS = 500  # LibreTranslate's default: how long its frontend waits after typing to translate

# Names for the languages Bergamot models exist for; a code without one is shown as itself.
NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish", "de": "German",
    "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish",
    "fr": "French", "hu": "Hungarian", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "lt": "Lithuanian", "lv": "Latvian", "nb": "Norwegian", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "zh": "Chinese",
}  # fmt: skip


def routes(
    models: Mapping[str, ServedModel], keys_in_use: Callable[[], bool], needs_key: Callable[[Request], bool]
) -> list[Route]:
    return [
        (
            "GET",
            re.compile(r"/frontend/settings"),
            "frontend_settings",
            lambda r, p: settings(models.values(), keys_in_use(), needs_key(r)),
        ),
        ("POST", re.compile(r"/translate"), "translate", lambda r, p: translate(models.values(), r)),
        ("GET", re.compile(r"/languages"), "languages", lambda r, p: languages(models.values(), r)),
        ("POST", re.compile(r"/detect"), "detect", lambda r, p: detect(models.values(), r)),
    ]


def _detector(models: Iterable[ServedModel]) -> LanguageDetector:
    found = next((m for m in models if isinstance(m, LanguageDetector)), None)
    if found is None:
        raise BadRequest(
            "this firmware has no language identification model to detect languages: give the source's code"
        )
    return found


def _detected(
    detector: LanguageDetector, text: str, among: Collection[str], candidates: int = 1
) -> list[dict[str, object]]:
    """As LibreTranslate detects: among the languages it translates (GET /languages), best first."""
    found = detector.detect(text, candidates, among)
    return [{"language": code, "confidence": round(p * 100, 1)} for code, p in found]


async def detect(models: Iterable[ServedModel], request: Request) -> Response:
    detector = _detector(models)
    q = (await json_or_form(request)).get("q")
    text = checked_text(q, "q")
    return json_response(200, _detected(detector, text, _codes(_pairs(models)), DETECT_CANDIDATES))


def _pairs(models: Iterable[ServedModel]) -> dict[tuple[str, str], Translator]:
    return {(m.source, m.target): m for m in models if isinstance(m, Translator)}


def _codes(pairs: Iterable[tuple[str, str]]) -> list[str]:
    """The languages translated from or to."""
    return sorted({code for pair in pairs for code in pair})


async def languages(models: Iterable[ServedModel], request: Request) -> Response:
    pairs = _pairs(models)
    codes = _codes(pairs)
    return json_response(
        200,
        [{"code": c, "name": NAMES.get(c, c), "targets": sorted(t for s, t in pairs if s == c)} for c in codes],
    )


async def settings(models: Iterable[ServedModel], keys_in_use: bool, key_required: bool) -> Response:
    pairs = sorted(_pairs(models))
    if not pairs:
        raise NotFound("this firmware has no translation model")
    source, target = pairs[0]
    return json_response(
        200,
        {
            "charLimit": MAX_TEXT_CHARS,  # one request's texts in all
            "frontendTimeout": FRONTEND_TIMEOUT_MS,
            "apiKeys": keys_in_use,
            "keyRequired": key_required,
            "suggestions": False,  # no /suggest: the models are the firmware's, not learned here
            "filesTranslation": False,
            "supportedFilesFormat": [],
            "language": {
                "source": {"code": source, "name": NAMES.get(source, source)},
                "target": {"code": target, "name": NAMES.get(target, target)},
            },
        },
    )


async def translate(models: Iterable[ServedModel], request: Request) -> Response:
    fields = await json_or_form(request)
    source, target, text_format = fields.get("source"), fields.get("target"), fields.get("format", "text")
    alternatives = _alternatives(fields.get("alternatives", 0))
    if text_format not in FORMATS:
        raise BadRequest(f"format {str(text_format)[:40]!r} is not served (one of: {', '.join(FORMATS)})")
    pairs = _pairs(models)
    if not isinstance(source, str) or not isinstance(target, str):
        raise BadRequest("'source' and 'target' must be language codes (GET /languages lists them)")
    source, target = source.lower(), target.lower()
    detector = _detector(models) if source == "auto" else None
    q = fields.get("q")
    texts = q if isinstance(q, list) else [q]
    if not texts:
        raise BadRequest("q is an empty list: there is no text to translate")
    checked = [checked_text(t, f"q[{i}]" if isinstance(q, list) else "q") for i, t in enumerate(texts)]
    if sum(map(len, checked)) > MAX_TEXT_CHARS:
        raise BadRequest(f"q holds more than {MAX_TEXT_CHARS} characters in all; send fewer at once", 413)
    detected = [_detected(detector, t, _codes(pairs))[0] for t in checked] if detector is not None else []
    sources = [str(d["language"]) for d in detected] or [source] * len(checked)
    chosen = [_pair(pairs, s, target) for s in sources]
    html = text_format == "html"
    translated = await asyncio.gather(*(_translate(m, t, html) for m, t in zip(chosen, checked)))
    answer: dict[str, object] = {"translatedText": translated if isinstance(q, list) else translated[0]}
    if detected:
        answer["detectedLanguage"] = detected if isinstance(q, list) else detected[0]
    if alternatives > 0:  # none to give: one translation per text is all the engine makes
        answer["alternatives"] = [[] for _ in checked] if isinstance(q, list) else []
    return json_response(200, answer)


def _alternatives(raw: object) -> int:
    """How many other translations are asked for (a number in JSON, a form's text), 0 at least."""
    if isinstance(raw, int) and not isinstance(raw, bool):
        return max(0, raw)
    if isinstance(raw, str):
        try:
            return max(0, int(raw))
        except ValueError:
            pass
    raise BadRequest(f"'alternatives' must be a whole number, got {str(raw)[:20]!r}")


def _pair(pairs: dict[tuple[str, str], Translator], source: str, target: str) -> Translator | None:
    """The pair from source to target; None where they are one language (the text comes back as it is)."""
    if source == target and any(target in pair for pair in pairs):
        return None
    model = pairs.get((source, target))
    if model is None:
        served = ", ".join(f"{s}->{t}" for s, t in sorted(pairs)) or "none"
        raise BadRequest(f"no translation from {source[:20]!r} to {target[:20]!r} (pairs: {served})")
    return model


async def _translate(model: Translator | None, text: str, html: bool) -> str:
    if model is None:
        return text
    return await (markup.translated(text, model.translate) if html else model.translate(text))
