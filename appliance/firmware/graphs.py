"""Graph edits the firmware build makes for a kind, before the graph is hashed and signed."""

from __future__ import annotations

from pathlib import Path

from appliance.errors import ApplianceError

DURATIONS = "durations"


def expose_durations(path: Path, where: str) -> None:
    """A Piper (VITS) voice with each phoneme's length in frames as the output `durations`: the output
    of the graph's one Ceil node, the rounded durations (the tensor Piper's own alignment patch marks).
    A batch's audio is padded to its longest shard; the durations say where each shard's audio ends."""
    import onnx  # the build's: the daemon imports this module for the name alone

    model = onnx.load(str(path))
    if any(o.name == DURATIONS for o in model.graph.output):
        return
    ceils = [n for n in model.graph.node if n.op_type == "Ceil"]
    if len(ceils) != 1:
        raise ApplianceError(f"{where}: {path.name} is not a Piper voice graph ({len(ceils)} Ceil nodes, not 1)")
    model.graph.node.append(onnx.helper.make_node("Identity", [ceils[0].output[0]], [DURATIONS], name=DURATIONS))
    model.graph.output.append(onnx.helper.make_tensor_value_info(DURATIONS, onnx.TensorProto.FLOAT, None))
    onnx.save(model, str(path))
