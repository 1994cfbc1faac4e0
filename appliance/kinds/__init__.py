"""Model kinds: how the requests of each kind become engine batches and answers. `base.py` says what a
kind provides; a firmware spec's `kind` picks the factory registered here. A new kind is a module in
this package, a line in KINDS and its parameters in firmware/manifest.py KIND_PARAMETERS."""

from collections.abc import Callable, Mapping

from appliance.config import Live
from appliance.engine.choice import load_engine
from appliance.engine.interface import Engine
from appliance.firmware import Bundle, ModelSpec
from appliance.kinds.base import ServedModel
from appliance.kinds.onnx import OnnxModel
from appliance.kinds.pipeline import SpeechPipeline
from appliance.kinds.speech import SpeechModel
from appliance.kinds.speech_to_text import SpeechToText
from appliance.kinds.translation import TranslationModel
from appliance.kinds.vad import VadModel

# A kind's factory: its manifest entry, the bundle (its files), the live config, and the models loaded
# before it in the firmware's order (a model built on others finds them there).
Factory = Callable[[ModelSpec, Bundle, Live, Mapping[str, ServedModel]], ServedModel]


def _engine_for(spec: ModelSpec, bundle: Bundle, live: Live) -> Engine:
    engine = live.config.engine
    return load_engine(engine.device, bundle, spec, engine.threads)


KINDS: dict[str, Factory] = {
    "vad": lambda spec, bundle, live, loaded: VadModel(
        spec, bundle.manifest.baked, _engine_for(spec, bundle, live), live
    ),
    "onnx": lambda spec, bundle, live, loaded: OnnxModel(
        spec, bundle.manifest.baked, _engine_for(spec, bundle, live), live
    ),
    "speech_synthesis": lambda spec, bundle, live, loaded: SpeechModel(spec, bundle, live),
    "text_translation": lambda spec, bundle, live, loaded: TranslationModel(spec, bundle, live),
    "speech_to_text": SpeechToText,
    "speech_pipeline": SpeechPipeline,
}


def load_models(
    bundle: Bundle, live: Live, loaded_one: Callable[[str], None] = lambda _: None
) -> dict[str, ServedModel]:
    """Every model of the firmware, in its order; `loaded_one(name)` after each (start-up progress)."""
    loaded: dict[str, ServedModel] = {}
    for spec in bundle.manifest.models:
        loaded[spec.name] = KINDS[spec.kind](spec, bundle, live, loaded)
        loaded_one(spec.name)
    return loaded


__all__ = ["KINDS", "ServedModel", "load_models"]
