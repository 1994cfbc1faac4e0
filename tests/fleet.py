"""What the fleet tests share: HAProxy's agent read as HAProxy reads it, a bounded wait, one VAD frame;
the fleet's CA and identities, a box on its own loopback address, HAProxy on image/haproxy.cfg."""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import socket
import subprocess
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from conftest import APPLIANCE, ROOT
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from waits import wait_until

from appliance.client import Client, ClientError, infer_call

FRAME = (np.sin(np.arange(512) / 8) * 0.1).astype(np.float32)  # one VAD frame: a stateless infer
ONE_FRAME = infer_call("silero_vad", FRAME)


def agent_says(host: str, port: int) -> str:
    """The line the box's agent answers (HAProxy's agent-check connects, reads a line, closes)."""
    with socket.create_connection((host, port), timeout=10) as s:
        answer = b""
        while chunk := s.recv(100):
            answer += chunk
    return answer.decode()


def answers(host: str, port: int) -> bool:
    try:
        agent_says(host, port)
    except OSError:
        return False
    return True


# --- the fleet: three boxes on 127.0.0.2, .3 and .4, HAProxy on 127.0.0.1 ------------------------------

ADDRESSES = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
BALANCER_SOURCE = "127.0.0.9"  # HAProxy connects to the boxes from here: their [fleet] proxies


def port_free_on_all(addresses: tuple[str, ...]) -> int:
    """A TCP port free on every address (the boxes share port numbers, as a real fleet does)."""
    while True:
        with socket.socket() as s:
            s.bind((addresses[0], 0))
            port = s.getsockname()[1]
        try:
            for address in addresses[1:]:
                with socket.socket() as s:
                    s.bind((address, port))
            return port
        except OSError:
            continue


def fleet_ca(base: Path) -> tuple[Path, dict[str, tuple[Path, Path]]]:
    """The operator's fleet CA, a server certificate it signed for each box and one for the balancer
    (127.0.0.1 in each: what clients of the fleet dial), and the balancer's cert+key PEM for HAProxy."""
    now = datetime.datetime.now(datetime.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "fleet-ca")])

    def signed(name: str, key: Any, ca: bool, ips: list[str]) -> x509.Certificate:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)]))
            .issuer_name(ca_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if not ca:
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False
            ).add_extension(
                x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(i)) for i in ips]), critical=False
            )
        return builder.sign(ca_key, hashes.SHA256())

    def pem(cert: x509.Certificate) -> bytes:
        return cert.public_bytes(serialization.Encoding.PEM)

    def key_pem(key: Any) -> bytes:
        return key.private_bytes(
            serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
        )

    ca_path = base / "fleet-ca.pem"
    ca_path.write_bytes(pem(signed("fleet-ca", ca_key, True, [])))
    identities = {}
    for name, ips in [*((a, ["127.0.0.1", a]) for a in ADDRESSES), ("balancer", ["127.0.0.1"])]:
        key = ec.generate_private_key(ec.SECP256R1())
        cert_path, key_path = base / f"{name}.pem", base / f"{name}.key"
        cert_path.write_bytes(pem(signed(name, key, False, ips)))
        key_path.write_bytes(key_pem(key))
        key_path.chmod(0o600)
        identities[name] = (cert_path, key_path)
    cert, key = identities["balancer"]
    (base / "balancer-combined.pem").write_bytes(cert.read_bytes() + key.read_bytes())
    return ca_path, identities


@dataclass
class Ports:
    https: int
    wyoming: int
    agent: int


class Box:
    """One box of the fleet: `appliance run` on its own address, with its own config, sockets and
    identity; stopped, killed and started again on another firmware on the same addresses."""

    def __init__(
        self,
        workdir: Path,
        address: str,
        ports: Ports,
        identity: tuple[Path, Path],
        operator_ca: Path,
        trusted: Path,
        extra: str = "",
        wyoming: str = "",
    ) -> None:
        """`extra`: config lines after its [fleet] table; `wyoming`: lines of its [wyoming] table."""
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir, self.address, self.ports, self.identity = workdir, address, ports, identity
        self.operator_ca, self.trusted, self.extra, self.wyoming = operator_ca, trusted, extra, wyoming
        self.socket = workdir / "api.sock"
        self.proc: subprocess.Popen[bytes] | None = None
        self.starts = 0

    def config(self, bundle: Path) -> str:
        cert, key = self.identity
        return (
            f'[server]\nsocket = "{self.socket}"\nworkers = 1\nshutdown_grace_s = 120.0\n'
            f'[firmware]\nbundle = "{bundle}"\ntrusted_keys = "{self.trusted}"\n'
            f'[quic]\ncertificate = "{cert}"\nprivate_key = "{key}"\noperator_ca = "{self.operator_ca}"\n'
            f'[https]\nenabled = true\nhost = "{self.address}"\nport = {self.ports.https}\n'
            f'[wyoming]\ntcp = "{self.address}:{self.ports.wyoming}"\n{self.wyoming}'
            f'[fleet]\nagent_address = "{self.address}:{self.ports.agent}"\nproxies = "{BALANCER_SOURCE}/32"\n'
            f"{self.extra}"
        )

    def start(self, bundle: Path, env: dict[str, str] | None = None) -> Box:
        self.starts += 1
        path = self.workdir / f"appliance-{self.starts}.toml"
        path.write_text(self.config(bundle))
        self.log = self.workdir / f"daemon-{self.starts}.log"
        self.proc = subprocess.Popen(
            [*APPLIANCE, "run", "--config", str(path)],
            cwd=ROOT,
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        return self

    def wait_ready(self) -> Box:
        assert self.proc is not None

        def ready() -> bool:
            assert self.proc is not None and self.proc.poll() is None, self.log.read_text()
            try:
                with Client(str(self.socket), timeout=10) as client:
                    return bool(client.health()["ready"])
            except (OSError, ClientError):
                return False

        wait_until(ready, f"box {self.address} ready")
        return self

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class HAProxy:
    """Debian's haproxy running image/haproxy.cfg as shipped, its values from the environment."""

    def __init__(self, workdir: Path, ca: Path, balancer_pem: Path, ports: Ports) -> None:
        self.stats = workdir / "haproxy.sock"
        self.api_port, self.sessions_port, self.wyoming_port = (port_free_on_all(("127.0.0.1",)) for _ in range(3))
        self.env = {
            "FLEET_ADDRESS": "127.0.0.1",
            "API_PORT": str(self.api_port),
            "SESSIONS_PORT": str(self.sessions_port),
            "WYOMING_FRONT_PORT": str(self.wyoming_port),
            "HTTPS_PORT": str(ports.https),
            "WYOMING_PORT": str(ports.wyoming),
            "AGENT_PORT": str(ports.agent),
            "FLEET_CA": str(ca),
            "BALANCER_PEM": str(balancer_pem),
            "HAPROXY_STATS_SOCKET": str(self.stats),
            "HAPROXY_LOG": "stdout",
            "BALANCER_SOURCE": BALANCER_SOURCE,
            **{f"BOX{i + 1}": address for i, address in enumerate(ADDRESSES)},
        }
        self.log = workdir / "haproxy.log"
        self.proc = subprocess.Popen(
            ["haproxy", "-db", "-f", str(ROOT / "image" / "haproxy.cfg")],
            env={**os.environ, **self.env},
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )
        wait_until(lambda: self._running() and self.stats.exists(), "HAProxy's stats socket")

    def _running(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        return True

    def command(self, line: str) -> str:
        with socket.socket(socket.AF_UNIX) as s:
            s.connect(str(self.stats))
            s.sendall(line.encode() + b"\n")
            out = b""
            while chunk := s.recv(65536):
                out += chunk
        return out.decode()

    def servers(self, backend: str) -> dict[str, dict[str, str]]:
        """`show stat` of a backend's servers, by name: status (UP, DOWN, DRAIN, MAINT), weight, stot..."""
        lines = self.command("show stat").splitlines()
        header = lines[0].lstrip("# ").split(",")
        rows = [dict(zip(header, line.split(","), strict=False)) for line in lines[1:] if line]
        return {r["svname"]: r for r in rows if r["pxname"] == backend and r["svname"] not in ("FRONTEND", "BACKEND")}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)


class Prometheus:
    """Debian's prometheus running image/prometheus.yml as shipped, its paths and interval replaced."""

    def __init__(self, workdir: Path, fleet_ca: Path, operator: tuple[str, str], targets: Path) -> None:
        text = (ROOT / "image" / "prometheus.yml").read_text()
        for shipped, here in (
            ("/etc/prometheus/fleet-ca.pem", str(fleet_ca)),
            ("/etc/prometheus/operator-client.pem", operator[0]),
            ("/etc/prometheus/operator-client.key", operator[1]),
            ("/etc/prometheus/appliance-boxes.json", str(targets)),
            ("scrape_interval: 15s", "scrape_interval: 1s"),
            ("scrape_timeout: 10s", "scrape_timeout: 1s"),
            ("refresh_interval: 1m", "refresh_interval: 1s"),
        ):
            assert shipped in text, shipped
            text = text.replace(shipped, here)
        config = workdir / "prometheus.yml"
        config.write_text(text)
        self.port = port_free_on_all(("127.0.0.1",))
        self.log = workdir / "prometheus.log"
        self.proc = subprocess.Popen(
            [
                "prometheus",
                f"--config.file={config}",
                f"--storage.tsdb.path={workdir / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
            ],
            stdout=self.log.open("wb"),
            stderr=subprocess.STDOUT,
        )

    def query(self, promql: str) -> list[dict[str, Any]]:
        assert self.proc.poll() is None, self.log.read_text()
        url = f"http://127.0.0.1:{self.port}/api/v1/query?" + urllib.parse.urlencode({"query": promql})
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return list(json.load(response)["data"]["result"])
        except OSError:  # not listening yet
            return []

    def versions(self) -> dict[str, str]:
        """Each scraped box's firmware version, as Prometheus holds it now (its latest scrape)."""
        return {r["metric"]["instance"]: r["metric"]["version"] for r in self.query("appliance_firmware_info")}

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(30)
