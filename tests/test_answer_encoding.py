"""What an infer answer's encoding is weighed at, for the event loop: past OFF_LOOP_BYTES it is encoded
on a thread. Language ID's answer of 65,536 texts was 768 KiB of arrays, under the bound by their
bytes, and its encoding held the loop for 50 ms (the loop bench's health check, 49 to 78 ms). On the
thread it is written JSON_SLICE values a call: one json.dumps holds the GIL to its end, so the loop's
thread waited out a whole answer's (65,536 FP32s as JSON: 30 ms)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from appliance.protocol import json_text
from appliance.protocol.json_text import JSON_SLICE
from appliance.protocol.tensors import InferRequest, decode_infer, encode_infer, encoding_size
from appliance.tasks import OFF_LOOP_BYTES

TEXTS = 65_536  # the most one language ID infer takes


def request(binary_outputs: tuple[str, ...] = ()) -> InferRequest:
    outputs = [{"name": name, "parameters": {"binary_data": True}} for name in binary_outputs]
    body = {"inputs": [{"name": "text", "datatype": "BYTES", "shape": [1], "data": ["a"]}], "outputs": outputs}
    return decode_infer(json.dumps(body).encode(), None)


def test_many_texts_or_json_numbers_weigh_past_the_bound_and_a_small_answer_does_not() -> None:
    languages = np.full(TEXTS, b"en", object)
    confidence = np.zeros(TEXTS, np.float32)
    assert languages.nbytes + confidence.nbytes < OFF_LOOP_BYTES  # what the bytes alone said
    assert encoding_size(request(), {"language": languages, "confidence": confidence}) > OFF_LOOP_BYTES
    assert encoding_size(request(("language", "confidence")), {"language": languages}) > OFF_LOOP_BYTES
    assert encoding_size(request(), {"confidence": confidence}) > OFF_LOOP_BYTES  # as JSON numbers
    assert encoding_size(request(("confidence",)), {"confidence": confidence}) == confidence.nbytes  # copied whole
    assert encoding_size(request(), {"speech_prob": np.zeros(16, np.float32)}) < OFF_LOOP_BYTES  # a VAD answer


def test_a_long_json_answer_is_written_a_slice_a_call_and_reads_as_written_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rng = np.random.default_rng(0)
    outputs = {
        "language": np.array([f"l\u00e9{i}".encode() for i in range(TEXTS)], object),
        "confidence": rng.random(TEXTS).astype(np.float32),
        "counts": rng.integers(0, 9, (JSON_SLICE + 1, 2)),
        "none": np.zeros(0, np.float32),
    }
    asked = request()
    asked.id = 'one "quoted" id'
    types = {"language": "BYTES", "confidence": "FP32", "counts": "INT64", "none": "FP32"}
    whole = {  # as KServe writes it, all in one json.dumps
        "model_name": "languages", "model_version": "1",
        "outputs": [
            {"name": name, "datatype": types[name], "shape": list(array.shape),
             "data": [v.decode() for v in array] if array.dtype == object else array.reshape(-1).tolist()}
            for name, array in outputs.items()
        ],
        "id": asked.id, "parameters": {"sequence_id": 7},
    }  # fmt: skip
    lengths: list[int] = []
    dumps = json.dumps

    def counted(value: object, **kwargs: object) -> str:
        lengths.append(len(value) if isinstance(value, list) else 1)
        return dumps(value, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(json_text.json, "dumps", counted)
    body, header_length = encode_infer("languages", "1", asked, outputs, {"sequence_id": 7})
    monkeypatch.undo()
    assert header_length is None
    assert body == json.dumps(whole, separators=(",", ":")).encode()
    assert max(lengths) == JSON_SLICE  # never a whole answer's values in one call
    assert len(lengths) > 2 * TEXTS // JSON_SLICE


def test_an_hours_verbose_json_is_written_a_slice_a_call_as_written_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """An hour of speech with its words (900 segments, 14,400 words): no call writes more than about
    JSON_SLICE values (a word's dict is its keys and values), and the text is json.dumps's."""
    words = [{"word": f" w{i}", "start": i * 0.25, "end": i * 0.25 + 0.2, "probability": 0.9} for i in range(14_400)]
    rows = [{"id": i, "start": i * 4.0, "text": " a b", "tokens": list(range(30))} for i in range(900)]
    doc = {
        "task": "transcribe",
        "duration": 3600.0,
        "words": words,
        "segments": rows,
        "empty": [],
        "nested": {"a": [1]},
    }
    values: list[int] = []
    dumps = json.dumps

    def counted(value: object, **kwargs: object) -> str:
        if isinstance(value, list) and value and isinstance(value[0], dict):
            values.append(len(value) * 2 * len(value[0]))
        return dumps(value, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(json_text.json, "dumps", counted)
    text = json_text.dumps(doc)
    monkeypatch.undo()
    assert text == json.dumps(doc, separators=(",", ":"))
    assert values and max(values) <= JSON_SLICE, max(values)  # never the 14,400 words in one call
    assert json_text.dumps([[], [], {}]) == "[[],[],{}]"  # empty items (LibreTranslate's alternatives)
