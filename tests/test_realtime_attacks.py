"""Realtime sessions under the red team's attacks of issue 47 (items 3, 4 and 7), on a real daemon
serving the interpreter firmware with its bounds set low: a `websockets` client on the Unix socket
and over HTTPS with API keys, a good client beside each attack. Items 8 and 13 (the prompt's bound,
nested JSON) are tests/test_hostile_realtime.py's. The pacing's own arithmetic is tested with a held
clock here too."""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
from conftest import Daemon, good_unix_client_beside
from speech import RATE, recording
from test_access import add_key
from test_hostile_realtime import URI, good_session, next_event, share_taken_and_freed
from test_realtime import live_session
from test_speech_to_text import CLEAR, wer, words
from websockets.asyncio.client import ClientConnection, connect, unix_connect

from appliance.api.realtime_limits import QUANTUM_S, Pace
from appliance.audio import to_pcm16
from appliance.config import SequenceConfig
from appliance.engine.sequences import OwnedTable
from appliance.errors import TooManyRequests

BUDGET = 8 << 20  # [server] max_buffered_bytes: 131 s of a manual buffer (float32 at 16 kHz)
MAX_AHEAD_S, MAX_TURN_S = 1.0, 4.0
TINY = {"model": "whisper_tiny_en", "language": "en"}


@pytest.fixture(scope="module")
def daemon(interpreter_bundle, keys, tls, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("attacks")
    key_file = workdir / "api-keys.toml"
    secrets = {name: add_key(key_file, name, "--sessions", "8") for name in ("flood", "hall")}
    extra = (
        f'[access]\nkeys = "{key_file}"\n[sequences]\nmax_per_key = 2\n'
        f"[realtime]\nmax_ahead_s = {MAX_AHEAD_S}\nmax_turn_s = {MAX_TURN_S}\n"
    )
    d = Daemon(
        workdir,
        interpreter_bundle,
        keys.trusted,
        extra,
        tls=tls,
        https="",
        extra_server=f"max_buffered_bytes = {BUDGET}\n",
    )
    d.secrets = secrets  # type: ignore[attr-defined]
    yield d.wait_ready(240)
    assert d.stop() == 0, d.log.read_text()
    assert "Traceback" not in d.log.read_text(), d.log.read_text()[-3000:]


def session_update(turn_detection: dict[str, Any] | None) -> str:
    audio = {"format": {"type": "audio/pcm", "rate": 16000}, "transcription": TINY, "turn_detection": turn_detection}
    return json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": audio}}})


def appends(samples: np.ndarray, seconds: float = 1.0) -> list[str]:
    pcm, step = to_pcm16(samples), int(seconds * RATE) * 2
    return [
        json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm[at : at + step]).decode()})
        for at in range(0, len(pcm), step)
    ]


def test_pace_lets_a_burst_through_then_real_time() -> None:
    """Held clock: a session may send `ahead_s` of audio at once; past it each append waits until the
    audio is due; time that passes refills the credit, never beyond `ahead_s`; debts under QUANTUM_S
    are not waited for yet."""
    now = [100.0]
    pace = Pace(lambda: now[0])
    assert pace.spend(1.0, 2.0) == 0.0 and pace.spend(1.0, 2.0) == 0.0  # the burst
    assert pace.spend(QUANTUM_S / 2, 2.0) == 0.0  # a small debt: read on
    assert pace.spend(1.0, 2.0) == pytest.approx(1.0 + QUANTUM_S / 2)  # wait until it is due
    now[0] += 1.0 + QUANTUM_S / 2  # the session waited
    assert pace.spend(0.5, 2.0) == pytest.approx(0.5)  # real time, no credit left
    now[0] += 3600.0  # an hour of silence buys no more than the burst
    assert pace.spend(2.0, 2.0) == 0.0 and pace.spend(1.0, 2.0) == pytest.approx(1.0)


def test_a_keys_share_counts_its_entries_from_every_host() -> None:
    """The table counts a key's entries whichever clients and hosts opened them, and gives each back
    when it ends; entries admitted for no key count against none."""

    class Entry:
        client, serial, last_used, in_flight = "", 0, 0.0, 0

    table: OwnedTable[Any] = OwnedTable(lambda: SequenceConfig(max_per_key=2), "streams")
    table.open("a", 0.0, "quic:1", Entry, "10.0.0.1", "key:flood")
    table.open("b", 0.0, "quic:2", Entry, "10.0.0.2", "key:flood")
    with pytest.raises(
        TooManyRequests, match=r"key:flood holds 2 live streams, its key's share \(\[sequences\] max_per_key\)"
    ):
        table.open("c", 0.0, "quic:3", Entry, "10.0.0.3", "key:flood")
    table.open("d", 0.0, "quic:4", Entry, "10.0.0.3", "key:hall")
    table.open("e", 0.0, "uid:1000", Entry)
    table.end("a")
    table.open("c", 0.0, "quic:3", Entry, "10.0.0.3", "key:flood")


def test_a_session_faster_than_real_time_is_paced_and_its_turns_bounded(daemon: Daemon) -> None:
    """One client sent speech far faster than real time and starved everyone's transcription (a good
    one went from 0.36 s p50 to 6.3 s), its open turn unbounded. Two attacking sessions send their
    audio at once, under a turn detection that waits 3 s of silence: one 100 s of silence and then a
    sentence (the VAD alone would run through the silence many times faster than real time), one three
    sentences glued together. A good client speaks two sentences at real-time pace beside them (some
    10 s). The good client's turns complete with the known text while the first attacker is still read
    at real-time pace ([realtime] max_ahead_s): its sentence at 100 s not yet heard; and the second's
    glued sentences were committed at [realtime] max_turn_s (without the bound, one turn that had not
    ended by then)."""
    glued, _ = recording(CLEAR[:3], gap_s=0.2, lead_s=0.2)  # one turn to the VAD
    late, _ = recording(CLEAR[3:4], gap_s=4.0, lead_s=100.0)
    good, _ = recording(CLEAR[4:6], gap_s=1.5, lead_s=0.5)

    async def attacker(samples: np.ndarray, events: list[dict[str, Any]], ready: asyncio.Event) -> None:
        async with unix_connect(str(daemon.socket), URI) as ws:
            await ws.send(session_update({"type": "server_vad", "silence_duration_ms": 3000}))
            while json.loads(await ws.recv())["type"] != "session.updated":
                pass
            ready.set()
            for message in appends(samples):
                await ws.send(message)
            while True:
                events.append(json.loads(await ws.recv()))

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        paced: list[dict[str, Any]] = []
        bounded: list[dict[str, Any]] = []
        ready = [asyncio.Event(), asyncio.Event()]
        attacks = [
            asyncio.ensure_future(attacker(late, paced, ready[0])),
            asyncio.ensure_future(attacker(glued, bounded, ready[1])),
        ]
        await asyncio.wait_for(asyncio.gather(*(r.wait() for r in ready)), 60)
        events = await live_session(daemon.socket, good, 100, 16000, 2)
        seen = list(paced), list(bounded)  # what the attackers had been answered when the good client was done
        for attack in attacks:
            attack.cancel()
        return events, *seen

    with good_unix_client_beside(daemon):
        events, paced, bounded = asyncio.run(run())
    transcripts = [e["transcript"] for e in events if e["type"].endswith("transcription.completed")]
    assert wer(CLEAR[4:6], " ".join(transcripts)) <= 0.15, transcripts
    assert paced == [], paced  # its sentence at 100 s is not heard yet: it is read at real-time pace
    assert not [e for e in bounded if e["type"] == "error"], bounded
    started = {e["item_id"]: e["audio_start_ms"] for e in bounded if e["type"] == "input_audio_buffer.speech_started"}
    turns = [
        (started[e["item_id"]], e["audio_end_ms"]) for e in bounded if e["type"] == "input_audio_buffer.speech_stopped"
    ]
    assert turns, bounded  # committed at the bound: the 3 s silence never came
    assert all(end - start <= MAX_TURN_S * 1000 + 1500 for start, end in turns), turns  # a chunk, the paddings
    completed = [e for e in bounded if e["type"].endswith("transcription.completed")]
    said = set(words(CLEAR[0]))  # its first turn's text was committed, not dropped: most of the first sentence
    assert completed and len(said & set(words(completed[0]["transcript"]))) >= len(said) * 0.7, completed


def test_manual_buffers_take_from_the_daemons_byte_budget(daemon: Daemon) -> None:
    """Manual buffers (turn_detection null) were bounded only by 600 s each (38 MB), and tiny appends
    grew the daemon 1.6 GB/min. They take from [server] max_buffered_bytes (8 MiB here, 131 s of
    audio), with request bodies: a buffer past it is an error event naming the bound and is cleared,
    the session goes on; a buffer left uncommitted is given back when its session closes; a good
    session is served after."""
    silence = appends(np.zeros(100 * RATE, np.float32))  # 100 s: 6.4 MB held

    async def fill(ws: ClientConnection, messages: list[str]) -> list[dict[str, Any]]:
        await ws.send(session_update(None))
        assert (await next_event(ws, "session.updated"))["type"] == "session.updated"
        for message in messages:
            await ws.send(message)
        await ws.send(session_update(None))  # answered once every append before it was read
        answers = []
        while (answer := await next_event(ws, "session.updated"))["type"] == "error":
            answers.append(answer)
        return answers

    async def run() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]]]:
        async with unix_connect(str(daemon.socket), URI) as first:
            held = await fill(first, silence)  # 6.4 MB held, then the session leaves
        for _ in range(50):  # the box gives the buffer back as it reads the close
            second = await unix_connect(str(daemon.socket), URI)
            if not (after_close := await fill(second, silence)):  # fits only once the first's was given back
                break
            await second.close()
            await asyncio.sleep(0.1)
        async with second:
            over = await fill(second, silence)  # 12.8 MB: past the budget
            await second.send(json.dumps({"type": "input_audio_buffer.commit"}))
            going_on = await next_event(second, "conversation.item.input_audio_transcription.completed")
        return held + after_close, over, [going_on]

    with good_unix_client_beside(daemon):
        fitted, over, going_on = asyncio.run(run())
    assert fitted == [], fitted
    assert len(over) == 1, over
    detail = over[0]["error"]
    assert detail["type"] == "invalid_request_error" and detail["code"] == "buffer_too_large", detail
    assert f"at the limit of {BUDGET} bytes ([server] max_buffered_bytes)" in detail["message"], detail
    assert going_on[0]["type"].endswith("completed"), going_on  # the session went on after the error
    assert wer(CLEAR[0], good_session(daemon)) <= 0.10


def test_one_key_cannot_take_the_whole_sequence_table(daemon: Daemon) -> None:
    """An address had a share of the live-sequence table but a key had none: one key's clients on
    many hosts could fill it. [sequences] max_per_key (2 here): a key's third live stream is refused
    with an error event naming the share, another key's session is served beside it, and the key's
    next stream is served once one of its sessions leaves."""
    context = ssl.create_default_context(cafile=daemon.cafile)
    https = f"wss://127.0.0.1:{daemon.https_port}/v1/realtime?intent=transcription"
    silence = appends(np.zeros(RATE // 2, np.float32))[0]

    def as_key(name: str) -> Any:
        headers = {"Authorization": f"Bearer {daemon.secrets[name]}"}  # type: ignore[attr-defined]
        return connect(https, ssl=context, additional_headers=headers)

    async def stream(ws: ClientConnection) -> dict[str, Any]:
        """Audio enough to open the session's live stream, then a session.update: the error its
        opening met, or session.updated once it is open."""
        await next_event(ws, "session.created")
        await ws.send(session_update({"type": "server_vad"}))
        await next_event(ws, "session.updated")
        await ws.send(silence)
        await ws.send(session_update({"type": "server_vad"}))
        return await next_event(ws, "session.updated")

    with good_unix_client_beside(daemon):
        answers = asyncio.run(share_taken_and_freed(lambda: as_key("flood"), lambda: as_key("hall"), stream))
    assert [a["type"] for a in answers] == ["session.updated"] * 2 + ["error"] + ["session.updated"] * 2, answers
    message = answers[2]["error"]["message"]
    assert "key:flood holds 2 live streams, its key's share ([sequences] max_per_key)" in message, message
