"""Short requests beside a long recording, against a real daemon: a one-off VAD request sent while a
long recording's /segments runs is answered before that recording is done (it shares the live
streams' lane), and the recording's answer is whole. Workers 1 and 2. The firmware bakes a small
batch (4) and short shards (64 frames), so that a 20-minute recording fills every slot of the batch
many times over, as a 40-minute one does with the default firmware.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import build_bundle
from promtext import sample

from appliance.audio import encode_wav

RATE = 16000


@pytest.fixture(scope="module")
def small_batches(keys, tmp_path_factory):
    return build_bundle(keys, tmp_path_factory.mktemp("fw-small") / "small", max_batch=4, max_tokens_per_shard=64)


@pytest.mark.parametrize("workers", [1, 2], ids=["workers1", "workers2"])
def test_a_short_request_is_not_held_behind_a_long_recording(start_daemon, small_batches, workers) -> None:
    daemon = start_daemon(bundle_dir=small_batches, workers=workers, max_body_bytes=64 << 20)
    rng = np.random.default_rng(7)
    long_wav = encode_wav((rng.standard_normal(RATE * 1200) * 0.1).astype(np.float32), RATE)  # 20 minutes
    finished: dict[str, float] = {}

    def long_request() -> None:
        with daemon.client() as client:
            assert "segments" in client.segments(long_wav)
        finished["long"] = time.monotonic()

    started = time.monotonic()
    runner = threading.Thread(target=long_request)
    runner.start()
    with daemon.client() as client:
        while sample(client.metrics(), "appliance_queue_depth", model="silero_vad") == 0:  # decoded, in the engine
            assert runner.is_alive(), "the long recording was answered before its work was seen in the engine"
            time.sleep(0.05)
        for _ in range(5):
            assert client.speech_probs(np.zeros(RATE, np.float32)).shape == (32,)
        finished["short"] = time.monotonic()
    runner.join(300)
    assert "long" in finished, "the long recording was not answered"
    print({k: round(v - started, 2) for k, v in finished.items()})
    assert finished["short"] < finished["long"], finished
