"""Voice activity on real speech (espeak-ng): segments, concurrent streams, long recordings in shards."""

from __future__ import annotations

import asyncio
import signal
import threading

import numpy as np
import pytest
from conftest import build_bundle
from speech import RATE, SENTENCES, recording, speech_segments
from waits import wait_until

from appliance.audio import encode_wav, to_frames
from appliance.client import AsyncClient, Client
from appliance.engine.failpoints import HANG_FAILPOINT
from appliance.kinds.segments import SegmentParams
from appliance.kinds.shards import frame_energy, plan_shards

FRAME = 512
CHUNK = 8 * FRAME  # 256 ms
# Pauses inside a sentence are speech for these tests: the spans are whole sentences.
QUERY = {"min_silence_ms": 400}


@pytest.fixture(scope="module")
def speech() -> tuple[np.ndarray, list[tuple[float, float]]]:
    return recording(SENTENCES)


def stream(client: Client, audio: np.ndarray, sequence_id: int) -> np.ndarray:
    audio = np.concatenate([audio, np.zeros(-len(audio) % CHUNK, np.float32)])
    chunks = [audio[i : i + CHUNK] for i in range(0, len(audio), CHUNK)]
    return np.concatenate(
        [
            client.speech_probs(chunk, sequence_id=sequence_id, start=i == 0, end=i == len(chunks) - 1)
            for i, chunk in enumerate(chunks)
        ]
    )


def test_segments_match_the_spoken_sentences(client: Client, speech) -> None:
    audio, spans = speech
    result = client.segments(encode_wav(audio, RATE), **QUERY)
    segments = [(s["start"], s["end"]) for s in result["segments"]]
    assert len(segments) == len(spans), (segments, spans)
    for (start, end), (truth_start, truth_end) in zip(segments, spans):
        assert abs(start - truth_start) <= 0.2 and abs(end - truth_end) <= 0.2, (segments, spans)
    assert result["duration"] == pytest.approx(len(audio) / RATE, abs=0.001)


def test_silence_has_no_segments(client: Client) -> None:
    assert client.segments(encode_wav(np.zeros(5 * RATE, np.float32), RATE))["segments"] == []


def test_streamed_sequence_matches_one_off_call(client: Client, speech) -> None:
    audio, _ = speech
    streamed = stream(client, audio, sequence_id=4242)
    whole = client.speech_probs(np.concatenate([audio, np.zeros(-len(audio) % CHUNK, np.float32)]))
    np.testing.assert_allclose(streamed, whole, atol=1e-4)


def test_sixteen_concurrent_streams_get_what_each_gets_alone(daemon, client: Client, speech) -> None:
    audio, _ = speech
    # each stream its own slice of speech, so a mixed-up state row would show
    inputs = [np.roll(audio, i * 3 * CHUNK) for i in range(16)]
    alone = [stream(client, x, sequence_id=5000 + i) for i, x in enumerate(inputs)]

    async def one(i: int) -> np.ndarray:
        c = AsyncClient(str(daemon.socket))
        padded = np.concatenate([inputs[i], np.zeros(-len(inputs[i]) % CHUNK, np.float32)])
        out = []
        for k in range(0, len(padded), CHUNK):
            out.append(
                await c.speech_probs(
                    padded[k : k + CHUNK], sequence_id=6000 + i, start=k == 0, end=k + CHUNK >= len(padded)
                )
            )
        await c.close()
        return np.concatenate(out)

    async def together() -> list[np.ndarray]:
        return await asyncio.gather(*(one(i) for i in range(16)))

    before = client.metrics()
    concurrent = asyncio.run(together())
    for i in range(16):
        np.testing.assert_allclose(concurrent[i], alone[i], atol=1e-4, err_msg=f"stream {i}")
    assert batched_frames(client.metrics()) > batched_frames(before), "concurrent streams were never batched"


def batched_frames(metrics: str) -> int:
    """Engine calls that carried more than one sequence."""
    ones = total = 0
    for line in metrics.splitlines():
        if line.startswith("appliance_batch_size_bucket") and 'le="1"' in line:
            ones = int(line.split()[-1])
        if line.startswith("appliance_batch_size_count"):
            total = int(line.split()[-1])
    return total - ones


@pytest.mark.parametrize("algorithm", ["semantic", "fixed"])
def test_long_recording_in_shards_agrees_with_one_sequence(keys, tmp_path, start_daemon, speech, algorithm) -> None:
    """A firmware with 3.2 s shards: segments agree with one sequence within a frame away from the cuts."""
    audio, _ = speech
    audio = np.concatenate([audio, audio, audio])  # ~45 s: many shards
    small = build_bundle(keys, tmp_path / f"fw-{algorithm}", max_tokens_per_shard=100, split_algorithm=algorithm)
    daemon = start_daemon(bundle_dir=small)
    with daemon.client() as client:
        assert client.model()["parameters"]["baked"]["max_tokens_per_shard"] == 100
        sharded = client.segments(encode_wav(audio, RATE), **QUERY)["segments"]
        probs = stream(client, audio, sequence_id=1)[: -(-len(audio) // FRAME)]
    params = SegmentParams(min_silence_ms=QUERY["min_silence_ms"])
    reference = speech_segments(probs, FRAME, RATE, len(audio), params)
    cuts = [start * FRAME / RATE for start, _ in plan_shards(frame_energy(to_frames(audio, FRAME)), 100, algorithm)[1:]]
    assert len(cuts) >= 10
    assert len(sharded) == len(reference)
    compared = 0
    for got, (ref_start, ref_end) in zip(sharded, reference):
        for value, ref in ((got["start"], ref_start / RATE), (got["end"], ref_end / RATE)):
            if min(abs(ref - c) for c in cuts) > 0.5:  # not at a shard boundary
                assert abs(value - ref) <= FRAME / RATE + 1e-3, (sharded, reference)
                compared += 1
    assert compared >= len(reference) // 2  # most boundaries are away from a cut


@pytest.mark.parametrize("transport", ["unix", "quic"])
def test_long_results_stream_as_they_are_produced(start_daemon, tls, tmp_path, speech, transport: str) -> None:
    """A 3-minute recording: the first segment arrives while the engine is held (failpoint) part
    way through; the rest follow once it resumes, and match the one-response call."""
    audio, spans = speech
    audio = np.concatenate([audio, np.zeros(180 * RATE - len(audio), np.float32)])  # 6 shards of <= 1024 frames
    wav = encode_wav(audio, RATE)
    hold = tmp_path / "hold-engine"
    daemon = start_daemon(tls=tls, env={HANG_FAILPOINT: str(hold)})
    with daemon.client(transport) as client, daemon.client() as observer:
        expected = client.segments(wav, **QUERY)
        hold.write_text("300")  # the engine runs 300 more batched steps, then stalls
        lines = client.stream_segments(wav, **QUERY)
        first = next(lines)
        frames_run = sum(
            float(line.split()[-1])
            for line in observer.metrics().splitlines()
            if line.startswith("appliance_engine_frames_total")
        )
        hold.unlink()
        rest = list(lines)
    assert (first["start"], first["end"]) == (expected["segments"][0]["start"], expected["segments"][0]["end"])
    assert abs(first["start"] - spans[0][0]) <= 0.2
    # what had run when the first segment arrived: the first call's frames, plus at most 300 steps of 6
    assert frames_run < 2 * len(audio) / FRAME, frames_run
    assert [first, *rest[:-1]] == expected["segments"]
    assert rest[-1] == {
        "model_name": "silero_vad",
        "duration": expected["duration"],
        "segments": len(expected["segments"]),
        "done": True,
    }


def test_sigterm_with_a_wedged_engine_exits_within_the_grace_time(start_daemon, tmp_path) -> None:
    hold = tmp_path / "hold-engine"
    daemon = start_daemon(env={HANG_FAILPOINT: str(hold)})
    hold.touch()  # the next engine call stalls, as a wedged driver call would

    outcome: list[BaseException | str] = []  # what the stuck call ended with, read in the test's thread

    def stuck_call() -> None:
        try:
            with Client(str(daemon.socket), timeout=60) as client:
                client.speech_probs(np.zeros(64 * FRAME, np.float32))
            outcome.append("answered")
        except BaseException as exc:  # noqa: BLE001 - asserted below
            outcome.append(exc)

    caller = threading.Thread(target=stuck_call)
    caller.start()
    wait_until(lambda: "held by the test's hang failpoint" in daemon.log.read_text(), "the call held in the engine")
    daemon.proc.send_signal(signal.SIGTERM)
    code = daemon.proc.wait(120)  # its own watchdog ends it (logged below); waiting for the call never would
    caller.join(10)
    log = daemon.log.read_text()
    assert len(outcome) == 1 and isinstance(outcome[0], OSError), outcome  # the abandoned call saw its connection go
    assert code == 1, (code, log)
    assert (
        "stopping: still running 9 s after the stop signal (the event loop is blocked, an engine call is "
        "wedged); abandoned 1 requests in flight and 0 open sequences, exiting"
    ) in log
