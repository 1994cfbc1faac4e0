"""`appliance call` and `appliance status`: the daemon's API over its Unix socket (or QUIC), printed.

Errors are raised and told once in main(): ServerError exits 1, ConnectError 4, local input 2.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import io
import itertools
import json
import logging
import shutil
import struct
import sys
import textwrap
from collections.abc import Iterator
from typing import Any, BinaryIO

from appliance import exitcodes
from appliance.cli import speech
from appliance.cli.options import EmptyAnswer, command, default_socket, print_json, read_input
from appliance.client import DEFAULT_CONNECT_TIMEOUT_S, DEFAULT_MODEL, Client, parse_quic_address
from appliance.errors import ApiError, ApplianceError

# `appliance call WHAT`: what each does (the choices and the help text come from here).
CALL_ACTIONS = {
    "health": "liveness and readiness (GET /v2/health/live, /v2/health/ready); exits 1 when not ready",
    "server": "server metadata: name, version, extensions and the firmware served (GET /v2)",
    "models": "the models served, with their versions and state (GET /v2/models)",
    "model": "one model's metadata: tensors, baked parameters, signing key id (GET /v2/models/NAME; "
    "NAME defaults to silero_vad)",
    "metrics": "the Prometheus metrics text (GET /metrics)",
    "vad": "speech segments of an audio FILE (WAV, FLAC, Ogg, MP3, M4A, WebM) as JSON (POST /v2/models/MODEL/segments); "
    "with --stream one line per segment as soon as it is final",
    "probs": "the speech probability of every 512-sample frame of an audio FILE (POST /v2/models/MODEL/infer)",
    "speak": "TEXT spoken by a voice of the firmware into -o FILE (POST /v1/audio/speech), written as each "
    "sentence arrives",
    "translate": "TEXT translated --to a language (POST /translate; --from defaults to the one source that has it)",
    "interpret": "an audio FILE through a speech pipeline into -o FILE (WAV), --to a language, else conversation "
    "mode (each turn into the other of --languages A,B, default the pipeline's two); each segment's texts and "
    "route printed as it is spoken (POST /v2/models/MODEL/interpret); nothing spoken exits 1",
    "transcribe": "the text of an audio FILE with segment times (POST /v2/models/MODEL/transcribe); --language, "
    "--translate (to English), --format json|text|verbose_json|srt|vtt, --stream (a line per segment); "
    "--speakers [N] (who said what: a line per turn, POST /v1/audio/transcriptions), --known NAME=CLIP",
    "live": "sends an audio FILE as a live stream in real time, 256 ms chunks (Triton sequence), and prints "
    "each segment's text as soon as it is final",
}
SPEAK_FORMATS = ("wav", "mp3", "opus", "aac", "flac", "pcm")
SOCKET_HELP = "the daemon's Unix socket ($APPLIANCE_SOCKET, else ./run/api.sock if present)"


def cmd_call(args: argparse.Namespace) -> int:
    if args.quic:
        logging.getLogger("quic").addHandler(logging.NullHandler())  # aioquic's own warning; main() tells it once
    for option, path in (("--cafile", args.cafile), ("--cert", args.cert), ("--key", args.key)):
        if path is not None:
            _check_readable(path, option)
    certificate = (args.cert, args.key) if args.cert else None
    timeout = getattr(args, "timeout", DEFAULT_CONNECT_TIMEOUT_S)
    client = (
        Client(quic=args.quic, cafile=args.cafile, certificate=certificate, connect_timeout=timeout)
        if args.quic
        else Client(args.socket, connect_timeout=timeout)
    )
    with client:
        if args.what == "health":
            health = client.health()
            print_json(health)
            return exitcodes.OK if health["ready"] else exitcodes.DAEMON_ERROR
        if args.what == "server":
            print_json(client.server())
        elif args.what == "models":
            print_json(client.models())
        elif args.what == "model":
            print_json(client.model(args.args[0] if args.args else "silero_vad"))
        elif args.what == "metrics":
            print(client.metrics(), end="")
        elif args.what in ("transcribe", "live"):
            if not args.args:
                raise ApplianceError(
                    f"usage: appliance call {args.what} FILE [--model NAME]  (WAV, FLAC, Ogg, MP3, M4A, WebM)"
                )
            if args.what == "live":
                speech.live(client, args, args.args[0])
            else:
                speech.transcribe(client, args, read_input(args.args[0]))
        elif args.what == "vad":
            if not args.args:
                raise ApplianceError(
                    "usage: appliance call vad FILE [--model NAME] [--stream]  (WAV, FLAC, Ogg, MP3, M4A, WebM)"
                )
            audio = read_input(args.args[0])
            if args.stream:
                for line in client.stream_segments(audio, model=args.model or DEFAULT_MODEL):
                    print(json.dumps(line), flush=True)
            else:
                print_json(client.segments(audio, model=args.model or DEFAULT_MODEL))
        elif args.what == "probs":
            if not args.args:
                raise ApplianceError(
                    "usage: appliance call probs FILE [--model NAME]  (WAV, FLAC, Ogg, MP3, M4A, WebM)"
                )
            from appliance.audio import decode_audio  # lazy: libsndfile and soxr load only for `call probs`

            model = args.model or DEFAULT_MODEL
            rate = client.model(model)["parameters"]["sample_rate"]
            try:  # decoded here, as the daemon decodes for segments, and sent as tensors
                samples = decode_audio(read_input(args.args[0]), rate)
            except ApiError as exc:
                raise ApplianceError(f"{args.args[0]}: {exc.message}") from None
            print_json([round(float(p), 4) for p in client.speech_probs(samples, model=model)])
        elif args.what == "speak":
            _speak(client, args)
        elif args.what == "translate":
            _translate(client, args)
        elif args.what == "interpret":
            return _interpret(client, args)
    return 0


def _speak(client: Client, args: argparse.Namespace) -> None:
    if not args.args or not args.output:
        formats = "|".join(SPEAK_FORMATS)
        raise ApplianceError(
            f'usage: appliance call speak "TEXT" -o FILE [--voice NAME] [--format {formats}] [--speed X]'
        )
    audio_format = args.format or "wav"
    if audio_format not in SPEAK_FORMATS:
        raise ApplianceError(f"speak: --format {audio_format} is not an audio format ({', '.join(SPEAK_FORMATS)})")
    voice = args.voice or "alloy"  # an OpenAI name: the box picks its voice of the text's language
    pieces = client.stream_speech(" ".join(args.args), voice, response_format=audio_format, speed=args.speed)
    first = next(pieces, b"")  # the daemon's refusal (a voice it lacks) before any file is made
    with _output(args.output) as out:
        for piece in itertools.chain([first], pieces):
            out.write(piece)
            out.flush()
        if audio_format == "wav" and out.seekable():
            _true_wav_sizes(out)


def _true_wav_sizes(out: BinaryIO) -> None:
    """The sizes of a streamed WAV written to a file, where its header said "unknown": the daemon's
    44-byte header (api/openai_speech.py), so Python's wave and strict readers see the true length."""
    size = out.tell()
    out.seek(4)
    out.write(struct.pack("<I", size - 8))
    out.seek(40)
    out.write(struct.pack("<I", size - 44))


def _interpret(client: Client, args: argparse.Namespace) -> int:
    """Each segment's line as it is spoken (times, the language heard, the texts, the route), the speech
    into -o as one WAV (at the first voice's rate). Nothing spoken is an error, not an empty WAV."""
    if not args.args or not args.output:
        raise ApplianceError(
            "usage: appliance call interpret FILE -o OUT.wav [--to LANG | --languages A,B] [--from LANG] [--model NAME]"
        )
    audio = read_input(args.args[0])
    model = args.model or _first_of_kind(client, "speech_pipeline")
    import numpy as np  # lazy: as for `call probs`
    import soundfile
    import soxr

    pieces: list[np.ndarray] = []
    rate = 0
    notes = []
    texts = sys.stderr if args.output == "-" else sys.stdout  # `-o -`: the audio has stdout
    for line in client.stream_interpret(audio, model, args.to, args.source, args.languages):
        if line.get("done"):
            break
        rate = rate or line["sample_rate"]
        speech = np.frombuffer(base64.b64decode(line["audio"]), "<i2").astype(np.float32) / 32768
        pieces.append(speech if line["sample_rate"] == rate else soxr.resample(speech, line["sample_rate"], rate))
        shown = (
            line["source_text"] if line["text"] == line["source_text"] else f"{line['source_text']} -> {line['text']}"
        )
        heard = f"{line['language']} {line.get('language_probability', 1.0):.2f}"  # Whisper's language, its probability
        notes += [line["note"]] if line.get("note") else []
        note = f"  [{line['note']}]" if line.get("note") else ""
        route = f"  [{line['target']} by {line['route']}]" if line.get("route") else ""
        print(f"[{line['start']:7.2f} {line['end']:7.2f}] ({heard}) {shown}{route}{note}", file=texts, flush=True)
    if not any(len(p) for p in pieces):
        raise EmptyAnswer(
            f"nothing was spoken from {args.args[0]}: " + (notes[0] if notes else "no speech was heard in it")
        )
    wav = io.BytesIO()  # libsndfile seeks back to write the sizes: a pipe cannot be written that way
    soundfile.write(wav, np.concatenate(pieces), rate, subtype="PCM_16", format="WAV")
    with _output(args.output) as out:
        out.write(wav.getvalue())
    return exitcodes.OK


@contextlib.contextmanager
def _output(path: str) -> Iterator[BinaryIO]:
    """-o FILE opened for writing, or standard output for `-o -`; a file that cannot be written is one line."""
    if path == "-":
        yield sys.stdout.buffer
        return
    try:
        with open(path, "wb") as out:
            yield out
    except OSError as exc:
        raise ApplianceError(f"cannot write {path}: {(exc.strerror or str(exc)).lower()}") from None


def _first_of_kind(client: Client, kind: str) -> str:
    name = next((m["name"] for m in client.models()["models"] if m["kind"] == kind), None)
    if name is None:
        raise ApplianceError(f"the daemon serves no {kind} model")
    return name


def _translate(client: Client, args: argparse.Namespace) -> None:
    if not args.args or not args.to:
        raise ApplianceError('usage: appliance call translate --to LANG [--from LANG] "TEXT"')
    source = args.source
    if source is None:
        languages = client.languages()
        sources = [lang["code"] for lang in languages if args.to in lang["targets"]]
        if not sources:
            targets = ", ".join(sorted({target for lang in languages for target in lang["targets"]})) or "none"
            raise ApplianceError(f"no translation into {args.to!r} on this box (it translates into: {targets})")
        if len(sources) != 1:
            raise ApplianceError(f"--from is needed: {', '.join(sources)} all translate into {args.to!r}")
        source = sources[0]
    print(client.translate(" ".join(args.args), source, args.to))


def quic_address(text: str) -> str:
    """argparse type of --quic: HOST:PORT, checked before anything is sent (a usage error, exit 2)."""
    try:
        parse_quic_address(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _check_readable(path: str, what: str = "") -> None:
    """A file argument that cannot be read is a local input error (exit 2) naming it and why."""
    read_input(path, what, size=0)


def cmd_status(args: argparse.Namespace) -> int:
    """The daemon's state and its QUIC peers, as `systemctl status` would want them."""
    with Client(args.socket) as client:
        status = client.status()
    if args.json:
        print_json(status)
        return 0
    firmware = status["firmware"]
    print(
        f"firmware {firmware['name']} {firmware['version']} (key {firmware['signing_key_id']}), "
        f"{'ready' if status['ready'] else 'not ready'}"
    )
    for model in status["models"]:
        print(f"model {model['name']} on {model['engine']}: {model['live_sequences']} live sequences")
    for worker in status.get("workers") or []:
        if not worker["up"]:
            print(f"worker {worker['worker']}: starting (restarts {worker['restarts']})")
            continue
        print(
            f"worker {worker['worker']} pid {worker['pid']}: {worker['in_flight']} requests in flight, "
            f"{worker['connections']} Unix connections, {worker.get('tcp_connections', 0)} HTTPS connections, "
            f"{len(worker['quic_peers'])} QUIC connections, "
            f"{worker['quic_datagrams']} datagrams ({worker['quic_stray_datagrams']} stray), "
            f"restarts {worker['restarts']}"
        )
    if tls := status.get("tls"):
        https = f"https on TCP port {tls['https_port']}" if tls["https_port"] else "https off"
        mutual = ", mutual TLS" if tls["mutual_tls"] else ""
        print(f"tls: certificate {tls['certificate']} ({https}{mutual})")
        print(f"tls: SHA-256 fingerprint {tls['sha256']}")
    if quic := status.get("quic"):
        print(f"quic: {quic['workers']} QUIC workers" + (f" ({quic['reason']})" if quic["reason"] else ""))
    cache = status["conncache"]
    if cache is None:
        print("quic: off")
        return 0
    totals = cache["totals"]
    reason = f" ({cache['reason']})" if cache["reason"] else ""
    print(
        f"conncache {cache['backend']}{reason}: {len(cache['peers'])} peers, {totals['packets']} packets, "
        f"{totals['bytes']} bytes, {totals['drops']} dropped"
    )
    print(f"{'PEER':<46} {'PACKETS':>9} {'BYTES':>11} {'DROPS':>8} {'IDLE_S':>8}  DCID")
    for peer in cache["peers"]:
        print(
            f"{peer['peer']:<46} {peer['packets']:>9} {peer['bytes']:>11} {peer['drops']:>8} {peer['idle_s']:>8.1f}  "
            f"{peer['dcid']}"
        )
    return 0


def _call_epilog() -> str:
    width = max(map(len, CALL_ACTIONS)) + 4
    columns = max(min(shutil.get_terminal_size().columns - 2, 100), width + 30)
    lines = ["actions:"]
    for name, text in CALL_ACTIONS.items():
        lines += textwrap.wrap(
            text,
            columns,
            initial_indent=f"  {name:<{width - 2}}",
            subsequent_indent=" " * width,
            break_on_hyphens=False,
        )
    lines += [
        "",
        "examples:",
        "  appliance call health",
        "  appliance call vad speech.wav --stream",
        '  appliance call speak "Hello there." -o hello.wav',
        '  appliance call translate --to pt "Where is the station?"',
        "  appliance call transcribe speech.wav --format srt",
        "  appliance call transcribe spanish.wav --translate",
        "  appliance call live speech.wav",
        "  appliance call --quic 127.0.0.1:4433 --cafile run/tls/cert.pem models",
    ]
    return "\n".join(lines)


def add_parsers(sub: Any) -> None:
    call = command(
        sub,
        "call",
        "call the daemon over its Unix socket (or QUIC with --quic)",
        description="Call the daemon's API and print the answer (JSON, or the metrics text).",
        epilog=_call_epilog(),
    )
    call.add_argument(
        "what",
        choices=list(CALL_ACTIONS),
        metavar="ACTION",
        help=f"what to ask: {', '.join(CALL_ACTIONS)} (see actions below)",
    )
    call.add_argument(
        "args", nargs="*", metavar="ARG", help="model: NAME; vad, probs: the audio FILE; speak, translate: the TEXT"
    )
    call.add_argument("--socket", default=default_socket(), help=SOCKET_HELP)
    call.add_argument(
        "--model",
        help=f"the model to run (vad, probs: {DEFAULT_MODEL}; transcribe, live: {speech.TINY}, or {speech.BASE} "
        "to translate or for another language than English; interpret: the pipeline, default the first)",
    )
    call.add_argument("--stream", action="store_true", help="vad, transcribe: print each segment when final")
    call.add_argument("--language", help="transcribe, live: the speech's language (ISO 639-1), else detected")
    call.add_argument("--translate", action="store_true", help="transcribe, live: English text of any language")
    call.add_argument(
        "--speakers", nargs="?", const="", metavar="N",
        help="transcribe: who said what (the firmware's speaker model); N: that many speakers, else found",
    )  # fmt: skip
    call.add_argument(
        "--known", action="append", metavar="NAME=CLIP",
        help="transcribe --speakers: a known speaker's name and a 2 to 10 s clip of their voice (repeatable)",
    )  # fmt: skip
    call.add_argument(
        "--format",
        choices=sorted({*SPEAK_FORMATS, *speech.FORMATS}),
        help=f"speak: {'|'.join(SPEAK_FORMATS)} (default wav); transcribe: {'|'.join(speech.FORMATS)} (default text)",
    )
    call.add_argument("-o", "--output", metavar="FILE", help="speak: the audio file to write")
    call.add_argument("--voice", help="speak: the voice (default: the firmware's voice of the text's language)")
    call.add_argument("--speed", type=float, default=1.0, help="speak: 0.25 to 4.0")
    call.add_argument("--to", metavar="LANG", help="translate, interpret: the target language code")
    call.add_argument("--from", dest="source", metavar="LANG", help="translate, interpret: the source language code")
    call.add_argument(
        "--languages",
        metavar="A,B",
        help="interpret without --to: conversation mode, each turn into the other of these two (default: the "
        "pipeline's two)",
    )
    call.add_argument(
        "--quic", metavar="HOST:PORT", type=quic_address, help="call over QUIC/HTTP3 instead of the Unix socket"
    )
    call.add_argument(
        "--timeout",
        type=float,
        default=5.0,
        metavar="SECONDS",
        help="how long connecting (the QUIC handshake) may take before the call fails (exit 4)",
    )
    call.add_argument("--cafile", help="pinned server certificate or CA file for --quic")
    call.add_argument("--cert", help="client certificate for servers that require mutual TLS")
    call.add_argument("--key", help="the client certificate's private key")
    call.set_defaults(func=cmd_call)

    status = command(sub, "status", "the daemon's firmware, engines and QUIC peers (connection cache)")
    status.add_argument("--socket", default=default_socket(), help=SOCKET_HELP)
    status.add_argument("--json", action="store_true", help="print the daemon's status document as JSON")
    status.set_defaults(func=cmd_status)
