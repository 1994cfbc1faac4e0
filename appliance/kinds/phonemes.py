"""Piper's phoneme ids for a text, with IPA phonemes from the `espeak-ng` program.

Piper itself (GPL-3.0) links libespeak-ng (GPL-3.0) and asks it for each clause's IPA and the
punctuation that ended it. The daemon runs the `espeak-ng` program as a helper process instead, one
per request, so no GPL code is linked into it (docs/speech-and-translation.md, the licences). The
program does not report terminators, so clauses are cut here (kinds/text.py, as espeak-ng cuts them) and sent one
per line, each followed by an empty line: espeak-ng answers an empty line with an empty line, which
marks where a clause's phonemes end, and a clause it says nothing for (U+1D7E0, a digit it has no
word for) with an empty line of its own, so a clause's answer is its first line, empty or not, and
the lines up to the next empty one. One process answers every clause of a request. The ids are then made the way Piper makes them: language-switch
flags dropped, the terminator kept as a phoneme (with a space after , ; :), NFD code points, BOS,
a pad after every phoneme, EOS.
"""

from __future__ import annotations

import asyncio
import json
import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from appliance.errors import ApplianceError
from appliance.kinds.text import Clause

ESPEAK = "espeak-ng"
LANGUAGE_FLAG = re.compile(r"\([^)]+\)")  # espeak-ng's "(fr)...(en)" around words of another language
BOS, EOS, PAD = "^", "$", "_"


@dataclass(frozen=True, slots=True)
class Voice:
    """What a Piper voice's .onnx.json says about making its input and reading its output."""

    sample_rate: int
    espeak_voice: str
    language: str  # the language it speaks, as a two-letter code ("en")
    phoneme_ids: dict[str, list[int]]
    noise_scale: float
    length_scale: float
    noise_w: float
    hop_length: int  # audio samples per unit of the duration predictor's output

    @classmethod
    def from_config(cls, path: Path) -> Voice:
        try:
            doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
            if doc.get("phoneme_type", "espeak") != "espeak":
                raise ApplianceError(f"{path}: phoneme_type {doc['phoneme_type']!r}: only espeak voices are served")
            inference = doc.get("inference", {})
            return cls(
                sample_rate=int(doc["audio"]["sample_rate"]),
                espeak_voice=str(doc["espeak"]["voice"]),
                language=str(doc.get("language", {}).get("family") or doc["espeak"]["voice"].split("-")[0]),
                phoneme_ids={str(k): [int(i) for i in v] for k, v in doc["phoneme_id_map"].items()},
                noise_scale=float(inference.get("noise_scale", 0.667)),
                length_scale=float(inference.get("length_scale", 1.0)),
                noise_w=float(inference.get("noise_w", 0.8)),
                hop_length=int(doc.get("hop_length", 256)),
            )
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ApplianceError(f"{path}: not a Piper voice config: {exc}") from None

    def ids(self, phonemes: list[str]) -> list[int]:
        """Piper's ids: BOS, then each phoneme followed by a pad, then EOS; unknown phonemes are skipped."""
        table, pad = self.phoneme_ids, self.phoneme_ids[PAD]
        out = [*table[BOS], *pad]
        for phoneme in phonemes:
            if phoneme in table:
                out += [*table[phoneme], *pad]
        return out + table[EOS]


@dataclass(frozen=True, slots=True)
class Phonemes:
    """One clause's phonemes (terminator included) and whether a sentence ends with it."""

    phonemes: list[str]
    ends_sentence: bool


async def phonemize(clauses: list[Clause], espeak_voice: str, tie: bool = False) -> list[Phonemes]:
    """Each clause's phonemes, as Piper would make them; clauses with nothing to say (no letter or
    digit, or none espeak-ng has a word for) are dropped.
    `tie`: a ^ joins the letters of one phoneme (Kokoro's affricates and diphthongs, kinds/kokoro.py)."""
    sayable = [c for c in clauses if any(ch.isalnum() for ch in c.text)]
    if not sayable:
        return []
    flags = ["--tie=^"] if tie else []
    lines = await _espeak([c.text + c.terminator for c in sayable], espeak_voice, flags)
    if len(lines) != len(sayable):
        raise ApplianceError(f"{ESPEAK} answered {len(lines)} clauses for {len(sayable)}: its output is not understood")
    out = []
    for clause, ipa in zip(sayable, lines):
        said = LANGUAGE_FLAG.sub("", ipa)
        if not said.strip():
            continue  # espeak-ng says nothing for it: no terminator spoken alone either
        text = said + clause.terminator + (" " if clause.terminator in (",", ";", ":") else "")
        out.append(Phonemes(list(unicodedata.normalize("NFD", text)), clause.ends_sentence))
    return out


async def _espeak(texts: list[str], espeak_voice: str, flags: list[str]) -> list[str]:
    """The IPA of each text (its clauses joined by spaces), from one espeak-ng process."""
    try:
        process = await asyncio.create_subprocess_exec(
            ESPEAK, "-q", "--ipa", *flags, "-v", espeak_voice,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
    except OSError as exc:
        raise ApplianceError(f"cannot run {ESPEAK} for phonemes: {exc}") from None
    # one text per line (a line break inside one would start another), each followed by an empty line
    stdin = "".join(" ".join(t.split()) + "\n\n" for t in texts).encode()
    try:
        stdout, stderr = await process.communicate(stdin)
    finally:
        if process.returncode is None:  # cancelled (the client left): the text is not read to its end
            process.kill()
            await asyncio.shield(process.wait())
    if process.returncode != 0:
        raise ApplianceError(f"{ESPEAK} failed ({process.returncode}): {stderr.decode(errors='replace').strip()}")
    groups: list[str] = []
    current: list[str] | None = None  # the lines of the text being answered
    for line in stdout.decode("utf-8", "replace").split("\n")[:-1]:
        if current is None:  # its first line: its phonemes, or empty where it says nothing
            current = [line.strip()]
        elif line.strip():
            current.append(line.strip())
        else:
            groups.append(" ".join(filter(None, current)))
            current = None
    return groups
