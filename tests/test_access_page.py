"""The box's page on a box that needs keys, in headless Chromium (as tests/test_page.py drives it): a
visitor with the room's PIN link talks through the interpreter with no long-lived key; a page of another
origin, holding a good key even, is refused its WebSocket and its form POST."""

from __future__ import annotations

import http.server
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon, free_tcp_port, needs
from test_access import KEYS, add_key, refused, room_pin
from test_https import SENTENCE
from test_page import CHROMIUM, TIMEOUT_MS, launch, spoken, wait_until

pytestmark = needs(shutil.which(CHROMIUM) is None, "Debian's chromium is not installed (make deps)")


@pytest.fixture(scope="module")
def box(tmp_path_factory, keys, interpreter_bundle, tls) -> Iterator[Daemon]:
    workdir = tmp_path_factory.mktemp("access-page")
    key_file = workdir / "api-keys.toml"
    # no operator CA: a server that asks for a client certificate has headless Chromium cancel a
    # WebSocket that is the first connection to it (a page of another origin's)
    access = f'[access]\nkeys = "{key_file}"\n'
    d = Daemon(workdir, interpreter_bundle, keys.trusted, extra=access, tls=tls, https="", operator=False)
    d.secret = add_key(key_file, "hall", *KEYS["hall"])  # type: ignore[attr-defined]
    yield d.wait_ready(240)
    assert d.stop() == 0, d.log.read_text()


@pytest.fixture(scope="module")
def browser(box: Daemon, tmp_path_factory: pytest.TempPathFactory):
    from playwright import sync_api as playwright

    with playwright.sync_playwright() as driver:
        chromium = launch(driver, box.cafile, spoken(tmp_path_factory.mktemp("microphone"), SENTENCE, "en"))
        yield chromium
        chromium.close()


def test_a_room_pin_link_lets_a_visitor_talk_through_the_interpreter(browser, box: Daemon, tmp_path: Path) -> None:
    context = browser.new_context(permissions=["microphone"])
    tab = context.new_page()
    tab.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    tab.on("pageerror", lambda exc: problems.append(str(exc)))
    try:
        tab.goto(f"{box.https_url}/?room={room_pin(box)}")
        wait_until(tab, "window.appliancePage && window.appliancePage.ready")
        assert (tab.text_content("#room-message") or "").startswith("In the room until")
        tab.select_option("#talk-source", "en")
        tab.select_option("#talk-target", "pt")
        tab.click("#talk-start")
        wait_until(tab, "document.getElementById('talk-translated').textContent.length > 0")
        # the box's interpreter session, opened with the room's secret as its subprotocol
        assert tab.evaluate("window.appliancePage.mode") == "interpreter"
        heard = (tab.text_content("#talk-heard") or "").lower()
        assert "doctor" in heard and "hospital" in heard, heard
        tab.click("#talk-stop")
    finally:
        tab.screenshot(path=str(tmp_path / "page.png"), full_page=True)
        context.close()
    assert not problems, problems


FOREIGN = """<!doctype html><html><body>
<form id="post" method="post" action="{box}/translate">
<input name="q" value="Good morning."><input name="source" value="en"><input name="target" value="pt">
<input name="api_key" value="{key}"></form>
<script>
window.socketResult = "pending";
const socket = new WebSocket("{wss}/v1/realtime?intent=transcription", ["realtime", "openai-insecure-api-key.{key}"]);
socket.onopen = () => (window.socketResult = "open");
socket.onclose = (event) => (window.socketResult = window.socketResult === "open" ? "open" : "refused " + event.code);
</script></body></html>"""


def test_a_page_of_another_origin_is_refused_its_websocket_and_its_form_post(browser, box: Daemon) -> None:
    page = FOREIGN.format(box=box.https_url, wss=box.https_url.replace("https", "wss"), key=box.secret)

    class Foreign(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            self.send_response(200)
            self.send_header("content-type", "text/html")
            self.end_headers()
            self.wfile.write(page.encode())

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_tcp_port()), Foreign)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    before = refused(box).get(("origin", "https"), 0)
    context = browser.new_context()
    tab = context.new_page()
    try:
        tab.goto(f"http://127.0.0.1:{server.server_address[1]}/")
        wait_until(tab, "window.socketResult !== 'pending'")
        assert tab.evaluate("window.socketResult") == "refused 1006"  # the handshake's 403: no socket
        assert refused(box).get(("origin", "https"), 0) == before + 1
        with tab.expect_navigation() as navigation:
            tab.evaluate("document.getElementById('post').submit()")
        answer = navigation.value
        assert answer.status == 403 and "is not this box's" in answer.text()
    finally:
        context.close()
        server.shutdown()
    assert refused(box)[("origin", "https")] == before + 2
