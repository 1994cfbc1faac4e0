"""Ed25519 signing keys, and the signed manifests of firmware bundles and disk images.

A private key is a PEM file; a trusted public key is a `<key id>.pub` file holding the raw
32 bytes in hex. The key id is the first 16 hex digits of sha256(raw public key), so a
manifest can name the key that signed it and the verifier need not try every key.

A signed manifest is a directory's manifest.json (sorted, indented JSON with a
`signing_key_id`) and manifest.sig (Ed25519 over the exact bytes of manifest.json).
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from appliance.errors import ApplianceError

MANIFEST = "manifest.json"
SIGNATURE = "manifest.sig"


def key_id(public: Ed25519PublicKey) -> str:
    raw = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()[:16]


def new_key_pair(private_path: Path, trust_dir: Path | None) -> str:
    """Write a new private key (mode 0600) and its public half; return the key id."""
    private = Ed25519PrivateKey.generate()
    pem = private.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    private_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(private_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(pem)
    public = private.public_key()
    kid = key_id(public)
    raw_hex = public.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw).hex()
    private_path.with_suffix(".pub").write_text(raw_hex + "\n")
    if trust_dir is not None:
        trust_dir.mkdir(parents=True, exist_ok=True)
        (trust_dir / f"{kid}.pub").write_text(raw_hex + "\n")
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
    try:
        return Ed25519PublicKey.from_public_bytes(bytes.fromhex(path.read_text().strip()))
    except (OSError, ValueError) as exc:
        raise ApplianceError(f"{path}: not an Ed25519 public key in hex: {exc}") from None


def trusted_key(trust_dir: Path, kid: str) -> Ed25519PublicKey:
    """The trusted public key with this id, or an error saying it is not trusted."""
    path = trust_dir / f"{kid}.pub"
    if not path.is_file():
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
    (directory / MANIFEST).write_bytes(data)
    (directory / SIGNATURE).write_bytes(private.sign(data))


def read_signed(directory: Path, trust_dir: Path, what: str) -> Any:
    """The directory's manifest (parsed JSON), if its signature verifies against the trusted key
    it names; else an ApplianceError naming the file and the reason. `what`: "firmware", "image"."""
    manifest_path, signature_path = directory / MANIFEST, directory / SIGNATURE
    try:
        data = manifest_path.read_bytes()
        signature = signature_path.read_bytes()
    except OSError as exc:
        raise ApplianceError(f"{exc.filename}: cannot read: {exc.strerror}") from None
    try:
        document = json.loads(data)
        kid = str(document["signing_key_id"])
    except (ValueError, KeyError, TypeError):
        raise ApplianceError(f"{manifest_path}: not {what} manifest (no signing_key_id)") from None
    public = trusted_key(trust_dir, kid)
    if len(signature) != 64 or not signature_valid(public, signature, data):
        raise ApplianceError(
            f"{signature_path}: signature does not verify manifest.json with trusted key {kid} "
            "(manifest or signature altered)"
        )
    return document
