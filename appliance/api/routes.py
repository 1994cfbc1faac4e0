"""A route of the API: method, path pattern, its name in the metrics, and its handler."""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable

from appliance.protocol.messages import Request, Response

# the request and the path's named groups (plus `query:NAME` for each query parameter)
Handler = Callable[[Request, dict[str, str]], Awaitable[Response]]
Route = tuple[str, re.Pattern[str], str, Handler]
