"""Operator routes (/status, /metrics: every QUIC peer's address, connection IDs, worker pids) for
operators only, against a real daemon: over QUIC a client whose certificate the operator CA signed;
on the Unix socket a member of the socket's group (or root, or the daemon's user). Everyone else
gets a 403 naming the rule, and is served on every other route.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
from conftest import ROOT, Daemon, good_clients_throughout, make_ca_and_client, open_to_all

from appliance.client import Call, Client

NOBODY = 65534
OPERATOR_ROUTES = ("/status", "/metrics")
ASK_AS_ANOTHER_USER = """
import json, sys
from appliance.client import Call, Client
with Client(sys.argv[1], timeout=20) as client:
    print(json.dumps({p: client.send(Call("GET", p)).status for p in sys.argv[2:]}))
"""


@pytest.fixture(scope="module", params=[1, 2], ids=["workers1", "workers2"])
def daemon(request, tmp_path_factory, keys, bundle, tls) -> Iterator[Daemon]:
    """Its Unix socket open to all local users (0666, in a directory they may traverse), so that
    non-members can be turned away by route."""
    workdir = tmp_path_factory.mktemp("operators")
    open_to_all(workdir)
    d = Daemon(
        workdir,
        bundle,
        keys.trusted,
        tls=tls,
        workers=request.param,
        extra_server='socket_mode = "0666"\n',
    )
    with good_clients_throughout(d.wait_ready()):
        yield d


def statuses(client: Client) -> dict[str, int]:
    return {path: client.send(Call("GET", path)).status for path in (*OPERATOR_ROUTES, "/v2/health/ready")}


def test_a_quic_client_without_an_operator_certificate_gets_403_on_operator_routes_only(daemon) -> None:
    with Client(quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, timeout=20) as client:
        assert statuses(client) == {"/status": 403, "/metrics": 403, "/v2/health/ready": 200}
        refusal = client.send(Call("GET", "/status")).json()["error"]
    assert "operator CA (quic.operator_ca)" in refusal


def test_a_quic_client_the_operator_ca_signed_is_an_operator(daemon) -> None:
    with daemon.client("quic") as client:  # presents the operator certificate
        assert statuses(client) == {"/status": 200, "/metrics": 200, "/v2/health/ready": 200}
        assert "workers" in client.status()


def test_a_certificate_another_ca_signed_is_refused_in_the_handshake(daemon, tmp_path) -> None:
    _, cert, key = make_ca_and_client(tmp_path, "stranger")
    with pytest.raises((ConnectionError, TimeoutError)):
        with Client(
            quic=f"127.0.0.1:{daemon.quic_port}", cafile=daemon.cafile, certificate=(cert, key), timeout=20
        ) as c:
            c.health()


def ask_as(daemon: Daemon, groups: list[int]) -> dict[str, int]:
    if os.geteuid() != 0:
        pytest.skip("becoming another user needs root")
    result = subprocess.run(
        [sys.executable, "-c", ASK_AS_ANOTHER_USER, str(daemon.socket), *OPERATOR_ROUTES, "/v2/health/ready"],
        user=NOBODY,
        group=NOBODY,
        extra_groups=groups,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def test_a_local_user_outside_the_sockets_group_gets_403_on_operator_routes_only(daemon) -> None:
    assert ask_as(daemon, []) == {"/status": 403, "/metrics": 403, "/v2/health/ready": 200}


def test_a_member_of_the_sockets_group_is_an_operator(daemon) -> None:
    group = daemon.socket.stat().st_gid
    assert ask_as(daemon, [group]) == {"/status": 200, "/metrics": 200, "/v2/health/ready": 200}


def test_root_on_the_unix_socket_is_an_operator(daemon) -> None:
    with daemon.client() as client:
        assert statuses(client) == {"/status": 200, "/metrics": 200, "/v2/health/ready": 200}
