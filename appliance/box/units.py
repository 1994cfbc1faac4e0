"""The systemd units an update restarts, and the reboot into a trial slot (systemctl)."""

from __future__ import annotations

import subprocess

from appliance.errors import ApplianceError

UNIT = "appliance.service"
SELFTEST_UNIT = "appliance-selftest.service"


def restart_daemon() -> None:
    """Restart the unit; systemctl waits for READY=1 (Type=notify) or reports the failed start."""
    result = subprocess.run(["systemctl", "restart", UNIT], capture_output=True, text=True)
    if result.returncode != 0:
        status = subprocess.run(
            ["systemctl", "show", "-p", "StatusText", "--value", UNIT], capture_output=True, text=True
        ).stdout.strip()
        raise ApplianceError(f"{UNIT} did not start: {status or result.stderr.strip()}")


def restart_with_selftest() -> None:
    """Restart the daemon and its self-test without waiting (the self-test's OnFailure runs this)."""
    subprocess.run(["systemctl", "restart", "--no-block", UNIT, SELFTEST_UNIT], check=True)


def reboot() -> None:
    subprocess.run(["systemctl", "reboot"], check=True)
