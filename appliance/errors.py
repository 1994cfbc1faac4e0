"""Errors that carry the HTTP status to answer with; each layer raises, the API core catches once."""

import os


class ApplianceError(Exception):
    """A problem the user can fix: bad config, a bundle that fails verification, a bad key."""


def cannot_listen(key: str, address: str, exc: OSError) -> ApplianceError:
    """A listener's start failure, naming its config key: "address already in use", not the wording of
    whichever library bound the socket."""
    why = os.strerror(exc.errno) if exc.errno and exc.errno > 0 else exc.strerror or str(exc)  # a name lookup's < 0
    return ApplianceError(f"{key} {address}: cannot listen: {why}")


class ApiError(Exception):
    status: int = 400

    def __init__(
        self,
        message: str,
        status: int | None = None,
        param: str | None = None,
        headers: tuple[tuple[str, str], ...] = (),
    ) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.param = param  # the request field at fault, where one is (OpenAI's errors name it)
        self.headers = list(headers)  # answered with the error (Retry-After, say)

    @property
    def message(self) -> str:
        return str(self.args[0])


class BadRequest(ApiError):
    status = 400


class NotFound(ApiError):
    status = 404


class TooManyRequests(ApiError):
    status = 429


class Unavailable(ApiError):
    status = 503


class QueueFull(Unavailable):
    """A model's queue is at its bound (engine.max_queue_size) or a request waited past its timeout:
    refused at once with a 503 and Retry-After, as Triton's default_queue_policy refuses."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message, 503, headers=(("Retry-After", str(retry_after_s)),))
