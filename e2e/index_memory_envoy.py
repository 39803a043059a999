#!/usr/bin/env python3
"""Envoy's resident memory with the kvsteer filter's block index empty and full, at several worker
counts (every worker VM, and the main thread's, holds its own index).

    .venv/bin/python e2e/index_memory_envoy.py [--concurrency 1,2,4,8] [--replicas 4]
                                              [--cap 1000000] [--settle 20]

For each worker count it starts Envoy (envoy/envoy.yaml, `--concurrency N`) twice in front of
REPLICAS feed-only replicas (`sim/examples/flood-feed.rs`): once with empty feeds, once with each
replica's first answer a snapshot of CAP / REPLICAS blocks, so every VM's index ends up holding CAP
blocks. It waits until the index gauge reaches CAP and Envoy's resident set stops growing (no change
for 5 s, at most --settle s after that), and prints VmRSS and VmHWM (peak) of the Envoy process.
Build first: the filter (`cargo build -p kvsteer-filter --target wasm32-wasip1 --release`, or
KVSTEER_WASM=path) and `cargo build --release -p kvsteer-sim --example flood-feed`. Not a test: it
prints figures (docs/design/filter.md quotes them).
"""

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from stack import Replica, Stack, free_ports, rss_kb, target_dir, wait_http, wasm_path  # noqa: E402


def run(concurrency: int, replicas: int, blocks: int, cap: int, settle_s: float) -> tuple[int, int, int, float]:
    feed = target_dir() / "release" / "examples" / "flood-feed"
    with Stack() as s:
        for i, port in enumerate(free_ports(replicas)):
            proc = s.spawn(f"feed-r{i}", [str(feed), str(port), str(blocks), str(i)])
            r = Replica(f"r{i}", port, proc, f"r{i}_0")
            s.replicas.append(r)
            wait_http(f"http://{r.endpoint}/health", 10, proc)
        s.start_envoy("envoy", concurrency=concurrency, plugin_overrides={
            "routing": {"index_capacity_blocks": cap}})
        pid = s.envoy.popen.pid
        started = time.monotonic()
        want = blocks * replicas
        last, last_change = rss_kb(pid)[0], time.monotonic()
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            time.sleep(1)
            blocks_now = s.stats("kvsteer_index_blocks").get("wasmcustom.kvsteer_index_blocks", -1)
            rss = rss_kb(pid)[0]
            if abs(rss - last) > 1024:
                last, last_change = rss, time.monotonic()
            if blocks_now == want and time.monotonic() - last_change >= 5:
                break
            if blocks_now == want and time.monotonic() - last_change >= settle_s:
                break
        rss, hwm = rss_kb(pid)
        return rss, hwm, blocks_now, time.monotonic() - started


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--replicas", type=int, default=4)
    ap.add_argument("--cap", type=int, default=1_000_000)
    ap.add_argument("--settle", type=float, default=20)
    args = ap.parse_args()
    print(f"filter: {wasm_path()}")
    print(f"index_capacity_blocks {args.cap}, {args.replicas} replicas")
    print("| workers | index | Envoy VmRSS MiB | VmHWM MiB | index blocks (gauge) | s to settle |")
    print("|---:|---|---:|---:|---:|---:|")
    share = args.cap // args.replicas
    for n in [int(x) for x in args.concurrency.split(",")]:
        for label, blocks in (("empty", 0), ("full", share)):
            rss, hwm, got, secs = run(n, args.replicas, blocks, args.cap, args.settle)
            print(f"| {n} | {label} | {rss / 1024:.1f} | {hwm / 1024:.1f} | {got} | {secs:.0f} |",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
