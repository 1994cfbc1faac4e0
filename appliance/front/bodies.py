"""Bodies as they cross between a protocol worker and the engine process (front/channel.py): up to
INLINE_BYTES inline in their message, larger ones written once to a file in shared memory (/dev/shm,
tmpfs) whose name the message carries; the reader takes the bytes and unlinks it, so a 64 MiB upload is
not pushed through the socket and asyncio's buffers. Big ones are copied in threads (the kernel copies,
the GIL released): the event loop goes on meanwhile. The names end in 128 random bits: no other local
user can guess one and create it first. A body that cannot cross (shared memory full, its file gone)
fails its own request with a logged 500."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import secrets
import tempfile
from dataclasses import dataclass
from pathlib import Path

from appliance.protocol.limits import LIMITS_BITTEN
from appliance.protocol.messages import Request, Response, error_response

INLINE_BYTES = 64 << 10
SHM_DIR = Path("/dev/shm") if os.access("/dev/shm", os.W_OK) else Path(tempfile.gettempdir())


@dataclass(frozen=True, slots=True)
class Body:
    """A body as it crosses: inline bytes, or the name and length of a shared-memory file."""

    inline: bytes = b""
    shm: str = ""
    length: int = 0


def pack_body(data: bytes, owner: str) -> Body:
    """`owner` names the writer (and, for the engine, the worker it writes to), so that the files a
    dead process left unread can be found: remove_leftovers(owner)."""
    if len(data) <= INLINE_BYTES:
        return Body(inline=data)
    path = SHM_DIR / f"appliance-{owner}-{secrets.token_hex(16)}"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR | os.O_CLOEXEC, 0o600)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    except BaseException:  # shared memory full, say: a part-written file would hold what was left of it
        path.unlink(missing_ok=True)
        raise
    finally:
        os.close(fd)
    return Body(shm=path.name, length=len(data))


async def written_body(data: bytes, owner: str) -> Body:
    """pack_body, in a thread where the body goes to shared memory: a 64 MiB body is 24 to 53 ms of
    copying, which the event loop waited for. Cancelled meanwhile (its client left), the file the
    thread goes on to write is removed."""
    if len(data) <= INLINE_BYTES:
        return pack_body(data, owner)
    writing = asyncio.ensure_future(asyncio.to_thread(pack_body, data, owner))
    try:
        return await asyncio.shield(writing)
    except asyncio.CancelledError:
        writing.add_done_callback(_discard_written)
        raise


def _discard_written(writing: asyncio.Future[Body]) -> None:
    if not writing.cancelled() and writing.exception() is None:
        discard(writing.result())


async def read_body(body: Body) -> bytes:
    """The body's bytes, read in a thread where it is in shared memory (a 64 MiB body: 47 to 71 ms)."""
    return await asyncio.to_thread(unpack_body, body) if body.shm else body.inline


async def packed(response: Response, owner: str) -> tuple[Response, Body]:
    """A response and its body as it crosses; a 500 in its place where the body cannot."""
    try:
        return response, await written_body(response.body, owner)
    except OSError as exc:
        return hand_over_failed(exc), Body()


async def unpack_request(request: Request, body: Body) -> Request | Response:
    """The request with its body; or, where the body cannot be read, the 500 to answer it with."""
    try:
        return dataclasses.replace(request, body=await read_body(body))
    except OSError as exc:
        return hand_over_failed(exc)


def unpack_body(body: Body) -> bytes:
    if not body.shm:
        return body.inline
    path = SHM_DIR / body.shm
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        data = os.read(fd, body.length)  # one copy, by the kernel, with the GIL released
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    if len(data) != body.length:
        raise OSError(f"{body.shm}: {len(data)} of its {body.length} bytes")
    return data


def discard(body: Body) -> None:
    """A body nobody will read: its shared-memory file goes."""
    if body.shm:
        (SHM_DIR / body.shm).unlink(missing_ok=True)


def remove_leftovers(owner: str) -> None:
    """Shared-memory bodies written under `owner` that nobody will read (their reader died)."""
    for path in SHM_DIR.glob(f"appliance-{owner}-*"):
        with contextlib.suppress(OSError):  # another user's file, in a shared /dev/shm: not ours to remove
            path.unlink()


def hand_over_failed(exc: Exception) -> Response:
    """The 500 for a body that could not cross between the processes, logged (at most once per 10 s)."""
    LIMITS_BITTEN.bit("shared memory", f"a body could not cross between processes in {SHM_DIR}: {exc}")
    return error_response(500, "internal error: the body could not be handed over (logged)")
