"""Bodies crossing between the engine and its protocol workers, against a local user who squats
/dev/shm: another user (nobody) creates thousands of files named as the daemon's bodies used to be
named (its pids and a counter); every request with a body past INLINE_BYTES is still answered, on
both transports. A body that cannot cross is a logged 500 for its own request, never a hang.
"""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import Daemon, good_clients_throughout

from appliance.front import bodies
from appliance.front.bodies import INLINE_BYTES, SHM_DIR, Body
from appliance.front.channel import Channel, RemoteApi
from appliance.protocol.messages import Request, Response

NOBODY = 65534
SQUAT = """
import os, sys
shm, names = sys.argv[1], sys.argv[2:]
for name in names:
    for n in range(3000):
        os.close(os.open(os.path.join(shm, f"appliance-{name}-{n}"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request, tmp_path_factory, keys, bundle, tls) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("hostile-shm"), bundle, keys.trusted, tls=tls, workers=request.param)
    with good_clients_throughout(d.wait_ready()):
        yield d


def children(pid: int) -> list[int]:
    return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


@pytest.fixture
def squatted(daemon: Daemon) -> Iterator[list[Path]]:
    """3,000 files per owner the daemon used to write under (the engine, each worker, each pair), made
    by another local user: 15,000 with two workers."""
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    engine, workers = daemon.proc.pid, children(daemon.proc.pid)
    owners = [str(engine), *map(str, workers), *(f"{engine}.{w}" for w in workers)]
    subprocess.run(
        [sys.executable, "-c", SQUAT, str(SHM_DIR), *owners],
        check=True,
        user=NOBODY,
        group=NOBODY,
        extra_groups=[],
    )
    made = [p for owner in owners for p in SHM_DIR.glob(f"appliance-{owner}-*") if p.stat().st_uid == NOBODY]
    assert len(made) == 3000 * len(owners)
    yield made
    for path in made:
        path.unlink(missing_ok=True)


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_bodies_cross_whatever_another_user_put_in_dev_shm(daemon, squatted, transport) -> None:
    audio = np.zeros(512 * 64, np.float32)  # 128 KiB: past INLINE_BYTES, so it crosses in shared memory
    assert audio.nbytes > INLINE_BYTES
    with daemon.client(transport) as client:
        for _ in range(8):
            assert client.speech_probs(audio).shape == (64,)
    assert all(p.exists() for p in squatted)  # the daemon neither used nor removed another user's files


def test_a_body_that_cannot_cross_is_a_logged_500_not_a_hang(monkeypatch, tmp_path, caplog) -> None:
    """The worker's side, in-process over a real socket pair: shared memory unusable, then a response
    whose file is gone."""
    monkeypatch.setattr(bodies, "SHM_DIR", tmp_path / "missing")

    async def main() -> None:
        worker_end, engine_end = socket.socketpair()
        api = RemoteApi(await Channel.open(worker_end.detach()))
        answer = await asyncio.wait_for(api.handle(Request("POST", "/x", {}, b"x" * (INLINE_BYTES + 1))), 5)
        assert answer.status == 500 and b"handed over" in answer.body
        asking = asyncio.ensure_future(api.handle(Request("GET", "/y", {}, b"")))
        await asyncio.sleep(0.05)
        rid = next(iter(api._waiting))
        api.deliver(("response", rid, Response(200), Body(shm="appliance-gone-0", length=10), False, True))
        answer = await asyncio.wait_for(asking, 5)
        assert answer.status == 500, answer
        engine_end.close()

    asyncio.run(main())
    assert "could not cross between processes" in caplog.text
