"""TLS material from local files: `appliance tls init` makes a self-signed certificate, offline."""

from __future__ import annotations

import datetime
import ipaddress
import socket
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from appliance.config import Config
from appliance.durable import make_directories, replace_file
from appliance.errors import ApplianceError


def init_self_signed(cert_path: Path, key_path: Path, names: list[str], days: int = 825) -> str:
    """Write a P-256 key (0600) and a self-signed certificate (0644) for the box, in directories made 0755,
    whatever the umask; return the certificate's SHA-256 fingerprint. It is its own CA (a phone installs
    it as one, docs/https.md) and meets what iOS asks of a server certificate it trusts: at most 825
    days, serverAuth in its extended key usage, the names in subjectAltName."""
    key = ec.generate_private_key(ec.SECP256R1())
    hostname = socket.gethostname()
    # HOSTNAME.local too: what a phone on the LAN reaches the box by, where mDNS announces it
    dns = sorted({hostname, f"{hostname.split('.')[0]}.local", "localhost", *[n for n in names if not _is_ip(n)]})
    ips = sorted({"127.0.0.1", "::1", *[n for n in names if _is_ip(n)]})
    subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, hostname)])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(subject)
        .issuer_name(subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=days))
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.DNSName(n) for n in dns] + [x509.IPAddress(ipaddress.ip_address(i)) for i in ips]
            ),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False), critical=True
        )  # digitalSignature (the TLS handshake), keyCertSign and cRLSign (its own CA)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .sign(key, hashes.SHA256())
    )
    make_directories(key_path.parent)
    make_directories(cert_path.parent)
    replace_file(
        key_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
        mode=0o600,
    )
    replace_file(cert_path, cert.public_bytes(serialization.Encoding.PEM), mode=0o644)
    return cert.fingerprint(hashes.SHA256()).hex()


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def certificate_identity(cert_path: Path) -> tuple[bytes, str]:
    """The certificates of `cert_path` as PEM (only they: a file that also holds a key does not give it
    away) and the SHA-256 fingerprint of the first, the box's own, as lower-case hex."""
    try:
        certificates = x509.load_pem_x509_certificates(cert_path.read_bytes())
    except (OSError, ValueError) as exc:
        raise ValueError(f"{cert_path}: no PEM certificate to read ({exc})") from None
    pem = b"".join(c.public_bytes(serialization.Encoding.PEM) for c in certificates)
    return pem, certificates[0].fingerprint(hashes.SHA256()).hex()


def colon_hex(fingerprint: str) -> str:
    """AB:CD:...: a fingerprint as browsers and phones show it."""
    return ":".join(fingerprint[i : i + 2] for i in range(0, len(fingerprint), 2)).upper()


def tls_identity(config: Config) -> tuple[bytes, dict[str, Any]]:
    """The PEM the box serves at /tls/certificate.pem, and /status's `tls`: the file and its fingerprint."""
    try:
        pem, fingerprint = certificate_identity(config.quic.certificate)
    except ValueError as exc:
        raise ApplianceError(f"quic.certificate: {exc}") from None
    return pem, {
        "certificate": str(config.quic.certificate),
        "sha256": colon_hex(fingerprint),
        "mutual_tls": bool(config.quic.client_ca.name),
        "https_port": config.https.port if config.https.enabled else None,
    }
