"""Engines run a model graph on one batch (`interface`); `choice` picks one for a model, with the
CPU as fallback; `scheduler` decides what goes into each batch and `loop` drives it."""

from appliance.engine.choice import load_engine
from appliance.engine.interface import Engine

__all__ = ["Engine", "load_engine"]
