"""Each model kind's own `parameters` in a firmware spec and manifest: their types, defaults, choices and
bounds (firmware/manifest.py reads them strictly)."""

from __future__ import annotations

from dataclasses import dataclass

Parameter = str | int | float | bool | list[str]


@dataclass(frozen=True, slots=True)
class ParameterSchema:
    """One setting of a kind's `parameters` table: its type, and its default where it may be left out."""

    kind: type | tuple[type, ...]
    default: Parameter | None = None  # None: required
    choices: tuple[str, ...] = ()  # a string's allowed values, where limited
    bounds: tuple[int, int] | None = None  # an integer's least and greatest values, where limited


# The model kinds a firmware may declare, and each kind's own `parameters`: the build refuses an unknown
# kind, an unknown key or a wrong type. The runtime's kinds (appliance/kinds/__init__.py KINDS) are the same
# names; a test checks the two agree.
KIND_PARAMETERS: dict[str, dict[str, ParameterSchema]] = {
    "vad": {},
    "onnx": {},
    # a Piper voice: its ONNX graph and its .onnx.json, files of the model's directory; shards of at
    # most max_tokens_per_shard phoneme ids, up to max_batch of them in one engine call
    "speech_synthesis": {
        "voice": ParameterSchema(str),
        "graph": ParameterSchema(str),
        "config": ParameterSchema(str),
        "max_tokens_per_shard": ParameterSchema(int, 400, bounds=(8, 4096)),
        "split_algorithm": ParameterSchema(str, "semantic", choices=("semantic", "fixed")),
        "max_batch": ParameterSchema(int, 16, bounds=(1, 256)),
    },
    # Kokoro-82M: one graph, many voices (style tables voices/NAME.bin, firmware/voices.py); shards of at most
    # max_tokens_per_shard phoneme tokens (Kokoro takes 510), up to max_batch of them side by side
    "kokoro_speech": {
        "graph": ParameterSchema(str),
        "vocab": ParameterSchema(str),
        "voices": ParameterSchema(list),
        "max_tokens_per_shard": ParameterSchema(int, 510, bounds=(8, 510)),
        "split_algorithm": ParameterSchema(str, "semantic", choices=("semantic", "fixed")),
        "max_batch": ParameterSchema(int, 8, bounds=(1, 256)),
    },
    # text in, its language out: a fastText model (the model's file); `languages` limits the answers to
    # those (empty: every language the model knows)
    "language_identification": {
        "languages": ParameterSchema(list, []),
    },
    # a Bergamot (Marian) model for one language pair: its files in the model's directory; shards of at
    # most max_tokens_per_shard SentencePiece pieces, up to max_batch of them in one engine call
    "text_translation": {
        "max_tokens_per_shard": ParameterSchema(int, 256, bounds=(8, 1024)),
        "split_algorithm": ParameterSchema(str, "semantic", choices=("semantic", "fixed")),
        "max_batch": ParameterSchema(int, 64, bounds=(1, 256)),
        "source": ParameterSchema(str),
        "target": ParameterSchema(str),
        "model": ParameterSchema(str),
        "source_vocab": ParameterSchema(str),
        "target_vocab": ParameterSchema(str),
        "shortlist": ParameterSchema(str, ""),
    },
    # Whisper (a CTranslate2 model directory) behind a VAD model listed before it. A shard token is one
    # encoder position, 20 ms: 1500 fill Whisper's 30 s window; 1400 leave its last 2 s silent, where
    # Whisper would leave speech for a next window.
    "speech_to_text": {
        "vad": ParameterSchema(str),
        "max_tokens_per_shard": ParameterSchema(int, 1400, bounds=(50, 1500)),
        "split_algorithm": ParameterSchema(str, "semantic", choices=("semantic", "fixed")),
        "max_batch": ParameterSchema(int, 8, bounds=(1, 256)),
        "beam_size": ParameterSchema(int, 5, bounds=(1, 16)),
        # an English-only model: the multilingual one that identifies each segment's language where a
        # request names none, and decodes the segments not in English ("": none, English is assumed)
        "languages_by": ParameterSchema(str, ""),
    },
    # microWakeWord's streaming models (their .json and .tflite in the model's directory), heard for
    # Wyoming's detect: at most max_streams streams at once, each of at most max_stream_s seconds, up to
    # max_batch streams' audio in one engine call
    "wake_word": {
        "models": ParameterSchema(list),
        "max_streams": ParameterSchema(int, 64, bounds=(1, 4096)),
        "max_stream_s": ParameterSchema(int, 3600, bounds=(1, 86400)),
        "max_batch": ParameterSchema(int, 64, bounds=(1, 4096)),
    },
    # Resemblyzer's GE2E encoder, converted to ONNX at build (firmware_build/ge2e.py): windows of
    # window_frames mel frames (10 ms each; 160 = the 1.6 s it was trained on) every step_frames along the
    # speech its VAD finds; up to max_batch windows of all waiting requests in one engine call
    "speaker_embedding": {
        "vad": ParameterSchema(str),  # a VAD model listed before it: where a diarization's speech is
        "window_frames": ParameterSchema(int, 160, bounds=(50, 400)),
        "step_frames": ParameterSchema(int, 40, bounds=(10, 400)),
        "max_batch": ParameterSchema(int, 32, bounds=(1, 256)),
    },
    # speech in, translated speech out, from models listed before it: a speech_to_text model, the
    # voices (the first of a language speaks it) and the text_translation pairs to use
    "speech_pipeline": {
        "speech_to_text": ParameterSchema(str),
        "voices": ParameterSchema(list),
        "translations": ParameterSchema(list, []),
    },
}
