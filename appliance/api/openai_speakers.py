"""The speaker fields of OpenAI's transcription form: whether a request asks who spoke
(response_format diarized_json, model gpt-4o-transcribe-diarize, known speakers or a speaker count),
the speaker count it allows (`min_speakers`, `max_speakers`: the box's own fields), and its known
speakers (`known_speaker_names[]` with `known_speaker_references[]`, short clips as data URLs, up to
MAX_KNOWN, each 2 to 10 s as OpenAI takes them). Errors name the field at fault.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping

import numpy as np

from appliance.api.openai_models import DIARIZED_MODEL
from appliance.errors import ApiError, BadRequest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Transcriber, VoicePrinter
from appliance.kinds.diarize import SpeakerCount, speaker_count
from appliance.kinds.speech_api import SAMPLE_RATE

NAMES, REFERENCES = "known_speaker_names[]", "known_speaker_references[]"
MAX_KNOWN = 4  # OpenAI's limit
REFERENCE_SECONDS = (2.0, 10.0)  # OpenAI's bounds on a reference clip
MAX_NAME_CHARS = 64


def asked(fields: Mapping[str, str], lists: Mapping[str, list[str]], diarized_format: bool) -> bool:
    return (
        diarized_format
        or fields.get("model") == DIARIZED_MODEL
        or bool(lists[NAMES] or lists[REFERENCES])
        or "min_speakers" in fields
        or "max_speakers" in fields
    )


def printer(models: Mapping[str, ServedModel]) -> VoicePrinter:
    found = next((m for m in models.values() if isinstance(m, VoicePrinter)), None)
    if found is None:
        raise BadRequest(
            "this firmware has no speaker_embedding model: it cannot tell who spoke", param="response_format"
        )
    return found


def count(fields: Mapping[str, str], lists: Mapping[str, list[str]]) -> SpeakerCount:
    """The speaker count the form allows; its known speakers' names checked against their clips."""
    allowed = speaker_count(fields)
    names, references = lists[NAMES], lists[REFERENCES]
    if len(names) != len(references):
        raise BadRequest(
            f"{len(names)} known_speaker_names[] but {len(references)} known_speaker_references[]: one name per clip",
            param=NAMES,
        )
    if len(names) > MAX_KNOWN:
        raise BadRequest(f"at most {MAX_KNOWN} known speakers, got {len(names)}", param=NAMES)
    for name in names:
        if not name.strip() or len(name) > MAX_NAME_CHARS:
            raise BadRequest(
                f"a known speaker's name is 1 to {MAX_NAME_CHARS} characters, got {name[:80]!r}", param=NAMES
            )
    if len(set(names)) != len(names):
        raise BadRequest("known_speaker_names[] holds a name twice", param=NAMES)
    return allowed


async def known(
    printer: VoicePrinter, transcriber: Transcriber, lists: Mapping[str, list[str]]
) -> dict[str, np.ndarray]:
    """Each known speaker's voiceprint, from their reference clip."""
    found = {}
    for i, (name, url) in enumerate(zip(lists[NAMES], lists[REFERENCES])):
        where = f"{REFERENCES} {i} ({name[:40]})"
        try:
            samples = await transcriber.recording(_data_url(url, where))
        except ApiError as exc:
            raise BadRequest(f"{where}: {exc.message}", param=REFERENCES) from None
        seconds = len(samples) / SAMPLE_RATE
        low, high = REFERENCE_SECONDS
        if not low <= seconds <= high:
            raise BadRequest(f"{where} is {seconds:.1f} s long; a reference is {low:g} to {high:g} s", param=REFERENCES)
        found[name] = await printer.utterance(samples)
    return found


def _data_url(url: str, where: str) -> bytes:
    """The bytes of a data URL (`data:audio/wav;base64,...`)."""
    head, comma, data = url.partition(",")
    if not head.startswith("data:") or not comma:
        raise BadRequest(f"{where} must be a data URL (data:audio/wav;base64,...), got {url[:40]!r}", param=REFERENCES)
    if not head.endswith(";base64"):
        raise BadRequest(f"{where}: the data URL must be base64 (;base64,)", param=REFERENCES)
    try:
        return base64.b64decode(data, validate=True)
    except (binascii.Error, ValueError):
        raise BadRequest(f"{where}: its base64 does not decode", param=REFERENCES) from None
