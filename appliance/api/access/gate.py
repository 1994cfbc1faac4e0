"""Who may use the box: every request passes `Access.admit` in the API core (the engine process), after
its route is known and before its handler runs.

- The Unix socket (listener "unix") is local users, held by the socket's mode and group: no key.
- QUIC and HTTPS need a key once the key file holds one, and are open where it holds none (`make run`).
  A key comes as each client sends it: `Authorization: Bearer KEY` (the OpenAI SDK, its Realtime
  client, tritonclient with a header), LibreTranslate's `api_key` field (query, form or JSON), or the
  WebSocket subprotocol `openai-insecure-api-key.KEY` (a browser cannot set headers on a WebSocket;
  OpenAI's own convention). A room's client secret (rooms.py) is taken the same ways.
- Browsers are held to the box's own page: a WebSocket upgrade or a POST whose `Origin` is neither the
  box's own (its Host) nor one of `access.origins` is refused, on every listener.
- Each key's share (shares.py): requests a minute, sessions at once, audio seconds an hour.

A refusal is the protocol's own status (401 no or unknown key, 403 a route or an origin the key may
not use, 429 a share spent) with a one-line reason; each is counted in
appliance_refused_total{reason, listener} and logged once per reason per 10 s.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from urllib.parse import parse_qsl, urlsplit

from appliance.api.access import keys as key_file
from appliance.api.access.rooms import ROOM_ROUTES, Rooms, Secret
from appliance.api.access.shares import Shares
from appliance.api.bodies import json_or_form
from appliance.api.metrics import Metrics
from appliance.config import Live
from appliance.errors import ApiError, ApplianceError
from appliance.protocol.limits import LIMITS_BITTEN
from appliance.protocol.messages import Close, Request, Response, Session, SessionIO

log = logging.getLogger("appliance.access")
# frontend_settings: LibreTranslate's clients read there whether a key is needed before they ask for one
PUBLIC_ROUTES = frozenset({"page", "certificate", "live", "ready", "client_secrets", "frontend_settings"})
KEYED_LISTENERS = ("quic", "https")
LIBRETRANSLATE_ROUTES = ("translate", "detect", "languages")
SUBPROTOCOL_KEY = "openai-insecure-api-key."
APPEND = '"input_audio_buffer.append"'
PCM16_24K_BYTES_S = 48000  # a Realtime session's audio: PCM16 at 24 kHz


@dataclass(frozen=True, slots=True)
class Grant:
    """Whom a request was admitted for ("" where no key was needed), and the subprotocol to answer."""

    principal: str = ""
    subprotocol: str = ""
    listener: str = ""


class Access:
    def __init__(self, live: Live, metrics: Metrics) -> None:
        self.live, self.metrics = live, metrics
        self.shares = Shares()
        self.rooms = Rooms()
        self.keys: tuple[key_file.Key, ...] = key_file.load(live.config.access.keys)

    def reload(self) -> None:
        """Read the key file again (SIGHUP): the sessions of keys it no longer holds are stopped, every
        other session goes on. A file that cannot be read keeps the keys in force."""
        try:
            keys = key_file.load(self.live.config.access.keys)
        except ApplianceError as exc:
            log.error("reload: keeping the API keys in force: %s", exc)
            return
        gone = {f"key:{k.name}" for k in self.keys} - {f"key:{k.name}" for k in keys}
        self.keys = keys
        stopped = self.shares.stop_all(gone)
        log.info("reload: %d API keys; revoked %d, their %d open sessions stopped", len(keys), len(gone), stopped)

    async def admit(self, request: Request, route: str, params: dict[str, str]) -> Grant:
        """The grant of a request on `route`, or the ApiError that refuses it."""
        upgrade = request.headers.get("upgrade", "").lower() == "websocket"
        if (upgrade or request.method == "POST") and not self._same_origin(request):
            raise self._refused("origin", request, 403, f"origin {request.headers['origin'][:80]!r} is not this box's")
        offered = [p.strip() for p in request.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
        answer = next((p for p in offered if not p.startswith(SUBPROTOCOL_KEY)), "")
        if route in PUBLIC_ROUTES or not self.needs_key(request):
            return Grant(subprotocol=answer)
        secret = await self._presented(request, route, offered)
        if not secret:
            raise self._refused("no_key", request, 401, "this box needs an API key (Authorization: Bearer KEY)")
        key = key_file.find(self.keys, secret)
        room_secret = self.rooms.secret(secret) if key is None else None
        if key is not None:
            principal, share, allowed = f"key:{key.name}", key.share, key.may_use(route)
        elif room_secret is not None:
            principal, share, allowed = room_secret.name, key_file.Share(), _room_allows(room_secret, route, params)
        else:
            raise self._refused("bad_key", request, 401, "the API key is not one of this box's (or was revoked)")
        if not allowed:
            raise self._refused("route", request, 403, f"{principal} may not use {route}")
        if why := self.shares.over(principal, share, upgrade):
            raise self._refused(why.split(":")[0], request, 429, f"{principal} is over its share ({why})", "60")
        return Grant(principal, answer, request.listener)

    def needs_key(self, request: Request) -> bool:
        """A route that is not public needs a key, for this request's listener and caller (as admit asks)."""
        return request.listener in KEYED_LISTENERS and not request.operator and bool(self.keys)

    def answered(self, grant: Grant, response: Response) -> Response:
        """The handler's response as the grant shapes it: a session counted against its key's share, and
        the subprotocol the client offered beside its key (a browser fails an answer without one)."""
        if response.session is None:
            return response
        if grant.subprotocol:
            response.headers.append(("Sec-WebSocket-Protocol", grant.subprotocol))
        if grant.principal:
            response.session = partial(self._metered, grant, response.session)
        return response

    async def _metered(self, grant: Grant, session: Session, io: SessionIO) -> Close:
        """A keyed session: its appended audio counted; stopped where its key is revoked (its usage
        gone) or its hour's audio spent."""
        number, stop = self.shares.opened(grant.principal)
        running = asyncio.ensure_future(session(_Metered(io, partial(self._heard, grant, stop))))
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait([running, stopped], return_when=asyncio.FIRST_COMPLETED)
            if running.done():
                return running.result()
            running.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await running
            if grant.principal not in self.shares.usage:
                return Close(1008, f"{grant.principal} was revoked")
            return Close(1008, f"{grant.principal} spent its audio share for this hour")
        finally:
            stopped.cancel()
            running.cancel()
            self.shares.closed(grant.principal, number)

    def _heard(self, grant: Grant, stop: asyncio.Event, seconds: float) -> None:
        if self.shares.heard(grant.principal, seconds):
            self._count("audio", grant.listener, f"{grant.principal} spent its audio share for this hour")
            stop.set()

    def _same_origin(self, request: Request) -> bool:
        origin = request.headers.get("origin")
        if origin is None:  # not a browser's request: a browser always sends it on these
            return True
        allowed = [o.strip() for o in self.live.config.access.origins.split(",") if o.strip()]
        own = urlsplit(origin).netloc if origin.startswith(("https://", "http://")) else None
        return origin in allowed or (own is not None and own == request.headers.get("host"))

    async def _presented(self, request: Request, route: str, offered: list[str]) -> str:
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and value.strip():
            return value.strip()
        for protocol in offered:
            if protocol.startswith(SUBPROTOCOL_KEY):
                return protocol[len(SUBPROTOCOL_KEY) :]
        if route in LIBRETRANSLATE_ROUTES:
            query = dict(parse_qsl(urlsplit(request.target).query))
            fields = await json_or_form(request) if request.body.strip() and "api_key" not in query else {}
            found = query.get("api_key", fields.get("api_key"))
            return found if isinstance(found, str) else ""
        return ""

    def _refused(self, reason: str, request: Request, status: int, message: str, retry_after: str = "") -> ApiError:
        self._count(reason, request.listener, f"{request.address}: {message}")
        error = ApiError(message, status)
        if status == 401:
            error.headers.append(("WWW-Authenticate", 'Bearer realm="appliance"'))
        if retry_after:
            error.headers.append(("Retry-After", retry_after))
        return error

    def _count(self, reason: str, listener: str, message: str) -> None:
        self.metrics.refused[(reason, listener)] = self.metrics.refused.get((reason, listener), 0) + 1
        LIMITS_BITTEN.bit(f"refused {reason}", f"refused ({reason}, {listener}) {message}")


def _room_allows(secret: Secret, route: str, params: dict[str, str]) -> bool:
    """A room's secret: the page's routes, and Realtime sessions on the room's pipeline alone."""
    if route == "openai_realtime":
        return params.get("query:model") == secret.room.model
    return route in ROOM_ROUTES


class _Metered:
    """A session's SessionIO that counts the audio of each input_audio_buffer.append it receives (from
    the base64 text's length: 4 characters are 3 bytes), without parsing it twice."""

    def __init__(self, io: SessionIO, heard: Callable[[float], None]) -> None:
        self.io, self.heard = io, heard

    async def receive(self) -> str | bytes:
        message = await self.io.receive()
        if isinstance(message, str) and APPEND in message[:200]:
            self.heard(len(message) * 3 / 4 / PCM16_24K_BYTES_S)
        return message

    async def send(self, message: str | bytes) -> None:
        await self.io.send(message)
