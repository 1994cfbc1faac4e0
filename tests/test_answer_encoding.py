"""What an infer answer's encoding is weighed at, for the event loop: past OFF_LOOP_BYTES it is encoded
on a thread. Language ID's answer of 65,536 texts was 768 KiB of arrays, under the bound by their
bytes, and its encoding held the loop for 50 ms (the loop bench's health check, 49 to 78 ms)."""

from __future__ import annotations

import json

import numpy as np

from appliance.protocol.tensors import InferRequest, decode_infer, encoding_size
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
