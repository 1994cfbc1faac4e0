"""Which QUIC peer opened which stateful sequence. The transport keeps this, not the API or the
scheduler: a peer is a transport's notion, and when one vanishes (idle, or evicted from the
connection cache) the daemon ends exactly the sequences it opened that are still the same."""

from __future__ import annotations

from collections.abc import Callable

from appliance.protocol.messages import Opened

Key = tuple[str, object]  # model, sequence id


class SequenceOwners:
    def __init__(self) -> None:
        self._by_peer: dict[str, dict[Key, Opened]] = {}
        self._owner: dict[Key, str] = {}

    def record(self, peer: str, opened: Opened) -> None:
        """A reopened id belongs to whoever opened it last."""
        key = (opened.model, opened.id)
        if (previous := self._owner.get(key)) is not None:
            self._drop(previous, key)
        self._owner[key] = peer
        self._by_peer.setdefault(peer, {})[key] = opened

    def peers(self) -> set[str]:
        return set(self._by_peer)

    def held(self) -> list[Opened]:
        return [opened for held in self._by_peer.values() for opened in held.values()]

    def forget_ended(self, still_open: Callable[[Opened], bool]) -> None:
        """Drop what has ended by other ways (sequence_end, idle expiry), so the table stays bounded."""
        for peer, held in list(self._by_peer.items()):
            for key in [k for k, opened in held.items() if not still_open(opened)]:
                self._drop(peer, key)

    def release(self, peer: str) -> list[Opened]:
        held = self._by_peer.pop(peer, {})
        for key in held:
            del self._owner[key]
        return list(held.values())

    def _drop(self, peer: str, key: Key) -> None:
        held = self._by_peer[peer]
        del held[key]
        del self._owner[key]
        if not held:
            del self._by_peer[peer]
