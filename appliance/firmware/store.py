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
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from appliance import keys
from appliance.durable import PARTIAL, fsync_path, replace_file
from appliance.errors import ApplianceError
from appliance.firmware.files import copy_file, sha256_file
from appliance.firmware.manifest import MANIFEST
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


def install(store: Store, source: Path, trust_dir: Path, progress: Progress = QUIET) -> Path:
    """Copy a verified bundle into the store and verify the copy; returns its release directory."""
    manifest = verify(source, trust_dir, progress).manifest
    release = (
        store.releases / f"{manifest.name}-{manifest.version}-{manifest.signing_key_id[:8]}-"
        f"{sha256_file(source / MANIFEST)[:12]}"
    )
    if release.is_dir():
        verify(release, trust_dir, progress)  # installed before: still intact
        return release
    store.releases.mkdir(parents=True, exist_ok=True)
    partial = release.with_name(release.name + PARTIAL)
    shutil.rmtree(partial, ignore_errors=True)
    # Only what the signature covers is copied: the manifest, its signature and the listed artifacts.
    covered = (keys.MANIFEST, keys.SIGNATURE, *manifest.artifacts)
    with progress.phase(f"copy {source} to {partial}", sum((source / r).stat().st_size for r in covered)) as advance:
        for relative in covered:
            (partial / relative).parent.mkdir(parents=True, exist_ok=True)
            copy_file(source / relative, partial / relative, advance)
            fsync_path(partial / relative)
    for directory in sorted({(partial / r).parent for r in manifest.artifacts} | {partial}, reverse=True):
        fsync_path(directory)
    verify(partial, trust_dir, progress)  # the copy as written
    partial.rename(release)
    fsync_path(store.releases)
    return release


def switch(store: Store, release: Path) -> None:
    """Make release current, on trial; what was current becomes previous."""
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
        if release not in keep:
            shutil.rmtree(release)


def revert(store: Store) -> Path:
    """Back to the previous release. A failed trial's release is deleted and `previous` restored."""
    previous, failed = store.previous, store.current
    if previous is None or not previous.is_dir():
        raise ApplianceError(f"{store.root}: no previous firmware to return to")
    trial = store.root / "trial"
    if trial.exists():
        before = trial.read_text().strip()
        _point(store, "current", previous)
        _point(store, "previous", store.releases / before if before else None)
        trial.unlink()
        fsync_path(store.root)
        if failed is not None and failed not in (store.current, store.previous):
            shutil.rmtree(failed, ignore_errors=True)
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
