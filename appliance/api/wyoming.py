"""Home Assistant's Wyoming protocol (PyPI `wyoming`: its event classes and writer) on a Unix socket
next to the API socket, served from the engine process: the same models, the same batches.

    describe                                   -> info: every speech_to_text model (its languages)
                                                  in one asr program, every voice of every speech
                                                  model (its language) in one tts program, every
                                                  wake word in one wake program per wake_word model
    transcribe, audio-start, audio-chunk..., audio-stop
                                               -> voice-started / voice-stopped and transcript-start,
                                                  transcript-chunk while the speech comes (where the
                                                  recording comes as it is spoken: wyoming_voice.py),
                                                  the rest as chunks at audio-stop, transcript-stop,
                                                  then transcript (made ahead where the recording
                                                  ended in silence: LiveTranscriber.hear)
    detect, (audio-start,) audio-chunk..., audio-stop
                                               -> detection per wake word heard, or not-detected at
                                                  audio-stop (wyoming_wake.py)
    synthesize (or synthesize-start/-chunk.../-stop), its voice by name or by language
                                               -> audio-start, audio-chunk per sentence as it is
                                                  made, audio-stop (the streamed form: each sentence
                                                  spoken once its chunks complete it, then
                                                  synthesize-stopped)

Wyoming has no authentication: whoever reaches the socket may use it (its mode and group are the API
socket's); on TCP, the peers of wyoming.allow (api/access/wyoming_allow.py). Events are read with bounds of our own (the package's reader has none): a header line of at
most MAX_HEADER_BYTES, data and payload of at most [wyoming] max_payload_bytes, a recording of at most
the API's body limit; in time as the API's HTTP/1.1 (an idle connection, a header line, a stalled
payload), and what the box sends as well (server.write_timeout_s: a client that takes nothing of it
is cut off, its slot freed); a recording's audio held against the daemon's byte budget
(server.max_buffered_bytes, shared with the API's request bodies); and [wyoming] max_connections
clients at once on the Unix socket, max_tcp_connections apart from them on TCP (the LAN cannot take a
local Home Assistant's slots), max_connections_per_peer of one user (Unix socket) or host (TCP). A
broken or oversized event, a bound in time, a full budget or a connection past the count is answered
by one `error` event and the connection closes; a client that disconnects mid-stream cancels its work.
Concurrent clients' recordings share engine calls (the speech_to_text batch queue), where
wyoming-faster-whisper holds a lock per model.

Here its sockets and its announcement on the LAN, made at the start by the listener table's entries.
The connections, their admission and each one's loop: transport/wyoming_server.py (a transport of
the listener table). Events read from bytes with their bounds and deadlines (sans I/O):
wyoming_codec.py; its pump, writes and the error that closes a connection: wyoming_events.py; each
event's answer: wyoming_handler.py (a stream's PCM in: wyoming_audio.py); TCP and its mDNS
announcement: wyoming_lan.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

from appliance.api.wyoming_lan import announce, tcp_socket
from appliance.config import Config
from appliance.networks import Bind, Listening

log = logging.getLogger("appliance.wyoming")


def unix_socket_path(config: Config) -> Path:
    """Where Wyoming's Unix socket is: [wyoming] socket, else wyoming.sock beside the API's."""
    socket_setting = str(config.wyoming.socket)
    return Path(socket_setting) if socket_setting != "." else config.server.socket.with_name("wyoming.sock")


async def open_unix(config: Config, bind: Bind) -> Listening | None:
    """[wyoming]'s Unix socket (`bind` makes it as the API's is made); None where Wyoming is off."""
    if not config.wyoming.enabled:
        return None
    path = unix_socket_path(config)
    listening = Listening(bind(path), path=path)
    log.info("Wyoming on %s", path)
    return listening


async def open_tcp(config: Config, bind: Bind) -> Listening | None:
    """[wyoming] tcp's socket, announced on the LAN before it serves, as it has a port (closing the
    announcement says goodbye); its TXT record carries the HTTPS port (`appliance fleet targets`). None
    where Wyoming is off or not on TCP."""
    settings = config.wyoming
    if not (settings.enabled and settings.tcp):
        return None
    sock = tcp_socket(settings.tcp)
    try:
        properties = {"https": str(config.https.port)} if config.https.enabled else {}
        announcement = await announce(settings.tcp, sock.getsockname()[1], properties)
    except BaseException:  # the start fails: the socket made for it goes too
        sock.close()
        raise
    return Listening(sock, goodbye=announcement.async_close)
