"""A tiny HTTP/1.1 client for the container, which has python3 but not the appliance venv on PATH."""

import json
import socket
import sys
import threading

SOCK = "/run/appliance/api.sock"


def request(method: str, path: str, body: bytes = b"") -> tuple[int, bytes]:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(30)
    s.connect(SOCK)
    s.sendall(
        f"{method} {path} HTTP/1.1\r\nhost: x\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    data = b""
    while chunk := s.recv(65536):
        data += chunk
    head, _, payload = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), payload


what = sys.argv[1]
body = json.dumps({"inputs": [{"name": "audio", "shape": [1024], "datatype": "FP32", "data": [0.0] * 1024}]}).encode()
if what == "infer":
    status, payload = request("POST", "/v2/models/silero_vad/infer", body)
    print(status, json.loads(payload)["outputs"][0]["shape"])
elif what == "infer-async":  # a request that meets the hung engine; its connection dies with the daemon
    threading.Thread(target=lambda: request("POST", "/v2/models/silero_vad/infer", body), daemon=True).start()
    threading.Event().wait(0.5)
else:
    try:
        print(request("GET", what)[0])
    except OSError as exc:
        print(f"error {exc}")
