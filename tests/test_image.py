"""The disk image, booted: qemu + OVMF on a copy written by `appliance flash`.

`appliance flash` writes the test image to a disk once; each scenario boots its own copy-on-write
copy of that disk (a box fresh from the factory, on slot A, serving the interpreter firmware): first boot,
a good update (new slot blessed), an update whose appliance fails its self-test (rolled back), an update
killed with -9 halfway, and a power cut during the write; and a box flashed with the VAD-only firmware
updated to the interpreter firmware, then rolled back. The box has no remote shell, so the test
copy of the image carries a small driver unit (tests/image/) that reports on the serial console and
runs `appliance update` from a disk the host attaches. Tampered images are refused on the host.
Needs `make image` (build/image/out); takes minutes (KVM) to a quarter of an hour (TCG).
"""

from __future__ import annotations

import base64
import json
import os
import re
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import ROOT, Keys, build_bundle, cli
from speech import SENTENCES, recording

from appliance.audio import encode_wav
from appliance.bench.daemon import free_udp_port
from appliance.box import layout, slots
from appliance.errors import ApplianceError

BUILT = ROOT / "build" / "image" / "out"
DEV_KEY = ROOT / "keys" / "dev.key"
TRUSTED = ROOT / "keys" / "trusted"
IMAGE_SPEC = ROOT / "firmware" / "interpreter.toml"  # the firmware make image puts on the data partition
OVMF = Path("/usr/share/OVMF")
BOOT_TIMEOUT_S = {"kvm": 600.0, "tcg": 1500.0}  # TCG: the interpreter firmware starts in minutes (twice in an update)
# TCG's guest CPU without FMA, which QEMU 7.2 emulates far slower than a multiply and an add: the engines take
# their FMA kernels where the CPU has them (Piper's voice under qemu-x86_64 on an Intel Xeon: 139 s with FMA,
# 15.6 s without). AVX2 stays: fxtranslate's int8 GEMM has no other path. tcg-slack.conf does the rest.
TCG_CPU = "max,-fma"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(os.geteuid() != 0, reason="debugfs on partitions and qemu need root"),
    pytest.mark.skipif(not (BUILT / layout.MANIFEST).exists(), reason="no image: run make image"),
    pytest.mark.skipif(shutil.which("qemu-system-x86_64") is None, reason="qemu-system-x86 is not installed"),
    pytest.mark.timeout(3600),  # several boots each; under TCG a boot with an update takes minutes
]


def run(*argv: str | Path, **kwargs: object) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], check=True, capture_output=True, text=True, **kwargs)


def copy_image(source: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    run("cp", "--sparse=always", source / layout.DISK, dest / layout.DISK)
    for name in (layout.MANIFEST, layout.SIGNATURE):
        shutil.copy(source / name, dest / name)
    return dest


def read_partition(image_dir: Path, label: str, part: Path) -> None:
    p = layout.partition(label)
    run(
        "dd",
        f"if={image_dir / layout.DISK}",
        f"of={part}",
        "bs=4M",
        f"skip={p.offset}",
        f"count={p.size}",
        "iflag=skip_bytes,count_bytes",
        "conv=sparse",
    )


def write_partition(image_dir: Path, label: str, part: Path) -> None:
    """Write a file system back into its partition (no bigger than it) and re-sign the image."""
    p = layout.partition(label)
    assert part.stat().st_size <= p.size
    run(
        "dd",
        f"if={part}",
        f"of={image_dir / layout.DISK}",
        "bs=4M",
        f"seek={p.offset}",
        "oflag=seek_bytes",
        "conv=sparse,notrunc",
    )
    part.unlink()
    cli("image", "sign", image_dir, "--key", DEV_KEY, "--version", image_dir.name)


def edit_root(image_dir: Path, commands: list[str], scratch: Path) -> None:
    """Apply debugfs commands to the image's root (slot A) file system, then re-sign the image."""
    part = scratch / "root.img"
    read_partition(image_dir, "root-a", part)
    script = scratch / "debugfs.cmd"
    script.write_text("\n".join(commands) + "\n")
    result = run("debugfs", "-w", "-f", script, part)
    assert "Could not" not in result.stderr and "not found" not in result.stderr, result.stderr
    write_partition(image_dir, "root-a", part)


def replace_firmware(image_dir: Path, bundle: Path, scratch: Path) -> None:
    """The image's data partition with `bundle` as its only firmware, installed as make image installs
    one (on trial until the first boot's self-test), everything else on the partition kept as it was."""
    part, tree = scratch / "data.img", scratch / "data"
    read_partition(image_dir, "data", part)
    tree.mkdir()
    run("debugfs", "-R", f"rdump / {tree}", part)  # owners, modes and links kept
    store = tree / "appliance" / "firmware"
    shutil.rmtree(store)
    cli("firmware", "install", bundle, "--store", store, "--trusted-keys", TRUSTED)
    owner = (tree / "appliance").stat()
    run("chown", "-R", f"{owner.st_uid}:{owner.st_gid}", store)
    part.unlink()
    run("mkfs.ext4", "-q", "-L", "data", "-d", tree, part, f"{layout.DATA_MIB}M")
    shutil.rmtree(tree)
    write_partition(image_dir, "data", part)


def install_driver(image_dir: Path, scratch: Path, accel: str) -> None:
    here = ROOT / "tests" / "image"
    slack = [
        "mkdir /etc/systemd/system/appliance.service.d",
        f"write {here / 'tcg-slack.conf'} /etc/systemd/system/appliance.service.d/tcg-slack.conf",
    ]
    edit_root(
        image_dir,
        [
            *(slack if accel == "tcg" else []),
            f"write {here / 'test-driver.sh'} /usr/local/sbin/appliance-test-driver",
            "sif /usr/local/sbin/appliance-test-driver mode 0100755",
            f"write {here / 'appliance-test-driver.service'} /etc/systemd/system/appliance-test-driver.service",
            "symlink /etc/systemd/system/multi-user.target.wants/appliance-test-driver.service "
            "/etc/systemd/system/appliance-test-driver.service",
            f"write {here / '10-test-lan.network'} /etc/systemd/network/10-test-lan.network",
            "symlink /etc/systemd/system/multi-user.target.wants/systemd-networkd.service "
            "/lib/systemd/system/systemd-networkd.service",
            "symlink /etc/systemd/system/sockets.target.wants/systemd-networkd.socket "
            "/lib/systemd/system/systemd-networkd.socket",
        ],
        scratch,
    )


@dataclass
class Boot:
    serial: str
    seconds: float
    ready_s: float | None

    def slot(self) -> str:
        found = re.findall(r"Command line: .*?root=PARTUUID=(\S+)", self.serial)
        assert found, self.tail()
        return next(s for s in layout.SLOTS if layout.slot_partition(s).uuid.lower() == found[-1].lower())

    def entries(self) -> list[str]:
        found = re.findall(r"test-driver: booted entries: (.*)", self.serial)
        assert found, self.tail()
        return found[-1].split()

    def selftest_ok(self) -> bool:
        return "appliance-selftest: ok" in self.serial

    def tail(self) -> str:
        return self.serial[-4000:]


class Machine:
    """A qemu + OVMF machine with its own EFI variable store and a copy-on-write disk over a flashed one."""

    def __init__(self, flashed: Path, workdir: Path, accel: str) -> None:
        self.workdir, self.accel = workdir, accel
        workdir.mkdir(parents=True)
        self.disk = workdir / "disk.qcow2"
        run("qemu-img", "create", "-q", "-f", "qcow2", "-F", "raw", "-b", flashed, self.disk)
        self.vars = workdir / "OVMF_VARS.fd"
        shutil.copy(OVMF / "OVMF_VARS_4M.fd", self.vars)
        self.boots = 0
        self.quic_port = free_udp_port()

    def boot(
        self,
        update_media: tuple[str, Path] | None = None,
        cut_power_at: str | None = None,
        while_serving: Callable[[str], None] | None = None,
    ) -> Boot:
        """Boot until the machine powers off or reboots (-no-reboot ends qemu either way).

        while_serving(certificate_pem) runs once the driver is serving (media "serve"); then qemu stops.
        The guest's UDP 4433 is forwarded to self.quic_port on the host's loopback. (Not restrict=on: it
        drops the guest's UDP replies to forwarded datagrams. The guest has no gateway to go further.)
        """
        self.boots += 1
        serial = self.workdir / f"serial-{self.boots}.log"
        nic = f"user,model=virtio-net-pci,hostfwd=udp:127.0.0.1:{self.quic_port}-10.0.2.15:4433"
        argv = [
            "qemu-system-x86_64",
            "-machine",
            "q35",
            "-m",
            "2048",
            "-smp",
            "2",
            "-display",
            "none",
            "-monitor",
            "none",
            "-nic",
            nic,
            "-no-reboot",
            "-serial",
            f"file:{serial}",
            "-drive",
            f"if=pflash,format=raw,readonly=on,file={OVMF / 'OVMF_CODE_4M.fd'}",
            "-drive",
            f"if=pflash,format=raw,file={self.vars}",
            "-drive",
            f"if=none,id=system,format=qcow2,file={self.disk}",
            "-device",
            "virtio-blk-pci,drive=system,addr=0x4,bootindex=0",
        ]
        argv += ["-accel", "kvm"] if self.accel == "kvm" else ["-accel", "tcg,thread=multi", "-cpu", TCG_CPU]
        if update_media is not None:
            mode, media = update_media
            argv += [
                "-drive",
                f"if=none,id=media,format=raw,readonly=on,file={media}",
                "-device",
                f"virtio-blk-pci,drive=media,addr=0x5,serial=update-{mode}",
            ]
        started = time.monotonic()
        ready_s = None
        qemu = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            while qemu.poll() is None:
                text = serial.read_text(errors="replace") if serial.exists() else ""
                if ready_s is None and "appliance-selftest: ok" in text:
                    ready_s = time.monotonic() - started
                if cut_power_at is not None and re.search(cut_power_at, text):
                    qemu.kill()  # the power cut: no sync, no shutdown
                    break
                if while_serving is not None and "test-driver: serving" in text:
                    certificate = re.search(r"test-driver: certificate (\S+)", text)
                    assert certificate, text[-4000:]
                    while_serving(base64.b64decode(certificate.group(1)).decode())
                    break
                assert time.monotonic() - started < BOOT_TIMEOUT_S[self.accel], f"boot timed out:\n{text[-4000:]}"
                time.sleep(0.5)
        finally:
            if qemu.poll() is None:
                qemu.kill()
            qemu.wait()
        assert serial.exists(), f"qemu did not start: {qemu.stderr.read().decode() if qemu.stderr else ''}"
        boot = Boot(serial.read_text(errors="replace"), time.monotonic() - started, ready_s)
        ready = f"ready after {boot.ready_s:.1f} s, " if boot.ready_s is not None else ""
        print(f"{self.workdir.name} boot {self.boots} ({self.accel}): {ready}ended after {boot.seconds:.1f} s")
        return boot


@pytest.fixture(scope="module")
def accel() -> str:
    """kvm where it can run OVMF, else tcg; decided before any test image is made (they cost minutes)."""
    return run(ROOT / "image" / "qemu-accel.sh").stdout.strip()


def boots_under_tcg() -> str:
    """Which boots run where KVM cannot run OVMF (as here and on CI): each costs 4 to 7 min under TCG alone,
    and beside the suite's workers far more (the first boot's test: 834 s against 326 s alone, its guest's
    start bounded by 15 min). `make test` boots none, `make image-first-boot` (which .ci/run calls after
    it) the first, `make image-test` all 13."""
    boots = os.environ.get("APPLIANCE_IMAGE_TCG", "none")
    if boots not in ("none", "first", "all"):
        raise pytest.UsageError(f"APPLIANCE_IMAGE_TCG={boots!r}: say none, first or all")
    return boots


@pytest.fixture(scope="module")  # before the module's image copies, which cost a minute
def first_boot(accel: str) -> None:
    if accel != "kvm" and boots_under_tcg() not in ("first", "all"):
        pytest.skip("KVM cannot run OVMF here: make image-first-boot boots it under TCG (.ci/run does)")


@pytest.fixture(scope="module")  # before the module's image copies, which cost a minute
def every_boot(accel: str) -> None:
    if accel != "kvm" and boots_under_tcg() != "all":
        pytest.skip("KVM cannot run OVMF here: make image-test boots every scenario under TCG")


@pytest.fixture(scope="module")
def test_images(accel: str, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The built image plus the test driver ("good"), and the same with a config that cannot start ("bad")."""
    work = tmp_path_factory.mktemp("images")
    good = copy_image(BUILT, work / "good")
    install_driver(good, work, accel)
    bad = copy_image(good, work / "bad")
    broken = work / "broken.toml"
    broken.write_text('[firmware]\nbundle = "/nonexistent/firmware"\ntrusted_keys = "/etc/appliance/trusted-keys"\n')
    edit_root(bad, ["rm /etc/appliance/appliance.toml", f"write {broken} /etc/appliance/appliance.toml"], work)
    return {"good": good, "bad": bad}


def speech_wav(directory: Path) -> Path:
    """Three spoken sentences (espeak-ng) as a 16 kHz WAV file."""
    path = directory / "speech.wav"
    path.write_bytes(encode_wav(recording(SENTENCES)[0], 16000))
    return path


def update_media(source: Path, out: Path) -> Path:
    """An ext4 disk holding an image directory (image/) or a firmware bundle (bundle/), as a USB stick would."""
    if out.exists():
        return out
    tree = out.with_suffix(".d")
    inside = "image" if (source / layout.DISK).exists() else "bundle"
    shutil.copytree(source, tree / inside, copy_function=os.link)
    run("mkfs.ext4", "-q", "-d", tree, out, "6G")
    shutil.rmtree(tree)
    return out


@pytest.fixture(scope="module")
def flashed(test_images: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A disk written by `appliance flash` once; every scenario boots its own copy-on-write copy of it."""
    disk = tmp_path_factory.mktemp("flashed") / "disk.raw"
    with disk.open("wb") as f:
        f.truncate(layout.DISK_SIZE)
    started = time.monotonic()
    result = cli("flash", test_images["good"], "--target", disk, "--trusted-keys", TRUSTED)
    print(f"flash: {time.monotonic() - started:.1f} s")
    assert "verified" in result.stdout
    return disk


@pytest.fixture
def machine(
    accel: str, flashed: Path, request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Machine:
    return Machine(flashed, tmp_path_factory.mktemp("machines") / request.node.name[:40], accel)


@pytest.fixture(scope="module")
def vad_only(test_images: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The test image's disk as a box flashed before the interpreter firmware was: its data partition holds
    the VAD-only firmware (firmware/default.toml). Booted as is: the bytes `appliance flash` would write."""
    work = tmp_path_factory.mktemp("vad-only")
    image = copy_image(test_images["good"], work / "image")
    replace_firmware(image, build_bundle(Keys(DEV_KEY, TRUSTED), work / "voice-vad"), work)
    return image / layout.DISK


Media = Callable[[str], Path]


@pytest.fixture(scope="module")
def media(test_images: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Media:
    """media("good"), media("bad"): test images; media("firmware"): the interpreter firmware, built and signed
    with the dev key; media("serve"), media("rollback"): requests, no content."""
    work = tmp_path_factory.mktemp("media")

    def make(kind: str) -> Path:
        if kind in ("serve", "rollback"):  # its serial number is the request
            (work / f"{kind}.raw").write_bytes(bytes(layout.MIB))
            return work / f"{kind}.raw"
        if kind == "firmware" and "firmware" not in test_images:
            test_images["firmware"] = build_bundle(Keys(DEV_KEY, TRUSTED), work / "interpreter", IMAGE_SPEC)
        return update_media(test_images[kind], work / f"{kind}.raw")

    return make


# --- refused before anything is written (host side) ---------------------------------------------


def test_flash_refuses_tampered_wrong_key_and_small_target(tmp_path: Path) -> None:
    target = tmp_path / "target.raw"
    with target.open("wb") as f:
        f.truncate(layout.DISK_SIZE)
    disk = BUILT / layout.DISK
    root = layout.partition("root-a")
    flip_at = root.offset + 4096 * 300
    with disk.open("r+b") as f:  # one flipped byte inside root A, flipped back afterwards
        f.seek(flip_at)
        original = f.read(1)
        f.seek(flip_at)
        f.write(bytes([original[0] ^ 0xFF]))
    try:
        result = cli("flash", BUILT, "--target", target, "--trusted-keys", TRUSTED, check=False)
    finally:
        with disk.open("r+b") as f:
            f.seek(flip_at)
            f.write(original)
    assert result.returncode == 2 and "region root-a" in result.stderr and "does not match" in result.stderr
    assert target.stat().st_blocks == 0, "the target was written before verification"

    other = tmp_path / "other"
    cli("keys", "new", "--out", other / "other.key", "--trust-dir", other / "trusted")
    result = cli("flash", BUILT, "--target", target, "--trusted-keys", other / "trusted", check=False)
    assert result.returncode == 2 and "is not trusted" in result.stderr
    assert target.stat().st_blocks == 0

    small = tmp_path / "small.raw"
    with small.open("wb") as f:
        f.truncate(layout.DISK_SIZE - layout.MIB)
    result = cli("flash", BUILT, "--target", small, "--trusted-keys", TRUSTED, check=False)
    assert result.returncode == 2 and "too small" in result.stderr


def test_update_refuses_tampered_manifest_and_wrong_key(tmp_path: Path) -> None:
    """`appliance update`'s checks, against a box laid out in files: nothing is touched."""
    esp = tmp_path / "esp"
    (esp / "loader/entries").mkdir(parents=True)
    (esp / "loader/entries/slot-a.conf").write_text(layout.loader_entry("a", 1))
    parts = tmp_path / "parts"
    parts.mkdir()
    for slot in layout.SLOTS:
        with (parts / f"root-{slot}").open("wb") as f:
            f.truncate(layout.slot_partition(slot).size)
    cmdline = tmp_path / "cmdline"
    cmdline.write_text(f"root=PARTUUID={layout.slot_partition('a').uuid.lower()} rw\n")
    target = slots.Box(esp, parts, cmdline)

    tampered = tmp_path / "tampered"
    tampered.mkdir()
    os.symlink(BUILT / layout.DISK, tampered / layout.DISK)
    shutil.copy(BUILT / layout.SIGNATURE, tampered / layout.SIGNATURE)
    manifest = bytearray((BUILT / layout.MANIFEST).read_bytes())
    manifest[manifest.index(b'"version"') + 13] ^= 0x01
    (tampered / layout.MANIFEST).write_bytes(bytes(manifest))
    with pytest.raises(ApplianceError, match="signature does not verify"):
        slots.update_slot(tampered, TRUSTED, target)
    other = tmp_path / "other"
    cli("keys", "new", "--out", other / "other.key", "--trust-dir", other / "trusted")
    with pytest.raises(ApplianceError, match="is not trusted"):
        slots.update_slot(BUILT, other / "trusted", target)
    assert (parts / "root-b").stat().st_blocks == 0
    assert sorted(p.name for p in (esp / "loader/entries").iterdir()) == ["slot-a.conf"]


def test_data_partition_holds_current_previous_and_a_third_being_installed(tmp_path: Path) -> None:
    """The firmware store at its fullest, during an update: current, previous and the release being installed
    (the old previous goes only after the new one's self-test), three releases of the image's firmware. A file
    system of the data partition's size takes them (mkfs.ext4 -d refuses what does not fit), with room left."""
    tree = tmp_path / "data"
    store = tree / "appliance" / "firmware"
    for version in ("1.0.0", "1.0.1", "1.0.2"):
        bundle = build_bundle(Keys(DEV_KEY, TRUSTED), tmp_path / version, IMAGE_SPEC, version=version)
        cli("firmware", "install", bundle, "--store", store, "--trusted-keys", TRUSTED)
        shutil.rmtree(bundle)
    assert len(list((store / "releases").iterdir())) == 3
    used_mib = int(run("du", "-sm", store).stdout.split()[0])
    part = tmp_path / "data.img"
    run("mkfs.ext4", "-q", "-L", "data", "-d", tree, part, f"{layout.DATA_MIB}M")
    stats = dict(line.split(":", 1) for line in run("dumpe2fs", "-h", part).stdout.splitlines() if ":" in line)
    block, free, reserved = (int(stats[k]) for k in ("Block size", "Free blocks", "Reserved block count"))
    spare_mib = (free - reserved) * block // layout.MIB
    print(f"data partition ({layout.DATA_MIB} MiB): three releases take {used_mib} MiB, {spare_mib} MiB spare")
    assert spare_mib >= layout.DATA_MIB // 10, "the data partition is nearly full with three releases"


# --- booted: each scenario starts from a box freshly flashed, running slot A -----------------------


@pytest.mark.usefixtures("first_boot")
def test_first_boot_serves_the_interpreter_from_slot_a_and_over_quic_to_the_lan(
    machine: Machine, media: Media, tmp_path: Path
) -> None:
    calls: dict[str, subprocess.CompletedProcess[str]] = {}

    def call_over_quic(certificate: str) -> None:
        cafile = tmp_path / "box-cert.pem"
        cafile.write_text(certificate)
        # a handshake may wait while the box runs a watchdog probe of Whisper: minutes under TCG
        quic = ("--quic", f"127.0.0.1:{machine.quic_port}", "--cafile", cafile, "--timeout", "100")
        calls["health"] = cli("call", "health", *quic, check=False)
        calls["vad"] = cli("call", "vad", speech_wav(tmp_path), *quic, check=False)
        # Bergamot on fxtranslate. Ready already means every model's warm-up ran in the root: Whisper on
        # CTranslate2, the Piper voice on espeak-ng's phonemes. (Under TCG the VAD's call outlasts QUIC's
        # 30 s idle timeout while the box runs its watchdog's probes: the server's PINGs keep it.)
        calls["translate"] = cli("call", "translate", "--to", "pt", "Where is the station?", *quic, check=False)

    boot = machine.boot(update_media=("serve", media("serve")), while_serving=call_over_quic)
    assert calls, boot.tail()
    assert calls["health"].returncode == 0 and '"ready": true' in calls["health"].stdout, calls["health"]
    assert calls["vad"].returncode == 0, (calls["vad"], boot.tail())
    assert len(json.loads(calls["vad"].stdout)["segments"]) == len(SENTENCES), calls["vad"]
    assert calls["translate"].returncode == 0 and "estação" in calls["translate"].stdout, calls["translate"]
    assert boot.selftest_ok(), boot.tail()
    assert boot.slot() == "a"
    assert "test-driver: appliance.service active" in boot.serial, boot.tail()
    assert boot.entries() == ["slot-a.conf"]
    assert re.search(r"appliance-selftest: firmware interpreter-1\.0\.0-\S+ committed", boot.serial), boot.tail()
    assert "test-driver: status firmware interpreter 1.0.0" in boot.serial, boot.tail()
    # the VM's two CPUs: server.workers = 0 runs no protocol workers below 8 cores (docs/performance.md),
    # QUIC runs in the engine process; eBPF loads as the appliance user
    assert "test-driver: status worker 1 pid" not in boot.serial, boot.tail()
    assert "test-driver: status quic: 1 QUIC workers (server.workers = 1" in boot.serial, boot.tail()
    assert "test-driver: status conncache ebpf" in boot.serial, boot.tail()


@pytest.mark.usefixtures("every_boot")
def test_good_update_boots_new_slot_and_commits(machine: Machine, media: Media) -> None:
    boot = machine.boot(update_media=("good", media("good")))
    assert boot.slot() == "a" and boot.selftest_ok(), boot.tail()
    assert "test-driver: update exit 0" in boot.serial, boot.tail()
    assert "slot b" in boot.serial and "is the next boot, on trial" in boot.serial
    trial = machine.boot()
    assert trial.slot() == "b" and trial.selftest_ok(), trial.tail()
    assert "slot-b.conf" in trial.entries(), trial.entries()  # blessed: the counter is gone
    again = machine.boot()
    assert again.slot() == "b" and again.selftest_ok(), again.tail()


@pytest.mark.usefixtures("every_boot")
def test_failing_update_rolls_back_after_its_tries(machine: Machine, media: Media) -> None:
    boot = machine.boot(update_media=("good", media("bad")))
    assert boot.slot() == "a" and "test-driver: update exit 0" in boot.serial, boot.tail()
    trial = machine.boot()
    assert trial.slot() == "b" and not trial.selftest_ok(), trial.tail()
    assert "appliance-rollback: trial boot failed" in trial.serial, trial.tail()
    back = machine.boot()
    assert back.slot() == "a" and back.selftest_ok(), back.tail()
    assert "slot-b+0-1.conf" in back.entries() and "slot-a.conf" in back.entries(), back.entries()


@pytest.mark.usefixtures("every_boot")
def test_update_killed_halfway_leaves_a_good_slot(machine: Machine, media: Media) -> None:
    boot = machine.boot(update_media=("kill", media("good")))
    assert "test-driver: killed the update" in boot.serial, boot.tail()
    after = machine.boot()
    assert after.slot() == "a" and after.selftest_ok(), after.tail()
    assert after.entries() == ["slot-a.conf"], after.entries()


@pytest.mark.usefixtures("every_boot")
def test_power_cut_during_the_write_leaves_a_good_slot(machine: Machine, media: Media) -> None:
    boot = machine.boot(update_media=("power", media("good")), cut_power_at=r"write slot b: [3-9]\d%")
    assert "write slot b: " in boot.serial and "test-driver: update exit" not in boot.serial, boot.tail()
    after = machine.boot()
    assert after.slot() == "a" and after.selftest_ok(), after.tail()
    assert after.entries() == ["slot-a.conf"], after.entries()


@pytest.mark.usefixtures("every_boot")
def test_firmware_update_from_vad_only_to_the_interpreter_and_rollback(
    accel: str, vad_only: Path, media: Media, tmp_path_factory: pytest.TempPathFactory
) -> None:
    machine = Machine(vad_only, tmp_path_factory.mktemp("machines") / "vad-only", accel)
    boot = machine.boot(update_media=("firmware", media("firmware")))
    assert boot.slot() == "a" and boot.selftest_ok(), boot.tail()
    assert "test-driver: status firmware voice-vad 1.0.0" in boot.serial, boot.tail()
    updated = re.search(r"test-driver: firmware update exit 0 after (\S+) s", boot.serial)
    assert updated, boot.tail()
    assert re.search(r"test-driver: store current  interpreter-1\.0\.0-", boot.serial), boot.tail()
    assert re.search(r"test-driver: store previous voice-vad-1\.0\.0-", boot.serial), boot.tail()
    data = re.search(r"test-driver: data partition: .*", boot.serial)
    print(f"firmware update voice-vad -> interpreter: {updated.group(1)} s; {data.group(0) if data else ''}")

    after = machine.boot(update_media=("rollback", media("rollback")))  # kept across the reboot, then undone
    assert after.slot() == "a" and after.selftest_ok(), after.tail()
    assert "test-driver: status firmware interpreter 1.0.0" in after.serial, after.tail()
    assert "test-driver: firmware rollback exit 0" in after.serial, after.tail()
    assert "test-driver: status after rollback firmware voice-vad 1.0.0" in after.serial, after.tail()
    assert re.search(r"test-driver: store current  voice-vad-1\.0\.0-", after.serial), after.tail()
    assert re.search(r"test-driver: store previous interpreter-1\.0\.0-", after.serial), after.tail()
