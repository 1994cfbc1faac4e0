"""`appliance update`: a signed image to the inactive slot, or a signed firmware bundle to the data
partition, restarted and self-tested on trial; `appliance firmware rollback` goes back one release.

What happens is told line by line through `tell` (the CLI prints each line at once, for the journal),
before the step that may take long or not return (a restart, a reboot).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from appliance import firmware
from appliance.box import units
from appliance.box.drain import drain
from appliance.box.layout import DISK
from appliance.box.selftest import selftest
from appliance.box.slots import update_slot
from appliance.client import ClientError, SocketUnreachable
from appliance.errors import ApplianceError
from appliance.firmware import store as firmware_store
from appliance.progress import QUIET, Progress

Tell = Callable[[str], None]


def try_firmware(store: firmware_store.Store, socket_path: str, timeout_s: float) -> str:
    """Restart the daemon on the store's current release and self-test it: committed, or reverted."""
    return firmware_store.try_current(store, units.restart_daemon, lambda: selftest(socket_path, timeout_s))


def update(
    source: Path,
    trust_dir: Path,
    store: firmware_store.Store,
    socket_path: str,
    timeout_s: float,
    reboot: bool,
    tell: Tell,
    progress: Progress = QUIET,
) -> None:
    """An image (disk.raw) goes to the inactive slot; a firmware bundle goes to the data partition."""
    if (source / DISK).exists():
        trial = update_slot(source, trust_dir, progress=progress)
        if reboot:
            drain_for_update(socket_path, tell)
            tell(f"slot {trial} written and verified; rebooting into it, on trial")
            units.reboot()
        else:
            tell(f"slot {trial} written and verified; reboot to try slot {trial} (on trial: one boot)")
        return
    if not (source / firmware.MANIFEST).exists():
        raise ApplianceError(f"{source}: neither a disk image ({DISK}) nor a firmware bundle ({firmware.MANIFEST})")
    release = firmware_store.install(store, source, trust_dir, progress)
    if release == store.current:
        tell(f"firmware {release.name} is already current")
        return
    drain_for_update(socket_path, tell)
    firmware_store.switch(store, release)
    tell(f"installed {release.name}; restarting {units.UNIT} on it, on trial")
    tell(try_firmware(store, socket_path, timeout_s))
    tell(f"firmware {release.name} committed; previous {firmware_store.describe(store.previous)} kept for rollback")


def drain_for_update(socket_path: str, tell: Tell) -> None:
    """Before the switch: the agent says maint, new work goes to other boxes, work under way finishes
    (up to server.shutdown_grace_s); the restart or reboot that follows ends the drain."""
    try:
        drain(socket_path, "hold", True, None, tell)
    except SocketUnreachable:
        tell("the daemon is not running: nothing to drain")
    except ClientError as exc:  # an update must not wait on a daemon that cannot drain
        tell(f"no drain before the update: {exc}")


def rollback_firmware(store: firmware_store.Store, socket_path: str, timeout_s: float, tell: Tell) -> None:
    """Back to the previous firmware, on trial: restarted and self-tested like an update."""
    back = firmware_store.revert(store)
    tell(f"back on {back.name}; restarting {units.UNIT}")
    tell(try_firmware(store, socket_path, timeout_s))
