"""The bench's figures as text, each against its target where it has one."""

from __future__ import annotations

from typing import Any

TARGETS = {
    "overhead_us": 200.0,
    "streams16_ratio": 1.5,
    "recording_ratio": 1.5,
    "rss_mib": 250.0,
    "live_p99_ms": 100.0,
    "batching_ratio": 3.0,
}


def report(r: dict[str, Any]) -> list[str]:
    """The lines `appliance bench` prints for the figures of run.run."""
    ok = {
        "overhead_us": r["overhead_us"] <= TARGETS["overhead_us"],
        "streams16_ratio": r["streams16_ratio"] >= TARGETS["streams16_ratio"],
        "recording_ratio": r["recording_ratio"] >= TARGETS["recording_ratio"],
        "rss_mib": r["rss_mib"] < TARGETS["rss_mib"],
        "live_p99_ms": r["live_during_recording"]["p99_ms"] <= TARGETS["live_p99_ms"],
        "batching_ratio": r["generic"]["batching_ratio"] >= TARGETS["batching_ratio"],
    }
    mark = {True: "ok", False: "MISSED"}
    lines = [f"appliance bench: {r['firmware']} on {r['cpu_count']} CPUs"]
    lines.append(
        f"  raw ONNX Runtime, 1 frame/call     median {r['raw_one_frame']['median_us']:8.1f} us  p99 {r['raw_one_frame']['p99_us']:8.1f} us  ({r['raw_frames_per_s']} frames/s)"
    )
    lines.append(
        f"  daemon, 1 frame/request, binary    median {r['daemon_one_frame']['median_us']:8.1f} us  p99 {r['daemon_one_frame']['p99_us']:8.1f} us"
    )
    lines.append(
        f"  overhead (median)                  {r['overhead_us']:8.1f} us   target <= {TARGETS['overhead_us']:.0f} us   {mark[ok['overhead_us']]}"
    )
    polled = r["daemon_one_frame_busy_poll"]
    lines.append(
        f"  same, client busy-polling 5 ms     median {polled['median_us']:8.1f} us  p99 {polled['p99_us']:8.1f} us  overhead {r['overhead_busy_poll_us']:.1f} us"
    )
    lines.append(
        f"  16 streams x 256 ms chunks         {r['streams16_frames_per_s']} frames/s = {r['streams16_ratio']}x raw   target >= 1.5x   {mark[ok['streams16_ratio']]}"
    )
    rec = r["recording_600s"]
    lines.append(
        f"  10 min recording, one call         {rec['daemon_sharded_s']} s vs one sequence {rec['one_sequence_s']} s = {r['recording_ratio']}x   target >= 1.5x   {mark[ok['recording_ratio']]}"
    )
    live = r["live_during_recording"]
    lines.append(
        f"  live stream during a 34 min recording  p99 {live['p99_ms']} ms (max {live['max_ms']} ms, {live['frames']} frames; "
        f"recording took {live['recording_s']} s)   target <= {TARGETS['live_p99_ms']:.0f} ms   {mark[ok['live_p99_ms']]}"
    )
    lines.append(f"  event-loop lag meanwhile           p99 <= {live['loop_lag_p99_ms']} ms (the histogram's bucket)")
    lines.append(
        f"  health meanwhile (every 20 ms)     p99 {live['health_p99_ms']} ms ({live['health_checks']} checks)   "
        f"target < 50 ms   {mark[live['health_p99_ms'] < 50]}"
    )
    lines.append(f"  daemon resident memory             {r['rss_mib']} MiB   target < 250 MiB   {mark[ok['rss_mib']]}")
    lines.append("  one-frame binary infer, by transport (median / p99 latency, requests per second):")
    rows = [(f"daemon {name.replace('_', ', ')} streams", v) for name, v in r["transports"].items()]
    if isinstance(r["hypercorn"], dict):
        rows += [(f"Hypercorn {name.replace('_', ', ')} streams", v) for name, v in r["hypercorn"].items()]
    else:
        lines.append(f"    Hypercorn peer: {r['hypercorn']}")
    for label, v in rows:
        lines.append(f"    {label:30} {v['median_us']:8.1f} us  {v['p99_us']:8.1f} us  {v['rps']:6} req/s")
    hs = r["quic_handshake"]
    lines.append(
        f"  QUIC full handshake + GET {hs['full_median_us']:.0f} us; resumed, GET in 0-RTT {hs['resumed_0rtt_median_us']:.0f} us"
    )
    if isinstance(r["hypercorn"], dict):
        for n in (1, 16):
            ours, peer = r["transports"][f"quic_{n}"], r["hypercorn"][f"quic_{n}"]
            lines.append(
                f"  QUIC vs Hypercorn at {n:2} streams: {ours['rps'] / peer['rps']:.2f}x throughput, "
                f"p99 {ours['p99_us']:.0f} vs {peer['p99_us']:.0f} us"
            )
    lines.append(
        "  connection cache (QUIC, 16 streams; then 1 stream on 127.0.0.3 without and with a flood from 127.0.0.2):"
    )
    for backend, c in r["conncache"].items():
        if isinstance(c, str):
            lines.append(f"    {backend}: {c}")
            continue
        f = c["flood"]
        lines.append(
            f"    {backend:5} {c['quic_16']['rps']:6} req/s; p99 {c['quiet_1']['p99_us']:.0f} us quiet, "
            f"{c['flooded_1']['p99_us']:.0f} us flooded ({c['flooded_1']['rps']} req/s); flood {f['sent']} sent, "
            f"{f['admitted']} admitted, {f['dropped']} dropped"
        )
    both = r["conncache"]
    if all(isinstance(both.get(b), dict) for b in ("ebpf", "user")):
        lines.append(
            f"  eBPF filter vs user-space table: {both['ebpf']['quic_16']['rps'] / both['user']['quic_16']['rps']:.2f}x "
            "QUIC throughput"
        )
    g = r["generic"]
    lines.append(
        f"  own model: MLP of {g['parameters'] / 1e6:.1f} M parameters, {g['clients']} clients of one row each: "
        f"{g['requests_per_s']['batching']} req/s batched vs {g['requests_per_s']['no_batching']} req/s with max_batch 1 "
        f"= {g['batching_ratio']}x   target >= {TARGETS['batching_ratio']:.0f}x   {mark[ok['batching_ratio']]}"
    )
    lines.append(
        f"    one row: raw ONNX Runtime {g['raw_onnxruntime_one_row_us']} us, daemon {g['daemon_one_row_us']} us: "
        f"{g['overhead_per_request_us']} us per request over the raw call"
    )
    return lines
