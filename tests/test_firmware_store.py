"""Firmware-only updates: the store on the data partition, with a real daemon restarted on each release.

On the box `appliance update BUNDLE` restarts appliance.service with systemctl (tests/test_systemd_pid1.py
runs that under systemd); here the restart is a real daemon process stopped and started again.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import Daemon, Keys, cli

from appliance import firmware
from appliance.box.selftest import selftest
from appliance.errors import ApplianceError
from appliance.firmware import store as firmware_store


class Box:
    """The daemon loading store/current, as appliance.service does; restart() is systemctl restart."""

    def __init__(self, store: firmware_store.Store, trusted: Path, workdir: Path) -> None:
        self.store, self.trusted, self.workdir = store, trusted, workdir
        self.daemon: Daemon | None = None
        self.starts = 0

    def restart(self) -> None:
        self.stop()
        self.starts += 1
        workdir = self.workdir / f"start-{self.starts}"
        workdir.mkdir()
        self.daemon = Daemon(workdir, self.store.root / "current", self.trusted)
        try:
            self.daemon.wait_ready()
        except AssertionError as exc:
            raise ApplianceError(f"the daemon did not start: {str(exc)[-300:]}") from None

    def selftest(self) -> str:
        assert self.daemon is not None
        return selftest(str(self.daemon.socket), timeout_s=30)

    def serving(self) -> str:
        assert self.daemon is not None
        with self.daemon.client() as client:
            return client.status()["firmware"]["version"]

    def stop(self) -> None:
        if self.daemon is not None:
            self.daemon.stop()


@pytest.fixture
def box(keys: Keys, bundles: dict[str, Path], tmp_path: Path):
    store = firmware_store.Store(tmp_path / "store")
    cli("firmware", "install", bundles["1.0.0"], "--store", store.root, "--trusted-keys", keys.trusted)
    running = Box(store, keys.trusted, tmp_path)
    firmware_store.try_current(store, running.restart, running.selftest)  # the first boot commits it
    yield running
    running.stop()


def releases(store: firmware_store.Store) -> list[str]:
    return sorted(p.name.split("-")[2] for p in store.releases.iterdir())


def test_update_commits_keeps_previous_and_rollback_returns(box: Box, bundles: dict[str, Path], keys: Keys) -> None:
    store = box.store
    assert box.serving() == "1.0.0" and not store.on_trial
    release = firmware_store.install(store, bundles["1.1.0"], keys.trusted)
    firmware_store.switch(store, release)
    assert store.on_trial and store.current == release
    line = firmware_store.try_current(store, box.restart, box.selftest)
    assert "appliance-selftest: ok" in line
    assert box.serving() == "1.1.0" and not store.on_trial
    assert releases(store) == ["1.0.0", "1.1.0"] and "-1.0.0-" in store.previous.name

    firmware_store.revert(store)  # `appliance firmware rollback`: the previous one, on trial again
    firmware_store.try_current(store, box.restart, box.selftest)
    assert box.serving() == "1.0.0" and "-1.1.0-" in store.previous.name and not store.on_trial
    assert cli("firmware", "store", "--store", store.root).stdout.splitlines() == [
        f"current  {store.current.name}",
        f"previous {store.previous.name}",
    ]


def test_firmware_failing_its_selftest_is_rolled_back(box: Box, bundles: dict[str, Path], keys: Keys) -> None:
    store = box.store
    for version in ("1.1.0", "broken"):
        firmware_store.switch(store, firmware_store.install(store, bundles[version], keys.trusted))
        if version == "1.1.0":
            firmware_store.try_current(store, box.restart, box.selftest)
    with pytest.raises(
        ApplianceError,
        match=r"(?s)firmware voice-vad-1\.2\.0-\S+ failed its self-test \(the daemon "
        r"did not start.*rolled back: voice-vad-1\.1\.0-\S+ serves again",
    ):
        firmware_store.try_current(store, box.restart, box.selftest)
    assert box.serving() == "1.1.0" and not store.on_trial
    assert releases(store) == ["1.0.0", "1.1.0"], "the failed release is deleted, the one before kept"
    assert "-1.0.0-" in store.previous.name, "previous is what it was before the failed update"
    failed_start = (box.workdir / "start-3" / "daemon.log").read_text()
    assert "silero_vad.onnx: ONNX Runtime cannot load the model" in failed_start and "Traceback" not in failed_start


def test_tampered_or_untrusted_bundle_is_refused_before_anything_is_written(
    box: Box, bundles: dict[str, Path], keys: Keys, tmp_path: Path
) -> None:
    store = box.store
    before = sorted(os.listdir(store.releases)), store.current, store.previous
    tampered = tmp_path / "tampered"
    shutil.copytree(bundles["1.1.0"], tampered)
    model = tampered / json.loads((tampered / firmware.MANIFEST).read_text())["models"][0]["file"]
    data = bytearray(model.read_bytes())
    data[len(data) // 2] ^= 0x01
    model.write_bytes(bytes(data))
    result = cli("update", tampered, "--store", store.root, "--trusted-keys", keys.trusted, check=False)
    assert result.returncode == 2 and "sha256 does not match the manifest" in result.stderr, result.stderr
    other = tmp_path / "other"
    cli("keys", "new", "--out", other / "other.key", "--trust-dir", other / "trusted")
    result = cli("update", bundles["1.1.0"], "--store", store.root, "--trusted-keys", other / "trusted", check=False)
    assert result.returncode == 2 and "is not trusted" in result.stderr, result.stderr
    assert (sorted(os.listdir(store.releases)), store.current, store.previous) == before
    assert box.serving() == "1.0.0"


def test_interrupted_install_leaves_current_whole_and_is_redone(box: Box, bundles: dict[str, Path], keys: Keys) -> None:
    """kill -9 or a power cut mid-copy leaves a .partial directory that nothing points at."""
    store = box.store
    release = firmware_store.install(store, bundles["1.1.0"], keys.trusted)
    shutil.rmtree(release)
    partial = release.with_name(release.name + firmware_store.PARTIAL)
    partial.mkdir()
    (partial / firmware.MANIFEST).write_text('{"half": ')
    firmware.verify(store.current, keys.trusted)  # what the daemon would load at a restart now
    assert firmware_store.install(store, bundles["1.1.0"], keys.trusted) == release
    assert not partial.exists()
    firmware.verify(release, keys.trusted)


def test_update_cli_tells_an_image_from_a_bundle(tmp_path: Path, keys: Keys) -> None:
    result = cli("update", tmp_path, "--store", tmp_path / "store", "--trusted-keys", keys.trusted, check=False)
    assert result.returncode == 2 and "neither a disk image (disk.raw) nor a firmware bundle" in result.stderr
