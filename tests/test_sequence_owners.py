"""Stateful sequences belong to the client that opened them: the same user on the Unix socket (peer
credentials), the same QUIC connection (or client certificate with mutual TLS). Others get 404 and
cannot feed, restart or end it; each client holds at most its share of the live sequences."""

from __future__ import annotations

import numpy as np
import pytest

from appliance.client import ClientError

FRAME = np.zeros(512, np.float32)


def test_a_sequence_is_its_openers_alone(daemon) -> None:
    with daemon.client() as unix, daemon.client("quic") as quic_a, daemon.client("quic") as quic_b:
        unix.speech_probs(FRAME, sequence_id="owned-u", start=True)
        quic_a.speech_probs(FRAME, sequence_id="owned-q", start=True)
        for other, sequence_id in ((quic_a, "owned-u"), (unix, "owned-q"), (quic_b, "owned-q")):
            for flags in ({}, {"start": True}, {"end": True}):
                with pytest.raises(ClientError) as err:
                    other.speech_probs(FRAME, sequence_id=sequence_id, **flags)
                assert err.value.status == 404, flags
                assert err.value.message == f"sequence {sequence_id} belongs to another client"
        assert unix.speech_probs(FRAME, sequence_id="owned-u", end=True).shape == (1,)  # the owners still can
        assert quic_a.speech_probs(FRAME, sequence_id="owned-q", end=True).shape == (1,)


def test_each_client_holds_at_most_its_share(start_daemon, tls) -> None:
    daemon = start_daemon("[sequences]\nmax_live = 4\nmax_per_client = 2\n", tls=tls)
    with daemon.client() as unix, daemon.client("quic") as quic:
        for i in range(2):
            unix.speech_probs(FRAME, sequence_id=f"u{i}", start=True)
        with pytest.raises(ClientError) as err:
            unix.speech_probs(FRAME, sequence_id="u2", start=True)
        assert err.value.status == 429
        assert err.value.message == "this client holds 2 live sequences, its share: end one or retry later"
        for i in range(2):  # another client still gets its share
            quic.speech_probs(FRAME, sequence_id=f"q{i}", start=True)
        unix.speech_probs(FRAME, sequence_id="u0", end=True)
        unix.speech_probs(FRAME, sequence_id="u2", start=True)  # room again once one ended
