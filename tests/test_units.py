"""Unit tests where the logic is subtle: shard planning, segment rules, the sequence table, batching."""

from __future__ import annotations

import asyncio
import logging
import sys
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from speech import speech_segments

from appliance.config import EngineConfig, SequenceConfig, ServerConfig
from appliance.daemon import ENGINE_STOP_MAX_S, ENGINE_STOP_S, engine_stop_s
from appliance.engine.loop import EngineLoop
from appliance.engine.queue_policy import QueuePolicy
from appliance.engine.scheduler import Batcher, FrameModel, Sequence, Work
from appliance.engine.sequences import OwnedTable, ScopedSequences
from appliance.engine.stats import ModelStats
from appliance.errors import BadRequest, TooManyRequests
from appliance.firmware import AudioSpec, ModelSpec, StatePair, TensorSpec
from appliance.kinds.segments import SegmentParams, SegmentTracker
from appliance.kinds.shards import plan_shards
from appliance.protocol.messages import Opened, Request
from appliance.protocol.peers import Peer, Totals, reading, without_stalling
from appliance.tasks import LOOP_SWITCH_S, OFF_LOOP_BYTES, run_loop
from appliance.transport.answering import whole
from appliance.transport.assembler import Arrived, BodyBudget
from appliance.transport.budget_ledger import BudgetLedger
from appliance.transport.owners import SequenceOwners


def test_fixed_shards_cut_at_the_limit() -> None:
    assert plan_shards(np.ones(25), 10, "fixed") == [(0, 10), (10, 20), (20, 25)]
    assert plan_shards(np.ones(0), 10, "fixed") == [(0, 0)]


def test_semantic_shards_cut_at_the_quietest_frame_of_the_window() -> None:
    energy = np.ones(25)
    energy[7] = 0.1  # a pause inside the second half of the first window
    energy[15] = 0.0
    plan = plan_shards(energy, 10, "semantic")
    assert plan[0] == (0, 7) and plan[1] == (7, 15)
    assert all(end - start <= 10 for start, end in plan)
    assert plan[-1][1] == 25 and all(a[1] == b[0] for a, b in zip(plan, plan[1:]))


def test_segment_rules_hysteresis_min_speech_and_padding() -> None:
    frame, rate = 512, 16000
    probs = np.zeros(100, np.float32)
    probs[10:40] = 0.9  # ~1 s of speech
    probs[42:44] = 0.2  # a dip above the off threshold (0.35)? no: below it, but shorter than min silence
    probs[44:60] = 0.9
    probs[80:82] = 0.9  # 64 ms: shorter than min_speech, dropped
    segments = speech_segments(probs, frame, rate, 100 * frame, SegmentParams())
    pad = int(0.03 * rate)
    assert segments == [(10 * frame - pad, 60 * frame + pad)]


class CountingEngine:
    """A fake engine whose state output counts frames seen, so order and row scatter are checkable."""

    name = "counting"

    def __init__(self) -> None:
        self.batches: list[int] = []

    def run(self, feeds, batch):
        state = feeds["state"]
        self.batches.append(state.shape[1])
        frame_mean = feeds["input"][:, 64:].mean(axis=1)
        return {"output": (state[0, :, 0] + frame_mean)[:, None].astype(np.float32), "stateN": state + 1.0}


def frame_model(engine) -> FrameModel:
    spec = ModelSpec(
        name="fake",
        kind="vad",
        file="x.onnx",
        inputs=(
            TensorSpec("input", "FP32", (-1, -1)),
            TensorSpec("state", "FP32", (2, -1, 128)),
            TensorSpec("sr", "INT64", ()),
        ),
        outputs=(TensorSpec("output", "FP32", (-1, 1)), TensorSpec("stateN", "FP32", (2, -1, 128))),
        state=(StatePair("state", "stateN", 1),),
        audio=AudioSpec(16000, 512, 64, "input", "output", "sr"),
    )
    return FrameModel(spec, engine)


def step(batcher: Batcher) -> None:
    """What the engine loop does each turn, on this thread."""
    batcher.fill()
    batcher.finish(batcher.run_steps())


def test_batcher_batches_streams_and_keeps_each_sequence_in_order() -> None:
    engine = CountingEngine()
    model = frame_model(engine)
    batcher = Batcher(model, max_batch=4)
    finished = []
    sequences = [model.new_sequence() for _ in range(6)]
    works = []
    for seq in sequences:
        for part in range(2):  # two requests per sequence: the second must see the first's state
            work = Work(seq, np.full((3, 512), part, np.float32), lambda w, e: finished.append((w, e)))
            works.append(work)
            batcher.submit(work)
    while batcher.busy:
        step(batcher)
    assert len(finished) == 12 and all(error is None for _, error in finished)
    assert max(engine.batches) == 4 and sum(engine.batches) == 6 * 2 * 3
    for seq_index in range(6):
        first, second = works[2 * seq_index], works[2 * seq_index + 1]
        # the counting state went 0,1,2 in the first request and 3,4,5 in the second (+1 for its frames)
        np.testing.assert_allclose(first.probs, [0, 1, 2])
        np.testing.assert_allclose(second.probs, [4, 5, 6])


def test_batcher_fails_the_batch_when_the_engine_raises() -> None:
    class Broken(CountingEngine):
        def run(self, feeds, batch):
            raise RuntimeError("device lost")

    batcher = Batcher(frame_model(Broken()), max_batch=4)
    errors = []
    seq = batcher.model.new_sequence()
    batcher.submit(Work(seq, np.zeros((2, 512), np.float32), lambda w, e: errors.append(e)))
    step(batcher)
    assert not batcher.busy and "device lost" in str(errors[0]) and errors[0].status == 500


def test_a_failed_batch_is_logged_once_with_its_traceback_once_the_engine_has_served() -> None:
    """Each request of a failed batch gets its 500 (logged by the API in one line each); the batch's
    failure is ours and logged once at ERROR with the engine's traceback, except before the engine has
    served at all: that is the warm-up's failure, which the start reports in one line."""

    class FailingAfter(CountingEngine):
        def __init__(self, fail: set[int]) -> None:
            super().__init__()
            self.fail, self.calls = fail, 0

        def run(self, feeds, batch):
            self.calls += 1
            if self.calls in self.fail:
                raise RuntimeError(f"device lost at call {self.calls}")
            return super().run(feeds, batch)

    class FailingSame(FailingAfter):
        def run(self, feeds, batch):
            try:
                return super().run(feeds, batch)
            except RuntimeError:
                raise RuntimeError("device lost") from None

    async def serve(engine: CountingEngine, requests: int) -> list[BaseException | None]:
        stats = ModelStats()
        batcher = Batcher(frame_model(engine), max_batch=4)
        engine_loop = EngineLoop(batcher, QueuePolicy("fake", EngineConfig, stats))
        engine_loop.start()
        errors: list[BaseException | None] = []
        for _ in range(requests):  # one after another: each its own batch
            done = asyncio.Event()

            def on_done(work: Work, error: BaseException | None, done: asyncio.Event = done) -> None:
                errors.append(error)
                done.set()

            engine_loop.submit(Work(batcher.model.new_sequence(), np.zeros((1, 512), np.float32), on_done))
            await done.wait()
        await engine_loop.stop(1.0)
        return errors

    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append  # type: ignore[method-assign]
    engine_log = logging.getLogger("appliance.engine")
    engine_log.addHandler(handler)
    engine_log.setLevel(logging.DEBUG)
    try:
        warm_up = asyncio.run(serve(FailingAfter({1}), 1))
        assert warm_up[0] is not None and warm_up[0].status == 500  # type: ignore[attr-defined]
        assert [r.levelno for r in records] == [logging.DEBUG]
        records.clear()
        served = asyncio.run(serve(FailingAfter({2, 3}), 4))
        failures = records[:]
        records.clear()
        repeated = asyncio.run(serve(FailingSame({2, 3, 5}), 5))
    finally:
        engine_log.removeHandler(handler)
        engine_log.setLevel(logging.NOTSET)
    assert [e is None for e in served] == [True, False, False, True]
    assert [r.levelno for r in failures] == [logging.ERROR, logging.ERROR]  # two failures, each its own
    assert failures[0].exc_info is not None and "device lost at call 2" in str(failures[0].exc_info[1])
    assert "model fake: its engine failed a batch of 1" in failures[0].getMessage()
    # the same failure batch after batch is logged once; again after a batch that went through
    assert [e is None for e in repeated] == [True, False, False, True, False]
    assert [r.levelno for r in records] == [logging.ERROR, logging.DEBUG, logging.ERROR]


def sequence_table(max_live: int, dropped: list[object] | None = None) -> OwnedTable[Sequence]:
    on_drop = None if dropped is None else lambda key, entry: dropped.append(key)
    return OwnedTable(lambda: SequenceConfig(idle_timeout_s=10, max_live=max_live), on_drop=on_drop)


def new_sequence() -> Sequence:
    return frame_model(CountingEngine()).new_sequence()


def test_sequence_table_limits_and_expiry_follow_the_clock() -> None:
    dropped: list[object] = []
    table = sequence_table(2, dropped)
    table.open("a", 0, "", new_sequence)
    table.open("b", 5, "", new_sequence)
    with pytest.raises(TooManyRequests):
        table.open("c", 6, "", new_sequence)
    table.get("a", 9, "")  # touching keeps it alive
    assert len(table) == len(table) == 2  # counting changes nothing
    assert table.expire(now=15.5) == 1 and dropped == ["b"]  # b idle 10.5 s
    table.open("c", 16, "", new_sequence)
    with pytest.raises(BadRequest, match="not open"):
        table.get("b", 16, "")
    busy = table.get("a", 16, "")
    busy.in_flight = 1
    assert table.expire(now=100) == 1 and len(table) == 1  # a request in flight keeps its sequence
    assert dropped == ["b", "c"]


def test_a_scoped_view_counts_and_ends_only_its_own_entries() -> None:
    table = sequence_table(8)
    view = ScopedSequences(table, "pipeline")
    table.open("raw", 0, "", new_sequence)
    serial = table.open(view.key(1), 0, "", new_sequence).serial
    assert len(view) == 1 and len(table) == 2 and view.holds(1, serial) and not view.holds("raw", serial)
    assert view.end_opened(1, serial) and len(view) == 0 and len(table) == 1


def test_sequence_owners_release_what_a_peer_opened_and_still_owns() -> None:
    owners = SequenceOwners()
    owners.record("a", Opened("vad", 1, serial=1))
    owners.record("a", Opened("vad", 2, serial=2))
    owners.record("b", Opened("vad", 2, serial=3))  # b reopened id 2: it is b's now
    owners.record("c", Opened("vad", 9, serial=4))
    owners.forget_ended(lambda opened: opened.id != 9)  # c's ended by sequence_end or idle expiry
    assert owners.peers() == {"a", "b"}
    assert owners.release("a") == [Opened("vad", 1, serial=1)]
    assert owners.release("b") == [Opened("vad", 2, serial=3)] and owners.peers() == set()


def test_ending_an_opened_sequence_spares_a_reopened_one() -> None:
    dropped: list[object] = []
    table = sequence_table(4, dropped)
    first = table.open("x", 0, "", new_sequence).serial
    second = table.open("x", 1, "", new_sequence).serial  # the client reconnected and started it again
    assert dropped == ["x"]  # the first one's state went with it
    assert not table.end_opened("x", first) and table.holds("x", second)
    assert table.end_opened("x", second) and len(table) == 0


def test_a_live_frame_goes_before_a_recording_that_fills_the_batch() -> None:
    engine = CountingEngine()
    batcher = Batcher(frame_model(engine), max_batch=4)
    done: list[str] = []
    shards = [  # a long recording: four shards of 100 frames fill the batch
        Work(batcher.model.new_sequence(), np.zeros((100, 512), np.float32), lambda w, e, i=i: done.append(f"shard{i}"))
        for i in range(4)
    ]
    for shard in shards:
        batcher.submit(shard)
    batcher.fill()
    batcher.run_steps()  # one engine call: the recording is under way
    live = Work(
        batcher.model.new_sequence(), np.zeros((1, 512), np.float32), lambda w, e: done.append("live"), urgent=True
    )
    batcher.submit(live)
    assert batcher.run_steps(budget_s=10.0) == []  # returns at once: a live frame waits
    while "live" not in done:
        step(batcher)
    assert done == ["live"] and engine.batches[-1] == 4  # one shard stepped out for it
    while batcher.busy:
        step(batcher)
    assert sorted(done) == ["live", "shard0", "shard1", "shard2", "shard3"]
    for shard in shards:  # the counting state went on where it was: the paused shard resumed intact
        np.testing.assert_allclose(shard.probs, np.arange(100))


def test_the_firmware_and_the_runtime_know_the_same_model_kinds() -> None:
    from appliance.firmware.manifest import KIND_PARAMETERS
    from appliance.kinds import KINDS

    assert set(KIND_PARAMETERS) == set(KINDS)


def test_every_kind_in_the_registry_is_a_factory_of_the_registry_signature() -> None:
    """Each KINDS entry imports and takes (spec, bundle, live, loaded), as load_models calls it."""
    import inspect

    from appliance.kinds import KINDS, factory

    for kind in KINDS:
        parameters = list(inspect.signature(factory(kind)).parameters)
        assert parameters[:4] == ["spec", "bundle", "live", "loaded"], (kind, parameters)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.2, 0.4, 0.9]), min_size=1, max_size=300),
    st.sampled_from([32, 100, 300]),
    st.sampled_from([0, 30, 200]),
)
def test_the_span_a_live_stream_decodes_ahead_is_the_one_the_vad_closes(
    probs: list[float], min_silence_ms: int, pad_ms: int
) -> None:
    """SegmentTracker.closing(): while the silence after speech is waited out, and after the close
    until the segment is released (its padding heard), it names one span, the one feed returns;
    speech that comes back withdraws it. (A live stream drops its decode ahead when the name changes.)"""
    params = SegmentParams(min_speech_ms=64, min_silence_ms=min_silence_ms, speech_pad_ms=pad_ms)
    tracker = SegmentTracker(512, 16000, params)
    predicted = None
    for p in probs:
        closed = tracker.feed(np.array([p], np.float32))
        if closed and predicted is not None:
            assert closed[0] == predicted
        closing = tracker.closing()
        if p >= params.threshold:
            assert closing is None  # speech goes on: nothing to decode ahead
        elif predicted is not None and not closed:
            assert closing == predicted  # the silence goes on: the same span until its release
        predicted = closing


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.sampled_from([0.0, 0.2, 0.4, 0.9]), min_size=1, max_size=200),
    st.lists(st.sampled_from([0.0, 0.2, 0.4]), max_size=40),
    st.sampled_from([32, 100, 300]),
    st.sampled_from([0, 30, 200]),
)
def test_a_settled_recording_has_the_segments_of_any_longer_one_where_no_speech_follows(
    probs: list[float], quiet: list[float], min_silence_ms: int, pad_ms: int
) -> None:
    """SegmentTracker.settled: a recording that ends where the tracker is settled has the very segments
    of the same recording with any silence after it (a Wyoming recording is transcribed ahead there)."""
    params = SegmentParams(min_speech_ms=64, min_silence_ms=min_silence_ms, speech_pad_ms=pad_ms)
    tracker = SegmentTracker(512, 16000, params)
    for heard in range(1, len(probs) + 1):
        tracker.feed(np.array(probs[heard - 1 : heard], np.float32))
        if tracker.settled:
            prefix = np.array(probs[:heard], np.float32)
            longer = np.array(probs[:heard] + quiet, np.float32)
            assert speech_segments(prefix, 512, 16000, heard * 512, params) == speech_segments(
                longer, 512, 16000, len(longer) * 512, params
            )


def test_a_stop_waits_for_an_engine_call_as_long_as_twice_its_longest() -> None:
    """A slow CPU's whole-window Whisper call (seconds) is work to finish at a stop, not a wedge; a
    model whose calls are short still gets ENGINE_STOP_S."""
    stats = ModelStats()
    assert engine_stop_s(stats) == ENGINE_STOP_S
    stats.record_execution(8, 1_000_000, 5_000_000, 1_000_000)  # 7 ms
    assert engine_stop_s(stats) == ENGINE_STOP_S
    stats.record_execution(2, 0, 2_600_000_000, 100_000_000)  # 2.7 s
    stats.record_execution(1, 0, 900_000_000, 0)
    assert engine_stop_s(stats) == pytest.approx(5.4)
    stats.record_execution(8, 0, 30_000_000_000, 0)  # 30 s: the stop still ends within the unit's TimeoutStopSec
    assert engine_stop_s(stats) == ENGINE_STOP_MAX_S


class WaitingTable:
    """A PeerTable whose walk waits until `release` is set, noting the thread it ran on."""

    reason = ""

    def __init__(self, backend: str, release: threading.Event) -> None:
        self.backend, self.release, self.walked_on = backend, release, 0
        self.peer = Peer("192.0.2.1:4433", 1.0, 2.0, validated=True)

    def peers(self) -> dict[str, Peer]:
        self.walked_on = threading.get_ident()
        assert self.release.wait(10), "never released"
        return {self.peer.address: self.peer}

    validated_peers = peers

    def validated_count(self) -> int:
        return len(self.peers())

    def droppers(self) -> dict[str, int]:
        return {}

    def totals(self) -> Totals:
        return Totals(packets=3)


def test_the_kernel_peer_table_is_walked_off_the_event_loop_and_the_user_space_one_on_it() -> None:
    """A walk of the kernel's maps (0.7 s of bpf() calls at 65,536 peers) runs in a thread while the
    loop goes on; the user-space tables, which the loop changes, are read on the loop's thread."""
    release = threading.Event()

    async def run() -> None:
        loop_thread, kernel = threading.get_ident(), WaitingTable("ebpf", release)
        walk = asyncio.create_task(reading(kernel, every_peer=False))
        while not kernel.walked_on:  # the loop runs this while the walk waits in its thread
            assert not walk.done(), walk.result()  # a walk that failed ends the test, not its timeout
            await asyncio.sleep(0.01)
        assert kernel.walked_on != loop_thread and not walk.done()
        release.set()
        read = await walk
        assert read.validated_count() == 1 and read.totals().packets == 3  # /metrics: counted, no Peer read
        user = WaitingTable("user", release)
        assert (await without_stalling(user, user.peers)) and user.walked_on == loop_thread

    asyncio.run(run())


@pytest.mark.parametrize("workers", [1, 2, 7])
def test_the_byte_budget_is_one_for_the_daemon_whatever_its_workers(workers: int) -> None:
    """Each process's budget over the engine's ledger (a worker's own view of the shared page): one
    process may hold all of max_buffered_bytes, and together they hold no more; a worker that ends
    has its slot cleared, and the others may take what it held."""
    limits = ServerConfig(max_buffered_bytes=24_000)
    engine_ledger = BudgetLedger.create(workers) if workers > 1 else None
    engine = BodyBudget(lambda: limits, workers, engine_ledger)
    ledgers = [BudgetLedger.attached(engine_ledger.fd, n + 1) for n in range(workers)] if engine_ledger else []
    processes = [engine, *(BodyBudget(lambda: limits, workers, ledger) for ledger in ledgers)]
    processes[-1].take(20_000)  # one process alone may hold most of it
    for budget in processes:
        while not budget.refuses(1_000, "request bodies"):
            budget.take(1_000)
    assert sum(b.held for b in processes) == limits.max_buffered_bytes
    assert "at the limit of 24000 bytes" in engine.refuses(1, "audio buffers")
    if engine_ledger is not None:
        engine_ledger.clear(workers)  # the last worker exited
        assert not engine.refuses(20_000, "audio buffers")


def test_a_process_event_loop_runs_with_a_gil_switch_interval_under_pythons() -> None:
    """The daemon's and each worker's loop (tasks.run_loop): a thread that took work off the loop lets it
    have the GIL within LOOP_SWITCH_S, not Python's 5 ms (the loop bench shows what that buys)."""

    async def interval() -> float:
        return sys.getswitchinterval()

    before = sys.getswitchinterval()
    try:
        assert run_loop(interval()) == LOOP_SWITCH_S < 0.005 == before
    finally:
        sys.setswitchinterval(before)


@pytest.mark.parametrize("sizes", [[10], [10, 20], [OFF_LOOP_BYTES, 1]])
def test_a_body_joined_for_its_answer_is_held_once(sizes: list[int]) -> None:
    """The pieces a transport received are let go once joined (the transport keeps what arrived until
    its answer is sent: with them kept, a body was held twice while the budget counted it once)."""
    pieces = [bytes([n]) * size for n, size in enumerate(sizes)]
    arrived = Arrived(Request("POST", "/", {}), list(pieces), sum(sizes))
    assert asyncio.run(whole(arrived)) == b"".join(pieces)
    assert arrived.pieces == []
