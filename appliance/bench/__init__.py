"""`appliance bench`: the daemon measured against raw in-process ONNX Runtime, side by side in one run.

Figures: one stream one frame per request (median, p99, overhead over the raw call); 16 concurrent
streams of 256 ms chunks (frames/s against the raw single-stream rate); a 10-minute recording in
one call (against the same audio run as one sequence, in-process); the daemon's resident memory;
the same one-frame call over the Unix socket and QUIC, and against Hypercorn serving it; the eBPF
connection cache against the user-space one, under a flood.

    run            the measurements in order, into one dict of figures
    daemon         the daemon under test in a process of its own, and free ports
    measure        the raw model, timing loops, concurrent streams, transports, handshakes, test audio
    hypercorn_peer Hypercorn serving the same endpoint (asgi_peer, the app it loads), measured alike
    conncache      the eBPF connection cache against the user-space one, with a flood
    report         the figures as text, against their targets
"""
