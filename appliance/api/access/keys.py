"""API keys in a local TOML file: each a name, the salted hash of its secret, the routes it may use and
its share. The secret itself is printed once, by `appliance keys add`, and never stored.

    [keys.hall-tablet]
    hash = "sha256:SALT_HEX:DIGEST_HEX"
    routes = ["*"]                  # route names as /metrics labels them (openai_realtime, translate...)
    requests_per_minute = 600
    sessions = 4                    # WebSocket sessions open at once
    audio_seconds_per_hour = 3600   # audio its Realtime sessions may send in any hour
    created = "2026-12-05T01:00:00Z"

A secret is 32 random bytes (256 bits), so one salted SHA-256 is enough: a slow hash (scrypt) guards
passwords a person chose, and would cost every request milliseconds here for no gain.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from appliance.durable import replace_file
from appliance.errors import ApplianceError

PREFIX = "box-"  # a secret's first characters: says what it is where it is pasted
NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")
ALL_ROUTES = ("*",)


@dataclass(frozen=True, slots=True)
class Share:
    """What one key may take: 0 is no bound."""

    requests_per_minute: int = 600
    sessions: int = 4
    audio_seconds_per_hour: int = 3600


@dataclass(frozen=True, slots=True)
class Key:
    name: str
    hash: str  # "sha256:SALT:DIGEST"
    routes: tuple[str, ...] = ALL_ROUTES
    share: Share = field(default_factory=Share)
    created: str = ""

    def matches(self, secret: str) -> bool:
        """Whether `secret` is this key's, compared in constant time."""
        _, salt, digest = self.hash.split(":")
        return hmac.compare_digest(_digest(bytes.fromhex(salt), secret), digest)

    def may_use(self, route: str) -> bool:
        return "*" in self.routes or route in self.routes


def _digest(salt: bytes, secret: str) -> str:
    return hashlib.sha256(salt + secret.encode("utf-8", "replace")).hexdigest()


def find(keys: tuple[Key, ...], secret: str) -> Key | None:
    """The key whose secret this is: every key is compared, so the time says nothing of which matched."""
    found = None
    for key in keys:
        if key.matches(secret) and found is None:
            found = key
    return found


def load(path: Path) -> tuple[Key, ...]:
    """The keys in `path`; none where the file does not exist (the box is then open on the LAN)."""
    try:
        doc = tomllib.loads(path.read_text())
    except FileNotFoundError:
        return ()
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise ApplianceError(f"{path}: cannot read the API keys: {exc}") from None
    tables = doc.get("keys", {})
    if set(doc) - {"keys"} or not isinstance(tables, dict):
        raise ApplianceError(f"{path}: an API key file holds [keys.NAME] tables only")
    return tuple(_key(path, name, table) for name, table in tables.items())


def _key(path: Path, name: str, table: Any) -> Key:
    where = f"{path}: keys.{name}"
    if not NAME.fullmatch(name) or not isinstance(table, dict):
        raise ApplianceError(f"{where}: a key is a table named by 1 to 64 letters, digits, '.', '_' or '-'")
    hashed = table.get("hash")
    if not isinstance(hashed, str) or not re.fullmatch(r"sha256:[0-9a-f]{32}:[0-9a-f]{64}", hashed):
        raise ApplianceError(f"{where}.hash: expected 'sha256:SALT:DIGEST' as `appliance keys add` writes it")
    routes = table.get("routes", list(ALL_ROUTES))
    if not isinstance(routes, list) or not routes or not all(isinstance(r, str) for r in routes):
        raise ApplianceError(f'{where}.routes: expected a non-empty list of route names (or ["*"])')
    bounds = {}
    for bound in ("requests_per_minute", "sessions", "audio_seconds_per_hour"):
        value = table.get(bound, getattr(Share(), bound))
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise ApplianceError(f"{where}.{bound}: expected a whole number, 0 or more (0: no bound)")
        bounds[bound] = value
    unknown = set(table) - {"hash", "routes", "created", *bounds}
    if unknown:
        raise ApplianceError(f"{where}.{sorted(unknown)[0]}: unknown key")
    return Key(name, hashed, tuple(routes), Share(**bounds), str(table.get("created", "")))


def add(path: Path, name: str, routes: tuple[str, ...], share: Share) -> str:
    """A new key under `name` written to `path`; its secret, to be shown once."""
    if not NAME.fullmatch(name):
        raise ApplianceError(f"key name {name[:80]!r}: use 1 to 64 letters, digits, '.', '_' or '-'")
    keys = load(path)
    if any(k.name == name for k in keys):
        raise ApplianceError(f"{path}: a key named {name!r} exists (revoke it first to replace it)")
    secret = PREFIX + secrets.token_urlsafe(32)
    salt = secrets.token_bytes(16)
    created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    _write(path, (*keys, Key(name, f"sha256:{salt.hex()}:{_digest(salt, secret)}", routes, share, created)))
    return secret


def revoke(path: Path, name: str) -> None:
    keys = load(path)
    if not any(k.name == name for k in keys):
        raise ApplianceError(f"{path}: no key named {name[:80]!r} (keys: {', '.join(k.name for k in keys) or 'none'})")
    _write(path, tuple(k for k in keys if k.name != name))


def _write(path: Path, keys: tuple[Key, ...]) -> None:
    lines = ["# API keys (appliance keys add/list/revoke); the daemon reads this file at start and on SIGHUP"]
    for k in keys:
        lines += [
            "",
            f"[keys.{k.name}]",
            f'hash = "{k.hash}"',
            f"routes = {json.dumps(list(k.routes))}",
            f"requests_per_minute = {k.share.requests_per_minute}",
            f"sessions = {k.share.sessions}",
            f"audio_seconds_per_hour = {k.share.audio_seconds_per_hour}",
            f'created = "{k.created}"',
        ]
    replace_file(path, ("\n".join(lines) + "\n").encode(), 0o640)
    if os.geteuid() == 0:  # root wrote it: it takes its directory's owner, so the daemon's user reads it
        directory = path.parent.stat()
        os.chown(path, directory.st_uid, directory.st_gid)
