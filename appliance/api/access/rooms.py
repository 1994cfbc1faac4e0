"""The room page without a long-lived key, the way OpenAI's client secrets are used: the operator opens
a room (`appliance room open`, an operator route) and hands out its PIN or link; the page trades the PIN
for a client secret (POST /v1/realtime/client_secrets, answered as OpenAI answers it:
{"value": "ek_...", "expires_at": UNIX_S, "session": {...}}), which it sends as its key (a bearer
header on HTTP, a WebSocket subprotocol `openai-insecure-api-key.SECRET`). A secret may use the
room's interpreter and its voices (ROOM_ROUTES, its Realtime sessions on the room's pipeline only) and
expires with the room.

    POST /v1/rooms                    {"minutes": 60, "model": PIPELINE?} -> {"pin", "link", "expires_at", "model"}
    POST /v1/realtime/client_secrets  {"room": PIN, "expires_after"?: {"seconds": N}} -> {"value", "expires_at", "session"}
"""

from __future__ import annotations

import hashlib
import re
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from appliance.api.bodies import json_body
from appliance.api.routes import Route
from appliance.errors import ApiError, BadRequest
from appliance.protocol.messages import Request, Response, json_response

# what a room's secret may use: the interpreter's session, its voices, the page's translation panel
ROOM_ROUTES = frozenset(
    {"openai_realtime", "openai_speech", "openai_voices", "translate", "languages", "server", "models", "model"}
)
MAX_MINUTES = 24 * 60
PIN_DIGITS = 8
PIN_TRIES_PER_MINUTE = 10  # wrong PINs one address may send: 10**8 PINs cannot be walked through
SECRETS_PER_ROOM = 256  # live secrets of one room: a PIN's holder cannot fill the box's memory with them


@dataclass(frozen=True, slots=True)
class Room:
    pin: str
    model: str  # the speech pipeline its secrets may open sessions on
    expires_at: float  # Unix seconds


@dataclass(frozen=True, slots=True)
class Secret:
    name: str  # "room:HASH_PREFIX": whose share it spends
    room: Room
    expires_at: float  # the room's end, or sooner where the page asked (expires_after); a session begun goes on


class Rooms:
    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.rooms: dict[str, Room] = {}
        self.secrets: dict[str, Secret] = {}  # by the SHA-256 of the secret: looked up, never compared
        self.wrong_pins: dict[str, deque[float]] = {}

    def open(self, minutes: float, model: str) -> Room:
        self._forget_expired()
        pin = "".join(secrets.choice("0123456789") for _ in range(PIN_DIGITS))
        room = self.rooms[pin] = Room(pin, model, self.clock() + minutes * 60)
        return room

    def trade(self, pin: str, address: str, seconds: float | None = None) -> tuple[str, Secret]:
        """A client secret for the room of `pin`, for `seconds` at most; a 401 for a PIN that opens none,
        a 429 past the tries."""
        now = self.clock()
        tries = self.wrong_pins.setdefault(address, deque())
        while tries and tries[0] <= now - 60:
            tries.popleft()
        if len(tries) >= PIN_TRIES_PER_MINUTE:
            raise ApiError(f"too many wrong room PINs from {address} (at most {PIN_TRIES_PER_MINUTE} a minute)", 429)
        room = self.rooms.get(pin)
        if room is None or room.expires_at <= now:
            tries.append(now)
            raise ApiError("no open room has this PIN (ask the operator for the room's PIN or link)", 401)
        if not tries:
            del self.wrong_pins[address]
        self._forget_expired()
        if sum(s.room is room for s in self.secrets.values()) >= SECRETS_PER_ROOM:
            raise ApiError(f"this room has {SECRETS_PER_ROOM} live client secrets, its most; ask again later", 429)
        value = "ek_" + secrets.token_urlsafe(24)
        expires_at = room.expires_at if seconds is None else min(room.expires_at, now + seconds)
        secret = self.secrets[_hashed(value)] = Secret(f"room:{_hashed(value)[:8]}", room, expires_at)
        return value, secret

    def secret(self, value: str) -> Secret | None:
        """The live room secret `value` is, if it is one."""
        found = self.secrets.get(_hashed(value))
        if found is not None and found.expires_at <= self.clock():
            del self.secrets[_hashed(value)]
            return None
        return found

    def _forget_expired(self) -> None:
        now = self.clock()
        self.rooms = {pin: r for pin, r in self.rooms.items() if r.expires_at > now}
        self.secrets = {h: s for h, s in self.secrets.items() if s.expires_at > now}


def _hashed(value: str) -> str:
    return hashlib.sha256(value.encode("utf-8", "replace")).hexdigest()


def routes(rooms: Rooms, pipelines: list[str]) -> list[Route]:
    async def open_room(request: Request, params: dict[str, str]) -> Response:
        doc = await json_body(request) if request.body.strip() else {}
        minutes, model = doc.get("minutes", 60), doc.get("model", pipelines[0] if pipelines else "")
        if not isinstance(minutes, int | float) or isinstance(minutes, bool) or not 0 < minutes <= MAX_MINUTES:
            raise BadRequest(f"minutes must be a number from 1 to {MAX_MINUTES}")
        if model not in pipelines:
            raise BadRequest(f"model {str(model)[:80]!r} is not a speech pipeline here (pipelines: {pipelines})")
        room = rooms.open(minutes, model)
        expires_at = int(room.expires_at)
        return json_response(
            200, {"pin": room.pin, "link": f"/?room={room.pin}", "expires_at": expires_at, "model": model}
        )

    async def client_secret(request: Request, params: dict[str, str]) -> Response:
        doc = await json_body(request)
        pin = doc.get("room")
        if not isinstance(pin, str) or not re.fullmatch(r"[0-9]{1,16}", pin):
            raise BadRequest(f'send the room\'s PIN: {{"room": "{"1" * PIN_DIGITS}"}} ({PIN_DIGITS} digits)')
        after = doc.get("expires_after")  # OpenAI's: {"anchor": "created_at", "seconds": 10 to 7200}
        seconds = after.get("seconds") if isinstance(after, dict) else None
        if seconds is not None and (
            not isinstance(seconds, int) or isinstance(seconds, bool) or not 10 <= seconds <= 7200
        ):
            raise BadRequest("expires_after.seconds must be a whole number from 10 to 7200")
        value, secret = rooms.trade(pin, request.address, seconds)
        session = {"type": "realtime", "model": secret.room.model}
        return json_response(200, {"value": value, "expires_at": int(secret.expires_at), "session": session})

    return [
        ("POST", re.compile(r"/v1/rooms"), "rooms", open_room),
        ("POST", re.compile(r"/v1/realtime/client_secrets"), "client_secrets", client_secret),
    ]
