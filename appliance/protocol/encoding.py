"""HTTP content codings as Triton speaks them: `Content-Encoding: gzip | deflate` request bodies undone
as they arrive, never past a bound (a small zip bomb cannot make a large body), and response bodies
compressed for an `Accept-Encoding` that asks for it. No I/O; zlib does the work."""

from __future__ import annotations

import zlib

from appliance.errors import ApiError, BadRequest

# wbits per coding: gzip's header and trailer (RFC 1952), or deflate as HTTP means it, zlib's (RFC 1950)
CODINGS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}
IDENTITY = ("", "identity")
LEVEL = 1  # responses: zlib's fastest level keeps most of the gain on tensors at a fraction of the time


class DecodedTooLarge(Exception):
    """The decoded body would exceed the room the caller gave."""


class BodyDecoder:
    """One request body's content coding, undone piece by piece."""

    def __init__(self, coding: str) -> None:
        self.coding = coding.strip().lower()
        if self.coding not in CODINGS:
            raise ApiError(f"content-encoding {coding[:40]!r} is not supported (gzip, deflate or identity)", 415)
        self._inflater = zlib.decompressobj(CODINGS[self.coding])

    def feed(self, data: bytes, room: int) -> list[bytes]:
        """What `data` decodes to; DecodedTooLarge as soon as that would exceed `room` bytes, so a
        bomb stops after at most room + 1 bytes of output."""
        out: list[bytes] = []
        try:
            while data:
                piece = self._inflater.decompress(data, room + 1)
                if len(piece) > room:
                    raise DecodedTooLarge
                room -= len(piece)
                out.append(piece)
                if not self._inflater.eof:
                    data = self._inflater.unconsumed_tail
                    continue
                data = self._inflater.unused_data
                if data and self.coding == "deflate":
                    raise BadRequest("content-encoding deflate: bytes after the end of the compressed body")
                if data:  # gzip allows members one after another (RFC 1952 2.2)
                    self._inflater = zlib.decompressobj(CODINGS[self.coding])
        except zlib.error as exc:
            raise BadRequest(
                f"content-encoding {self.coding}: the body is not valid {self.coding} data ({exc})"
            ) from None
        return out

    def finish(self) -> None:
        if not self._inflater.eof:
            raise BadRequest(f"content-encoding {self.coding}: the compressed body ends before its end")


def accepted_coding(accept_encoding: str) -> str | None:
    """The coding to compress a response with for this Accept-Encoding (RFC 9110 12.5.3): gzip, else
    deflate, where the client gives it a non-zero weight (`*` counts for both); None: send it as is."""
    weights: dict[str, float] = {}
    for item in accept_encoding.lower().split(","):
        name, _, params = item.partition(";")
        weight = 1.0
        key, _, value = params.strip().partition("=")
        if key.strip() == "q":
            try:
                weight = float(value)
            except ValueError:
                weight = 0.0
        weights[name.strip()] = weight
    for coding in ("gzip", "deflate"):
        if weights.get(coding, weights.get("*", 0.0)) > 0.0:
            return coding
    return None


def compress(body: bytes, coding: str) -> bytes:
    packer = zlib.compressobj(LEVEL, zlib.DEFLATED, CODINGS[coding])
    return packer.compress(body) + packer.flush()
