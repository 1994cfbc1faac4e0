"""The box's own page at `/` (plain HTML, CSS and JavaScript from appliance/web: no build step, no
network), and the box's TLS certificate at `/tls/certificate.pem` for a phone or tablet to trust.

The page calls only the box's own routes: /translate and /languages, /v1/audio/speech, /v1/realtime,
/v2/health/ready, and /status where its visitor is an operator (else /v2, /v2/models and the certificate). It is served on every transport; the certificate is public, so it is too.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from importlib import resources

from appliance.api.routes import Route
from appliance.errors import NotFound
from appliance.protocol.messages import Request, Response

TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
}
# the page's own files and the box's routes only; audio it plays is made in the page (blob:); no frame may
# hold it; its forms post to the box alone; a room's PIN in its address is never sent on as a referrer
POLICY = (
    "default-src 'self'; media-src 'self' blob:; img-src 'self' data:; frame-ancestors 'none'; "
    "form-action 'self'; base-uri 'none'"
)
HEADERS = [
    ("Cache-Control", "no-cache"),
    ("Content-Security-Policy", POLICY),
    ("X-Content-Type-Options", "nosniff"),
    ("Referrer-Policy", "no-referrer"),
]


def routes(certificate: Callable[[], bytes]) -> list[Route]:
    files = {
        f.name: f.read_bytes()
        for f in resources.files("appliance.web").iterdir()
        if f.name[f.name.rfind(".") :] in TYPES
    }

    async def page(request: Request, params: dict[str, str]) -> Response:
        name = params.get("name", "index.html")
        if name not in files:
            raise NotFound(f"the page has no file {name[:60]!r} (it has: {', '.join(sorted(files))})")
        return Response(200, files[name], TYPES[name[name.rfind(".") :]], list(HEADERS))

    async def certificate_pem(request: Request, params: dict[str, str]) -> Response:
        pem = certificate()
        if not pem:
            raise NotFound("this box serves no TLS listener (quic and https are off): it has no certificate to give")
        disposition = ("Content-Disposition", 'attachment; filename="appliance-ca.pem"')
        return Response(200, pem, "application/x-pem-file", [disposition])

    return [
        ("GET", re.compile(r"/"), "page", page),
        ("GET", re.compile(r"/page/(?P<name>[a-z0-9_.-]+)"), "page", page),
        ("GET", re.compile(r"/tls/certificate\.pem"), "certificate", certificate_pem),
    ]
