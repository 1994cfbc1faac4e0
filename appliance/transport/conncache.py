"""The per-peer connection cache of the QUIC listener: kernel (eBPF via bcc) or user space.

bpf/conncache.c, compiled by bcc in a loader child (conncache_loader.py), is attached to the listener's
UDP sockets (SO_ATTACH_BPF) and its maps pinned under `pin_dir`, which the daemon reads with bare bpf()
calls (bpfmaps.py; `bpftool map dump pinned PIN_DIR/peers` shows them). Datagrams over a peer's budget
are dropped in the kernel. Where it cannot load (no privileges, kernel headers or bcc) the user-space
backend keeps the same tables with the same limits, fed by the QUIC layer (`admit`).

With a key per socket of one SO_REUSEPORT group, the loader also attaches bpf/quic_steering.c to the
group: a datagram whose destination connection ID starts with a worker's key goes to that worker's
socket (`steering_reason` says why not). A worker reads the engine's pins with `KernelCache.attached`.

Both keep the validated peers (`validate`: its handshake completed) apart from every other source, in
a small LRU of its own (max_unvalidated): a flood that never completes a handshake cannot evict a
validated peer nor grow what the daemon reads. `peers()` serves /status; `sweep()` reads when each
validated peer last sent, forgets those idle past `idle_timeout_s`, and reports them and those
evicted without a live connection, so the daemon can release what they held.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import subprocess
import sys
import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Iterator
from typing import Any

from appliance.config import ConnCacheConfig
from appliance.protocol.peers import Peer, TokenBucket, Totals, without_stalling
from appliance.transport.bpfmaps import PinnedMap, own_pin_dir, possible_cpus

log = logging.getLogger("appliance.conncache")

HOST_CID_LENGTH = 8  # aioquic's server connection IDs
# what bpf/conncache.c pins: validated peers, other sources, totals, the last peers over budget
MAPS = ("peers", "fresh", "totals", "droppers")
DROPPERS = 256  # bpf/conncache.c's DROPPERS: the peers over budget last, whose drops /metrics shows
STEERING_MAP = "workers"  # what the steering pins: worker key -> socket (bpftool map dump pinned ...)


def peer_name(addr: tuple[Any, ...]) -> str:
    """'1.2.3.4:5' or '[::1]:5' for a socket address; IPv4-mapped IPv6 reads as IPv4."""
    ip = ipaddress.ip_address(addr[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return f"{ip}:{addr[1]}" if ip.version == 4 else f"[{ip}]:{addr[1]}"


class ConnectionCache:
    """What both backends share: the idle and eviction sweep."""

    backend = ""
    reason = ""  # why this backend (set when the kernel one could not load)
    steering_reason = "no worker keys given"  # "": QUIC steering across the worker sockets is loaded

    def __init__(self, settings: Callable[[], ConnCacheConfig]) -> None:
        self._settings = settings  # the live config's section: a reload changes the idle timeout

    @property
    def config(self) -> ConnCacheConfig:
        return self._settings()

    def admit(self, data: bytes, addr: tuple[Any, ...]) -> bool:
        """Count one datagram; False: over the peer's budget, drop it."""
        return True

    def validate(self, addr: tuple[Any, ...]) -> None:
        """The peer at `addr` completed a handshake: into the validated table, with what it sent so far."""
        raise NotImplementedError

    def peers(self) -> dict[str, Peer]:
        """Both tables (the validated peers first)."""
        raise NotImplementedError

    def validated_peers(self) -> dict[str, Peer]:
        raise NotImplementedError

    def validated_count(self) -> int:
        raise NotImplementedError

    def last_seen(self) -> dict[str, float]:
        """When each validated peer last sent: what the sweep reads each second. Floats by name, no
        Peer objects: 65,536 of those made and dropped each second filled the collector's old
        generation, and each of its full passes held the GIL for up to 12.5 ms."""
        raise NotImplementedError

    def droppers(self) -> dict[str, int]:
        """The drops of the DROPPERS peers that went over budget last (read without walking `fresh`)."""
        raise NotImplementedError

    def totals(self) -> Totals:
        raise NotImplementedError

    def forget(self, address: str) -> None:
        raise NotImplementedError

    def sweep(self, holding: set[str], live: Collection[str] = (), now: float | None = None) -> set[str]:
        """Forget validated peers idle past the timeout; return those of `holding` (peers with state in
        the daemon) that are gone: idle, or no longer in the table and without a `live` connection."""
        now = time.monotonic() if now is None else now
        present = self.last_seen()
        idle = {a for a, seen in present.items() if now - seen > self.config.idle_timeout_s}
        for address in idle:
            self.forget(address)
        return {a for a in holding if a in idle or (a not in present and a not in live)}

    async def swept(self, holding: set[str], live: Collection[str]) -> set[str]:
        """sweep, where it cannot stall the loop (protocol/peers.py without_stalling)."""
        return await without_stalling(self, lambda: self.sweep(holding, live))

    def close(self) -> None:
        pass


class UserSpaceCache(ConnectionCache):
    """The same tables in Python: LRUs of at most max_entries validated peers and max_unvalidated
    other sources, each peer with a token bucket."""

    backend = "user"

    def __init__(self, settings: Callable[[], ConnCacheConfig], reason: str = "") -> None:
        super().__init__(settings)
        self.reason = reason
        self._validated: OrderedDict[str, tuple[Peer, TokenBucket]] = OrderedDict()
        self._fresh: OrderedDict[str, tuple[Peer, TokenBucket]] = OrderedDict()
        self._droppers: OrderedDict[str, int] = OrderedDict()
        self._totals = Totals()

    def admit(self, data: bytes, addr: tuple[Any, ...]) -> bool:
        now = time.monotonic()
        address = peer_name(addr)
        table = self._validated if address in self._validated else self._fresh
        entry = table.get(address)
        if entry is None:
            if len(self._fresh) >= self.config.max_unvalidated:
                self._fresh.popitem(last=False)
            entry = self._fresh[address] = (
                Peer(address, now, now),
                TokenBucket(self.config.peer_rate, self.config.peer_burst),
            )
            self._totals.peers_seen += 1
        else:
            table.move_to_end(address)
        peer, bucket = entry
        peer.last_seen = now
        if not bucket.take():
            peer.drops += 1
            self._totals.drops += 1
            self._droppers[address] = peer.drops
            self._droppers.move_to_end(address)
            if len(self._droppers) > DROPPERS:
                self._droppers.popitem(last=False)
            return False
        peer.packets += 1
        peer.bytes += len(data)
        self._totals.packets += 1
        self._totals.bytes += len(data)
        if data:
            peer.dcid = _dcid(data)
        return True

    def validate(self, addr: tuple[Any, ...]) -> None:
        if (entry := self._fresh.pop(address := peer_name(addr), None)) is not None:  # else evicted meanwhile
            if len(self._validated) >= self.config.max_entries:
                self._validated.popitem(last=False)
            self._validated[address] = entry
            entry[0].validated = True

    def peers(self) -> dict[str, Peer]:
        return {address: peer for table in (self._validated, self._fresh) for address, (peer, _) in table.items()}

    def validated_peers(self) -> dict[str, Peer]:
        return {address: peer for address, (peer, _) in self._validated.items()}

    def last_seen(self) -> dict[str, float]:
        return {address: peer.last_seen for address, (peer, _) in self._validated.items()}

    def validated_count(self) -> int:
        return len(self._validated)

    def droppers(self) -> dict[str, int]:
        return dict(self._droppers)

    def totals(self) -> Totals:
        return self._totals

    def forget(self, address: str) -> None:
        self._validated.pop(address, None)
        self._fresh.pop(address, None)


def _dcid(data: bytes) -> str:
    if data[0] & 0x80:
        length = data[5] if len(data) > 5 else 0
        return data[6 : 6 + length].hex() if length <= 20 else ""
    return data[1 : 1 + HOST_CID_LENGTH].hex()


class KernelCache(ConnectionCache):
    """bpf/conncache.c attached to the listener's sockets by a loader child (bcc stays out of the
    daemon), and with worker keys bpf/quic_steering.c on their SO_REUSEPORT group; the daemon reads
    and trims the pinned maps with plain bpf() calls."""

    backend = "ebpf"
    KEY = struct.Struct("<BBH16s")  # struct peer_key: family, pad, port (network order), addr
    STATS = struct.Struct("<7QB20s")  # struct peer_stats, up to its tail padding (80 bytes)
    STATS_SIZE = 80

    def __init__(
        self, settings: Callable[[], ConnCacheConfig], socks: list[socket.socket], keys: list[int] | None = None
    ) -> None:
        super().__init__(settings)
        config = self.config
        self._attached = False
        nothing_to_steer = unsteered(socks, keys)
        self._owner = own_pin_dir(config.pin_dir)
        try:
            self._load(config, socks, None if nothing_to_steer else keys)
            self.steering_reason = nothing_to_steer or self.steering_reason
        except BaseException:
            with contextlib.suppress(OSError):  # empty unless the loader got as far as pinning
                config.pin_dir.rmdir()
            os.close(self._owner)
            raise

    @classmethod
    def attached(cls, settings: Callable[[], ConnCacheConfig]) -> KernelCache:
        """A worker process's view of the maps the engine's cache pinned: no loader, no pin_dir lock,
        and close() leaves the pins (and so the engine's filter and steering) alone.
        OSError: nothing pinned there (the engine's cache is not the kernel one)."""
        cache = cls.__new__(cls)
        ConnectionCache.__init__(cache, settings)
        cache._attached = True
        cache._open_maps(cache.config)
        steered = (cache.config.pin_dir / STEERING_MAP).exists()
        cache.steering_reason = "" if steered else "the engine's cache pinned no steering map"
        return cache

    def _load(self, config: ConnCacheConfig, socks: list[socket.socket], keys: list[int] | None) -> None:
        fds = [sock.fileno() for sock in socks]
        loader = subprocess.run(
            loader_command(config, fds, keys), pass_fds=fds, capture_output=True, text=True, timeout=120
        )
        if loader.returncode != 0:
            raise OSError(
                loader.stderr.strip().splitlines()[-1]
                if loader.stderr.strip()
                else f"loader exited {loader.returncode}"
            )
        if keys is not None:
            said = [line for line in loader.stdout.splitlines() if line.startswith("steering: ")]
            self.steering_reason = said[-1].removeprefix("steering: ") if said else ""
        self._open_maps(config)

    def _open_maps(self, config: ConnCacheConfig) -> None:
        self._table = PinnedMap(config.pin_dir / "peers", self.KEY.size, self.STATS_SIZE)
        self._fresh = PinnedMap(config.pin_dir / "fresh", self.KEY.size, self.STATS_SIZE)
        self._totals = PinnedMap(config.pin_dir / "totals", 4, 8 * possible_cpus())
        self._droppers = PinnedMap(config.pin_dir / "droppers", self.KEY.size, 8)

    def _key(self, addr: tuple[Any, ...]) -> bytes:
        """A socket address's key in the maps (struct peer_key); IPv4-mapped IPv6 as IPv4."""
        ip = ipaddress.ip_address(addr[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        return self.KEY.pack(ip.version, 0, socket.htons(addr[1]), ip.packed.ljust(16, b"\0"))

    def validate(self, addr: tuple[Any, ...]) -> None:
        key = self._key(addr)
        value = self._fresh.lookup(key)
        if value is None or self._table.lookup(key) is not None:
            return  # evicted from the fresh table meanwhile (its next datagram starts it there again)
        self._table.update(key, value)  # from now on the filter finds it here first
        self._fresh.delete(key)

    def peers(self) -> dict[str, Peer]:
        """Both maps. Their times are bpf_ktime_get_ns: CLOCK_MONOTONIC, as time.monotonic()."""
        return {**self.validated_peers(), **self._read(self._fresh, self.config.max_unvalidated)}

    def validated_peers(self) -> dict[str, Peer]:
        return self._read(self._table, self.config.max_entries)

    def last_seen(self) -> dict[str, float]:
        walk = self._walk(self._table, self.config.max_entries)
        return {self._name(key): int.from_bytes(value[8:16], "little") / 1e9 for key, value in walk}  # last_seen_ns

    def validated_count(self) -> int:
        return sum(1 for _ in self._keys(self._table, self.config.max_entries))

    def _read(self, table: PinnedMap, size: int) -> dict[str, Peer]:
        out = {}
        for key, value in self._walk(table, size):
            name = self._name(key)
            first, last, packets, size_, drops, _, _, dcid_len, dcid = self.STATS.unpack_from(value)
            dcid_hex, validated = dcid[:dcid_len].hex(), table is self._table
            out[name] = Peer(name, first / 1e9, last / 1e9, packets, size_, drops, dcid_hex, validated)
        return out

    def _walk(self, table: PinnedMap, size: int) -> Iterator[tuple[bytes, bytes]]:
        """Each entry of a map as it is now (one evicted while we walk is passed over)."""
        for key in self._keys(table, size):
            if (value := table.lookup(key)) is not None:
                yield key, value

    @staticmethod
    def _keys(table: PinnedMap, size: int) -> Iterator[bytes]:
        for count, key in enumerate(table.keys(limit=2 * size)):
            if count % 64 == 63:
                time.sleep(0)  # a walk runs in a thread: the GIL to the event loop (else it waits 5 ms a turn)
            yield key

    def droppers(self) -> dict[str, int]:
        out = {}
        for key in self._droppers.keys(limit=2 * DROPPERS):
            if (value := self._droppers.lookup(key)) is not None:  # else evicted while we walked
                out[self._name(key)] = int.from_bytes(value, "little")
        return out

    def _name(self, key: bytes) -> str:
        family, _, port, addr = self.KEY.unpack(key)
        return peer_name((str(ipaddress.ip_address(addr[:4] if family == 4 else addr)), socket.ntohs(port)))

    def totals(self) -> Totals:
        counts = []
        for index in range(4):
            value = self._totals.lookup(index.to_bytes(4, "little")) or b""
            counts.append(sum(v for (v,) in struct.iter_unpack("<Q", value)))
        return Totals(*counts)

    def forget(self, address: str) -> None:
        host, _, port = address.rpartition(":")  # its name, as peer_name made it
        self._table.delete(self._key((host.strip("[]"), int(port))))  # False if it was evicted meanwhile

    def close(self) -> None:
        self._table.close()
        self._fresh.close()
        self._totals.close()
        self._droppers.close()
        if self._attached:  # the engine's pins: it removes them
            return
        for name in (*MAPS, STEERING_MAP):
            (self.config.pin_dir / name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # left in place if someone else pinned there too
            self.config.pin_dir.rmdir()
        os.close(self._owner)  # only now may another daemon take the directory


def loader_command(config: ConnCacheConfig, fds: list[int], keys: list[int] | None) -> list[str]:
    """The loader child's command line: it attaches to the sockets `fds` (inherited) and ends with this process."""
    defines = [
        f"MAX_ENTRIES={config.max_entries}",
        f"MAX_UNVALIDATED={config.max_unvalidated}",
        f"RATE_PER_S={max(1, int(config.peer_rate))}",
        f"BURST={max(1, int(config.peer_burst))}",
        f"HOST_CID_LENGTH={HOST_CID_LENGTH}",
        f"DROPPERS={DROPPERS}",
    ]
    return [
        sys.executable, "-m", "appliance.transport.conncache_loader", f"--parent={os.getpid()}",
        *(f"--fd={fd}" for fd in fds), *(f"--steer-key={key}" for key in keys or ()),
        "--pin-dir", str(config.pin_dir), *(f"--define={d}" for d in defines),
    ]  # fmt: skip


def unsteered(socks: list[socket.socket], keys: list[int] | None) -> str:
    """Why there is nothing to steer ("" if there is); ValueError for keys that cannot steer."""
    if keys is None:
        return "no worker keys given"
    if len(keys) != len(socks):
        raise ValueError(f"{len(keys)} worker keys for {len(socks)} sockets")
    if len(set(keys)) != len(keys) or not all(0 < key < 1 << 32 for key in keys):
        raise ValueError("worker keys must be distinct, nonzero and 32-bit")
    if len(socks) < 2:
        return "one socket: nothing to steer"
    return ""
