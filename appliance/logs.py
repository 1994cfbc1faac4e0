"""The daemon's logging, in the engine process and in every worker: to the journal with structured
fields where stderr is the journal, else one line per record on stderr."""

from __future__ import annotations

import logging
import sys

from appliance import systemd


class FirmwareField(logging.Filter):
    """Adds FIRMWARE to every record, for the journal's structured fields."""

    firmware = "-"

    def filter(self, record: logging.LogRecord) -> bool:
        record.FIRMWARE = self.firmware
        return True


FIRMWARE_FIELD = FirmwareField()


def configure_logging(level: str, who: str = "appliance") -> None:
    """`who` starts each stderr line: "appliance", or "appliance worker N" in a protocol worker."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    if systemd.stderr_is_journal():
        handler = systemd.journal_handler()
    else:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"{who}: %(levelname)s: %(message)s"))
    handler.addFilter(FIRMWARE_FIELD)
    root.addHandler(handler)
    root.setLevel(level.upper())
    logging.getLogger("quic").setLevel(logging.WARNING)  # aioquic logs every connection's handshake at info
