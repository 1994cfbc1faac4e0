"""The box's firmware store on the data partition: signed bundles side by side, one current.

    /var/lib/appliance/firmware/
        releases/<name>-<version>-<id>/   verified copies of signed bundles
        current  -> releases/...          what the daemon loads (the config's firmware.bundle)
        previous -> releases/...          what a rollback returns to
        trial                             present while `current` has not yet passed a self-test;
                                          it names what `previous` was before the switch

Every change is a rename: a release is copied under a .partial name, synced, verified again and
only then renamed into place; links are replaced by renaming a new link over them. A power cut
therefore leaves the old state or the new one, and the daemon always finds a complete bundle.
A bundle is refused before anything is written if its signature or a hash does not verify.
Every release path is checked to be a directory right under releases/ (resolved, not a link) before
anything is written or deleted there; directories are made 0755 and files 0644, whatever the umask.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance import keys
from appliance.durable import PARTIAL, fsync_path, make_directories, replace_file
from appliance.errors import ApplianceError
from appliance.firmware.files import write_blocks
from appliance.firmware.manifest import ARTIFACT_MAX, MANIFEST
from appliance.firmware.verify import verify
from appliance.progress import QUIET, Progress

STORE = Path("/var/lib/appliance/firmware")
RELEASES = "releases"


@dataclass(frozen=True, slots=True)
class Store:
    root: Path = STORE

    @property
    def releases(self) -> Path:
        return self.root / RELEASES

    def link(self, name: str) -> Path | None:
        """Where current or previous points (a release directory), or None."""
        path = self.root / name
        if not path.is_symlink():
            return None
        return self.root / os.readlink(path)

    @property
    def current(self) -> Path | None:
        return self.link("current")

    @property
    def previous(self) -> Path | None:
        return self.link("previous")

    @property
    def on_trial(self) -> bool:
        return (self.root / "trial").exists()


def describe(release: Path | None) -> str:
    """For messages: the release's directory name says name, version, key and manifest hash."""
    return "none" if release is None else release.name


def _point(store: Store, name: str, release: Path | None) -> None:
    """Make store/name point at release (relative, so the store can be mounted anywhere), atomically."""
    link = store.root / name
    if release is None:
        link.unlink(missing_ok=True)
    else:
        partial = store.root / f"{name}{PARTIAL}"
        partial.unlink(missing_ok=True)
        partial.symlink_to(os.path.relpath(release, store.root))
        partial.rename(link)
    fsync_path(store.root)


def release_path(store: Store, name: str) -> Path:
    """store/releases/name, once checked to stay in the store: resolved, it is right under releases/, and
    it is not a link. Every release the store writes or deletes goes through this first."""
    path = store.releases / name
    if "/" in name or name in ("", ".", "..") or path.is_symlink() or path.resolve().parent != store.releases.resolve():
        raise ApplianceError(f"{path}: not a release directory in {store.releases} (refused: it would leave the store)")
    return path


def confined(store: Store, release: Path) -> Path:
    """A release path from elsewhere (a link's target, a caller's argument), checked like release_path."""
    if release.parent != store.releases:
        raise ApplianceError(
            f"{release}: not a release directory in {store.releases} (refused: it would leave the store)"
        )
    return release_path(store, release.name)


def _limit(relative: str) -> tuple[int, str]:
    return {
        keys.MANIFEST: (keys.MANIFEST_MAX, "manifest"),
        keys.SIGNATURE: (keys.SIGNATURE_MAX, "signature"),
    }.get(relative, (ARTIFACT_MAX, "firmware artifact"))


def install(store: Store, source: Path, trust_dir: Path, progress: Progress = QUIET) -> Path:
    """Copy a verified bundle into the store and verify the copy; returns its release directory."""
    manifest = verify(source, trust_dir, progress).manifest
    manifest_hash = hashlib.sha256(keys.read_medium(source, MANIFEST, keys.MANIFEST_MAX, "manifest")).hexdigest()
    release = release_path(
        store, f"{manifest.name}-{manifest.version}-{manifest.signing_key_id[:8]}-{manifest_hash[:12]}"
    )
    if release.is_dir():
        verify(release, trust_dir, progress)  # installed before: still intact
        return release
    make_directories(store.releases)
    partial = release_path(store, release.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    make_directories(partial)
    # Only what the signature covers is copied: the manifest, its signature and the listed artifacts,
    # each read from the source as update media (keys.open_medium) and written 0644.
    covered = (keys.MANIFEST, keys.SIGNATURE, *manifest.artifacts)
    total = 0
    for relative in covered:
        with keys.open_medium(source, relative, *_limit(relative)) as medium:
            total += medium.size
    with progress.phase(f"copy {source} to {partial}", total) as advance:
        for relative in covered:
            make_directories((partial / relative).parent)
            with keys.open_medium(source, relative, *_limit(relative)) as medium:
                write_blocks(medium.blocks(), partial / relative, advance)
            fsync_path(partial / relative)
    for directory in sorted({(partial / r).parent for r in manifest.artifacts} | {partial}, reverse=True):
        fsync_path(directory)
    verify(partial, trust_dir, progress)  # the copy as written
    partial.rename(release)
    fsync_path(store.releases)
    return release


def switch(store: Store, release: Path) -> None:
    """Make release current, on trial; what was current becomes previous."""
    release = confined(store, release)
    old_current, old_previous = store.current, store.previous
    if release == old_current:
        return
    replace_file(store.root / "trial", f"{old_previous.name if old_previous else ''}\n".encode())
    _point(store, "previous", old_current)
    _point(store, "current", release)


def commit(store: Store) -> None:
    """The current release passed its self-test: end the trial, delete releases nothing points at."""
    (store.root / "trial").unlink(missing_ok=True)
    fsync_path(store.root)
    keep = {store.current, store.previous}
    for release in store.releases.iterdir() if store.releases.is_dir() else ():
        if release.is_symlink():  # not the store's doing: the link goes, what it points at stays
            release.unlink()
        elif release not in keep:
            shutil.rmtree(confined(store, release))


def revert(store: Store) -> Path:
    """Back to the previous release. A failed trial's release is deleted and `previous` restored."""
    previous, failed = store.previous, store.current
    if previous is None or not previous.is_dir():
        raise ApplianceError(f"{store.root}: no previous firmware to return to")
    trial = store.root / "trial"
    if trial.exists():
        before = trial.read_text().strip()
        _point(store, "current", previous)
        _point(store, "previous", release_path(store, before) if before else None)
        trial.unlink()
        fsync_path(store.root)
        if failed is not None and failed not in (store.current, store.previous):
            shutil.rmtree(confined(store, failed), ignore_errors=True)
    else:
        switch(store, previous)
    return previous


def try_current(store: Store, restart: Callable[[], None], selftest: Callable[[], str]) -> str:
    """Restart the daemon on the trial release and self-test it: commit it, or revert and restart.

    Returns the self-test's line; raises naming the failed release and the one serving again.
    """
    try:
        restart()
        line = selftest()
    except ApplianceError as exc:
        failed = describe(store.current)
        if store.previous is None:
            raise ApplianceError(
                f"firmware {failed} failed its self-test ({exc}); there is no previous firmware to return to"
            ) from None
        back = revert(store)
        restart()
        selftest()
        raise ApplianceError(
            f"firmware {failed} failed its self-test ({exc}); rolled back: {describe(back)} serves again"
        ) from None
    commit(store)
    return line
