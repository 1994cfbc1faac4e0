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

from conftest import ROOT, Keys

NSPAWN_ROOT = ROOT / "build" / "nspawn-root"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="systemd-nspawn needs root"),
    pytest.mark.skipif(shutil.which("systemd-nspawn") is None or shutil.which("debootstrap") is None,
                       reason="systemd-container and debootstrap are not installed (make deps)"),
]


@pytest.fixture(scope="module")
def rootfs() -> Path:
    if not NSPAWN_ROOT.exists():
        subprocess.run([str(ROOT / "image" / "debootstrap-root.sh"), str(NSPAWN_ROOT)], check=True, timeout=1200)
    return NSPAWN_ROOT


def install(rootfs: Path, bundle: Path, keys: Keys) -> None:
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
    firmware_dir = rootfs / "var/lib/appliance/firmware/current"
    shutil.rmtree(firmware_dir, ignore_errors=True)
    shutil.copytree(bundle, firmware_dir)
    trusted = rootfs / "etc/appliance/trusted-keys"
    shutil.rmtree(trusted, ignore_errors=True)
    shutil.copytree(keys.trusted, trusted)
    (units / "appliance-selftest.service").write_text(
        "[Unit]\nAfter=multi-user.target\n[Service]\nType=oneshot\nExecStart=/selftest/selftest.sh\n"
        "[Install]\nWantedBy=multi-user.target\n")
    wants = units / "multi-user.target.wants" / "appliance-selftest.service"
    wants.unlink(missing_ok=True)
    wants.symlink_to("/etc/systemd/system/appliance-selftest.service")


def test_unit_under_systemd_pid1(rootfs: Path, bundle: Path, keys: Keys, tmp_path: Path) -> None:
    install(rootfs, bundle, keys)
    out = tmp_path / "out"
    out.mkdir()
    boot = subprocess.run(
        ["systemd-nspawn", "-q", "-D", str(rootfs), "--boot", "--register=no", "--keep-unit", "--pipe",
         f"--bind-ro={ROOT}:/opt/appliance", f"--bind-ro={ROOT / 'tests' / 'pid1'}:/selftest", f"--bind={out}:/out",
         "--capability=CAP_BPF,CAP_PERFMON,CAP_NET_ADMIN", "--private-network"],
        capture_output=True, text=True, timeout=600)
    text = (out / "result.txt").read_text() if (out / "result.txt").exists() else ""
    result = dict(line.split("=", 1) for line in text.splitlines() if "=" in line)
    context = f"result: {result}\nnspawn: {boot.stdout[-3000:]}{boot.stderr[-2000:]}"
    assert result.get("done") == "yes", context
    assert result["start_rc"] == "0" and result["active"] == "active", context
    assert result["health"] == "200" and result["infer"] == "200 [2]", context
    assert result["quic_health"] == "ready" and int(result["quic_from_systemd"]) >= 1, context
    assert "conncache" in result["status_text"], context
    assert result["tls_key_mode"] == "600:appliance", context
    assert "firmware voice-vad 1.0.0, engine onnxruntime-cpu" in result["status_text"], context
    assert result["uid"] == "appliance" and result["socket_mode"] == "660:appliance", context
    assert int(result["journal_firmware"]) >= 1, context
    assert result["restarted"] == "0" and int(result["restarts"]) >= 1 and int(result["watchdog_logged"]) >= 1, context
    assert result["active_after_hang"] == "active" and result["health_after_hang"] == "200", context
    assert result["new_pid"] == "yes", context
    assert result["stop_result"] == "success" and result["stop_status"] == "0", context
