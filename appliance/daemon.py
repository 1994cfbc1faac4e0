"""The daemon: verify firmware, load engines, warm up, bind the socket, serve, shut down gracefully.

Start-up failures (bad config, a bundle that does not verify, a socket in use) print one line
naming the file and the reason and exit with EXIT_START_FAILED.
"""

from __future__ import annotations

import asyncio
import contextlib
import grp
import logging
import os
import signal
import socket
import stat
import time
from pathlib import Path

import numpy as np

from appliance import firmware
from appliance.api.core import Api
from appliance.config import Config, ServerConfig
from appliance.engine import load_engine
from appliance.errors import ApplianceError
from appliance.transport.http1 import Http1Server, Limits
from appliance.vad import VadModel

log = logging.getLogger("appliance")

EXIT_START_FAILED = 3
EXPIRY_INTERVAL_S = 1.0


def load_models(config: Config, bundle: firmware.Bundle) -> dict[str, VadModel]:
    models = {}
    for spec in bundle.manifest.models:
        engine = load_engine(config.engine.device, bundle.artifact(spec.file), config.engine.threads)
        models[spec.name] = VadModel(
            spec, bundle.manifest.baked, engine,
            max_live=config.sequences.max_live, idle_timeout_s=config.sequences.idle_timeout_s,
            queue_delay_s=config.engine.queue_delay_us / 1e6,
        )
    return models


async def warm_up(model: VadModel) -> None:
    """One real inference per model before the daemon calls itself ready."""
    probs = await model.infer_recording(np.zeros(model.frames.frame_samples * 4, np.float32))
    if not np.all(np.isfinite(probs)):
        raise ApplianceError(f"model {model.name}: warm-up inference returned non-finite values")


def bind_unix_socket(server: ServerConfig) -> socket.socket:
    path = server.socket
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ApplianceError(f"{path}: exists and is not a socket; refusing to replace it")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            raise ApplianceError(f"{path}: another daemon is already serving on this socket")
        except (ConnectionRefusedError, FileNotFoundError):
            path.unlink(missing_ok=True)  # stale socket of a daemon that died
        finally:
            probe.close()
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    os.chmod(path, int(server.socket_mode, 8))
    if server.socket_group:
        try:
            os.chown(path, -1, grp.getgrnam(server.socket_group).gr_gid)
        except KeyError:
            sock.close()
            path.unlink()
            raise ApplianceError(f"server.socket_group: no group named {server.socket_group!r}") from None
    sock.listen(1024)
    sock.setblocking(False)
    return sock


class Daemon:
    def __init__(self, config: Config) -> None:
        self.config = config
        self.stopping = asyncio.Event()
        self.api: Api | None = None
        self.http: Http1Server | None = None
        self.models: dict[str, VadModel] = {}

    async def start(self) -> asyncio.base_events.Server:
        config = self.config
        bundle = firmware.verify(config.firmware.bundle, config.firmware.trusted_keys)
        manifest = bundle.manifest
        log.info("firmware %s %s verified (key %s)", manifest.name, manifest.version, manifest.signing_key_id)
        self.models = load_models(config, bundle)
        for model in self.models.values():
            model.start()
            await warm_up(model)
            log.info("model %s loaded on %s and warmed up", model.name, model.engine_name)
        self.api = Api(manifest, self.models, config.vad)
        limits = Limits(config.server.max_body_bytes, config.server.max_header_bytes, config.server.max_connections)
        self.http = Http1Server(self.api, limits)
        sock = bind_unix_socket(config.server)
        server = await asyncio.get_running_loop().create_unix_server(self.http.protocol, sock=sock)
        self.api.ready = True
        log.info("ready: serving %s on %s", ", ".join(self.models), config.server.socket)
        return server

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        try:
            server = await self.start()
        except BaseException:
            await self._stop_models()
            raise
        expiry = loop.create_task(self._expire_idle_sequences())
        await self.stopping.wait()
        expiry.cancel()
        await self.shutdown(server)
        return 0

    async def _expire_idle_sequences(self) -> None:
        while True:
            await asyncio.sleep(EXPIRY_INTERVAL_S)
            for model in self.models.values():
                if count := model.expire_idle():
                    log.info("model %s: %d idle sequences expired", model.name, count)

    async def shutdown(self, server: asyncio.base_events.Server) -> None:
        """Stop accepting, let accepted requests finish within the grace time, then stop."""
        assert self.api is not None and self.http is not None
        log.info("stopping: %d requests in flight", self.http.in_flight)
        self.api.ready = False
        server.close()
        self.http.close_idle()
        deadline = time.monotonic() + self.config.server.shutdown_grace_s
        while self.http.in_flight and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if self.http.in_flight:
            log.warning("grace time over: %d requests abandoned", self.http.in_flight)
        for connection in list(self.http.connections):
            connection.close()
        await self._stop_models()
        with contextlib.suppress(FileNotFoundError):
            Path(self.config.server.socket).unlink()
        log.info("stopped")

    async def _stop_models(self) -> None:
        for model in self.models.values():
            await model.stop()


def configure_logging(level: str) -> None:
    logging.basicConfig(level=level.upper(), format="appliance: %(levelname)s: %(message)s")


def run(config: Config) -> int:
    configure_logging(config.log.level)
    try:
        return asyncio.run(Daemon(config).run())
    except ApplianceError as exc:
        log.error("start failed: %s", exc)
        return EXIT_START_FAILED
