"""Model kinds: how the requests of each kind become engine batches and answers. `base.py` says what a
kind provides; a firmware spec's `kind` picks the class registered here. A new kind is a module in
this package and a line in KINDS."""

from collections.abc import Callable

from appliance.config import Live
from appliance.engine.interface import Engine
from appliance.firmware import Baked, ModelSpec
from appliance.kinds.base import ServedModel
from appliance.kinds.vad import VadModel

KINDS: dict[str, Callable[[ModelSpec, Baked, Engine, Live], ServedModel]] = {"vad": VadModel}


def load_model(spec: ModelSpec, baked: Baked, engine: Engine, live: Live) -> ServedModel:
    return KINDS[spec.kind](spec, baked, engine, live)


__all__ = ["KINDS", "ServedModel", "load_model"]
