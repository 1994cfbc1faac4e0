"""GET /v1/realtime (a WebSocket): OpenAI's Realtime API, transcription session, on any speech_to_text
model (`?model=` or session.audio.input.transcription.model; OpenAI's names take the first one).

The pump between the session's events (realtime_session.py, no I/O) and the model: with server VAD,
the audio goes as a live stream of CHUNK samples through LiveTranscriber.live_chunk (the same VAD state,
sequence table and urgent batch lane as Triton-style live sequences), each closed span is a turn;
without, the buffer is transcribed at each commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from appliance.api.metrics import Metrics
from appliance.api.openai_models import speech_to_text
from appliance.api.realtime_session import (
    COMPLETED,
    MAX_BUFFER_S,
    SAMPLE_RATE,
    Audio,
    Clear,
    Commit,
    Restart,
    Step,
    TranscriptionSession,
)
from appliance.api.realtime_settings import RealtimeError, default_settings
from appliance.api.routes import Route
from appliance.audio import StreamResampler, to_pcm16
from appliance.engine.stats import RequestTimes
from appliance.errors import ApiError, BadRequest, NotFound
from appliance.kinds.base import SequenceCall, ServedModel
from appliance.kinds.capabilities import Interpreting, LiveTranscriber
from appliance.kinds.speech_api import MIN_SAMPLES, LiveChunk, Options, Segment
from appliance.protocol.messages import Close, Request, Response, SessionIO

CHUNK = 2048  # 128 ms at 16 kHz: whole VAD frames; the turn's end is known within this
FRAME = 512  # the VAD's frame: the last chunk of a committed turn is padded to whole frames
# an interpreter session's turns transcribed and waiting to be spoken before it stops taking audio
ANSWERS_WAITING = 4
# appends closer together than this (10 ms of audio) share one arrival time: a turn is timed from the
# first of them
ARRIVAL_STEP = 160
GATHERED = 256  # a buffer's small appends are joined into one array every this many


def routes(models: dict[str, ServedModel], metrics: Metrics) -> list[Route]:
    async def realtime(request: Request, params: dict[str, str]) -> Response:
        if request.headers.get("upgrade", "").lower() != "websocket":
            raise ApiError("/v1/realtime is a WebSocket: connect with an Upgrade: websocket handshake", 426)
        pipeline = models.get(params.get("query:model", ""))
        if isinstance(pipeline, Interpreting):  # the interpreter session: translated speech back
            # a 400 before the switch; without a target, conversation mode (each turn into the other language)
            plan = pipeline.plan(*(params.get(f"query:{k}") for k in ("target", "source", "languages")))
            interpret = Interpreter(pipeline, plan)
            return Response(
                101,
                session=partial(
                    transcription, models, metrics, pipeline.stt.name, request.client, request.address, interpret
                ),
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
        return Response(
            101, session=partial(transcription, models, metrics, model.name, request.client, request.address, None)
        )

    return [("GET", re.compile(r"/v1/realtime"), "openai_realtime", realtime)]


@dataclass(frozen=True, slots=True)
class Answer:
    """An interpreter turn waiting to be answered: its transcript's segments, and when the audio that
    ended it arrived (its answer's first audio is timed from then)."""

    item: str
    segments: list[Segment]
    arrived: float | None


@dataclass(frozen=True, slots=True)
class Interpreter:
    """An interpreter session's pipeline and plan (target language, the voice)."""

    pipeline: Interpreting
    plan: Any  # the pipeline's Plan: options, target, voice


async def transcription(
    models: dict[str, ServedModel],
    metrics: Metrics,
    model: str,
    client: str,
    address: str,
    interpreter: Interpreter | None,
    io: SessionIO,
) -> Close:
    names = tuple(m.name for m in models.values() if isinstance(m, LiveTranscriber))
    kind, target = ("realtime", ",".join(interpreter.plan.targets)) if interpreter else ("transcription", "")
    session = TranscriptionSession(default_settings(model), names, kind=kind, target=target)

    output = Output(io)

    async def emit(event: dict) -> None:
        """One event to the client, as soon as it is known (a turn's transcript before its translation)."""
        await output.send(_json(event))
        if event["type"] == COMPLETED and (arrived := turns.arrived.get(event["item_id"])):
            metrics.observe_live(turns.model.name, "realtime", time.monotonic() - arrived)

    def first_audio(seconds: float) -> None:
        assert interpreter is not None
        metrics.observe_live(interpreter.pipeline.name, "realtime", seconds, "first_audio")

    turns = Turns(models, session, client, address, emit, interpreter, first_audio)
    await io.send(_json(session.created()))
    try:
        while True:
            await output.sent.wait()  # a client that does not read what the session says is not read either
            message = await io.receive()
            steps: list[Step]
            if isinstance(message, bytes):
                steps = [session.error(RealtimeError("events are JSON text messages, not binary", "invalid_event"))]
            else:
                steps = session.receive(message)
            for step in steps:
                try:
                    await (emit(step) if isinstance(step, dict) else turns.apply(step))
                except ApiError as exc:
                    await emit(session.error(exc))
    finally:
        turns.close()
        await turns.stop_answering()


class Output:
    """A session's sends, from its reading path and its answers' task. While one waits for the client
    to take it, the reading path takes none of the client's messages: an interpreter's answers are
    spoken in a task of their own, and a client that stopped reading them would otherwise still be read
    (silence, say) for as long as it sent."""

    def __init__(self, io: SessionIO) -> None:
        self.io = io
        self.waiting = 0  # sends under way
        self.sent = asyncio.Event()  # set while none is
        self.sent.set()

    async def send(self, message: str) -> None:
        self.waiting += 1
        self.sent.clear()
        try:
            await self.io.send(message)
        finally:
            self.waiting -= 1
            if not self.waiting:
                self.sent.set()


class Turns:
    """One session's audio on its model: a live stream under server VAD, else a buffer. The events it
    makes go out through `emit` as each is known."""

    def __init__(
        self,
        models: dict[str, ServedModel],
        session: TranscriptionSession,
        client: str,
        address: str,  # Request.address: a host's sessions share one share of the sequence table
        emit: Callable[[dict], Awaitable[None]],
        interpreter: Interpreter | None,
        first_audio: Callable[[float], None],  # an interpreter answer's first audio, seconds after its turn
    ) -> None:
        self.models, self.session, self.client, self.interpreter = models, session, client, interpreter
        self.emit, self.first_audio, self.address = emit, first_audio, address
        self.pending: list[np.ndarray] = []  # 16 kHz samples not yet sent (or, without VAD, the buffer)
        self.pending_samples = 0
        self.gathered = 0  # pending's arrays before this one are joined (see feed)
        self.stream = 0  # the live stream's number within the session
        self.started = False  # whether the live stream is open on the model
        self.offset = 0  # the session's sample position where the live stream began
        self.model = self._model()
        # under server VAD, when the audio up to each session position arrived (an entry per
        # ARRIVAL_STEP of audio, from where a turn may still end on), to time the turns
        self.arrivals: deque[tuple[int, float]] = deque()
        self.arrived: dict[str, float] = {}  # item id -> when the audio that ended its turn arrived
        # an interpreter session's turns to answer, in order, while it goes on listening
        self.to_answer: asyncio.Queue[Answer] = asyncio.Queue(ANSWERS_WAITING)
        self.answering = asyncio.get_running_loop().create_task(self._answer()) if interpreter else None

    def _model(self) -> LiveTranscriber:
        model = speech_to_text(self.models, self.session.settings.model, "transcribe", None)
        if not isinstance(model, LiveTranscriber):  # a live stream needs the kind's VAD-fed sequences
            raise RealtimeError(f"model {model.name} takes no live streams", "model_not_found")
        return model

    @property
    def key(self) -> str:
        return f"realtime:{self.session.id}:{self.stream}"

    def options(self) -> Options:
        if self.interpreter is not None:
            return self.interpreter.plan.options
        s = self.session.settings
        return Options(s.language, "transcribe", s.prompt)

    async def apply(self, step: Audio | Commit | Clear | Restart) -> None:
        if isinstance(step, Audio):
            return await self.feed(step.samples)
        if isinstance(step, Commit):
            return await self.commit(step.item_id)
        self.close()
        self.pending, self.pending_samples, self.gathered, self.offset = [], 0, 0, self.session.heard_samples
        self.arrivals.clear()  # no turn can end before the new offset
        if isinstance(step, Restart):
            self.model = self._model()

    async def _emit(self, events: list[dict]) -> None:
        for event in events:
            await self.emit(event)

    async def feed(self, samples: np.ndarray) -> None:
        self.pending.append(samples)
        self.pending_samples += len(samples)
        if self.session.settings.vad is None:
            if self.pending_samples > MAX_BUFFER_S * SAMPLE_RATE:
                self.pending, self.pending_samples, self.gathered = [], 0, 0
                raise RealtimeError(
                    f"the input buffer holds more than {MAX_BUFFER_S:g} s: commit sooner", "buffer_too_large"
                )
            if len(self.pending) - self.gathered >= GATHERED:  # a million tiny appends: arrays, not samples
                self.pending[self.gathered :] = [np.concatenate(self.pending[self.gathered :])]
                self.gathered = len(self.pending)
            return
        position = self.session.heard_samples
        if not self.arrivals or position - self.arrivals[-1][0] >= ARRIVAL_STEP:
            self.arrivals.append((position, time.monotonic()))
        while self.pending_samples >= CHUNK:
            audio = np.concatenate(self.pending)
            self.pending, self.pending_samples = [audio[CHUNK:]], len(audio) - CHUNK
            await self._chunk(audio[:CHUNK], end=False)

    async def commit(self, item: str) -> None:
        audio = np.concatenate(self.pending) if self.pending else np.zeros(0, np.float32)
        self.pending, self.pending_samples, self.gathered = [], 0, 0
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
        self.started, self.stream, self.offset = False, self.stream + 1, self.session.heard_samples
        text = " ".join(s.text for s in chunk.segments)
        end = chunk.closed[-1][0][1] + self.offset if chunk.closed else None
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
            await self._emit(heard + closed)
            await self._interpret(closed[-1]["item_id"], segments)
        if chunk.open_start is not None:
            await self._emit(self.session.turn_heard(chunk.open_start + self.offset))
            if chunk.partial is not None:
                await self._emit(self.session.partial(chunk.partial))
        self._forget_arrivals(chunk.open_start)

    async def _interpret(self, item: str, segments: list[Segment]) -> None:
        """An interpreter turn, its transcript sent: queued to be translated and spoken while the session
        goes on listening. Where ANSWERS_WAITING turns already wait, the session waits (and, holding the
        client's messages, stops reading it) until the oldest is answered."""
        arrived = self.arrived.pop(item, None)
        if self.answering is None:
            return
        put = asyncio.ensure_future(self.to_answer.put(Answer(item, segments, arrived)))
        try:
            await asyncio.wait((put, self.answering), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the session may end meanwhile: a put left pending was logged as a task destroyed
            if not put.done():
                put.cancel()
        if self.answering.done():
            self.answering.result()  # what ended it ends the session too

    async def _answer(self) -> None:
        """Each queued turn's segments translated and spoken, at the session's output rate, in order."""
        assert self.interpreter is not None
        pipeline, plan = self.interpreter.pipeline, self.interpreter.plan
        while True:
            answer = await self.to_answer.get()
            arrived = answer.arrived
            for segment in answer.segments:
                try:
                    done = await pipeline.interpret(segment, plan)
                except ApiError as exc:
                    await self.emit(self.session.error(exc))
                    continue
                if done is None:
                    continue
                resampler = StreamResampler(done.sample_rate, self.session.settings.output_rate)
                samples = done.audio.astype(np.float32) / 32768.0
                pcm = to_pcm16(np.concatenate([resampler.feed(samples), resampler.flush()]))
                step = self.session.settings.output_rate * 2 // 10  # 100 ms a delta
                pieces = [pcm[i : i + step] for i in range(0, len(pcm), step)]
                for event in self.session.response(answer.item, done.text, pieces, done.target, " > ".join(done.route)):
                    await self.emit(event)
                    if event["type"] == "response.output_audio.delta" and arrived is not None:
                        self.first_audio(time.monotonic() - arrived)
                        arrived = None

    async def stop_answering(self) -> None:
        """The session ends: the turns not yet answered are dropped, the one under way cancelled."""
        if self.answering is not None:
            self.answering.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self.answering

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
        call = SequenceCall(self.key, start=not self.started, end=end, client=self.client, address=self.address)
        vad = self.session.settings.vad
        # the open turn's text so far is decoded behind the stream, as often as the model's cadence
        chunk = await self.model.live_chunk(
            samples, call, not end, self.options(), RequestTimes(), vad, partial_waits=False
        )
        self.started = not end
        return chunk

    def close(self) -> None:
        """End the live stream without decoding what it holds (the client left, or cleared)."""
        if self.started:
            self.model.sequences.end(self.key)
            self.started, self.stream = False, self.stream + 1


def _json(event: dict) -> str:
    return json.dumps(event, separators=(",", ":"))
