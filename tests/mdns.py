"""A legacy unicast mDNS query for a service instance's SRV record, as `dig -p 5353` asks: the ports a
box answers with. Run as a script (`python tests/mdns.py NAME ADDRESS INTERFACE TRIES [SOURCE]`, it
prints the ports as JSON) to ask from another network namespace (`ip netns exec NS ...`)."""

from __future__ import annotations

import contextlib
import json
import random
import socket
import sys

from zeroconf import DNSIncoming, DNSOutgoing, DNSQuestion, DNSService

SRV, IN = 33, 1  # DNS's record type and class numbers
MDNS_GROUP = "224.0.0.251"


def srv_ports(name: str, address: str, tries: int = 1, interface: str = "127.0.0.1", source: str = "") -> list[int]:
    """The ports in the SRV records of `name` that answer a legacy unicast query (from a port other
    than 5353) sent to port 5353 at `address` (the mDNS group: out of `interface`), from `source`
    where given, from `tries` sockets: several boxes' sockets share port 5353 (SO_REUSEPORT), and the
    kernel hands a datagram to one of them by its source port. Answers are read for a second after
    the last (the first socket waits 5 s for the group's, 1 s for an address's; the others 0.3 s)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_DGRAM) for _ in range(tries)]
    ports: list[int] = []
    with contextlib.ExitStack() as stack:
        # each its own id, as dig's: a responder drops a datagram the same as one it took within a second
        for sock, query_id in zip(sockets, random.sample(range(1, 1 << 16), tries), strict=True):
            stack.enter_context(sock)
            sock.setsockopt(socket.IPPROTO_IP, socket.IP_MULTICAST_IF, socket.inet_aton(interface))
            if source:
                sock.bind((source, 0))
            query = DNSOutgoing(0, multicast=False, id_=query_id)
            query.add_question(DNSQuestion(name, SRV, IN))
            sock.sendto(query.packets()[0], (address, 5353))
        for number, sock in enumerate(sockets):  # the answers to the others come while the first waits
            sock.settimeout((5.0 if address == MDNS_GROUP else 1.0) if number == 0 else 0.3)
            with contextlib.suppress(TimeoutError):
                while True:
                    answer = DNSIncoming(sock.recv(9000))
                    ports += [
                        r.port for r in answer.answers() if isinstance(r, DNSService) and r.name.lower() == name.lower()
                    ]
                    sock.settimeout(1.0)
    return ports


if __name__ == "__main__":
    name, address, interface, tries, *source = sys.argv[1:]
    print(json.dumps(srv_ports(name, address, int(tries), interface, source[0] if source else "")))
