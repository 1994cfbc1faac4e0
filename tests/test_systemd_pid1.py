"""Under systemd as PID 1: a minimal Debian tree (debootstrap) booted with systemd-nspawn --boot.

The units from image/ are installed as they are (a drop-in points ExecStart at this checkout's
venv, shortens WatchdogSec and arms the engine-hang failpoint); a oneshot unit inside the
container drives systemctl and reports. Takes a minute or two; the tree is cached in build/.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, Keys, cli, needs

NSPAWN_ROOT = ROOT / "build" / "nspawn-root"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="systemd-nspawn needs root"),
    needs(
        shutil.which("systemd-nspawn") is None or shutil.which("debootstrap") is None,
        "systemd-container and debootstrap are not installed (make deps)",
    ),
]


@pytest.fixture(scope="module")
def rootfs() -> Path:
    if not NSPAWN_ROOT.exists():
        subprocess.run([str(ROOT / "image" / "debootstrap-root.sh"), str(NSPAWN_ROOT)], check=True, timeout=1200)
    return NSPAWN_ROOT


def install(rootfs: Path, bundle: Path, keys: Keys, driver: str) -> None:
    units = rootfs / "etc/systemd/system"
    for name in ("appliance.service", "appliance.socket"):
        shutil.copy(ROOT / "image" / name, units / name)
    dropin = units / "appliance.service.d"
    dropin.mkdir(exist_ok=True)
    # The checkout is mounted where the image installs the appliance; its venv's scripts name the
    # checkout's own path, so run the venv's python on the mounted package instead.
    (dropin / "test.conf").write_text(
        "[Service]\nExecStart=\n"
        "ExecStartPre=\nExecStartPre=/opt/appliance/.venv/bin/python -m appliance tls init\n"
        "ExecStart=/opt/appliance/.venv/bin/python -m appliance run\n"
        "Environment=PYTHONPATH=/opt/appliance\n"
        "WatchdogSec=2\n"
        "Environment=APPLIANCE_FAILPOINT_ENGINE_HANG=/run/appliance-hang\n"
    )
    shutil.copy(ROOT / "image" / "appliance.sysusers.conf", rootfs / "usr/lib/sysusers.d/appliance.conf")
    (rootfs / "etc/appliance").mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "image" / "appliance.toml", rootfs / "etc/appliance/appliance.toml")
    shutil.rmtree(rootfs / "var/lib/appliance/tls", ignore_errors=True)
    store = rootfs / "var/lib/appliance/firmware"
    shutil.rmtree(store, ignore_errors=True)
    cli("firmware", "install", bundle, "--store", store, "--trusted-keys", keys.trusted)
    trusted = rootfs / "etc/appliance/trusted-keys"
    shutil.rmtree(trusted, ignore_errors=True)
    shutil.copytree(keys.trusted, trusted)
    (units / "appliance-selftest.service").unlink(missing_ok=True)
    (units / "appliance-test-driver.service").write_text(
        f"[Unit]\nAfter=multi-user.target\n[Service]\nType=oneshot\nExecStart=/selftest/{driver}\n"
        "[Install]\nWantedBy=multi-user.target\n"
    )
    for wants in (units / "multi-user.target.wants").glob("appliance-*"):
        wants.unlink()
    (units / "multi-user.target.wants" / "appliance-test-driver.service").symlink_to(
        "/etc/systemd/system/appliance-test-driver.service"
    )


def boot(rootfs: Path, out: Path, *extra: str) -> tuple[dict[str, str], str]:
    """Boot the container until the driver powers it off; the driver's key=value lines and nspawn's output."""
    out.mkdir()
    run = subprocess.run(
        [
            "systemd-nspawn",
            "-q",
            "-D",
            str(rootfs),
            "--boot",
            "--register=no",
            "--keep-unit",
            "--pipe",
            f"--bind-ro={ROOT}:/opt/appliance",
            f"--bind-ro={ROOT / 'tests' / 'pid1'}:/selftest",
            f"--bind={out}:/out",
            "--capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN",
            "--private-network",
            *extra,
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    text = (out / "result.txt").read_text() if (out / "result.txt").exists() else ""
    result = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    return result, f"result: {result}\nnspawn: {run.stdout[-3000:]}{run.stderr[-2000:]}"


def test_unit_under_systemd_pid1(rootfs: Path, bundle: Path, keys: Keys, tmp_path: Path) -> None:
    install(rootfs, bundle, keys, "selftest.sh")
    result, context = boot(rootfs, tmp_path / "out")
    assert result.get("done") == "yes", context
    assert result["start_rc"] == "0" and result["active"] == "active", context
    assert result["health"] == "200" and result["infer"] == "200 [2]", context
    assert result["quic_health"] == "ready" and int(result["quic_listening"]) >= 1, context
    assert "conncache" in result["status_text"], context
    assert result["tls_key_mode"] == "600:appliance", context
    assert "firmware voice-vad 1.0.0, engine onnxruntime-cpu" in result["status_text"], context
    assert result["uid"] == "appliance" and result["socket_mode"] == "660:appliance", context
    assert int(result["journal_firmware"]) >= 1, context
    assert result["restarted"] == "0" and int(result["restarts"]) >= 1 and int(result["watchdog_logged"]) >= 1, context
    assert result["active_after_hang"] == "active" and result["health_after_hang"] == "200", context
    assert result["new_pid"] == "yes", context
    assert result["stop_result"] == "success" and result["stop_status"] == "0", context


def test_firmware_update_under_systemd_pid1(rootfs: Path, bundles: dict[str, Path], keys: Keys, tmp_path: Path) -> None:
    """`appliance update BUNDLE` restarts the unit on the new firmware and commits it; a signed bundle whose
    model cannot load is rolled back to the one before; `appliance firmware rollback` returns further."""
    install(rootfs, bundles["1.0.0"], keys, "firmware-update.sh")
    # The boot self-test and its OnFailure recovery, as the image has them.
    units = rootfs / "etc/systemd/system"
    for name in ("appliance-selftest.service", "appliance-rollback.service"):
        shutil.copy(ROOT / "image" / name, units / name)
        command = "image selftest --timeout 60" if "selftest" in name else "recover"
        (units / f"{name}.d").mkdir(exist_ok=True)
        (units / f"{name}.d" / "test.conf").write_text(
            f"[Service]\nExecStartPre=\nExecStart=\nExecStart=/opt/appliance/.venv/bin/python -m appliance {command}\n"
            "Environment=PYTHONPATH=/opt/appliance\n"
        )
    result, context = boot(
        rootfs,
        tmp_path / "out",
        f"--bind-ro={bundles['1.1.0']}:/media/newer",
        f"--bind-ro={bundles['broken']}:/media/broken",
    )
    assert result.get("done") == "yes", context
    assert result["boot_selftest"] == "0" and result["boot_committed"] == "1", context
    assert result["update_rc"] == "0" and result["after_update"] == "1.1.0", context
    assert result["store_after_update"].startswith("current  voice-vad-1.1.0-"), context
    assert result["broken_rc"] == "2" and int(result["broken_rolled_back"]) == 1, context
    assert result["after_broken"] == "1.1.0" and result["active_after_broken"] == "active", context
    assert result["rollback_rc"] == "0" and result["after_rollback"] == "1.0.0", context
    assert result["releases"] == "2", context
    # Power lost with a bad bundle on trial: the boot self-test fails, recovery returns to the previous one.
    assert result["boot_trial_start"] != "0" and result["recovered"] == "0", context
    assert result["after_recovery"] == "1.0.0" and result["store_after_recovery"].startswith(
        "current  voice-vad-1.0.0-"
    ), context
    assert "trial" not in result["store_after_recovery"], context
    assert int(result["recover_logged"]) == 1, context
