"""OpenAI's model names on the box: `GET /v1/models` and `/v1/models/{id}` in OpenAI's shape (the
firmware's models, and OpenAI's names a served model answers to), and the choice of the
speech_to_text model behind a name.

`whisper-1`, `gpt-4o-transcribe` and `gpt-4o-mini-transcribe` take the best served model for the
request: one that can do the task in the language (a multilingual one where the language is not
English or not given, so it is detected), the largest among those. A name that is neither such an
alias nor a served model is a 404 naming the served ones.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from datetime import datetime

from appliance.api.bodies import openai_errors
from appliance.api.openai_speech import OPENAI_MODELS as SPEECH_ALIASES
from appliance.api.routes import Route
from appliance.errors import ApiError, BadRequest, NotFound
from appliance.firmware import Manifest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Speaker, Transcriber, VoicePrinter
from appliance.protocol.messages import Request, Response, json_response

TRANSCRIPTION_ALIASES = ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe")
DIARIZED_MODEL = "gpt-4o-transcribe-diarize"  # OpenAI's transcription with speakers: where a firmware has voiceprints


def routes(models: Mapping[str, ServedModel], manifest: Manifest) -> list[Route]:
    async def listing(request: Request, params: dict[str, str]) -> Response:
        return json_response(200, {"object": "list", "data": [_entry(n, manifest) for n in _names(models)]})

    async def one(request: Request, params: dict[str, str]) -> Response:
        name = params["id"]
        if name not in _names(models):
            raise NotFound(f"The model '{name[:80]}' does not exist (served: {', '.join(_names(models))})")
        return json_response(200, _entry(name, manifest))

    return [
        ("GET", re.compile(r"/v1/models/?"), "openai_models", lambda r, p: openai_errors(listing(r, p))),
        ("GET", re.compile(r"/v1/models/(?P<id>[^/]+)"), "openai_model", lambda r, p: openai_errors(one(r, p))),
    ]


def _names(models: Mapping[str, ServedModel]) -> list[str]:
    """The served models, then OpenAI's names some served model answers to."""
    aliases: list[str] = []
    if any(isinstance(m, Transcriber) for m in models.values()):
        aliases += TRANSCRIPTION_ALIASES
        if any(isinstance(m, VoicePrinter) for m in models.values()):
            aliases.append(DIARIZED_MODEL)
    if any(isinstance(m, Speaker) for m in models.values()):
        aliases += SPEECH_ALIASES
    return [*models, *(a for a in aliases if a not in models)]


def _entry(name: str, manifest: Manifest) -> dict[str, object]:
    return {"id": name, "object": "model", "created": _created(manifest), "owned_by": manifest.name}


def _created(manifest: Manifest) -> int:
    """The firmware's build time as Unix seconds (OpenAI's `created`); 0 where it does not parse."""
    try:
        return int(datetime.fromisoformat(manifest.built_at.replace("Z", "+00:00")).timestamp())
    except ValueError:
        return 0


def speech_to_text(models: Mapping[str, ServedModel], name: str, task: str, language: str | None) -> Transcriber:
    """The model a transcription or translation names (a served one, or the best for an OpenAI name)."""
    if not name:
        raise BadRequest("the form needs a 'model' field", param="model")
    chosen = models.get(name)
    speech = [m for m in models.values() if isinstance(m, Transcriber)]
    if chosen is not None:
        if not isinstance(chosen, Transcriber):
            raise BadRequest(f"model {name!r} is a {chosen.spec.kind} model, not speech_to_text", param="model")
        return chosen
    if name not in (*TRANSCRIPTION_ALIASES, DIARIZED_MODEL):
        served = ", ".join(m.name for m in speech) or "none"
        raise ApiError(
            f"The model '{name[:80]}' does not exist (speech_to_text models served: {served})", 404, param="model"
        )
    able = [m for m in speech if _can(m, task, language)]
    if not able and language is None and task == "transcribe":
        able = speech  # only English-only models are served: English is what they hear
    if not able:
        what = "translate" if task == "translate" else f"transcribe {language!r}"
        raise BadRequest(f"no served speech_to_text model can {what} (served: {', '.join(m.name for m in speech)})")
    return max(able, key=lambda m: m.weight_bytes)


def _can(model: Transcriber, task: str, language: str | None) -> bool:
    if not model.multilingual:
        return task == "transcribe" and language == "en"
    return language is None or language in model.languages
