"""Setup from nothing: the Makefile's steps and bpf/setup-host.sh where nothing they set up exists yet
(no venv, keys, firmware or TLS in a fresh copy of the tree; no kernel headers under /lib/modules and
no bpffs, hidden in a private mount namespace), and then the daemon loads its eBPF program."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import ROOT, needs

from appliance.bench.daemon import free_udp_port

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="hiding /lib/modules and bpffs needs root and a mount namespace"),
    needs(shutil.which("unshare") is None, "unshare (util-linux) is not installed (make deps)"),
]


def test_make_run_from_nothing_serves_with_the_ebpf_cache(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "bash",
            str(ROOT / "tests" / "setup_from_nothing.sh"),
            str(ROOT),
            str(tmp_path),
            str(free_udp_port()),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    make_log = (tmp_path / "make.log").read_text() if (tmp_path / "make.log").exists() else ""
    assert result.returncode == 0, f"{result.stdout}{result.stderr}\n--- make run:\n{make_log}"
    assert "before: /lib/modules holds [], bpffs mounted: no" in result.stdout
    assert "bpf/setup-host.sh: kernel headers: linked /lib/modules/" in make_log
    assert "bpf/setup-host.sh: bpffs: mounted on /sys/fs/bpf" in make_log
    for step in ("-m venv --system-site-packages .venv", "keys new", "firmware build", "tls init"):
        assert step in make_log, f"make run did not run {step!r}:\n{make_log}"
    status = json.loads((tmp_path / "status.json").read_text())
    assert status["ready"] and status["conncache"]["backend"] == "ebpf", status
    assert "after: bpffs mounted: yes" in result.stdout
