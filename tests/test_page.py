"""The box's own page in a real browser: Debian's chromium, headless, driven by Playwright over HTTPS.

Chromium trusts the box's key only (--ignore-certificate-errors-spki-list with its SPKI hash, as a
phone that installed the certificate would), its microphone is an English espeak-ng recording
(--use-file-for-fake-audio-capture). The page must translate typed text, speak it, show the status
panel, and say plainly when the box has no voice for a language or the interpreter's socket drops.
A screenshot of the page is kept under the test's tmp directory (its path is printed)."""

from __future__ import annotations

import base64
import hashlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import Daemon
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from speech import RATE, recording
from test_https import SENTENCE, interpreter_bundle  # noqa: F401 - the session's interpreter firmware

from appliance.audio import encode_wav

playwright = pytest.importorskip("playwright.sync_api")
CHROMIUM = "/usr/bin/chromium"
pytestmark = pytest.mark.skipif(shutil.which(CHROMIUM) is None, reason="Debian's chromium is not installed")
TIMEOUT_MS = 120_000


@pytest.fixture(scope="module")
def daemon(tmp_path_factory, keys, interpreter_bundle, tls) -> Iterator[Daemon]:  # noqa: F811
    d = Daemon(tmp_path_factory.mktemp("page"), interpreter_bundle, keys.trusted, tls=tls, https="")
    yield d.wait_ready(180)
    assert d.stop() == 0, d.log.read_text()


def spki_hash(cafile: str) -> str:
    """What Chromium's --ignore-certificate-errors-spki-list names: base64 of SHA-256 of the key's SPKI."""
    certificate = x509.load_pem_x509_certificate(Path(cafile).read_bytes())
    spki = certificate.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return base64.b64encode(hashlib.sha256(spki).digest()).decode()


@pytest.fixture(scope="module")
def browser(daemon: Daemon, tmp_path_factory: pytest.TempPathFactory):
    microphone = tmp_path_factory.mktemp("microphone") / "english.wav"
    microphone.write_bytes(encode_wav(recording([SENTENCE], gap_s=3.0)[0], RATE))
    flags = [
        "--no-sandbox",
        "--disable-gpu",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--ignore-certificate-errors-spki-list={spki_hash(daemon.cafile)}",
        "--use-fake-device-for-media-stream",
        "--use-fake-ui-for-media-stream",
        f"--use-file-for-fake-audio-capture={microphone}",
        "--autoplay-policy=no-user-gesture-required",
    ]
    with playwright.sync_playwright() as driver:
        chromium = driver.chromium.launch(executable_path=CHROMIUM, headless=True, args=flags)
        yield chromium
        chromium.close()


def wait_until(tab, expression: str, timeout_s: float = TIMEOUT_MS / 1000) -> None:
    """Poll `expression` from outside: the page's CSP (no eval) stops Playwright's in-page polling."""
    deadline = time.monotonic() + timeout_s
    while not tab.evaluate(expression):
        assert time.monotonic() < deadline, f"not true within {timeout_s:g} s: {expression}"
        time.sleep(0.1)


@pytest.fixture
def page(browser, daemon: Daemon, tmp_path: Path):
    context = browser.new_context(permissions=["microphone"])
    tab = context.new_page()
    tab.set_default_timeout(TIMEOUT_MS)
    problems: list[str] = []
    tab.on("pageerror", lambda exc: problems.append(str(exc)))
    tab.goto(daemon.https_url + "/")
    wait_until(tab, "window.appliancePage && window.appliancePage.ready")
    yield tab
    shot = tmp_path / "page.png"
    tab.screenshot(path=str(shot), full_page=True)
    print(f"screenshot of the page: {shot}")
    context.close()
    assert not problems, problems  # no script error on the page


def test_the_status_panel_shows_firmware_engines_workers_and_the_certificate(page, daemon: Daemon) -> None:
    wait_until(page, "document.getElementById('health').textContent === 'ready'")
    assert page.text_content("#firmware") == "firmware interpreter 1.0.0"
    panel = page.inner_text("#status")
    fingerprint = subprocess.run(
        ["openssl", "x509", "-in", daemon.cafile, "-noout", "-fingerprint", "-sha256"], capture_output=True, text=True
    ).stdout.strip()
    assert fingerprint.split("=")[1] in panel  # as openssl computes it from the file the box serves
    for expected in ("onnxruntime-cpu", "ctranslate2", "in the engine process", f"TCP port {daemon.https_port}"):
        assert expected in panel, (expected, panel)
    models = page.inner_text("#status-models")
    for name in ("silero_vad", "whisper_tiny_en", "joe", "en-pt", "pt-en"):
        assert name in models


def test_typed_text_is_translated_and_spoken_and_a_missing_voice_is_said(page) -> None:
    page.select_option("#text-source", "en")
    page.select_option("#text-target", "pt")
    page.fill("#text-input", SENTENCE)
    page.click("#translate")
    wait_until(page, "document.getElementById('text-output').textContent.length > 0")
    translated = page.text_content("#text-output").lower()
    assert "médic" in translated and "hospital" in translated, translated  # Portuguese, by the box's Bergamot
    page.click("#speak-output")  # this firmware has an English voice only
    wait_until(page, "document.getElementById('text-message').textContent.includes('no voice')")
    assert page.text_content("#text-message") == ("This box has no voice for Portuguese (its voices: English (joe)).")
    page.click("#speak-input")  # the English text, in the English voice
    wait_until(page, "window.appliancePage.playedSamples > 22050")  # more than a second of it played
    assert "error" not in page.get_attribute("#text-message", "class")
