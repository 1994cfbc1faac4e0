"""Errors that carry the HTTP status to answer with; each layer raises, the API core catches once."""


class ApplianceError(Exception):
    """A problem the user can fix: bad config, a bundle that fails verification, a bad key."""


class ApiError(Exception):
    status: int = 400

    def __init__(self, message: str, status: int | None = None, param: str | None = None) -> None:
        super().__init__(message)
        if status is not None:
            self.status = status
        self.param = param  # the request field at fault, where one is (OpenAI's errors name it)

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
