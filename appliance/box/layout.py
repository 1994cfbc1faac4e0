"""The fixed A/B layout of disk.raw: ESP, root-a, root-b, data; the regions a manifest hashes; loader entries."""

from __future__ import annotations

from dataclasses import dataclass

from appliance import keys

DISK = "disk.raw"
MANIFEST, SIGNATURE = keys.MANIFEST, keys.SIGNATURE
MIB = 1 << 20
ESP_TYPE = "C12A7328-F81F-11D2-BA4B-00A0C93EC93B"
ROOT_TYPE = "4F68BCE3-E8CD-4DB1-96E7-FBCAF984B709"  # root (x86-64), Discoverable Partitions Specification
DATA_TYPE = "0FC63DAF-8483-4772-8E79-3D69D8477DE4"
DISK_GUID = "6A1C3E80-3F5B-4E4C-9A55-1D2B2C0A0001"
SLOTS = ("a", "b")
TRIAL_TRIES = 1
# no_timer_check: the kernel's check of the IO-APIC timer panics a busy virtual machine ("IO-APIC + timer
# doesn't work", seen under qemu's TCG on a loaded host); cloud images ship it, and real timers need no check
KERNEL_OPTIONS = "rw console=ttyS0,115200 panic=10 no_timer_check"
KERNEL_IN_ROOT = "/boot/vmlinuz"
INITRD_IN_ROOT = "/boot/initrd.img"
# Partition sizes in MiB (image/build.sh makes its file systems these sizes). The data partition holds the
# firmware store: the interpreter firmware (417 MiB with the Kokoro voices, the wake words and the speaker
# encoder) as current and previous, plus a third release while `appliance update` installs one (the old
# previous goes only once the new one passed its self-test), with a tenth of it to spare; tests/test_image.py
# checks that they fit. At 1536 MiB three releases left 150 MiB, under the tenth: 2048 leaves room to grow.
ESP_MIB, ROOT_MIB, DATA_MIB = 256, 2048, 2048


@dataclass(frozen=True, slots=True)
class Partition:
    label: str
    type: str
    uuid: str
    start_mib: int
    size_mib: int

    @property
    def offset(self) -> int:
        return self.start_mib * MIB

    @property
    def size(self) -> int:
        return self.size_mib * MIB


def _layout() -> tuple[Partition, ...]:
    sizes = (
        ("esp", ESP_TYPE, ESP_MIB),
        ("root-a", ROOT_TYPE, ROOT_MIB),
        ("root-b", ROOT_TYPE, ROOT_MIB),
        ("data", DATA_TYPE, DATA_MIB),
    )
    parts, start = [], 1
    for n, (label, kind, size) in enumerate(sizes, 1):
        parts.append(Partition(label, kind, f"6A1C3E80-3F5B-4E4C-9A55-1D2B2C0A{n:04X}", start, size))
        start += size
    return tuple(parts)


LAYOUT = _layout()
DISK_SIZE = (LAYOUT[-1].start_mib + LAYOUT[-1].size_mib + 1) * MIB  # + 1 MiB for the backup GPT


def partition(label: str) -> Partition:
    return next(p for p in LAYOUT if p.label == label)


def slot_partition(slot: str) -> Partition:
    return partition(f"root-{slot}")


def regions() -> list[tuple[str, int, int]]:
    """(name, offset, size) of every region of disk.raw: both GPT copies and each partition, every byte."""
    spans = [("gpt", 0, LAYOUT[0].offset)]
    spans += [(p.label, p.offset, p.size) for p in LAYOUT]
    end = LAYOUT[-1].offset + LAYOUT[-1].size
    spans.append(("gpt-backup", end, DISK_SIZE - end))
    return spans


def loader_entry(slot: str, version: int) -> str:
    return (
        f"title Appliance (slot {slot.upper()})\nsort-key appliance\nversion {version}\n"
        f"linux /appliance/slot-{slot}/vmlinuz\ninitrd /appliance/slot-{slot}/initrd.img\n"
        f"options root=PARTUUID={slot_partition(slot).uuid.lower()} {KERNEL_OPTIONS}\n"
    )


LOADER_CONF = "timeout 0\nauto-entries no\nauto-firmware no\nconsole-mode keep\n"
