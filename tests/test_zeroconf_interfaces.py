"""Issue 47, item 16: a box that serves Wyoming on one address answers mDNS there alone. Two networks
made of network namespaces and veth pairs: the served LAN (10.47.1.0/24, the box at .1) and another
one (10.47.2.0/24, the box at .1 too). From the other network, a unicast query to the served address
(Linux takes a datagram for any of its addresses on any interface), to the box's address there, or
to the mDNS group gets no answer: it learns neither the host name nor the port. From the served LAN,
unicast and multicast are answered with the port (Home Assistant's discovery), and a query routed
onto the LAN from a third subnet (10.47.3.0/24, behind a router on the LAN) is not (RFC 6762's source
address check). A real daemon; the query is a real mDNS packet from zeroconf's own codec."""

from __future__ import annotations

import contextlib
import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from conftest import AS_ROOT, ROOT, Daemon, root_can
from mdns import MDNS_GROUP

from appliance.bench.daemon import free_tcp_port

SERVED, OTHER, ROUTED = "10.47.1", "10.47.2", "10.47.3"  # the subnets' first three octets
IP_MULTICAST_ALL = 49  # linux/in.h's, which Python does not name


@dataclass(frozen=True)
class Network:
    namespace: str  # where its hosts are
    host: str  # their address
    box: str  # the box's address on it


def ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


@pytest.fixture(scope="module")
def networks() -> Iterator[dict[str, Network]]:
    """The served LAN and the other network, each a namespace joined to the box by a veth pair; the
    LAN's host also holds an address of a third subnet, routed to the box through it."""
    if not AS_ROOT:
        root_can("network namespaces need root")
    made = {
        "lan": Network("web47-lan", f"{SERVED}.2", f"{SERVED}.1"),
        "other": Network("web47-other", f"{OTHER}.2", f"{OTHER}.1"),
    }
    try:
        for name, net in made.items():
            ip("netns", "add", net.namespace)
            ip("link", "add", f"w47{name}", "type", "veth", "peer", "name", "peer", "netns", net.namespace)
            ip("addr", "add", f"{net.box}/24", "dev", f"w47{name}")
            ip("link", "set", f"w47{name}", "up")
            ip("-n", net.namespace, "addr", "add", f"{net.host}/24", "dev", "peer")
            ip("-n", net.namespace, "link", "set", "peer", "up")
            ip("-n", net.namespace, "link", "set", "lo", "up")
        # the other network's hosts reach the served address through the box's address there
        ip("-n", made["other"].namespace, "route", "add", f"{SERVED}.0/24", "via", made["other"].box)
        ip("-n", made["lan"].namespace, "addr", "add", f"{ROUTED}.2/24", "dev", "peer")
        ip("route", "add", f"{ROUTED}.0/24", "via", made["lan"].host)
        yield made
    finally:
        subprocess.run(["ip", "route", "del", f"{ROUTED}.0/24"], capture_output=True)
        for net in made.values():  # the namespace's end of each pair goes with it, and the box's end too
            subprocess.run(["ip", "netns", "del", net.namespace], capture_output=True)


@pytest.fixture(scope="module")
def box(networks: dict[str, Network], tmp_path_factory: pytest.TempPathFactory, keys, bundle) -> Iterator[Daemon]:
    extra = f'[wyoming]\ntcp = "{networks["lan"].box}:{free_tcp_port()}"\n'
    d = Daemon(tmp_path_factory.mktemp("zeroconf"), bundle, keys.trusted, extra=extra).wait_ready(120)
    yield d
    assert d.stop() == 0, d.log.read_text()


def asked_from(net: Network, address: str, name: str, source: str = "", tries: int = 1) -> list[int]:
    """The ports a legacy unicast SRV query for `name`, sent to `address` from a host of `net` (from
    `tries` sockets), gets."""
    script = str(ROOT / "tests" / "mdns.py")
    query = [sys.executable, script, name, address, net.host, str(tries), *([source] if source else [])]
    done = subprocess.run(["ip", "netns", "exec", net.namespace, *query], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@contextlib.contextmanager
def responders(count: int, address: str) -> Iterator[None]:
    """`count` other mDNS responders on this host, as other boxes hold them: sockets on port 5353
    shared with SO_REUSEPORT, members of the group on `address`'s interface alone (IP_MULTICAST_ALL
    off), as zeroconf's are in a box."""
    with contextlib.ExitStack() as stack:
        for _ in range(count):
            member = stack.enter_context(socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
            member.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            member.bind(("", 5353))
            group = socket.inet_aton(MDNS_GROUP) + socket.inet_aton(address)
            member.setsockopt(socket.IPPROTO_IP, socket.IP_ADD_MEMBERSHIP, group)
            member.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
        yield


def unanswered(box: Daemon) -> str:
    """What the box and the kernel said, for a query that got no answer: the daemon's log, the
    served interface's memberships, the sockets on port 5353 and the kernel's UDP drop counters."""
    seen = [box.log.read_text()[-3000:]]
    for command in (
        ["ip", "-4", "maddr", "show", "dev", "w47lan"],
        ["ss", "-uanpe", "sport = :5353"],
        ["nstat", "-asz", "UdpIgnoredMulti", "UdpInErrors", "UdpRcvbufErrors", "IpExtInMcastPkts"],
    ):
        seen.append(subprocess.run(command, capture_output=True, text=True).stdout)
    return "\n".join(seen)


def test_zeroconf_answers_the_served_lan_alone(networks: dict[str, Network], box: Daemon) -> None:
    name = re.search(r"announced as (\S+) \(", box.log.read_text())[1]  # type: ignore[index]
    port = int(re.search(r'tcp = "[\d.]+:(\d+)"', box.config.read_text())[1])  # type: ignore[index]
    lan, other = networks["lan"], networks["other"]
    # other boxes on this host may share the name (one host name): only this box's port is judged.
    # Other responders on the box share port 5353: when the box's socket was bound to no interface,
    # the kernel handed a query from the LAN to any one of theirs (this box's got 1 of 12)
    with responders(3, "127.0.0.1"):
        # Home Assistant's discovery on the LAN, each from its own port
        assert asked_from(lan, MDNS_GROUP, name, tries=16).count(port) == 16, unanswered(box)
        assert asked_from(lan, lan.box, name, tries=16).count(port) == 16, unanswered(box)
    assert port not in asked_from(other, lan.box, name), "the other network learnt the served address's port"
    assert port not in asked_from(other, other.box, name)
    assert port not in asked_from(other, MDNS_GROUP, name)
    # another responder on the box listens on the other network (avahi, a box serving there), so the
    # box takes the group's datagrams there: the kernel was seen handing one to a box's wildcard
    # socket whose memberships are all on another interface; from 16 source ports, none is answered
    with responders(1, other.box):
        assert port not in asked_from(other, MDNS_GROUP, name, tries=16), "a query from the other network was answered"
    assert port not in asked_from(lan, lan.box, name, source=f"{ROUTED}.2"), "a query routed onto the LAN was answered"


def test_an_announcement_that_cannot_start_is_one_start_failure_line(start_daemon, tmp_path) -> None:
    """Another mDNS responder holds port 5353 for itself (no SO_REUSEPORT, which zeroconf asks for): the
    announcement cannot start, and the daemon exits with the start-failure code and one line naming
    `wyoming.tcp`, its sockets removed. In a network namespace of its own, away from the responders of
    the suite's other boxes, which share the port on this host."""
    if not AS_ROOT:
        root_can("network namespaces need root")
    namespace, address = "web47-held", f"127.0.0.1:{free_tcp_port()}"
    ip("netns", "add", namespace)
    try:
        ip("-n", namespace, "link", "set", "lo", "up")
        hold = "import socket, sys; s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind(('', 5353));"
        hold += " print('held', flush=True); sys.stdin.read()"
        holder = subprocess.Popen(
            ["ip", "netns", "exec", namespace, sys.executable, "-c", hold],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert holder.stdout is not None and holder.stdout.readline() == "held\n"
            prefix = ("ip", "netns", "exec", namespace)
            daemon = start_daemon(extra=f'[wyoming]\ntcp = "{address}"\n', wait=False, prefix=prefix)
            assert daemon.proc.wait(60) == 3, daemon.log.read_text()  # exitcodes.START_FAILED
        finally:
            holder.communicate("")
    finally:
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
    lines = [line for line in daemon.log.read_text().splitlines() if "ERROR" in line]
    assert lines == [
        f"appliance: ERROR: start failed: wyoming.tcp {address}: cannot announce it on zeroconf: "
        "[Errno 98] Address already in use (another mDNS responder holds port 5353 and does not share it: "
        "avahi's disallow-other-stacks)"
    ], daemon.log.read_text()
    assert not daemon.socket.exists() and not list(daemon.socket.parent.glob("*.sock"))
