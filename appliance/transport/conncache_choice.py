"""Which connection cache serves QUIC's sockets: the kernel's (eBPF) where it loads, else the user-space
one with the reason; and whether the sockets' SO_REUSEPORT group is steered to its workers."""

from __future__ import annotations

import asyncio
import logging
import socket
import subprocess
from collections.abc import Callable

from appliance.config import ConnCacheConfig
from appliance.errors import ApplianceError
from appliance.transport.conncache import ConnectionCache, KernelCache, UserSpaceCache, unsteered

log = logging.getLogger("appliance.conncache")


def open_cache(
    settings: Callable[[], ConnCacheConfig], socks: list[socket.socket], keys: list[int] | None = None
) -> ConnectionCache:
    """The kernel backend where it loads; else the user-space one, with the reason (logged once).
    `backend = "ebpf"` makes a failure to load a start-up error. `settings`: the live config's section.

    The filter goes on every socket of `socks`, counting into one table. With `keys` (one per socket,
    in order: the CID key of the worker that reads it) the sockets' SO_REUSEPORT group is steered as
    well; `steering_reason` is "" when it is, else why not (a failure there never fails the cache)."""
    config = settings()
    nothing_to_steer = unsteered(socks, keys)
    cache: ConnectionCache
    if config.backend == "user":
        cache = UserSpaceCache(settings, 'backend = "user" in config')
    else:
        try:
            cache = KernelCache(settings, socks, keys)
        except (OSError, subprocess.SubprocessError) as exc:  # the loader's reason, or the maps' pins
            reason = str(exc)
            if config.backend == "ebpf":
                raise ApplianceError(
                    f'conncache: backend = "ebpf" but the eBPF program cannot load: {reason}'
                ) from None
            log.warning(
                "conncache: eBPF program not loaded (%s); the user-space table serves with the same limits", reason
            )
            cache = UserSpaceCache(settings, reason)
    if isinstance(cache, UserSpaceCache):
        cache.steering_reason = nothing_to_steer or "the connection cache is the user-space one: steering needs eBPF"
    elif keys is not None and cache.steering_reason:
        log.warning("quic steering: not loaded (%s)", cache.steering_reason)
    return cache


async def opened_cache(
    settings: Callable[[], ConnCacheConfig], socks: list[socket.socket], keys: list[int] | None = None
) -> ConnectionCache:
    """open_cache in a thread: the eBPF loader compiles and loads for seconds, and the loop serves
    meanwhile (health checks answered throughout, where they waited for it)."""
    return await asyncio.to_thread(open_cache, settings, socks, keys)
