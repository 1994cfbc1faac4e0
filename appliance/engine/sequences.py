"""Open sequences by id, each owned by the client that opened it: one table for every stateful kind.

The VAD's recurrent state rows, a generic ONNX model's state, a speech_to_text model's live streams
(and through them a pipeline's) are all entries of an OwnedTable. The table bounds their count
(overall, per client, per address and per API key: one host's many connections, or one key's many
hosts, cannot take it all), expires the
idle ones, restarts one on a second start and ends them; what a kind keeps besides (a VAD sequence
under a stream) it releases in `on_drop`. The caller passes the time, so nothing here reads a clock;
the bounds are read from the live config at each use.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any, Generic, Protocol, TypeVar

from appliance.config import SequenceConfig
from appliance.errors import ApiError, BadRequest, NotFound, TooManyRequests


class Owned(Protocol):
    """What the table keeps on each entry (set by the table; the entry carries them)."""

    client: str  # who opened it (protocol.messages.Request.client): only it may use it
    serial: int  # tells this entry apart from an earlier or later one under the same key
    last_used: float
    in_flight: int  # requests using it now: it neither expires nor restarts meanwhile


S = TypeVar("S", bound=Owned)


class OwnedTable(Generic[S]):
    """Entries by key; `settings` gives the bounds as the live config holds them now; `noun` names
    the entries in messages ("sequences", "streams"); `on_drop(key, entry)` runs whenever one leaves."""

    def __init__(
        self,
        settings: Callable[[], SequenceConfig],
        noun: str = "sequences",
        on_drop: Callable[[object, S], None] | None = None,
    ) -> None:
        self._settings, self.noun, self._on_drop = settings, noun, on_drop
        self._open: dict[object, S] = {}
        self._per_client: Counter[str] = Counter()
        self._per_address: Counter[str] = Counter()
        self._addresses: dict[object, str] = {}  # each entry's address (its client where none was given)
        self._per_principal: Counter[str] = Counter()
        self._principals: dict[object, str] = {}  # each entry's API key or room, where it came with one
        self._serials = 0

    @property
    def max_live(self) -> int:
        return self._settings().max_live

    @property
    def idle_timeout_s(self) -> float:
        return self._settings().idle_timeout_s

    def __len__(self) -> int:
        return len(self._open)

    def count(self, scope: object, client: str | None = None) -> int:
        """Entries under keys `(scope, ...)`: those another model keeps here (a pipeline's streams),
        or a kind of entry (a Wyoming recording's); `client`'s alone where it is given."""
        return sum(
            1
            for key, entry in self._open.items()
            if isinstance(key, tuple) and key and key[0] == scope and client in (None, entry.client)
        )

    def open(
        self, key: object, now: float, client: str, make: Callable[[], S], address: str = "", principal: str = ""
    ) -> S:
        """A new entry from `make()` for `client` at `address` (its clients' share; "": the client is
        its own), admitted for `principal` (an API key's or a room's share; "": none was needed); a
        start on its own open key restarts it (it reconnected)."""
        old = self._open.get(key)
        if old is not None:
            self._check_owner(key, old, client)
            if old.in_flight:
                raise ApiError(f"sequence {key} has a request in flight; it cannot restart until that finishes", 409)
            self._drop(key)
        settings, address = self._settings(), address or client
        if (
            len(self._open) >= settings.max_live
            or self._per_client[client] >= settings.max_per_client
            or self._per_address[address] >= settings.max_per_address
            or (principal and self._per_principal[principal] >= settings.max_per_key)
        ):
            self.expire(now)
        if len(self._open) >= settings.max_live:
            raise TooManyRequests(f"sequence table full ({settings.max_live} live {self.noun}): end one or retry later")
        if self._per_client[client] >= settings.max_per_client:
            raise TooManyRequests(
                f"this client holds {settings.max_per_client} live {self.noun}, its share: end one or retry later"
            )
        if self._per_address[address] >= settings.max_per_address:
            raise TooManyRequests(
                f"{address} holds {settings.max_per_address} live {self.noun}, its address's share "
                "([sequences] max_per_address): end one or retry later"
            )
        if principal and self._per_principal[principal] >= settings.max_per_key:
            raise TooManyRequests(
                f"{principal} holds {settings.max_per_key} live {self.noun}, its key's share "
                "([sequences] max_per_key): end one or retry later"
            )
        entry = make()
        self._serials += 1
        entry.client, entry.serial, entry.last_used = client, self._serials, now
        self._open[key] = entry
        self._per_client[client] += 1
        self._per_address[address] += 1
        self._addresses[key] = address
        if principal:
            self._per_principal[principal] += 1
            self._principals[key] = principal
        return entry

    def get(self, key: object, now: float, client: str) -> S:
        entry = self._open.get(key)
        if entry is None:
            raise BadRequest(
                f"sequence {key} is not open (never started, ended, or expired after "
                f"{self.idle_timeout_s:g} s idle): send sequence_start=true first"
            )
        self._check_owner(key, entry, client)
        entry.last_used = now
        return entry

    def end(self, key: object) -> None:
        if key in self._open:
            self._drop(key)

    def holds(self, key: object, serial: int) -> bool:
        entry = self._open.get(key)
        return entry is not None and entry.serial == serial

    def end_opened(self, key: object, serial: int) -> bool:
        """End the entry under `key` if it is still the one opened with `serial` (a transport
        releasing what its vanished client opened); False if it ended or was reopened meanwhile."""
        if not self.holds(key, serial):
            return False
        self._drop(key)
        return True

    def streaming(self, now: float, within_s: float) -> int:
        """Entries with a request in flight or one within the last `within_s` (a stop waits for these)."""
        return sum(1 for s in self._open.values() if s.in_flight or now - s.last_used <= within_s)

    def expire(self, now: float) -> int:
        timeout = self.idle_timeout_s
        idle = [k for k, s in self._open.items() if not s.in_flight and now - s.last_used > timeout]
        for key in idle:
            self._drop(key)
        return len(idle)

    @staticmethod
    def _check_owner(key: object, entry: Owned, client: str) -> None:
        """Only the client that opened an entry may feed, restart or end it; others do not see it."""
        if entry.client != client:
            raise NotFound(f"sequence {key} belongs to another client")

    def _drop(self, key: object) -> None:
        entry = self._open.pop(key)
        self._per_client[entry.client] -= 1
        if not self._per_client[entry.client]:
            del self._per_client[entry.client]
        address = self._addresses.pop(key)
        self._per_address[address] -= 1
        if not self._per_address[address]:
            del self._per_address[address]
        principal = self._principals.pop(key, "")
        if principal:
            self._per_principal[principal] -= 1
            if not self._per_principal[principal]:
                del self._per_principal[principal]
        if self._on_drop is not None:
            self._on_drop(key, entry)


class ScopedSequences:
    """A model's sequences kept in another model's table under keys `(scope, id)` (the pipeline's live
    streams are its speech_to_text model's); that table expires them."""

    def __init__(self, table: OwnedTable[Any], scope: object) -> None:
        self._table, self.scope = table, scope

    def key(self, sequence_id: object) -> object:
        return (self.scope, sequence_id)

    def __len__(self) -> int:
        return self._table.count(self.scope)

    def holds(self, key: object, serial: int) -> bool:
        return self._table.holds(self.key(key), serial)

    def end_opened(self, key: object, serial: int) -> bool:
        return self._table.end_opened(self.key(key), serial)

    def expire(self, now: float) -> int:
        return 0  # the owning table expires them

    def streaming(self, now: float, within_s: float) -> int:
        return 0  # the owning table counts them
