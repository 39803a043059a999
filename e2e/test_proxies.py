"""End-to-end: two independent Envoy processes (each `--concurrency 2`, each its own filter VMs and
shared data) in front of the same two simulated replicas (issue 15, docs/proxies.md). Nothing passes
between the Envoys but the replicas' feeds: proxy B learns of a long decode sent through proxy A only
from the replica's report.

Run by scripts/e2e (`scripts/e2e test_proxies`); needs the release wasm and the sim binary.
"""

from __future__ import annotations

import os
import threading
import time
import unittest
import urllib.request

from client import Client, Result, tokens
from stack import Stack

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
# A feed poll of B (every 200 ms) after the long decode started, plus the relay to B's other worker
# (next 100 ms tick), with margin.
FEED_SETTLE_S = 0.8


def decode_blocks(endpoint: str) -> float:
    """The replica's own `kvsteer_sim:decode_blocks` gauge."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("kvsteer_sim:decode_blocks"))


def two_envoys(reported_load: str) -> tuple[Stack, Stack]:
    """Replicas and Envoy A in one stack; Envoy B in a second stack sharing A's replicas (B stops
    only its own Envoy)."""
    overrides = {"routing": {"kv_load": {"reported_load": reported_load}}}
    a, b = Stack(), Stack()
    try:
        a.start_replicas(2, extra=["--time-scale", TIME_SCALE])
        a.start_envoy("envoy", concurrency=2, plugin_overrides=overrides)
        b.replicas = a.replicas
        b.start_envoy("envoy", concurrency=2, plugin_overrides=overrides)
    except BaseException:
        b.close()
        a.close()
        raise
    return a, b


class TwoEnvoysOneFleet(unittest.TestCase):
    """A long decode through Envoy A; then four short requests at once through Envoy B. With
    `reported_load: merge` B keeps all four off the replica decoding A's request; with `ignore` it
    balances them over both replicas as if both were idle (it sees only its own bookings)."""

    def run_case(self, reported_load: str) -> tuple[str, list[str]]:
        a, b = two_envoys(reported_load)
        long_result: list[Result] = []
        try:
            client = Client("127.0.0.1", a.listen_port, timeout_s=120)
            t = threading.Thread(
                target=lambda: long_result.append(client.complete(
                    tokens(4096, 70_000), max_tokens=8000, stream=True, ignore_eos=True)),
                daemon=True)
            t.start()
            # Which replica took it: the one whose own gauge shows its decode.
            deadline = time.monotonic() + 10
            busy = None
            while busy is None and time.monotonic() < deadline:
                loads = {r.name: decode_blocks(r.endpoint) for r in a.replicas}
                hot = [n for n, v in loads.items() if v >= 200]
                busy = hot[0] if len(hot) == 1 else None
                time.sleep(0.05)
            self.assertIsNotNone(busy, "the long request is decoding on one replica")
            time.sleep(FEED_SETTLE_S)
            results: list[Result] = [None] * 4  # type: ignore[list-item]

            def short(i: int) -> None:
                c = Client("127.0.0.1", b.listen_port)
                try:
                    results[i] = c.complete(tokens(64, 71_000 + i), max_tokens=200,
                                            ignore_eos=True)
                finally:
                    c.close()

            shorts = [threading.Thread(target=short, args=(i,), daemon=True) for i in range(4)]
            for s in shorts:
                s.start()
            for s in shorts:
                s.join(60)
            landed = []
            for r in results:
                self.assertTrue(r is not None and r.ok, r)
                rep = a.by_sim_name(r.replica)
                self.assertIsNotNone(rep, r)
                landed.append(rep.name)
            # The long decode is still running: the contrast above is not an artefact of it ending.
            self.assertEqual(long_result, [], "the long decode outlived the test's requests")
            self.assertEqual(a.vm_failures() + b.vm_failures(), [])
            return busy, landed
        finally:
            b.close()
            a.close()  # ends the long stream

    def test_merge_steers_the_other_proxy_away_from_a_reported_decode(self):
        busy, landed = self.run_case("merge")
        self.assertNotIn(busy, landed, f"B sent to the replica decoding A's request: {landed}")

    def test_ignore_cannot_see_the_other_proxys_decode(self):
        busy, landed = self.run_case("ignore")
        self.assertIn(busy, landed, f"B balanced its own four over both replicas: {landed}")


if __name__ == "__main__":
    unittest.main()
