"""`appliance recover` (appliance-rollback.service, the self-test's OnFailure): undo what is on trial.

Firmware on trial goes back to the previous release and the daemon restarts on it; a trial boot
reboots, and systemd-boot, with no tries left on the trial entry, boots the previous slot.
"""

from __future__ import annotations

from collections.abc import Callable

from appliance.box import units
from appliance.box.slots import booted_on_trial
from appliance.firmware import store as firmware_store


def recover(store: firmware_store.Store, tell: Callable[[str], None]) -> bool:
    """Undo the trial; False when the self-test failed on a committed slot and firmware (nothing to undo)."""
    if store.on_trial:
        failed = firmware_store.describe(store.current)
        back = firmware_store.revert(store)
        tell(f"appliance-rollback: firmware {failed} failed its self-test; back on {back.name}")
        if not booted_on_trial():
            units.restart_with_selftest()
            return True
    if booted_on_trial():
        tell("appliance-rollback: trial boot failed its self-test, rebooting into the previous slot")
        units.reboot()
        return True
    tell("appliance-rollback: the self-test failed on a committed slot and firmware: nothing to return to")
    return False
