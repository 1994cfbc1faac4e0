"""`make bench`'s fleet figures: requests per second and p95 latency of one-frame VAD infers (KServe, over
HTTPS with kept connections) to one box directly, and through HAProxy (image/haproxy.cfg as shipped)
with 1, 2 and 3 boxes behind it. On one machine the boxes share its cores: the figures show what the
balancer costs, not how a fleet scales.

    .venv/bin/python tests/bench_fleet.py [--bundle build/firmware/default] [--requests 600] [--clients 4]
"""

from __future__ import annotations

import argparse
import http.client
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fleet import ADDRESSES, ONE_FRAME, Box, HAProxy, Ports, fleet_ca, port_free_on_all  # noqa: E402
from waits import wait_until  # noqa: E402


def measure(connect, requests: int, clients: int) -> tuple[float, float]:
    """Requests per second and p95 latency (ms) of `requests` infers from `clients` threads, back to back."""
    latencies: list[float] = []
    lock = threading.Lock()

    def client(count: int) -> None:
        connection = connect()
        mine = []
        for _ in range(count):
            started = time.perf_counter()
            connection.request(ONE_FRAME.method, ONE_FRAME.target, ONE_FRAME.body, dict(ONE_FRAME.headers))
            response = connection.getresponse()
            response.read()
            assert response.status == 200, response.status
            mine.append(time.perf_counter() - started)
        with lock:
            latencies.extend(mine)

    client(5)  # the first connection and batches off the clock
    latencies.clear()
    threads = [threading.Thread(target=client, args=(requests // clients,)) for _ in range(clients)]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    wall = time.perf_counter() - started
    latencies.sort()
    return len(latencies) / wall, 1000 * latencies[int(0.95 * (len(latencies) - 1))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--bundle", type=Path, default=Path("build/firmware/default"))
    p.add_argument("--trusted-keys", type=Path, default=Path("keys/trusted"))
    p.add_argument("--requests", type=int, default=600)
    p.add_argument("--clients", type=int, default=4)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as work:
        base = Path(work)
        ca, identities = fleet_ca(base)
        ports = Ports(*(port_free_on_all(ADDRESSES) for _ in range(3)))
        boxes = [Box(base / a, a, ports, identities[a], ca, args.trusted_keys.resolve()) for a in ADDRESSES]
        haproxy = HAProxy(base, ca, base / "balancer-combined.pem", ports)
        context = ssl.create_default_context(cafile=str(ca))
        rows = []
        try:
            for count in (1, 2, 3):
                boxes[count - 1].start(args.bundle.resolve()).wait_ready()
                names = [f"box{n + 1}" for n in range(count)]
                wait_until(lambda: all(haproxy.servers("stateless")[n]["status"] == "UP" for n in names), "UP")
                if count == 1:
                    direct = lambda: http.client.HTTPSConnection(ADDRESSES[0], ports.https, context=context)  # noqa: E731
                    rows.append(("1 box, direct", *measure(direct, args.requests, args.clients)))
                front = lambda: http.client.HTTPSConnection("127.0.0.1", haproxy.api_port, context=context)  # noqa: E731
                rows.append(
                    (
                        f"{count} box{'es' if count > 1 else ''}, through HAProxy",
                        *measure(front, args.requests, args.clients),
                    )
                )
        finally:
            haproxy.stop()
            for box in boxes:
                box.stop()
    print(f"fleet: one-frame VAD infers over HTTPS, {args.clients} clients, {args.requests} requests each row")
    for name, rate, p95 in rows:
        print(f"  {name:<28} {rate:7.0f} req/s   p95 {p95:6.1f} ms")


if __name__ == "__main__":
    main()
