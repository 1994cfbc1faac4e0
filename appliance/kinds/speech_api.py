"""The speech_to_text kind's codec: KServe tensors (audio in, text out as BYTES), the `transcribe`
route's query and its answers (OpenAI's response formats, NDJSON lines), as plain values. No model
here: kinds/speech_to_text.py routes, runs and keeps the live streams.

KServe infer: input `audio` is FP32 or INT16 samples at 16 kHz, or BYTES holding one encoded file
(WAV, FLAC, Ogg); parameters `language`, `task` (transcribe | translate), `prompt`, `temperature`.
Outputs: `text` (BYTES, one element per segment), `start` and `end` (FP32 seconds). Under Triton's
sequence parameters each 256 ms chunk answers the segments the VAD closed since the previous chunk
(final text), and with parameter `partial` true also `partial` (BYTES [1]): the open segment so far.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import numpy as np

from appliance.config import Live
from appliance.errors import BadRequest
from appliance.firmware import Baked, ModelSpec, TensorSpec
from appliance.kinds import subtitles
from appliance.kinds.audio_in import AUDIO_INPUT
from appliance.kinds.streaming import query_flag
from appliance.kinds.text import ends_sentence
from appliance.kinds.triton_config import model_config
from appliance.protocol.messages import Response, json_response

SAMPLE_RATE = 16000  # what Whisper hears (engine/whisper.py's SAMPLE_RATE is this one)
FORMATS = ("json", "text", "verbose_json", "srt", "vtt")  # OpenAI's response formats
CAPITALIZED_NOUNS = ("de", "lb")  # languages whose nouns begin with a capital anywhere in a sentence
PRONOUN_I = ("I", "I'm", "I'll", "I've", "I'd")
SUBTITLES = ("srt", "vtt")  # cut at the words' times: these formats ask for them
MIN_SAMPLES = 512  # one VAD frame, 32 ms: anything shorter holds no speech to find
OUTPUTS = ("text", "start", "end")
TRANSCRIBE_QUERY = ("language", "task", "prompt")  # besides stream and response_format
PARAMETERS: dict[str, type | tuple[type, ...]] = {
    "language": str,
    "task": str,
    "prompt": str,
    "temperature": (int, float),
    "partial": bool,
}


# a prompt's characters: Whisper reads its last 223 tokens (some 1,000 characters of English), and
# tokenizing 900 KB took 4 s
MAX_PROMPT_CHARS = 8192


def check_prompt(prompt: str) -> None:
    if len(prompt) > MAX_PROMPT_CHARS:
        raise BadRequest(f"prompt holds {len(prompt)} characters; the most one takes is {MAX_PROMPT_CHARS}")


@dataclass(frozen=True, slots=True)
class Options:
    """How a request wants its audio decoded."""

    language: str | None = None
    task: str = "transcribe"
    prompt: str = ""
    temperature: float = 0.0
    words: bool = False  # word timestamps too
    # where set, no language named: speech in these languages is transcribed, in any other translated
    # to English, each segment by the language identified in it (a speech pipeline's routes)
    transcribed: tuple[str, ...] = ()
    # conversation mode's two languages: a segment too short for Whisper to tell its language is taken
    # to be in the other one than the speech before it (kinds/speech_languages.py turn_taking)
    conversation: tuple[str, ...] = ()
    after: str = ""  # the language of the speech before this audio, where known (a live session's last turn)
    padding: int = 0  # the VAD's padding on each side of a segment, samples: its speech is the rest at least


@dataclass(frozen=True, slots=True)
class Word:
    start: float  # seconds in the recording
    end: float
    word: str
    probability: float


@dataclass(frozen=True, slots=True)
class Segment:
    start: float  # seconds in the recording
    end: float
    text: str
    language: str
    words: tuple[Word, ...] = ()  # where the request asked for them
    language_probability: float = 1.0  # Whisper's, where it detected the language
    # openai-whisper's, of the decode it came from (engine/whisper_tokens.py Quality), and its text's ids
    tokens: tuple[int, ...] = ()
    temperature: float = 0.0
    avg_logprob: float = 0.0
    compression_ratio: float = 0.0
    no_speech_prob: float = 0.0
    speaker: str = ""  # who said it, where the request asked (kinds/diarized.py)


@dataclass(frozen=True, slots=True)
class LiveChunk:
    """What one chunk of a live stream produced (SpeechToText.live_chunk)."""

    closed: list[tuple[tuple[int, int], list[Segment]]]  # each span the VAD closed (stream samples), decoded
    open_start: int | None  # where the speech being heard began, if a span is open
    partial: str | None  # its text so far, where asked for
    serial: int | None  # the stream's serial, when this chunk opened it

    @property
    def segments(self) -> list[Segment]:
        return [s for _, found in self.closed for s in found]


def metadata(spec: ModelSpec, engine_name: str, multilingual: bool) -> dict[str, Any]:
    return {
        "platform": "ctranslate2",
        "inputs": [
            {
                "name": AUDIO_INPUT,
                "datatype": "FP32",
                "shape": [-1],
                "parameters": {"accepts": ["FP32", "INT16", "BYTES"], "sample_rate": SAMPLE_RATE},
            }
        ],
        "outputs": [
            {"name": "text", "datatype": "BYTES", "shape": [-1]},
            {"name": "start", "datatype": "FP32", "shape": [-1]},
            {"name": "end", "datatype": "FP32", "shape": [-1]},
            {"name": "partial", "datatype": "BYTES", "shape": [1]},
        ],
        "parameters": {
            "kind": spec.kind,
            "engine": engine_name,
            "sample_rate": SAMPLE_RATE,
            "multilingual": multilingual,
            "tasks": ["transcribe", "translate"] if multilingual else ["transcribe"],
            "stateful": True,
            "parameters": dict(spec.parameters),
        },
    }


def config(spec: ModelSpec, baked: Baked, live: Live) -> dict[str, Any]:
    """Triton's model config: shards of all requests batched up to max_batch, live streams as sequences."""
    return model_config(
        spec,
        baked,
        live,
        platform="ctranslate2",
        backend="ctranslate2",
        max_batch_size=0,  # a request is a recording, not a row: the shards inside are what batch
        inputs=[TensorSpec(AUDIO_INPUT, "FP32", (-1,))],
        outputs=[
            TensorSpec("text", "BYTES", (-1,)),
            TensorSpec("start", "FP32", (-1,)),
            TensorSpec("end", "FP32", (-1,)),
        ],
        dynamic_batching=True,
        stateful=True,  # live streams: the box keeps their VAD state and the audio not yet decoded
    )


def options(parameters: dict[str, Any]) -> Options:
    """A request's decoding options from KServe parameters or an OpenAI form (same names)."""
    for name, value in parameters.items():
        kind = PARAMETERS.get(name)
        if kind is not None and (not isinstance(value, kind) or isinstance(value, bool) and kind is not bool):
            raise BadRequest(f"parameters.{name} has the wrong type: {type(value).__name__}")
    language = parameters.get("language") or None
    return Options(
        language=language.lower() if language else None,
        task=parameters.get("task", "transcribe"),
        prompt=parameters.get("prompt", ""),
        temperature=float(parameters.get("temperature", 0.0)),
    )


def long_enough(samples: np.ndarray) -> np.ndarray:
    if len(samples) < MIN_SAMPLES:
        raise BadRequest(
            f"audio too short: {len(samples)} samples at 16 kHz; at least {MIN_SAMPLES} ({MIN_SAMPLES // 16} ms)"
        )
    return samples


def tensors(segments: list[Segment]) -> dict[str, np.ndarray]:
    return {
        "text": np.array([s.text.encode() for s in segments], dtype=object),
        "start": np.array([s.start for s in segments], np.float32),
        "end": np.array([s.end for s in segments], np.float32),
    }


def transcribe_query(query: dict[str, str]) -> tuple[bool, str, Options]:
    """The transcribe route's query: `stream`, `response_format` (verbose_json by default), the options
    (`words`: word timestamps, also taken for subtitles, which are cut at them)."""
    stream = query_flag(query, "stream")
    words = query_flag(query, "words")
    response_format = query.pop("response_format", "verbose_json")
    if response_format not in FORMATS:
        raise BadRequest(f"response_format must be one of {', '.join(FORMATS)}, got {response_format[:40]!r}")
    unknown = sorted(set(query) - set(TRANSCRIBE_QUERY))
    if unknown:
        raise BadRequest(
            f"unknown query parameter {unknown[0][:40]!r} (known: stream, {', '.join(TRANSCRIBE_QUERY)}, "
            "response_format, words)"
        )
    return (
        stream,
        response_format,
        dataclasses.replace(options(dict(query)), words=words or response_format in SUBTITLES),
    )


def segment_json(s: Segment) -> dict[str, Any]:
    """A streamed segment: one NDJSON line (with its words where they were asked for)."""
    line: dict[str, Any] = {"start": s.start, "end": s.end, "text": s.text, "language": s.language}
    if s.words:
        line["words"] = [word_json(w) for w in s.words]
    return line


def continued(previous: Segment | None, segment: Segment) -> Segment:
    """`segment` as it reads after `previous`. Whisper begins each of its segments with a capital, a
    sentence's continuation too ("...the lights in the kitchen" "Please we are going..."): after a segment
    of the same language that ends no sentence, a capitalized first word is lowercased ("I" and acronyms
    kept, and every word in languages that capitalize nouns)."""
    if previous is None or previous.language != segment.language or segment.language in CAPITALIZED_NOUNS:
        return segment
    if ends_sentence(previous.text):
        return segment
    first, _, rest = segment.text.partition(" ")
    bare = first.rstrip(",;:.!?")
    if not (bare[:1].isupper() and bare[1:] == bare[1:].lower()) or bare in PRONOUN_I:
        return segment
    return dataclasses.replace(segment, text=" ".join(filter(None, (first[0].lower() + first[1:], rest))))


def merged(segments: list[Segment]) -> list[Segment]:
    """Segments as one (a live turn: one span the VAD closed), its text read on from one to the next."""
    if len(segments) < 2:
        return segments
    read: list[Segment] = []
    for segment in segments:
        read.append(continued(read[-1] if read else None, segment))
    first = read[0]
    return [
        dataclasses.replace(
            first,
            end=read[-1].end,
            text=" ".join(s.text for s in read),
            words=tuple(w for s in read for w in s.words),
            tokens=tuple(t for s in read for t in s.tokens),
        )
    ]


def word_json(word: Word) -> dict[str, Any]:
    return {"word": word.word.strip(), "start": word.start, "end": word.end, "probability": word.probability}


def render(
    segments: list[Segment], response_format: str, task: str, duration: float, shown: tuple[str, ...] = ("segment",)
) -> Response:
    """The answer in OpenAI's response_format; verbose_json holds the `shown` granularities (segment, word)."""
    doc = as_json(segments)
    if response_format == "json":
        return json_response(200, {"text": doc["text"]})
    if response_format == "text":
        return Response(200, (doc["text"] + "\n").encode(), content_type="text/plain; charset=utf-8")
    if response_format == "verbose_json":
        rows = [
            {
                "id": i,
                "seek": round(s.start * 100),  # where it begins in Whisper's 10 ms mel frames (openai-whisper's unit)
                "start": s.start,
                "end": s.end,
                "text": s.text,
                "tokens": list(s.tokens),
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            | ({"speaker": s.speaker} if s.speaker else {})
            for i, s in enumerate(segments)
        ]
        verbose: dict[str, Any] = {
            "task": task,
            # whisper-1's names ("english"); a translation's is its text's, English
            "language": "english" if task == "translate" else LANGUAGE_NAMES.get(doc["language"], doc["language"]),
            "duration": round(duration, 3),
            "text": doc["text"],
        }
        if "word" in shown:
            verbose["words"] = [word_json(w) for s in segments for w in s.words]
        if "segment" in shown:
            verbose["segments"] = rows
        return json_response(200, verbose)
    return Response(200, subtitles.render(segments, response_format).encode(), content_type="text/plain; charset=utf-8")


# Whisper's languages by the names its verbose_json gives them (OpenAI's whisper-1 says "english" where
# the box's own answers say "en")
LANGUAGE_NAMES = dict(
    pair.replace("_", " ").split(":")
    for pair in (
        "en:english zh:chinese de:german es:spanish ru:russian ko:korean fr:french ja:japanese pt:portuguese "
        "tr:turkish pl:polish ca:catalan nl:dutch ar:arabic sv:swedish it:italian id:indonesian hi:hindi "
        "fi:finnish vi:vietnamese he:hebrew uk:ukrainian el:greek ms:malay cs:czech ro:romanian da:danish "
        "hu:hungarian ta:tamil no:norwegian th:thai ur:urdu hr:croatian bg:bulgarian lt:lithuanian la:latin "
        "mi:maori ml:malayalam cy:welsh sk:slovak te:telugu fa:persian lv:latvian bn:bengali sr:serbian "
        "az:azerbaijani sl:slovenian kn:kannada et:estonian mk:macedonian br:breton eu:basque is:icelandic "
        "hy:armenian ne:nepali mn:mongolian bs:bosnian kk:kazakh sq:albanian sw:swahili gl:galician "
        "mr:marathi pa:punjabi si:sinhala km:khmer sn:shona yo:yoruba so:somali af:afrikaans oc:occitan "
        "ka:georgian be:belarusian tg:tajik sd:sindhi gu:gujarati am:amharic yi:yiddish lo:lao uz:uzbek "
        "fo:faroese ht:haitian_creole ps:pashto tk:turkmen nn:nynorsk mt:maltese sa:sanskrit "
        "lb:luxembourgish my:myanmar bo:tibetan tl:tagalog mg:malagasy as:assamese tt:tatar haw:hawaiian "
        "ln:lingala ha:hausa ba:bashkir jw:javanese su:sundanese yue:cantonese"
    ).split()
)


def as_json(segments: list[Segment]) -> dict[str, Any]:
    return {
        "language": segments[0].language if segments else "",
        "text": " ".join(s.text for s in segments),
        "segments": [{"start": s.start, "end": s.end, "text": s.text} for s in segments],
    }
