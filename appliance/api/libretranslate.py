"""LibreTranslate's routes on the firmware's translation models: `POST /translate` and
`GET /languages`, the API offline translation apps already script against.

`/translate` takes a JSON body or a form (urlencoded), as LibreTranslate does: `q` (a string, or a
list of strings in JSON), `source`, `target`, `format` (`text`; `html` is not served), and ignores
`api_key` and `alternatives`. The answer is `{"translatedText": ...}`, a string or a list like `q`.
Each (source, target) pair is a model of the firmware (kind `text_translation`): a new pair is a new
firmware, nothing here changes.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Mapping

from appliance.api.bodies import json_or_form
from appliance.api.routes import Route
from appliance.errors import BadRequest
from appliance.kinds.base import ServedModel
from appliance.kinds.capabilities import Translator
from appliance.kinds.text import MAX_TEXT_CHARS, checked_text
from appliance.protocol.messages import Request, Response, json_response

# Names for the languages Bergamot models exist for; a code without one is shown as itself.
NAMES = {
    "ar": "Arabic", "bg": "Bulgarian", "ca": "Catalan", "cs": "Czech", "da": "Danish", "de": "German",
    "el": "Greek", "en": "English", "es": "Spanish", "et": "Estonian", "fa": "Persian", "fi": "Finnish",
    "fr": "French", "hu": "Hungarian", "is": "Icelandic", "it": "Italian", "ja": "Japanese", "ko": "Korean",
    "lt": "Lithuanian", "lv": "Latvian", "nb": "Norwegian", "nl": "Dutch", "pl": "Polish", "pt": "Portuguese",
    "ro": "Romanian", "ru": "Russian", "sk": "Slovak", "sl": "Slovenian", "sv": "Swedish", "tr": "Turkish",
    "uk": "Ukrainian", "zh": "Chinese",
}  # fmt: skip


def routes(models: Mapping[str, ServedModel]) -> list[Route]:
    return [
        ("POST", re.compile(r"/translate"), "translate", lambda r, p: translate(models.values(), r)),
        ("GET", re.compile(r"/languages"), "languages", lambda r, p: languages(models.values(), r)),
    ]


def _pairs(models: Iterable[ServedModel]) -> dict[tuple[str, str], Translator]:
    return {(m.source, m.target): m for m in models if isinstance(m, Translator)}


async def languages(models: Iterable[ServedModel], request: Request) -> Response:
    pairs = _pairs(models)
    codes = sorted({code for pair in pairs for code in pair})
    return json_response(
        200,
        [{"code": c, "name": NAMES.get(c, c), "targets": sorted(t for s, t in pairs if s == c)} for c in codes],
    )


async def translate(models: Iterable[ServedModel], request: Request) -> Response:
    fields = await json_or_form(request)
    source, target, text_format = fields.get("source"), fields.get("target"), fields.get("format", "text")
    if text_format != "text":
        raise BadRequest(f"format {str(text_format)[:40]!r} is not served (only 'text')")
    pairs = _pairs(models)
    if not isinstance(source, str) or not isinstance(target, str):
        raise BadRequest("'source' and 'target' must be language codes (GET /languages lists them)")
    if source == "auto":
        raise BadRequest("source 'auto': this box does not detect languages; give the source language's code")
    model = pairs.get((source, target))
    if model is None:
        served = ", ".join(f"{s}->{t}" for s, t in sorted(pairs)) or "none"
        raise BadRequest(f"no translation from {source[:20]!r} to {target[:20]!r} (pairs: {served})")
    q = fields.get("q")
    texts = q if isinstance(q, list) else [q]
    if not texts:
        raise BadRequest("q is an empty list: there is no text to translate")
    checked = [checked_text(t, f"q[{i}]" if isinstance(q, list) else "q") for i, t in enumerate(texts)]
    if sum(map(len, checked)) > MAX_TEXT_CHARS:
        raise BadRequest(f"q holds more than {MAX_TEXT_CHARS} characters in all; send fewer at once", 413)
    translated = await asyncio.gather(*(model.translate(t) for t in checked))
    return json_response(200, {"translatedText": translated if isinstance(q, list) else translated[0]})
