"""Engines run a model graph on one batch; the scheduler decides what goes into each batch."""

from appliance.engine.base import Engine, load_engine

__all__ = ["Engine", "load_engine"]
