"""The image's signed manifest: the sha256 of every region of disk.raw, signed like a firmware bundle."""

from __future__ import annotations

import time
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass
from pathlib import Path

from appliance import keys
from appliance.box.disk import sha256_range
from appliance.box.layout import DISK, DISK_SIZE, MANIFEST, regions
from appliance.errors import ApplianceError
from appliance.progress import QUIET, Progress

FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class Region:
    """A byte range of disk.raw and its sha256; together the regions cover every byte."""

    name: str
    offset: int
    size: int
    sha256: str


@dataclass(frozen=True, slots=True)
class ImageManifest:
    format: int
    name: str
    version: str
    build_time: str
    signing_key_id: str
    disk_size: int
    regions: tuple[Region, ...]

    def region(self, name: str) -> Region:
        for region in self.regions:
            if region.name == name:
                return region
        raise ApplianceError(f"image manifest has no region {name!r}")


def sign(image_dir: Path, key_path: Path, name: str, version: str, progress: Progress = QUIET) -> ImageManifest:
    """Hash every region of image_dir/disk.raw and write the signed manifest next to it."""
    disk = image_dir / DISK
    if disk.stat().st_size != DISK_SIZE:
        raise ApplianceError(f"{disk}: {disk.stat().st_size} bytes, the layout needs {DISK_SIZE}")
    private = keys.load_private_key(key_path)
    with progress.phase(f"hash {disk}", DISK_SIZE) as advance:
        hashed = tuple(Region(n, o, s, sha256_range(disk, o, s, advance)) for n, o, s in regions())
    manifest = ImageManifest(
        FORMAT_VERSION,
        name,
        version,
        time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        keys.key_id(private.public_key()),
        DISK_SIZE,
        hashed,
    )
    keys.write_signed(image_dir, asdict(manifest), private)
    return manifest


def verify_signature(image_dir: Path, trust_dir: Path) -> ImageManifest:
    """The manifest, if its signature verifies against a trusted key; hashes are checked separately."""
    manifest_path = image_dir / MANIFEST
    doc = keys.read_signed(image_dir, trust_dir, "an image")
    try:
        manifest = ImageManifest(**{**doc, "regions": tuple(Region(**r) for r in doc["regions"])})
    except (TypeError, KeyError) as exc:
        raise ApplianceError(f"{manifest_path}: malformed image manifest: {exc}") from None
    keys.check_name(str(manifest.name), f"{manifest_path}: name")
    keys.check_name(str(manifest.version), f"{manifest_path}: version")
    for region in manifest.regions:
        if not (
            isinstance(region.name, str)
            and isinstance(region.sha256, str)
            and all(type(n) is int and n >= 0 for n in (region.offset, region.size))
        ):
            raise ApplianceError(f"{manifest_path}: malformed image manifest: region {str(region.name)[:40]!r}")
    if manifest.format != FORMAT_VERSION or manifest.disk_size != DISK_SIZE:
        raise ApplianceError(
            f"{manifest_path}: format {manifest.format}, disk size {manifest.disk_size}: "
            f"this appliance reads format {FORMAT_VERSION} with disk size {DISK_SIZE}"
        )
    return manifest


def check_regions(
    path: Path | keys.Medium,
    base: int,
    regions: tuple[Region, ...],
    what: str,
    progress: Progress = QUIET,
    phase: str | None = None,
) -> None:
    """Every region's bytes, read from `path` at base + region offset, hash as the manifest says."""
    with progress.phase(phase or f"verify {what}", sum(r.size for r in regions)) as advance:
        for region in regions:
            if sha256_range(path, base + region.offset, region.size, advance) != region.sha256:
                raise ApplianceError(
                    f"{what}: region {region.name} (bytes {region.offset}..{region.offset + region.size})"
                    " does not match the signed manifest (altered or badly written)"
                )


def verify(
    image_dir: Path, trust_dir: Path, names: tuple[str, ...] | None = None, progress: Progress = QUIET
) -> ImageManifest:
    """Signature, then the hash of every region (or of the named ones) of disk.raw."""
    manifest = verify_signature(image_dir, trust_dir)
    with open_disk(image_dir) as disk:
        if disk.size != manifest.disk_size:
            raise ApplianceError(f"{disk.path}: {disk.size} bytes, not the {manifest.disk_size} of the manifest")
        wanted = manifest.regions if names is None else tuple(manifest.region(n) for n in names)
        check_regions(disk, 0, wanted, str(disk.path), progress)
    return manifest


def open_disk(image_dir: Path) -> AbstractContextManager[keys.Medium]:
    """The image's disk.raw, opened as update media (keys.open_medium), at most the layout's size."""
    return keys.open_medium(image_dir, DISK, DISK_SIZE, "disk image")
