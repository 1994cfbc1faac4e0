"""One box's part in a fleet, against a real daemon (the VAD firmware): readiness and liveness with
Triton's meaning, HAProxy's agent check on its own port ([fleet] agent_address), and the drain
(SIGUSR2, `appliance drain`). The engine is held by the hang failpoint where a state must last (a
start, a full queue): the tests assert what the box says in each state, never how long it took."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
from pathlib import Path

from conftest import APPLIANCE, ROOT
from fleet import FRAME, ONE_FRAME, agent_says, answers
from waits import wait_until
from wyoming.client import AsyncUnixClient
from wyoming.error import Error
from wyoming.info import Describe

from appliance.bench.daemon import free_tcp_port
from appliance.client import Call, Client, infer_call, speech_call
from appliance.engine.failpoints import HANG_FAILPOINT

HOST = "127.0.0.1"


def agent_config(port: int, extra: str = "") -> str:
    return f'[fleet]\nagent_address = "{HOST}:{port}"\n{extra}'


def health(client: Client) -> tuple[int, int, str]:
    live, ready = client.send(Call("GET", "/v2/health/live")), client.send(Call("GET", "/v2/health/ready"))
    return live.status, ready.status, ready.body.decode()


def test_the_agent_says_down_while_the_box_starts_then_up_with_its_weight(start_daemon, tmp_path: Path) -> None:
    """The warm-up is held (the hang failpoint): the agent already answers, "down"; once the box
    serves, "up ready 100%" (idle), and both health routes answer 200."""
    hold, port = tmp_path / "hold", free_tcp_port()
    hold.write_text("0")
    daemon = start_daemon(agent_config(port), wait=False, env={HANG_FAILPOINT: str(hold)})
    wait_until(lambda: answers(HOST, port), "the agent listens during the start")
    wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the warm-up held")
    assert agent_says(HOST, port) == "down\n"
    hold.unlink()
    daemon.wait_ready()
    assert agent_says(HOST, port) == "up ready 100%\n"
    with daemon.client() as client:
        assert health(client)[:2] == (200, 200)


def test_a_queue_at_its_bound_fails_readiness_and_takes_the_weight_down_liveness_stays(
    start_daemon, speech_bundle: Path, tmp_path: Path
) -> None:
    """The speech firmware, [engine.models.joe] max_queue_size = 4; the engine is held (it runs off the
    event loop) with one sentence in it and 4 more wait: ready answers 503 naming joe's full queue,
    the agent's weight drops to its floor (1%), live stays 200. Released: all 5 are answered 200 and
    the box is ready at 100% again."""
    hold, port = tmp_path / "hold", free_tcp_port()
    config = agent_config(port, "[engine.models.joe]\nmax_queue_size = 4\n")
    daemon = start_daemon(config, bundle_dir=speech_bundle, env={HANG_FAILPOINT: str(hold)})
    hold.write_text("0")  # the engine's next call stalls
    statuses: list[int] = []

    def speak(text: str) -> None:
        with Client(str(daemon.socket), timeout=300) as client:
            statuses.append(client.send(speech_call(text, "tts-1", "joe")).status)

    threads = [threading.Thread(target=speak, args=(f"Sentence number {n}.",)) for n in range(5)]
    threads[0].start()
    wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the engine held")
    for thread in threads[1:]:
        thread.start()
    wait_until(lambda: agent_says(HOST, port) == "up ready 1%\n", "the weight at its floor")
    with daemon.client() as client:
        live, ready, why = health(client)
    assert (live, ready) == (200, 503) and "overloaded" in why and "joe" in why, why
    hold.unlink()
    for thread in threads:
        thread.join(300)
    assert statuses == [200] * 5
    assert agent_says(HOST, port) == "up ready 100%\n"
    with daemon.client() as client:
        assert health(client)[:2] == (200, 200)


def drain_command(daemon, *options: str) -> subprocess.Popen[str]:
    args = [*APPLIANCE, "drain", "--socket", str(daemon.socket), *options]
    return subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


async def wyoming_refusal(socket_path: Path) -> Error | None:
    async with AsyncUnixClient(socket_path) as client:
        await client.write_event(Describe().event())
        event = await asyncio.wait_for(client.read_event(), 60)
    return Error.from_event(event) if event is not None and Error.is_type(event.type) else None


def test_appliance_drain_refuses_new_work_lets_an_open_sequence_finish_then_resumes(
    start_daemon, tmp_path: Path
) -> None:
    """A KServe sequence is open when `appliance drain` runs: the agent says drain, readiness fails,
    a new sequence and a Realtime handshake get 503 with Retry-After, a Wyoming client an error event,
    a stateless request is still served; the open sequence goes on and ends, and only then does the
    command say drained. Held, the drain refuses a stateless request too. `appliance drain --resume`:
    the box takes new work again."""
    port = free_tcp_port()
    daemon = start_daemon(agent_config(port))
    with daemon.client() as client:
        client.infer("silero_vad", {"audio": FRAME}, sequence_id=7, start=True)
        drain = drain_command(daemon, "--deadline", "600")
        wait_until(lambda: agent_says(HOST, port) == "drain\n", "the agent says drain")
    refused = []
    with daemon.client() as client:
        _, ready, why = health(client)
        served_meanwhile = client.send(ONE_FRAME).status  # stateless: served while work under way finishes
        refused.append(client.send(infer_call("silero_vad", FRAME, sequence_id=8, start=True)))
        refused.append(client.send(Call("GET", "/v1/realtime", b"", (("upgrade", "websocket"),))))
    assert ready == 503 and "draining" in why, why
    assert served_meanwhile == 200
    assert [r.status for r in refused] == [503] * 2, [r.body for r in refused]
    assert all(r.headers.get("retry-after") == "1" and b"draining" in r.body for r in refused)
    error = asyncio.run(wyoming_refusal(daemon.socket.with_name("wyoming.sock")))
    assert error is not None and error.code == "draining", error
    assert drain.poll() is None  # the open sequence holds the drain (its deadline is 10 minutes)
    with daemon.client() as client:
        client.infer("silero_vad", {"audio": FRAME}, sequence_id=7)
        client.infer("silero_vad", {"audio": FRAME}, sequence_id=7, end=True)
    out, _ = drain.communicate(timeout=300)
    assert drain.returncode == 0 and "drained: all work under way finished" in out, out
    assert agent_says(HOST, port) == "drain\n"  # it holds: now a stateless request is refused too
    with daemon.client() as client:
        held = client.send(ONE_FRAME)
    assert held.status == 503 and held.headers.get("retry-after") == "1" and b"draining" in held.body
    resume = drain_command(daemon, "--resume")
    out, _ = resume.communicate(timeout=300)
    assert resume.returncode == 0 and "up ready 100%" in out, out
    with daemon.client() as client:
        assert client.send(ONE_FRAME).status == 200
        assert health(client)[:2] == (200, 200)


def test_sigusr2_drains_and_a_drain_for_an_update_says_maint_then_stops(start_daemon) -> None:
    """SIGUSR2: the agent says drain and the daemon keeps running; `appliance drain --update --then
    stop`: the agent says maint, and the daemon exits 0 once the work under way is done."""
    port = free_tcp_port()
    daemon = start_daemon(agent_config(port))
    daemon.proc.send_signal(signal.SIGUSR2)
    wait_until(lambda: agent_says(HOST, port) == "drain\n", "SIGUSR2 drains")
    wait_until(lambda: "drained:" in daemon.log.read_text(), "nothing under way: it holds")
    with daemon.client() as client:
        assert client.send(ONE_FRAME).status == 503
    assert daemon.proc.poll() is None
    drain = drain_command(daemon, "--update", "--then", "stop")
    out, _ = drain.communicate(timeout=300)
    assert drain.returncode == 0 and "the agent says maint" in out and "stopped" in out, out
    assert daemon.proc.wait(300) == 0, daemon.log.read_text()
