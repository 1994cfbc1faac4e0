"""KServe v2's infer route as Triton answers it: a request's tensors and Triton's sequence parameters
read and checked, the model run and counted in its statistics, the outputs it asks for encoded."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from appliance.api import fleet_routes
from appliance.engine.stats import RequestTimes
from appliance.errors import BadRequest
from appliance.kinds.base import SequenceCall, ServedModel
from appliance.protocol.messages import Request, Response
from appliance.protocol.tensors import (
    HEADER_LENGTH,
    MAX_NAME_BYTES,
    decode_infer,
    encode_infer,
    encoding_size,
    json_kind,
)
from appliance.tasks import PARSE_OFF_LOOP_BYTES, off_loop, off_loop_past

SEQUENCE_IDS = (-(2**63), 2**64 - 1)  # an integer sequence id is in the int64 or the uint64 range


async def answer(model: ServedModel, request: Request, fleet: fleet_routes.Fleet, version: str) -> Response:
    """POST /v2/models/{name}/infer: its tensors decoded (off the loop when large), its sequence
    parameters read, the model run and counted in its statistics, the outputs asked for encoded."""
    json_length = request.headers.get(HEADER_LENGTH)
    infer = await off_loop_past(PARSE_OFF_LOOP_BYTES, len(request.body), decode_infer, request.body, json_length)
    sequence = sequence_call(infer.parameters)
    if fleet.draining and sequence is not None and sequence.start:
        raise fleet_routes.refusal("new sequences")
    if fleet.holding and sequence is None:
        raise fleet_routes.refusal("new requests")
    if sequence is not None:
        sequence = dataclasses.replace(
            sequence, client=request.client, address=request.address, principal=request.principal
        )
    times, started = RequestTimes(), time.perf_counter_ns()
    try:
        outputs, opened = await model.infer(infer, sequence, times)
    except BaseException:
        model.stats.record_request(False, time.perf_counter_ns() - started, times, time.time_ns() // 1_000_000)
        raise
    model.stats.record_request(True, time.perf_counter_ns() - started, times, time.time_ns() // 1_000_000)
    if infer.requested_outputs:
        unknown = [name for name in infer.requested_outputs if name not in outputs]
        if unknown:
            raise BadRequest(f"model {model.name} has no output {unknown[0]!r} (it has: {', '.join(outputs)})")
        outputs = {name: outputs[name] for name in infer.requested_outputs}
    out_params: dict[str, Any] = {}
    if sequence is not None:
        out_params = {"sequence_id": sequence.id, "sequence_start": sequence.start, "sequence_end": sequence.end}
    size = encoding_size(infer, outputs)
    body, header_length = await off_loop(size, encode_infer, model.name, version, infer, outputs, out_params)
    headers = [] if header_length is None else [("Inference-Header-Content-Length", str(header_length))]
    content_type = "application/json" if header_length is None else "application/octet-stream"
    return Response(200, body, content_type, headers, opened=opened)


def sequence_call(parameters: dict[str, Any]) -> SequenceCall | None:
    """Triton's sequence parameters, or None for a one-off request."""
    sequence_id = parameters.get("sequence_id")
    start, end = parameters.get("sequence_start", False), parameters.get("sequence_end", False)
    for name, flag in (("sequence_start", start), ("sequence_end", end)):
        if not isinstance(flag, bool):
            raise BadRequest(f"parameters.{name} must be true or false, got {json_kind(flag)}")
    accepted = f"an integer from {SEQUENCE_IDS[0]} to {SEQUENCE_IDS[1]} or a string of at most {MAX_NAME_BYTES} bytes"
    if isinstance(sequence_id, int) and not isinstance(sequence_id, bool):
        if not SEQUENCE_IDS[0] <= sequence_id <= SEQUENCE_IDS[1]:
            raise BadRequest(
                f"parameters.sequence_id must be {accepted}, got an integer of {len(str(sequence_id))} digits"
            )
    elif isinstance(sequence_id, str):
        if len(sequence_id.encode()) > MAX_NAME_BYTES:
            raise BadRequest(
                f"parameters.sequence_id must be {accepted}, got a string of {len(sequence_id.encode())} bytes"
            )
    elif sequence_id is not None:
        raise BadRequest(f"parameters.sequence_id must be {accepted}, got {json_kind(sequence_id)}")
    if sequence_id is None or sequence_id == 0:
        if start or end:
            raise BadRequest("sequence_start/sequence_end need a non-zero sequence_id")
        return None
    return SequenceCall(sequence_id, start, end)
