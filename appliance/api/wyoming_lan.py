"""Wyoming on the LAN ([wyoming] tcp = "HOST:PORT"): the TCP listener, and its announcement by
multicast DNS (zeroconf) as _wyoming._tcp.local., so Home Assistant discovers it.

zeroconf receives on one wildcard socket (0.0.0.0:5353) whatever interfaces it is given, and on a
socket bound to each given address's port 5353: it answered a query sent to any address of the box,
and one sent to the served address from any network (Linux takes a datagram for any of its
addresses on any interface). Where Wyoming is served on one address, both are narrowed to what mDNS
needs there (_narrow): the wildcard socket to multicast datagrams to the mDNS group, of the
memberships it joined on that address's interface; the address's own socket to queries that came in
on that interface from its subnet (RFC 6762 section 11's source address check), or from the box
itself.
"""

from __future__ import annotations

import ctypes
import errno
import hmac
import ipaddress
import logging
import socket
import struct
from pathlib import Path

import ifaddr
from zeroconf import DNSQuestionType, InterfaceChoice, IPVersion
from zeroconf import Error as ZeroconfError
from zeroconf.asyncio import AsyncServiceInfo, AsyncZeroconf

from appliance.errors import ApplianceError
from appliance.networks import tcp_listener

log = logging.getLogger("appliance.wyoming")
SERVICE = "_wyoming._tcp.local."
MDNS_GROUP = "224.0.0.251"
NAME_QUERY_MS = 1500  # how long a box waits for another to answer for the name it would take
# Linux's constants Python does not name (linux/in.h, asm-generic/socket.h, linux/filter.h)
IP_MULTICAST_ALL, SO_ATTACH_FILTER, SKF_NET_OFF, SKF_AD_IFINDEX = 49, 26, -0x100000, -0x1000 + 8
# classic BPF's opcodes (linux/filter.h): loads, a mask, a comparison, the verdicts
LOAD_WORD, AND, JUMP_IF_EQUAL, RETURN = 0x20, 0x54, 0x15, 0x06
KEEP, DROP = (RETURN, 0, 0, 0xFFFFFFFF), (RETURN, 0, 0, 0)


def tcp_socket(address: str) -> socket.socket:
    """[wyoming] tcp's listening socket at "HOST:PORT" (served by the listener table's wyoming-tcp,
    announced by `announce` once bound); a failure is the start's one line naming the key."""
    host, _, port = address.rpartition(":")
    sock = tcp_listener("wyoming.tcp", host, int(port))
    sock.setblocking(False)
    return sock


async def announce(address: str, port: int, properties: dict[str, str]) -> AsyncZeroconf:
    """Wyoming on TCP `port` ([wyoming] tcp `address`) announced on the listening address's interface
    (all of them for 0.0.0.0), answering mDNS queries only there; the announcement's TXT record carries
    `properties` (the HTTPS port: `appliance fleet targets`). Closing it says goodbye on the LAN."""
    try:
        return await _announce(address, address.rpartition(":")[0], port, properties)
    except (OSError, ZeroconfError) as exc:  # no multicast on that interface, say
        held = " (another mDNS responder holds port 5353 and does not share it: avahi's disallow-other-stacks)"
        why = held if isinstance(exc, OSError) and exc.errno == errno.EADDRINUSE else ""
        raise ApplianceError(f"wyoming.tcp {address}: cannot announce it on zeroconf: {exc}{why}") from None


async def _announce(address: str, host: str, port: int, properties: dict[str, str]) -> AsyncZeroconf:
    """Wyoming on TCP `port` announced by zeroconf on `host`'s interface (every one for 0.0.0.0)."""
    everywhere = host in ("0.0.0.0", "")
    zeroconf_log = logging.getLogger("zeroconf")
    zeroconf_log.addFilter(_below_error)  # its own line for a socket it cannot bind: the start's failure says it
    try:
        zeroconf = AsyncZeroconf(interfaces=InterfaceChoice.All if everywhere else [host], ip_version=IPVersion.V4Only)
    finally:
        zeroconf_log.removeFilter(_below_error)
    try:
        if not everywhere:
            _narrow(zeroconf, host)
        name = socket.gethostname().split(".")[0] or "appliance"
        addresses = [socket.inet_aton(a) for a in (_addresses() if everywhere else [host])]
        instance = await _free_instance(zeroconf, f"appliance-{name}")
        info = AsyncServiceInfo(
            SERVICE,
            f"{instance}.{SERVICE}",
            addresses=addresses,
            port=port,
            properties=properties,
            server=f"{_lan_host(name, address)}.local.",
        )
        # boxes flashed from one image share a host name: the second one on the LAN is "appliance-NAME-2"
        await zeroconf.async_register_service(info, allow_name_change=True)
    except BaseException:  # failed, or cancelled (a stop during the start): its sockets go
        await zeroconf.async_close()
        raise
    log.info("Wyoming on TCP %s, announced as %s (peers from wyoming.allow)", address, info.name)
    return zeroconf


def _below_error(record: logging.LogRecord) -> bool:
    return record.levelno < logging.ERROR


async def _free_instance(zeroconf: AsyncZeroconf, instance: str) -> str:
    """`instance`, or the first of instance-2, -3... that no box on the LAN answers for. zeroconf's own
    probe asks for unicast answers (QU), and where several mDNS responders share port 5353 on one host
    the kernel hands a unicast answer to one of their sockets, not always the asker's: two boxes on one
    host both took the first name. A question asked for multicast answers (QM) reaches every one."""
    for number in range(1, 100):
        candidate = instance if number == 1 else f"{instance}-{number}"
        taken = AsyncServiceInfo(SERVICE, f"{candidate}.{SERVICE}")
        if not await taken.async_request(zeroconf.zeroconf, NAME_QUERY_MS, question_type=DNSQuestionType.QM):
            return candidate
    raise ApplianceError(f"[wyoming] tcp: {instance} and its next 98 names are all announced on this LAN")


def _narrow(zeroconf: AsyncZeroconf, host: str) -> None:
    """zeroconf's wildcard socket is bound to `host`'s interface and takes only datagrams to the mDNS
    group (a socket filter on the destination address, read from the IP header), and of those only
    the ones of the memberships it joined itself (IP_MULTICAST_ALL off). Bound to no interface, it
    shared port 5353 (SO_REUSEPORT) with the other responders' wildcard sockets on this host, and the
    kernel handed a query from the LAN to any one of them: beside two other boxes on loopback, this
    box's got 1 of 12. Its socket on `host` takes only datagrams that came in on `host`'s interface
    from `host`'s subnet, or from the box itself (loopback). zeroconf has no setting for either: the
    sockets are its engine's (_listen_socket and _respond_sockets, there since zeroconf 0.32),
    before its setup runs."""
    engine = zeroconf.zeroconf.engine
    listen, responders = getattr(engine, "_listen_socket", None), getattr(engine, "_respond_sockets", None)
    if not isinstance(listen, socket.socket) or not responders:
        raise ApplianceError("[wyoming] tcp: this zeroconf has no sockets to narrow to the served address")
    group = struct.unpack("!I", socket.inet_aton(MDNS_GROUP))[0]
    index, prefix = _interface_of(host)
    _attach(
        listen,
        [
            (LOAD_WORD, 0, 0, (SKF_NET_OFF + 16) & 0xFFFFFFFF),  # the IPv4 destination
            (JUMP_IF_EQUAL, 0, 1, group),  # the group: keep, else drop
            KEEP,
            DROP,
        ],
    )
    listen.setsockopt(socket.IPPROTO_IP, IP_MULTICAST_ALL, 0)
    listen.setsockopt(socket.SOL_SOCKET, socket.SO_BINDTODEVICE, socket.if_indextoname(index).encode())
    mask = (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF
    subnet = struct.unpack("!I", socket.inet_aton(host))[0] & mask
    on_link = [
        (LOAD_WORD, 0, 0, SKF_AD_IFINDEX & 0xFFFFFFFF),  # the interface it came in on
        (JUMP_IF_EQUAL, 4, 0, socket.if_nametoindex("lo")),  # from the box itself: keep
        (JUMP_IF_EQUAL, 0, 4, index),  # another interface: drop
        (LOAD_WORD, 0, 0, (SKF_NET_OFF + 12) & 0xFFFFFFFF),  # the IPv4 source
        (AND, 0, 0, mask),
        (JUMP_IF_EQUAL, 0, 1, subnet),  # from the served subnet: keep, else (routed here) drop
        KEEP,
        DROP,
    ]
    for responder in responders:
        _attach(responder, on_link)


def _attach(sock: socket.socket, program: list[tuple[int, int, int, int]]) -> None:
    """A classic BPF program as `sock`'s filter: what it returns 0 for is dropped before the socket."""
    instructions = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *i) for i in program))
    sock.setsockopt(
        socket.SOL_SOCKET, SO_ATTACH_FILTER, struct.pack("HL", len(program), ctypes.addressof(instructions))
    )


def _interface_of(host: str) -> tuple[int, int]:
    """The index of the interface that holds the address `host` (or, as loopback holds all of 127/8,
    whose network holds it), and the prefix length."""
    held = [(adapter, ip) for adapter in ifaddr.get_adapters() for ip in adapter.ips if isinstance(ip.ip, str)]
    address = ipaddress.ip_address(host)
    for exact in (True, False):
        for adapter, ip in held:
            network = ipaddress.ip_network(f"{ip.ip}/{ip.network_prefix}", strict=False)
            if (ip.ip == host) if exact else (address in network):
                return socket.if_nametoindex(adapter.name), ip.network_prefix
    raise ApplianceError(f"[wyoming] tcp: no interface of this host holds {host}")


def _lan_host(name: str, address: str) -> str:
    """The host name the announcement points to: unique to this machine and listening address, so
    two boxes with one host name, or two on one machine, do not answer for each other's address.
    From its machine id, keyed (machine-id(5): the id itself must not leave the machine)."""
    try:
        machine = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine = ""
    if not machine or machine == "uninitialized":  # a first boot's placeholder
        return f"appliance-{name}-{address.replace('.', '-').replace(':', '-')}"
    keyed = hmac.new(machine.encode(), f"appliance-wyoming {address}".encode(), "sha256").hexdigest()[:8]
    return f"appliance-{name}-{keyed}"


def _addresses() -> list[str]:
    """This host's IPv4 addresses but loopback, for an announcement on every interface."""
    found = {a.ip for adapter in ifaddr.get_adapters() for a in adapter.ips if isinstance(a.ip, str)}
    return sorted(a for a in found if not a.startswith("127.")) or ["127.0.0.1"]
