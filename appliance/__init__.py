"""appliance: the runtime of an offline inference box."""

__version__ = "0.1.0"
