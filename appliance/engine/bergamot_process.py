"""One Bergamot translator in a process of its own: engine/bergamot.py starts one per engine thread.

fxtranslate's Translator holds the GIL while it translates (its class is unsendable, so it cannot let
go of it): in the daemon's process two of them took turns on one core, and the event loop waited
behind every sentence. Run as a script (`python -I`), this imports only the standard library and
fxtranslate. It lowers its priority by the nice value in argv[2], reads the model's files, then one
text at a time, from the connection on the fd named in argv[1], and answers each with ("ok", result)
or ("error", message); it ends when the connection does, so it never outlives the daemon. The
service's stop signals are the daemon's to act on.
"""

from __future__ import annotations

import os
import signal
import sys
from multiprocessing.connection import Connection

import fxtranslate


def serve(connection: Connection) -> None:
    try:
        translator = fxtranslate.Translator(*connection.recv())
    except ValueError as exc:
        connection.send(("error", f"fxtranslate cannot load the translation model: {exc}"))
        return
    connection.send(("ok", translator.backend()))
    while True:
        try:
            text = connection.recv()
        except EOFError:
            return
        try:
            reply = ("ok", translator.translate(text))
        except Exception as exc:  # the engine's own error goes back to the text that caused it
            reply = ("error", f"fxtranslate: {exc}")
        connection.send(reply)


if __name__ == "__main__":
    # systemd's stop, a terminal's ^C and hang-up reach the whole group: the daemon decides (a stop
    # closes their connections). SIGHUP is held already where the thread that started this one was
    # started before the daemon allowed reloads (signals.py), not in translators a reload starts.
    for stop in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(stop, signal.SIG_IGN)
    os.nice(int(sys.argv[2]))  # behind the daemon's event loop, as its other compute (engine/loop_first.py)
    serve(Connection(int(sys.argv[1])))
