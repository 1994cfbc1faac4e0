"""Model kinds: how the requests of each kind become engine batches and answers. `base.py` says what a
kind provides; a firmware spec's `kind` picks the factory registered here. A new kind is a module in
this package, a line in KINDS and its parameters in firmware/kind_parameters.py KIND_PARAMETERS.

The registry is lazy: a kind's module (and its engine's library: CTranslate2 for speech_to_text,
fxtranslate and sentencepiece for text_translation) is imported only when the firmware lists a model
of that kind, so a VAD-only firmware starts without them.
"""

import importlib
from collections.abc import Callable, Mapping

from appliance.config import Live
from appliance.firmware import Bundle, ModelSpec
from appliance.kinds.base import ServedModel

# A kind's factory: its manifest entry, the bundle (its files), the live config, and the models loaded
# before it in the firmware's order (a model built on others finds them there).
Factory = Callable[[ModelSpec, Bundle, Live, Mapping[str, ServedModel]], ServedModel]

# kind -> "module:class" under appliance.kinds, imported when a firmware first uses the kind; the class
# is the factory: (spec, bundle, live, loaded)
KINDS: dict[str, str] = {
    "vad": "vad:VadModel",
    "onnx": "onnx:OnnxModel",
    "speech_synthesis": "speech:SpeechModel",
    "kokoro_speech": "kokoro:KokoroModel",
    "language_identification": "language_id:LanguageIdentifier",
    "text_translation": "translation:TranslationModel",
    "speech_to_text": "speech_to_text:SpeechToText",
    "speech_pipeline": "pipeline:SpeechPipeline",
    "wake_word": "wake_word:WakeWordModel",
    "speaker_embedding": "speaker_embedding:SpeakerEncoder",
}


def factory(kind: str) -> Factory:
    """The factory of `kind`, its module imported now."""
    module, _, name = KINDS[kind].partition(":")
    found: Factory = getattr(importlib.import_module(f"appliance.kinds.{module}"), name)
    return found


def load_models(
    bundle: Bundle, live: Live, loaded_one: Callable[[str], None] = lambda _: None
) -> dict[str, ServedModel]:
    """Every model of the firmware, in its order; `loaded_one(name)` after each (start-up progress)."""
    loaded: dict[str, ServedModel] = {}
    for spec in bundle.manifest.models:
        loaded[spec.name] = factory(spec.kind)(spec, bundle, live, loaded)
        loaded_one(spec.name)
    return loaded


__all__ = ["KINDS", "ServedModel", "factory", "load_models"]
