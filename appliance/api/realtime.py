"""GET /v1/realtime (a WebSocket): OpenAI's Realtime API, transcription session, on any speech_to_text
model (`?model=` or session.audio.input.transcription.model; OpenAI's names take the first one).

The pump between the session's events (realtime_session.py, no I/O) and the model: with server VAD,
the audio goes as a live stream of CHUNK samples through LiveTranscriber.live_chunk (the same VAD state,
sequence table and urgent batch lane as Triton-style live sequences), each closed span is a turn;
without, the buffer is transcribed at each commit (its bytes taken from the daemon's byte budget).
A live stream is read no faster than real time past a burst (realtime_limits.py), and a turn the VAD
has not closed within [realtime] max_turn_s is committed there.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import replace
from functools import partial

import numpy as np

from appliance.api.metrics import Metrics
from appliance.api.openai_models import speech_to_text
from appliance.api.realtime_answers import Answer, Answers, Interpreter
from appliance.api.realtime_conversation import AudioItem, Item
from appliance.api.realtime_io import Output
from appliance.api.realtime_limits import Limits, Pace
from appliance.api.realtime_session import (
    COMPLETED,
    MAX_BUFFER_S,
    SAMPLE_RATE,
    Audio,
    Cancel,
    Clear,
    Commit,
    Respond,
    Restart,
    TranscriptionSession,
    read_event,
)
from appliance.api.realtime_settings import RealtimeError, default_settings
from appliance.api.routes import Route
from appliance.config import Live
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError, BadRequest, NotFound
from appliance.kinds.base import SequenceCall, ServedModel
from appliance.kinds.capabilities import Interpreting, LiveTranscriber
from appliance.kinds.speech_api import MIN_SAMPLES, LiveChunk, Options, Segment
from appliance.protocol.flow import received
from appliance.protocol.limits import LIMITS_BITTEN, ByteBudget, Held
from appliance.protocol.messages import Close, Message, Request, Response, SessionIO
from appliance.tasks import PARSE_OFF_LOOP_BYTES, off_loop_past

CHUNK = 2048  # 128 ms at 16 kHz: whole VAD frames; the turn's end is known within this
FRAME = 512  # the VAD's frame: the last chunk of a committed turn is padded to whole frames
# appends closer together than this (10 ms of audio) share one arrival time: a turn is timed from the
# first of them
ARRIVAL_STEP = 160
GATHERED = 256  # a buffer's small appends are joined into one array every this many


def routes(
    models: dict[str, ServedModel], metrics: Metrics, live: Live, budget: ByteBudget | None, stopping: asyncio.Event
) -> list[Route]:
    limits = Limits(live, budget, stopping)

    async def realtime(request: Request, params: dict[str, str]) -> Response:
        if request.method != "GET" or request.headers.get("upgrade", "").lower() != "websocket":
            raise ApiError("/v1/realtime is a WebSocket: connect with an Upgrade: websocket handshake", 426)
        pipeline = models.get(params.get("query:model", ""))
        if isinstance(pipeline, Interpreting):  # the interpreter session: translated speech back
            # a 400 before the switch; without a target, conversation mode (each turn into the other language)
            plan = pipeline.plan(*(params.get(f"query:{k}") for k in ("target", "source", "languages")))
            interpret = Interpreter(pipeline, plan)
            return Response(
                101, session=partial(transcription, models, metrics, limits, pipeline.stt.name, request, interpret)
            )
        intent = params.get("query:intent", "transcription")
        if intent != "transcription":
            raise BadRequest(
                f"intent {intent[:40]!r} is not served: use intent=transcription, or ?model= a speech pipeline"
            )
        speech = [m for m in models.values() if isinstance(m, LiveTranscriber)]
        if not speech:
            raise NotFound("this firmware serves no speech_to_text model")
        model = speech_to_text(models, params.get("query:model", speech[0].name), "transcribe", None)
        return Response(101, session=partial(transcription, models, metrics, limits, model.name, request, None))

    return [("GET", re.compile(r"/v1/realtime"), "openai_realtime", realtime)]


async def transcription(
    models: dict[str, ServedModel],
    metrics: Metrics,
    limits: Limits,
    model: str,
    request: Request,
    interpreter: Interpreter | None,
    io: SessionIO,
) -> Close:
    names = tuple(m.name for m in models.values() if isinstance(m, LiveTranscriber))
    session = TranscriptionSession(default_settings(model), names)
    if interpreter is not None:
        plan = interpreter.plan
        session.kind, session.target = "realtime", ",".join(plan.targets)
        # a text item is in the source language, else in one the session answers out of
        candidates = (*plan.targets, *interpreter.pipeline.conversation)
        session.text_language = plan.options.language or next(
            (c for c in candidates if c != plan.targets[-1]), plan.targets[0]
        )

    output = Output(io)

    async def emit(event: dict) -> None:
        """One event to the client, as soon as it is known (a turn's transcript before its translation)."""
        await output.send(_json(event))
        if event["type"] == COMPLETED and (arrived := turns.arrived.get(event["item_id"])):
            metrics.observe_live(turns.model.name, "realtime", time.monotonic() - arrived)

    def first_audio(seconds: float) -> None:
        assert interpreter is not None
        metrics.observe_live(interpreter.pipeline.name, "realtime", seconds, "first_audio")

    turns = Turns(models, session, limits, request, emit, interpreter, first_audio)
    await io.send(_json(session.created()))
    receiving: asyncio.Future[Message] | None = None
    try:
        while True:
            await output.sent.wait()  # a client that does not read what the session says is not read either
            receiving = receiving or asyncio.ensure_future(io.receive())
            if not await received(receiving, limits.stopping, lambda: turns.listening_only):
                return Close(1001, "the box is stopping")
            message, receiving = receiving.result(), None
            event = await off_loop_past(PARSE_OFF_LOOP_BYTES, len(message), read_event, message)  # long: on a thread
            for step in session.receive_read(event):
                try:
                    await (emit(step) if isinstance(step, dict) else turns.apply(step))
                except ApiError as exc:
                    await emit(session.error(exc))
    finally:
        if receiving is not None:
            receiving.cancel()
        turns.close()
        if turns.answers is not None:
            await turns.answers.stop()


class Turns:
    """One session's audio on its model: a live stream under server VAD, else a buffer. The events it
    makes go out through `emit` as each is known."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        session: TranscriptionSession,
        limits: Limits,
        request: Request,  # its client, address and key: each has a share of the sequence table
        emit: Callable[[dict], Awaitable[None]],
        interpreter: Interpreter | None,
        first_audio: Callable[[float], None],  # an interpreter answer's first audio, seconds after its turn
    ) -> None:
        self.models, self.session, self.limits, self.request = models, session, limits, request
        self.emit, self.first_audio, self.interpreter = emit, first_audio, interpreter
        self.pending: list[np.ndarray] = []  # 16 kHz samples not yet sent (or, without VAD, the buffer)
        self.pending_samples = 0
        self.held = Held(limits.budget)  # the manual buffer's bytes
        self.pace = Pace()
        self.gathered = 0  # pending's arrays before this one are joined (see feed)
        self.stream = 0  # the live stream's number within the session
        self.started = False  # whether the live stream is open on the model
        self.offset = 0  # the session's sample position where the live stream began
        self.model = self._model()
        # under server VAD, when the audio up to each session position arrived (an entry per
        # ARRIVAL_STEP of audio, from where a turn may still end on), to time the turns
        self.arrivals: deque[tuple[int, float]] = deque()
        self.arrived: dict[str, float] = {}  # item id -> when the audio that ended its turn arrived
        # an interpreter session's answers, in order, while it goes on listening
        self.answers = Answers(interpreter, session, emit, first_audio) if interpreter else None
        self.after = ""  # the last turn's language: a short next turn's is the other one (conversation mode)

    def _model(self) -> LiveTranscriber:
        model = speech_to_text(self.models, self.session.settings.model, "transcribe", None)
        if not isinstance(model, LiveTranscriber):  # a live stream needs the kind's VAD-fed sequences
            raise RealtimeError(f"model {model.name} takes no live streams", "model_not_found")
        return model

    @property
    def key(self) -> str:
        return f"realtime:{self.session.id}:{self.stream}"

    @property
    def listening_only(self) -> bool:
        """Nothing under way but listening: no turn being heard, no manual buffer held, no answer
        being spoken or waiting to be."""
        held = self.session.settings.vad is None and self.pending_samples > 0
        return not (self.session.turn_open or held or (self.answers is not None and self.answers.busy))

    def options(self) -> Options:
        if self.interpreter is not None:
            return replace(self.interpreter.plan.options, after=self.after)
        s = self.session.settings
        return Options(s.language, "transcribe", s.prompt)

    async def apply(self, step: Audio | Commit | Clear | Restart | Respond | Cancel | AudioItem) -> None:
        if isinstance(step, Audio):
            return await self.feed(step.samples)
        if isinstance(step, Commit):
            return await self.commit(step.item_id)
        if isinstance(step, Respond | Cancel | AudioItem):
            return await self._converse(step)
        self.close()
        self.offset = self.session.heard_samples
        if isinstance(step, Restart):
            self.model = self._model()

    async def _emit(self, events: list[dict]) -> None:
        for event in events:
            await self.emit(event)

    async def feed(self, samples: np.ndarray) -> None:
        if self.session.settings.vad is None:
            self._hold(samples)
            if len(self.pending) - self.gathered >= GATHERED:  # a million tiny appends: arrays, not samples
                self.pending[self.gathered :] = [np.concatenate(self.pending[self.gathered :])]
                self.gathered = len(self.pending)
            return
        self.pending.append(samples)
        self.pending_samples += len(samples)
        if wait := self.pace.spend(len(samples) / SAMPLE_RATE, self.limits.live.config.realtime.max_ahead_s):
            await asyncio.sleep(wait)  # the client is read no further meanwhile
        position = self.session.heard_samples
        if not self.arrivals or position - self.arrivals[-1][0] >= ARRIVAL_STEP:
            self.arrivals.append((position, time.monotonic()))
        while self.pending_samples >= CHUNK:
            audio = np.concatenate(self.pending)
            self.pending, self.pending_samples = [audio[CHUNK:]], len(audio) - CHUNK
            await self._chunk(audio[:CHUNK], end=False)

    def _hold(self, samples: np.ndarray) -> None:
        """A manual buffer's new samples, within MAX_BUFFER_S and the daemon's byte budget; past
        either the buffer is dropped (its bytes given back) and the error names the bound."""
        try:
            if self.pending_samples + len(samples) > MAX_BUFFER_S * SAMPLE_RATE:
                raise RealtimeError(f"the input buffer holds more than {MAX_BUFFER_S:g} s", "buffer_too_large")
            if why := self.held.take(samples.nbytes):
                LIMITS_BITTEN.bit("realtime buffers", f"Realtime session {self.session.id}: {why}")
                raise RealtimeError(f"{why} ([server] max_buffered_bytes)", "buffer_too_large")
        except RealtimeError as exc:
            self._drop()
            raise RealtimeError(f"{exc.message}: the buffer was cleared; commit sooner", exc.code) from None
        self.pending.append(samples)
        self.pending_samples += len(samples)

    def _drop(self) -> None:
        """Forget the audio held (a manual buffer's bytes given back to the budget)."""
        self.held.give_all()
        self.pending, self.pending_samples, self.gathered = [], 0, 0

    async def commit(self, item: str) -> None:
        audio = np.concatenate(self.pending) if self.pending else np.zeros(0, np.float32)
        self._drop()
        if self.session.settings.vad is None:
            if not len(audio):
                raise RealtimeError("the input buffer is empty: nothing to commit", "input_audio_buffer_commit_empty")
            padded = np.concatenate([audio, np.zeros(max(0, MIN_SAMPLES - len(audio)), np.float32)])
            found = [s async for s in self.model.transcribe(padded, self.options())]
            await self._emit(self.session.turn_closed(None, " ".join(s.text for s in found), item))
            return await self._interpret(item, found)
        if not self.started and not len(audio):
            raise RealtimeError("the input buffer is empty: nothing to commit", "input_audio_buffer_commit_empty")
        audio = np.concatenate([audio, np.zeros(-len(audio) % FRAME, np.float32)])
        chunk = await self._send(audio, end=True)
        end = chunk.closed[-1][0][1] + self.offset if chunk.closed else None  # the stream's offset, not the next's
        self.started, self.stream, self.offset = False, self.stream + 1, self.session.heard_samples
        text = " ".join(s.text for s in chunk.segments)
        self._timed(item, self.session.heard_samples)
        await self._emit(self.session.turn_closed(end, text, item))
        await self._interpret(item, chunk.segments)

    async def _chunk(self, samples: np.ndarray, end: bool) -> None:
        chunk = await self._send(samples, end)
        for (start, stop), segments in chunk.closed:
            heard = self.session.turn_heard(start + self.offset)
            closed = self.session.turn_closed(stop + self.offset, " ".join(s.text for s in segments))
            pad = self.session.settings.vad.speech_pad_ms * SAMPLE_RATE // 1000 if self.session.settings.vad else 0
            self._timed(closed[-1]["item_id"], stop + self.offset - pad)  # where the speech itself ended
            self._barge_in(heard)
            await self._emit(heard + closed)
            await self._interpret(closed[-1]["item_id"], segments)
        if chunk.open_start is not None:
            heard = self.session.turn_heard(chunk.open_start + self.offset)
            self._barge_in(heard)
            await self._emit(heard)
            if chunk.partial is not None:
                await self._emit(self.session.partial(chunk.partial))
            stream_at = self.session.heard_samples - self.pending_samples
            if (
                stream_at - (chunk.open_start + self.offset)
                >= self.limits.live.config.realtime.max_turn_s * SAMPLE_RATE
            ):
                # a turn that never pauses is committed in pieces: none holds the batch for long
                await self.commit(self.session.end_turn())
                self.after = ""  # its speaker goes on: the next piece is not the other person's turn
                return
        self._forget_arrivals(chunk.open_start)

    async def _interpret(self, item: str, segments: list[Segment]) -> None:
        """An interpreter turn, its transcript sent: a user item of the conversation, answered (where
        the turn detection creates responses) while the session goes on listening."""
        arrived = self.arrived.pop(item, None)
        if self.answers is None:
            return
        self.after = segments[-1].language if segments else self.after
        await self._emit(self.session.conversation.user_turn(item, segments))
        settings = self.session.settings
        if settings.vad is not None and settings.create_response:  # manual turns wait for response.create
            await self.answers.put(Answer(item, segments, arrived))

    async def _converse(self, step: Respond | Cancel | AudioItem) -> None:
        """An interpreter session's response.create, response.cancel, and audio items."""
        assert self.answers is not None  # the session refuses these events in a transcription session
        if isinstance(step, Cancel):
            return self.answers.cancel("client_cancelled", step.response_id)
        if isinstance(step, Respond):
            item = self.session.conversation.unanswered()
            if item is None:
                raise RealtimeError("no user item waits for an answer: speak, or create one first")
            return await self.answers.put(Answer(item.id, item.segments, None))
        padded = np.concatenate([step.samples, np.zeros(max(0, MIN_SAMPLES - len(step.samples)), np.float32)])
        found = [s async for s in self.model.transcribe(padded, self.options())]
        transcript = " ".join(s.text.strip() for s in found).strip()
        self.after = found[-1].language if found and step.previous is None else self.after  # the last turn
        conversation = self.session.conversation
        added = conversation.add(
            Item(step.item_id, "user", [{"type": "input_audio", "transcript": transcript}], found), step.previous
        )
        usage = {"type": "duration", "seconds": round(len(step.samples) / SAMPLE_RATE, 3)}
        done = self.session.event(COMPLETED, item_id=step.item_id, content_index=0, transcript=transcript, usage=usage)
        await self._emit([*added, done])

    def _barge_in(self, heard: list[dict]) -> None:
        """Speech heard (`heard`: its speech_started) cancels the answer being made, where the turn
        detection's interrupt_response asks it, as OpenAI's server VAD does."""
        if heard and self.answers is not None and self.session.settings.interrupt_response:
            self.answers.cancel("turn_detected")

    def _timed(self, item: str, end_sample: int) -> None:
        """The turn ends at `end_sample`: note when the append that carried it arrived."""
        self._trim_arrivals(end_sample)
        if self.arrivals:  # the append that began before end_sample and ran to or past it
            self.arrived[item] = self.arrivals[0][1]

    def _forget_arrivals(self, open_start: int | None) -> None:
        """The VAD has heard what was sent: no turn ends before the open one's start or, with none
        open, before the speech that may be beginning in what it heard last (its shortest speech,
        padding and silence back). Silence for hours keeps no more arrivals than that."""
        vad = self.session.settings.vad
        if open_start is not None:
            self._trim_arrivals(open_start + self.offset)
        elif vad is not None:
            back = (vad.min_speech_ms + vad.speech_pad_ms + vad.min_silence_ms) * SAMPLE_RATE // 1000 + CHUNK
            self._trim_arrivals(self.session.heard_samples - self.pending_samples - back)

    def _trim_arrivals(self, end_sample: int) -> None:
        """Drop the arrivals no turn ending at `end_sample` or later is timed from."""
        while len(self.arrivals) > 1 and self.arrivals[1][0] < end_sample:
            self.arrivals.popleft()

    async def _send(self, samples: np.ndarray, end: bool) -> LiveChunk:
        request = self.request
        call = SequenceCall(self.key, not self.started, end, request.client, request.address, request.principal)
        vad = self.session.settings.vad
        # the open turn's text so far is decoded behind the stream, as often as the model's cadence
        chunk = await self.model.live_chunk(
            samples, call, not end, self.options(), RequestTimes(), vad, partial_waits=False
        )
        self.started = not end
        return chunk

    def close(self) -> None:
        """End the live stream without decoding what it holds, and drop what the session holds (the
        client left, cleared, or changed the settings)."""
        if self.started:
            self.model.sequences.end(self.key)
            self.started, self.stream = False, self.stream + 1
        self._drop()
        self.arrivals.clear()  # no turn can end before what comes next
        self.arrived.clear()


def _json(event: dict) -> str:
    return json.dumps(event, separators=(",", ":"))
