"""Ed25519 signing keys, the signed manifests of firmware bundles and disk images, and the one way a
file of update media is read.

A private key is a PEM file; a trusted public key is a `<key id>.pub` file holding the raw
32 bytes in hex. The key id is the first 16 hex digits of sha256(raw public key), so a
manifest can name the key that signed it and the verifier need not try every key.

A signed manifest is a directory's manifest.json (sorted, indented JSON with a
`signing_key_id`) and manifest.sig (Ed25519 over the exact bytes of manifest.json).

Update media (a bundle or an image on a USB stick, a bundle in the store, the trusted keys) are
hostile until verified: every file of them is read through `open_medium`, which opens a regular
file reached without a symbolic link, never blocks on a FIFO, and refuses one over its size limit
before reading it. The keys and manifests written here get explicit modes, whatever the umask.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import re
import stat
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.errors import ApplianceError

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
MANIFEST_MAX = MIB  # a manifest is a few KiB; the limit is said in the error
SIGNATURE_MAX = KIB  # an Ed25519 signature is 64 bytes
PUBLIC_KEY_MAX = KIB  # 64 hex digits and a newline
JSON_DEPTH_MAX = 32  # a manifest nests 5 deep
NAME_MAX = 64
# A manifest's name and version end up in paths (the store's release directories): a conservative set,
# starting with a letter or digit, so no separator, no "..", no leading "-" or ".".
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+~-]*")
KEY_ID = re.compile(r"[0-9a-f]{16}")
PRIVATE_MODE, PUBLIC_MODE = 0o600, 0o644  # whatever the umask


# --- reading update media ---------------------------------------------------------------------------


class Medium:
    """A regular file of update media, open for reading: reads never pass the size it had when opened."""

    def __init__(self, path: Path, fd: int, size: int) -> None:
        self.path, self.fd, self.size = path, fd, size

    def blocks(self, offset: int = 0, size: int | None = None, block: int = MIB) -> Iterator[bytes]:
        """The bytes [offset, offset + size) in blocks; an error if the file changed size while read."""
        end = self.size if size is None else offset + size
        if end > self.size:
            raise ApplianceError(f"{self.path}: ends at byte {self.size}, before byte {end} (truncated)")
        position = offset
        while position < end:
            data = os.pread(self.fd, min(block, end - position), position)
            if not data:
                raise ApplianceError(f"{self.path}: ended at byte {position} while read (changed on the medium)")
            position += len(data)
            yield data
        if size is None and os.pread(self.fd, 1, end):
            raise ApplianceError(f"{self.path}: grew past its {self.size} bytes while read (changed on the medium)")

    def read(self) -> bytes:
        return b"".join(self.blocks())


def size_text(size: int) -> str:
    for unit, name in ((GIB, "GiB"), (MIB, "MiB"), (KIB, "KiB")):
        if size >= unit and size % unit == 0:
            return f"{size // unit} {name}"
    return f"{size} bytes"


def _kind(mode: int) -> str:
    kinds = (
        (stat.S_ISLNK, "a symbolic link"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def not_regular(path: Path, mode: int) -> ApplianceError:
    """The refusal of a file of update media that is not a regular file (by its lstat mode)."""
    kind = _kind(mode)
    if stat.S_ISLNK(mode):
        return ApplianceError(f"{path}: is {kind}; update media are read as regular files only, never through links")
    return ApplianceError(f"{path}: is {kind}, not a regular file; update media are read as regular files only")


def _lstat(name: str, dir_fd: int, path: Path) -> os.stat_result:
    try:
        return os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        raise ApplianceError(f"{path}: missing") from None
    except OSError as exc:
        raise ApplianceError(f"{path}: cannot read: {exc.strerror}") from None


def _open(name: str | Path, flags: int, path: Path, dir_fd: int | None = None) -> int:
    try:
        return os.open(name, flags | os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY | os.O_NONBLOCK, dir_fd=dir_fd)
    except FileNotFoundError:
        raise ApplianceError(f"{path}: missing") from None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise not_regular(path, stat.S_IFLNK) from None
        raise ApplianceError(f"{path}: cannot read: {exc.strerror}") from None


@contextmanager
def open_medium(directory: Path, relative: str, limit: int, what: str = "file") -> Iterator[Medium]:
    """directory/relative, open for reading as update media: the one way every file of a bundle, an
    image or the trusted keys is read.

    `directory` itself may be reached through a link (the store's `current`); from there each part of
    `relative` must be a real directory and the file a regular file (lstat, then open with O_NOFOLLOW
    and O_NONBLOCK, so that a FIFO cannot hang the open, then fstat of what was opened), of at most
    `limit` bytes. Every refusal is one ApplianceError naming the file and the reason.
    """
    path = directory / relative
    parts = relative.split("/")
    if any(part in ("", ".", "..") for part in parts):
        raise ApplianceError(f"{path}: not a plain path inside {directory}")
    fd = _open(directory, os.O_DIRECTORY, directory)
    try:
        for i, part in enumerate(parts[:-1]):
            where = directory.joinpath(*parts[: i + 1])
            mode = _lstat(part, fd, where).st_mode
            if not stat.S_ISDIR(mode):
                raise not_regular(where, mode) if stat.S_ISLNK(mode) else ApplianceError(f"{where}: not a directory")
            inner = _open(part, os.O_DIRECTORY | os.O_NOFOLLOW, where, fd)
            os.close(fd)
            fd = inner
        before = _lstat(parts[-1], fd, path)
        if not stat.S_ISREG(before.st_mode):
            raise not_regular(path, before.st_mode)
        file_fd = _open(parts[-1], os.O_NOFOLLOW, path, fd)
    finally:
        os.close(fd)
    try:
        opened = os.fstat(file_fd)
        if not stat.S_ISREG(opened.st_mode):
            raise not_regular(path, opened.st_mode)
        if (opened.st_dev, opened.st_ino) != (before.st_dev, before.st_ino):
            raise ApplianceError(f"{path}: replaced while opened (changed on the medium)")
        if opened.st_size > limit:
            raise ApplianceError(f"{path}: {opened.st_size} bytes, over the {size_text(limit)} limit for a {what}")
        yield Medium(path, file_fd, opened.st_size)
    finally:
        os.close(file_fd)


def read_medium(directory: Path, relative: str, limit: int, what: str = "file") -> bytes:
    """The whole of a small file of update media (a manifest, a signature, a key), via `open_medium`."""
    with open_medium(directory, relative, limit, what) as medium:
        return medium.read()


def parse_json(data: bytes, path: Path) -> Any:
    """JSON from update media; nesting past JSON_DEPTH_MAX or that the parser cannot take is one error."""
    try:
        document = json.loads(data)
    except RecursionError:
        raise ApplianceError(f"{path}: not valid JSON: nested deeper than {JSON_DEPTH_MAX} levels") from None
    except ValueError as exc:  # not JSON, or not UTF-8
        raise ApplianceError(f"{path}: not valid JSON: {exc}") from None
    level: list[Any] = [document]
    for _ in range(JSON_DEPTH_MAX):  # level by level: no recursion
        level = [c for v in level for c in (v.values() if isinstance(v, dict) else v if isinstance(v, list) else ())]
        if not level:
            return document
    raise ApplianceError(f"{path}: not valid JSON: nested deeper than {JSON_DEPTH_MAX} levels")


def read_manifest(directory: Path) -> tuple[bytes, Any]:
    """A directory's manifest.json: its exact bytes and the JSON they hold (not yet verified)."""
    data = read_medium(directory, MANIFEST, MANIFEST_MAX, "manifest")
    return data, parse_json(data, directory / MANIFEST)


def check_name(value: str, where: str) -> str:
    """A manifest's name or version: safe as part of a file name (see NAME), at most NAME_MAX characters."""
    if not (len(value) <= NAME_MAX and NAME.fullmatch(value) and ".." not in value):
        raise ApplianceError(
            f"{where}: {value[:80]!r} is not a safe name: letters, digits and . _ + ~ - only, starting with a "
            f"letter or digit, no '..', at most {NAME_MAX} characters"
        )
    return value


# --- keys and signed manifests -----------------------------------------------------------------------


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def _write(path: Path, data: bytes, mode: int, exclusive: bool = False) -> None:
    """Write a file with exactly `mode`, whatever the umask, never through a link at `path`."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    with os.fdopen(os.open(path, flags, mode), "wb") as f:
        os.fchmod(f.fileno(), mode)
        f.write(data)


def new_key_pair(private_path: Path, trust_dir: Path | None) -> str:
    """Write a new private key (mode 0600) and its public half (0644), also into trust_dir when given;
    return the key id. The directories must exist (durable.make_directories makes them 0755)."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    _write(private_path, pem, PRIVATE_MODE, exclusive=True)
    public = private.public_key()
    kid = key_id(public)
    raw_hex = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    _write(private_path.with_suffix(".pub"), f"{raw_hex}\n".encode(), PUBLIC_MODE)
    if trust_dir is not None:
        _write(trust_dir / f"{kid}.pub", f"{raw_hex}\n".encode(), PUBLIC_MODE)
    return kid


def load_private_key(path: Path) -> Ed25519PrivateKey:
    try:
        key = serialization.load_pem_private_key(path.read_bytes(), password=None)
    except (OSError, ValueError) as exc:
        raise ApplianceError(f"{path}: cannot read signing key: {exc}") from None
    if not isinstance(key, Ed25519PrivateKey):
        raise ApplianceError(f"{path}: not an Ed25519 private key")
    return key


def load_public_key(path: Path) -> Ed25519PublicKey:
    data = read_medium(path.parent, path.name, PUBLIC_KEY_MAX, "public key")
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(data.decode("ascii").strip()))
    except ValueError as exc:  # UnicodeDecodeError is one
        raise ApplianceError(f"{path}: not an Ed25519 public key in hex: {exc}") from None


def trusted_key(trust_dir: Path, kid: str) -> Ed25519PublicKey:
    """The trusted public key with this id (16 hex digits, checked before it names a file), or an error
    saying it is not trusted."""
    if not KEY_ID.fullmatch(kid):
        raise ApplianceError(f"signing key {kid[:40]!r} is not a key id (16 hex digits)")
    path = trust_dir / f"{kid}.pub"
    if not os.path.lexists(path):
        raise ApplianceError(f"signing key {kid} is not trusted (no {path})")
    public = load_public_key(path)
    if key_id(public) != kid:
        raise ApplianceError(f"{path}: holds key {key_id(public)}, not {kid}")
    return public


def signature_valid(public: Ed25519PublicKey, signature: bytes, data: bytes) -> bool:
    try:
        public.verify(signature, data)
    except InvalidSignature:
        return False
    return True


def encode_manifest(document: dict[str, Any]) -> bytes:
    return (json.dumps(document, indent=2, sort_keys=True) + "\n").encode()


def write_signed(directory: Path, document: dict[str, Any], private: Ed25519PrivateKey) -> None:
    data = encode_manifest(document)
    _write(directory / MANIFEST, data, PUBLIC_MODE)
    _write(directory / SIGNATURE, private.sign(data), PUBLIC_MODE)


def read_signed(directory: Path, trust_dir: Path, what: str) -> Any:
    """The directory's manifest (parsed JSON), if its signature verifies against the trusted key
    it names; else an ApplianceError naming the file and the reason. `what`: "a firmware", "an image".
    Both files are read through `open_medium`, within MANIFEST_MAX and SIGNATURE_MAX."""
    manifest_path, signature_path = directory / MANIFEST, directory / SIGNATURE
    data, document = read_manifest(directory)
    signature = read_medium(directory, SIGNATURE, SIGNATURE_MAX, "signature")
    kid = document.get("signing_key_id") if isinstance(document, dict) else None
    if not isinstance(kid, str):
        raise ApplianceError(f"{manifest_path}: not {what} manifest (no signing_key_id)")
    if not KEY_ID.fullmatch(kid):
        raise ApplianceError(f"{manifest_path}: signing_key_id {kid[:40]!r} is not a key id (16 hex digits)")
    public = trusted_key(trust_dir, kid)
    if len(signature) != 64 or not signature_valid(public, signature, data):
        raise ApplianceError(
            f"{signature_path}: signature does not verify manifest.json with trusted key {kid} "
            "(manifest or signature altered)"
        )
    return document
