#!/usr/bin/env python3
"""Envoy's memory while many clients upload large request bodies slowly (docs/reports/uploads.md).

Why: the filter routes on the body, so Envoy holds each request until its body has arrived, and the
filter used to copy every arriving slice into its VM's memory, which WebAssembly never gives back.
This starts 4 simulated replicas and Envoy 1.40 (`--concurrency 2`, `envoy/envoy.yaml` or another
variant, the built release filter) on 127.0.0.1 and sends `--bursts` bursts of `--clients` concurrent
`POST /v1/completions`, each on its own connection, each a ~`--body-mb` MB JSON body (a token-id
prompt, which the filter's early scan follows, or `--text` for a text prompt) written in
`--chunk-kb` KiB chunks spread over `--seconds` s. It samples Envoy's RSS (`/proc/<pid>/status`)
and its heap (`/memory`'s `allocated`: Envoy's own buffers; the rest of the growth is mostly the
VMs' WebAssembly memories) every 0.25 s and prints, per burst, the peak during it and the figure
2 s after it, the filter's counters, and every request's status. Not a test: it prints figures
(`e2e/test_slow_uploads.py` is the test).

    .venv/bin/python e2e/bench_slow_uploads.py                    # the filter as shipped
    .venv/bin/python e2e/bench_slow_uploads.py --plugin '{"early_body_scan": false}'
    .venv/bin/python e2e/bench_slow_uploads.py --variant envoy-round-robin   # no filter at all
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import sys
import threading
import time
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from stack import Stack, rss_kb  # noqa: E402

MIB = 1024 * 1024


def body_bytes(target: int, seed: int, text: bool, padded: bool = False) -> bytes:
    """A completions body of about `target` bytes: a flat token-id prompt (about 6 bytes an id), or
    text words; distinct seeds give distinct prompts. `padded`: a 1,024-id prompt followed by a
    `user` member that makes up the size (the bytes cost the proxy and the filter what a long
    prompt's do, without the KV index and the replicas' feeds growing with them)."""
    rng = random.Random(seed)
    if padded:
        ids = ",".join(str(rng.randrange(1, 32000)) for _ in range(1024))
        pad = "u" * max(0, target - len(ids))
        return ('{"model": "sim", "prompt": [%s], "max_tokens": 4, "user": "%s"}'
                % (ids, pad)).encode()
    if text:
        words = []
        n = 0
        while n < target:
            w = "w%d" % rng.randrange(1, 32000)
            words.append(w)
            n += len(w) + 1
        prompt = json.dumps(" ".join(words))
    else:
        ids = []
        n = 0
        while n < target:
            t = str(rng.randrange(1, 32000))
            ids.append(t)
            n += len(t) + 1
        prompt = "[" + ",".join(ids) + "]"
    return ('{"model": "sim", "prompt": %s, "max_tokens": 4}' % prompt).encode()


@dataclass
class Upload:
    status: int = 0
    error: str = ""
    seconds: float = 0.0
    headers: dict = field(default_factory=dict)


def upload(port: int, body: bytes, seconds: float, chunk: int, out: Upload,
           timeout_s: float = 120.0) -> None:
    """One request on its own connection: the headers, then `body` in `chunk`-byte writes spread
    evenly over `seconds`, then the response read to its end (Content-Length or close)."""
    t0 = time.monotonic()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            head = (f"POST /v1/completions HTTP/1.1\r\nhost: kvsteer\r\n"
                    f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                    f"connection: close\r\n\r\n").encode()
            s.sendall(head)
            n = max(1, (len(body) + chunk - 1) // chunk)
            for i in range(n):
                s.sendall(body[i * chunk:(i + 1) * chunk])
                # Paced against the clock, not by sleeps alone, so a loaded machine still spreads
                # the body over about `seconds`.
                due = t0 + seconds * (i + 1) / n
                d = due - time.monotonic()
                if d > 0:
                    time.sleep(d)
            data = b""
            while True:
                b = s.recv(65536)
                if not b:
                    break
                data += b
            line, _, rest = data.partition(b"\r\n")
            parts = line.split()
            out.status = int(parts[1]) if len(parts) > 1 else 0
            hdrs, _, _ = rest.partition(b"\r\n\r\n")
            for h in hdrs.split(b"\r\n"):
                k, _, v = h.partition(b":")
                out.headers[k.strip().lower().decode(errors="replace")] = v.strip().decode(
                    errors="replace")
    except OSError as e:
        out.error = f"{type(e).__name__}: {e}"
    out.seconds = time.monotonic() - t0


def heap_mib(s: Stack) -> float:
    """Envoy's heap in use (its allocator's `allocated`: HTTP buffers, shared data, callouts)."""
    return memory_mib(s)[0]


def memory_mib(s: Stack) -> tuple[float, float]:
    """Envoy's heap in use, and the heap's pages resident (`total_physical_bytes`: in use, and
    freed but kept by the allocator); what RSS holds beyond the latter is mostly the VMs' memories
    (and V8's code), which WebAssembly never gives back."""
    try:
        m = json.loads(s.admin("/memory"))
        return int(m["allocated"]) / MIB, int(m["total_physical_bytes"]) / MIB
    except Exception:  # noqa: BLE001 - a figure missing from one sample, not a failure
        return float("nan"), float("nan")


def burst(s: Stack, bodies: list[bytes], seconds: float, chunk: int) -> dict:
    """One burst of concurrent slow uploads; Envoy's memory sampled throughout."""
    pid = s.envoy.popen.pid
    outs = [Upload() for _ in bodies]
    threads = [threading.Thread(target=upload, args=(s.listen_port, b, seconds, chunk, o),
                                daemon=True) for b, o in zip(bodies, outs)]
    rss0 = rss_kb(pid)[0] / 1024
    heap0, phys0 = memory_mib(s)
    peak_rss, peak_heap = rss0, heap0
    for t in threads:
        t.start()
    while any(t.is_alive() for t in threads):
        time.sleep(0.25)
        peak_rss = max(peak_rss, rss_kb(pid)[0] / 1024)
        peak_heap = max(peak_heap, heap_mib(s))
    for t in threads:
        t.join()
    time.sleep(2.0)
    return {
        "rss_before": rss0, "heap_before": heap0, "rss_peak": peak_rss, "heap_peak": peak_heap,
        "rss_after": rss_kb(pid)[0] / 1024, "heap_after": heap_mib(s), "hwm": rss_kb(pid)[1] / 1024,
        "heap_phys_after": memory_mib(s)[1], "heap_phys_before": phys0,
        "statuses": sorted({o.status for o in outs}), "ok": sum(o.status == 200 for o in outs),
        "errors": [o.error for o in outs if o.error][:3], "n": len(outs),
        "slowest_s": max(o.seconds for o in outs),
    }


def kvsteer_counters(s: Stack) -> dict[str, int]:
    return {k.removeprefix("wasmcustom."): v for k, v in s.stats("wasmcustom.kvsteer").items()
            if any(w in k for w in ("fallback", "early_scan", "held"))}


def run(args) -> list[dict]:
    plugin = json.loads(args.plugin) if args.plugin else None
    rows = []
    with Stack() as s:
        # A prompt of ~500K token ids is past the simulated model's context and cache by default.
        s.start_replicas(4, extra=["--time-scale", args.time_scale, "--max-model-len", "2000000",
                                   "--kv-blocks", "200000"])
        s.start_envoy(args.variant, concurrency=2, plugin_overrides=plugin,
                      wait_feeds=args.variant == "envoy")
        s.wait_healthy()
        pid = s.envoy.popen.pid
        rss_start = rss_kb(pid)[0] / 1024
        heap, phys = memory_mib(s)
        print(f"Envoy RSS at start {rss_start:.1f} MiB, heap {heap:.1f} MiB (pages resident "
              f"{phys:.1f}, the rest of RSS {rss_start - phys:.1f})", flush=True)
        target = int(args.body_mb * 1e6)
        for b in range(args.bursts):
            # The same bodies each burst by default: after the first, the filter's index already
            # holds their blocks, so what a repeat adds is what the bodies cost, not the index.
            seed = 1000 * b if args.fresh else 0
            bodies = [body_bytes(target, seed + i, args.text, args.padded)
                      for i in range(args.clients)]
            r = burst(s, bodies, args.seconds, args.chunk_kb * 1024)
            r["burst"] = b + 1
            r["counters"] = kvsteer_counters(s) if args.variant == "envoy" else {}
            rows.append(r)
            print(f"burst {b + 1}: RSS {r['rss_before']:.1f} -> peak {r['rss_peak']:.1f} -> "
                  f"{r['rss_after']:.1f} MiB after (VmHWM {r['hwm']:.1f}); heap "
                  f"{r['heap_before']:.1f} -> peak {r['heap_peak']:.1f} -> {r['heap_after']:.1f} "
                  f"MiB (heap pages resident {r['heap_phys_after']:.1f}, the rest of RSS "
                  f"{r['rss_after'] - r['heap_phys_after']:.1f}); {r['ok']}/{r['n']} ok, statuses {r['statuses']}, slowest "
                  f"{r['slowest_s']:.1f} s {r['errors']} {r['counters']}", flush=True)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--clients", type=int, default=30)
    p.add_argument("--body-mb", type=float, default=3.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--chunk-kb", type=int, default=8)
    p.add_argument("--bursts", type=int, default=3)
    p.add_argument("--text", action="store_true", help="a text prompt instead of token ids")
    p.add_argument("--padded", action="store_true",
                   help="a 1,024-id prompt and a long `user` member instead of a long prompt")
    p.add_argument("--fresh", action="store_true",
                   help="new prompts each burst (the index grows with them) instead of the same")
    p.add_argument("--variant", default="envoy", help="envoy/<variant>.yaml")
    p.add_argument("--plugin", default="", help="JSON merged into the filter's configuration")
    p.add_argument("--time-scale", default="1000")
    args = p.parse_args()
    rows = run(args)
    bad = sum(r["n"] - r["ok"] for r in rows)
    print("\n| burst | RSS before | RSS peak | RSS after | heap in use, peak | heap pages after "
          "| RSS after less heap pages | ok |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['burst']} | {r['rss_before']:.1f} | {r['rss_peak']:.1f} | {r['rss_after']:.1f} "
              f"| {r['heap_peak']:.1f} | {r['heap_phys_after']:.1f} "
              f"| {r['rss_after'] - r['heap_phys_after']:.1f} | {r['ok']}/{r['n']} |")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
