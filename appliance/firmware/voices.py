"""Kokoro's voices as a firmware holds them: one style table per voice, `voices/NAME.bin` in the model's
directory, raw little-endian float32 of shape (STYLE_ROWS, 1, STYLE_DIM) as kokoro-js ships them (row n
is the style for a shard of n phoneme tokens). A voice's language is the first letter of its name, as
Kokoro names its voices; the build refuses a voice of another language or a table of the wrong size."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from appliance.errors import ApplianceError

STYLE_ROWS, STYLE_DIM = 510, 256
STYLE_BYTES = STYLE_ROWS * STYLE_DIM * 4
MAX_PHONEME_TOKENS = STYLE_ROWS  # Kokoro's context is 512 ids: the phonemes and a pad at each end


@dataclass(frozen=True, slots=True)
class KokoroLanguage:
    code: str  # two-letter code, as Whisper and the translation pairs name it
    espeak_voice: str  # the espeak-ng voice that makes its phonemes


# Kokoro's language letters (its voices' first letter) that espeak-ng phonemizes for it.
LANGUAGES = {
    "p": KokoroLanguage("pt", "pt-br"),
    "e": KokoroLanguage("es", "es"),
    "f": KokoroLanguage("fr", "fr-fr"),
    "i": KokoroLanguage("it", "it"),
}


def voice_file(name: str) -> str:
    return f"voices/{name}.bin"


def language_of(name: str, where: str) -> KokoroLanguage:
    found = LANGUAGES.get(name[:1])
    if found is None or name[1:2] not in ("f", "m") or name[2:3] != "_":
        letters = ", ".join(f"{k} ({v.code})" for k, v in LANGUAGES.items())
        raise ApplianceError(f"{where}: voice {name!r} is not a Kokoro voice of a served language ({letters})")
    return found


def check_style_table(path: Path, where: str) -> None:
    """A voice's style table must be the size Kokoro reads: a truncated or foreign file fails the build."""
    if not path.is_file():
        raise ApplianceError(f"{where}: voice file {path.name} is missing (assemble it from the kokoro-js voices)")
    if (size := path.stat().st_size) != STYLE_BYTES:
        raise ApplianceError(
            f"{where}: voice file {path.name} is {size} bytes, not a style table of {STYLE_ROWS}x{STYLE_DIM} "
            f"float32 ({STYLE_BYTES} bytes)"
        )
