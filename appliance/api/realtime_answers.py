"""An interpreter session's answers: each user item queued to be answered (a turn the VAD closed, or the
client's `response.create`) is translated and spoken, in order, in a task of its own while the session
goes on listening, one Realtime response per segment. The voice goes out as the engine makes it, 100 ms
a delta in the session's output format; `response.cancel` or barge-in (speech heard, where
`interrupt_response` is on) stops the response being made: no delta after its `response.done`
(status cancelled), and the sentences of its voice not yet made are never made.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance import g711
from appliance.api.realtime_conversation import Item, Response
from appliance.api.realtime_session import TranscriptionSession
from appliance.api.realtime_settings import PCM, RealtimeError
from appliance.audio import StreamResampler, to_pcm16
from appliance.errors import ApiError
from appliance.kinds.capabilities import Interpreting
from appliance.kinds.speech_api import Segment

# an interpreter session's turns transcribed and waiting to be spoken before it stops taking audio
ANSWERS_WAITING = 4


@dataclass(frozen=True, slots=True)
class Answer:
    """A user item waiting to be answered: its segments, and when the audio that ended it arrived (its
    answer's first audio is timed from then)."""

    item: str
    segments: list[Segment]
    arrived: float | None


@dataclass(frozen=True, slots=True)
class Interpreter:
    """An interpreter session's pipeline and plan (target language, the voice)."""

    pipeline: Interpreting
    plan: Any  # the pipeline's Plan: options, target, voice


@dataclass(slots=True)
class Speaking:
    """The response being made, and why it was stopped, once it is."""

    response: Response
    task: asyncio.Task[None]
    arrived: float | None  # when its turn's end arrived: its first delta is timed from then
    stopped: str | None = None  # client_cancelled or turn_detected
    sending: bool = False  # an event of it is being sent: it stops after that send, not inside it


class Answers:
    def __init__(
        self,
        interpreter: Interpreter,
        session: TranscriptionSession,
        emit: Callable[[dict], Awaitable[None]],
        first_audio: Callable[[float], None],  # an answer's first audio, seconds after its turn ended
    ) -> None:
        self.interpreter, self.session, self.emit, self.first_audio = interpreter, session, emit, first_audio
        self.queue: asyncio.Queue[Answer] = asyncio.Queue(ANSWERS_WAITING)
        self.speaking: Speaking | None = None
        self.task = asyncio.get_running_loop().create_task(self._run())

    @property
    def busy(self) -> bool:
        """An answer is being spoken, or waits to be."""
        return self.speaking is not None or not self.queue.empty()

    async def put(self, answer: Answer) -> None:
        """Queue an answer. Where ANSWERS_WAITING already wait, wait (and, holding the client's
        messages, stop reading it) until the oldest is answered."""
        item = self.session.conversation.items.get(answer.item)
        if item is not None:
            item.answered = True
        put = asyncio.ensure_future(self.queue.put(answer))
        try:
            await asyncio.wait((put, self.task), return_when=asyncio.FIRST_COMPLETED)
        finally:  # the session may end meanwhile: a put left pending was logged as a task destroyed
            if not put.done():
                put.cancel()
        if self.task.done():
            self.task.result()  # what ended it ends the session too

    def cancel(self, reason: str, response_id: str | None = None) -> None:
        """Stop the response being made: client_cancelled (an error where there is none, or it is not
        `response_id`) or turn_detected (barge-in: nothing to do where none is being made)."""
        speaking = self.speaking
        if speaking is None or speaking.stopped or response_id not in (None, speaking.response.id):
            if reason == "turn_detected":
                return
            raise RealtimeError("no response in progress to cancel", "response_cancel_not_active", "response_id")
        speaking.stopped = reason
        if not speaking.sending:
            speaking.task.cancel()  # its engine work too: the voice's generator is closed

    async def stop(self) -> None:
        """The session ends: the answers not yet made are dropped, the one under way cancelled."""
        self.task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self.task

    async def _run(self) -> None:
        while True:
            answer = await self.queue.get()
            for segment in answer.segments:
                if answer.item not in self.session.conversation.items or not segment.text.strip():
                    continue  # deleted while it waited, or nothing to say
                if not await self._respond(answer, segment):
                    break  # cancelled: the turn's other segments are not spoken either
                answer = Answer(answer.item, answer.segments, None)

    async def _respond(self, answer: Answer, segment: Segment) -> bool:
        """One segment's response; False where it was cancelled."""
        pipeline, plan = self.interpreter.pipeline, self.interpreter.plan
        target, route = pipeline.heading(segment, plan)
        item = Item(self.session.new_id("item"), "assistant", [])
        self.session.conversation.keep(item)
        metadata = {"input_item_id": answer.item, "language": target, "route": " > ".join(route)}
        response = Response(self.session.event, self.session.new_id("resp"), item, metadata)
        task = asyncio.get_running_loop().create_task(self._speak(response, segment))
        self.speaking = speaking = Speaking(response, task, answer.arrived)
        try:
            await asyncio.wait((task,))
        except asyncio.CancelledError:
            task.cancel()
            raise
        finally:
            self.speaking = None
        if speaking.stopped is None:
            task.result()  # a failure ends the session
            return True
        await self.emit_all(response.finished("cancelled", speaking.stopped))
        return False

    async def _speak(self, response: Response, segment: Segment) -> None:
        await self._send(response.started())
        try:
            answered = await self.interpreter.pipeline.answer(segment, self.interpreter.plan)
        except ApiError as exc:
            await self._send([self.session.error(exc), *response.finished("failed")])
            return
        assert answered is not None  # the segment has text
        done, voice = answered
        await self._send(response.text(done.text))
        rate = self.session.settings.output_rate
        resampler, held, step = StreamResampler(done.sample_rate, rate), np.zeros(0, np.float32), rate // 10
        async with contextlib.aclosing(voice):  # closed early, the sentences not yet made are not made
            async for piece in voice:
                held = np.concatenate([held, resampler.feed(piece.astype(np.float32) / 32768.0)])
                whole = len(held) - len(held) % step  # 100 ms a delta
                if not await self._audio(response, held[:whole], step):
                    return await self._send(response.done())  # truncated: nothing past the cut
                held = held[whole:]
            await self._audio(response, np.concatenate([held, resampler.flush()]), step)
        await self._send(response.done())

    async def _audio(self, response: Response, samples: np.ndarray, step: int) -> bool:
        """Deltas of `step` samples; False where the client truncated the answer before their end."""
        rate, codec, item = self.session.settings.output_rate, self.session.settings.output_codec, response.item
        for at in range(0, len(samples), step):
            if item.cut_ms is not None and item.audio_ms >= item.cut_ms:
                return False
            piece = samples[at : at + step]
            await self._send([response.audio(_encode(piece, codec), len(piece) * 1000 // rate)])
            if self.speaking is not None and self.speaking.arrived is not None:
                self.first_audio(time.monotonic() - self.speaking.arrived)
                self.speaking.arrived = None
        return True

    async def _send(self, events: list[dict]) -> None:
        """A response's events, unless it was stopped; the task is cancelled between sends, never in one."""
        speaking = self.speaking
        for event in events:
            if speaking is not None and speaking.stopped:
                raise asyncio.CancelledError
            if speaking is not None:
                speaking.sending = True
            try:
                await self.emit(event)
            finally:
                if speaking is not None:
                    speaking.sending = False

    async def emit_all(self, events: list[dict]) -> None:
        for event in events:
            await self.emit(event)


def _encode(samples: np.ndarray, codec: str) -> bytes:
    return to_pcm16(samples) if codec == PCM else g711.encode(samples, codec)
