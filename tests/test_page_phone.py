"""The box's page on a phone (390 px wide, touch, 3x pixels) in headless Chromium, as people in the room
use it: the Status panel reads in lines (not a few characters each), says nothing meant for operators and
asks /status once, not every refresh; Talk, English to Portuguese, is said by a Portuguese voice (Kokoro's,
a model of another kind than Piper's), the audio the page was sent heard by faster-whisper base run from
its package files, not by the box."""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import pytest
import soxr
from conftest import Daemon, needs
from faster_whisper import WhisperModel
from playwright import sync_api as playwright
from speech import RATE
from test_https import SENTENCE
from test_page import CHROMIUM, launch, opened, spoken, talk, text, wait_until

pytestmark = needs(shutil.which(CHROMIUM) is None, "Debian's chromium is not installed (make deps)")
PHONE = {"viewport": {"width": 390, "height": 844}, "device_scale_factor": 3, "is_mobile": True, "has_touch": True}
REALTIME_RATE = 24000  # the page's PCM16, both ways
MIN_CHARACTERS_PER_LINE = 20  # a 390 px column holds about 40; the broken panel held 3 to 8


@pytest.fixture(scope="module")
def daemon(interpreter_daemon: Daemon) -> Daemon:
    return interpreter_daemon  # HTTPS with the box's certificate, as a LAN sees the box


@pytest.fixture(scope="module")
def browser(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory):
    with playwright.sync_playwright() as driver:
        chromium = launch(driver, daemon.cafile, spoken(tmp_path_factory.mktemp("microphone"), SENTENCE, "en"))
        yield chromium
        chromium.close()


def layout(tab) -> dict:
    return tab.evaluate(
        """() => ({
            scrollWidth: document.documentElement.scrollWidth,
            innerWidth: window.innerWidth,
            rows: [...document.querySelectorAll('#status-list dd')].map((dd) => [
                dd.textContent,
                Math.round(dd.getBoundingClientRect().height / parseFloat(getComputedStyle(dd).lineHeight)),
            ]),
            buttons: [...document.querySelectorAll('#interpreter button')].map((b) => b.getBoundingClientRect().right),
        })"""
    )


def waited(tab, done, what: str, timeout_s: float = 60.0) -> None:
    """Until `done()` holds, the page running meanwhile; fails only if it never does."""
    for _ in range(int(timeout_s * 10)):
        if done():
            return
        tab.wait_for_timeout(100)
    raise AssertionError(f"not within {timeout_s:g} s: {what}")


def test_the_status_panel_reads_on_a_phone_and_holds_nothing_for_operators(
    browser, daemon: Daemon, tmp_path: Path
) -> None:
    answered: list[tuple[str, int]] = []
    with opened(browser, daemon, tmp_path / "phone.png", **PHONE) as tab:
        tab.on("response", lambda r: answered.append((urlparse(r.url).path, r.status)))
        tab.reload()  # watched from its first request
        wait_until(tab, "window.appliancePage && window.appliancePage.ready")
        polls = [p for p, _ in answered].count("/v2/health/ready")
        # two more refreshes of the panel (every 5 s) after the page was ready
        waited(tab, lambda: [p for p, _ in answered].count("/v2/health/ready") >= polls + 2, "two refreshes")
        found = layout(tab)
        body = tab.inner_text("body")
    assert found["scrollWidth"] <= found["innerWidth"] == 390, found  # nothing runs off the side
    assert found["buttons"] and all(right <= 390 for right in found["buttons"]), found
    assert len(found["rows"]) >= 4, found  # firmware, health, engines, HTTPS, certificate
    for value, lines in found["rows"]:
        assert lines == 1 or len(value) / lines >= MIN_CHARACTERS_PER_LINE, (value, lines, found)
    assert "operator" not in body.lower(), body
    assert [p for p, _ in answered].count("/status") == 1, answered  # its refusal is remembered
    assert [s for _, s in answered].count(403) == 1, answered


def test_english_is_said_in_portuguese_by_a_kokoro_voice(
    browser, daemon: Daemon, judge_base: WhisperModel, tmp_path: Path
) -> None:
    """The microphone says SENTENCE; the box's interpreter session answers in Portuguese (pf_dora); the
    first answer's audio, as the page received it, is Portuguese to faster-whisper."""
    frames: list[str] = []
    with opened(browser, daemon, tmp_path / "phone.png", **PHONE) as tab:
        tab.on("websocket", lambda socket: socket.on("framereceived", lambda frame: frames.append(frame)))
        talk(tab, "en", "pt")
        wait_until(tab, "window.appliancePage.mode")
        assert tab.evaluate("window.appliancePage.mode") == "interpreter"  # the box speaks, not the page
        assert text(tab, "#talk-voice") == ""  # no 'no voice for Portuguese'
        wait_until(tab, "window.appliancePage.events.includes('response.done')")
        wait_until(tab, f"window.appliancePage.playedSamples > {REALTIME_RATE}")  # a second of it played
        translated = text(tab, "#talk-translated").lower()
        tab.click("#talk-stop")
    assert "hospital" in translated, translated
    events = [json.loads(f) for f in frames if isinstance(f, str)]
    first = next(i for i, e in enumerate(events) if e["type"] == "response.done")
    pcm = b"".join(base64.b64decode(e["delta"]) for e in events[:first] if e["type"] == "response.output_audio.delta")
    audio = soxr.resample(np.frombuffer(pcm, "<i2").astype(np.float32) / 32768, REALTIME_RATE, RATE)
    segments, info = judge_base.transcribe(audio.astype(np.float32), beam_size=5)
    heard = " ".join(s.text for s in segments).lower()
    assert info.language == "pt" and "hospital" in heard, (info.language, heard)


def test_a_language_without_a_voice_is_said_plainly(browser, keys, speech_bundle: Path, tls, tmp_path: Path) -> None:
    """The speech firmware has Portuguese text (Bergamot) but no Portuguese voice: Type says so, naming
    the voices it has, and still says the English."""
    daemon = Daemon(tmp_path, speech_bundle, keys.trusted, tls=tls, https="")
    try:
        daemon.wait_ready(120)
        with opened(browser, daemon, tmp_path / "phone.png", **PHONE) as tab:
            tab.select_option("#text-source", "en")
            tab.select_option("#text-target", "pt")
            tab.fill("#text-input", "Good morning. Where is the station?")
            tab.click("#translate")
            wait_until(tab, "document.getElementById('text-output').textContent.length > 0")
            tab.click("#speak-output")
            wait_until(tab, "document.getElementById('text-message').textContent.includes('no voice')")
            message = text(tab, "#text-message")
            tab.click("#speak-input")
            wait_until(tab, "window.appliancePage.playedSamples > 22050")  # joe says the English
    finally:
        assert daemon.stop() == 0, daemon.log.read_text()
    assert message == "This box has no voice for Portuguese (its voices: English (joe)).", message
