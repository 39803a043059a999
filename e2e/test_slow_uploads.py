"""End-to-end: many clients uploading large bodies slowly, through Envoy 1.40 (`--concurrency 2`) with
envoy/envoy.yaml, the built filter and simulated replicas, all on 127.0.0.1.

The filter routes on the body, so Envoy buffers each body until the filter has routed it. The
filter used to copy every arriving slice into its VM as well: each burst of concurrent uploads
raised the VMs' WebAssembly memory (which never shrinks) by about the bodies in flight, and a
repeat raised it again (docs/reports/uploads.md: 30 clients, 3 MB each, RSS 195 -> 465 -> 646 ->
707 MiB over three bursts, of which outside Envoy's heap 172 -> 304 -> 360 MiB). Now the early scan
keeps only the part of a body it has not read, and `body_hold_max_bytes` bounds what Envoy holds
for one VM's streams.

1. `RepeatedBursts`: three bursts of concurrent slow uploads, every request answered 200; Envoy's
   RSS beyond its heap's resident pages (the VMs' memories, mostly) grows by less than
   `VM_GROWTH_MIB` from before the first burst to after the third.
2. `HoldBound`: with `body_hold_max_bytes` at 8 MiB a VM holds at most about three 2.5 MB bodies;
   the others are routed by load unread (`kvsteer_body_hold_fallbacks`) and every request still
   completes.

`e2e/bench_slow_uploads.py` measures the same thing at the issue's size and prints the figures.
"""

from __future__ import annotations

import os
import unittest

from bench_slow_uploads import body_bytes, burst
from stack import Stack

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "1000")
CLIENTS = 16
BODY_BYTES = 2_500_000
UPLOAD_S = 4.0
# Measured with these bursts (16 bodies of 2.5 MB, a 1,024-id prompt and a long `user` member, so
# the KV index and the replicas' feeds do not grow with the bytes; docs/reports/uploads.md): the
# filter as it was left the memory outside Envoy's heap (the VMs, mostly) about 60 MiB above where
# it started after three bursts (129.6, 141.0, 157.7 MiB after each, from about 96), the filter now
# within a few MiB of it (79.5, 85.8, 89.4). 25 MiB sits between them with room for V8's own noise.
VM_GROWTH_MIB = 25.0


def fleet(plugin_overrides: dict | None = None) -> Stack:
    s = Stack()
    try:
        # A prompt of ~400K token ids: past the simulated model's context and cache by default.
        s.start_replicas(4, extra=["--time-scale", TIME_SCALE, "--max-model-len", "2000000",
                                   "--kv-blocks", "200000"])
        s.start_envoy("envoy", concurrency=2, plugin_overrides=plugin_overrides)
        s.wait_healthy()
    except BaseException:
        s.close()
        raise
    return s


class RepeatedBursts(unittest.TestCase):
    def setUp(self):
        self.s = fleet()
        self.addCleanup(self.s.close_checked)

    def test_memory_stays_flat_over_repeated_bursts_and_every_upload_completes(self):
        bodies = [body_bytes(BODY_BYTES, i, False, padded=True) for i in range(CLIENTS)]
        rows = [burst(self.s, bodies, UPLOAD_S, 8 * 1024) for _ in range(3)]
        for i, r in enumerate(rows):
            self.assertEqual(r["ok"], CLIENTS, f"burst {i + 1}: {r['statuses']} {r['errors']}")
        start = rows[0]["rss_before"] - rows[0]["heap_phys_before"]
        outside = [r["rss_after"] - r["heap_phys_after"] for r in rows]
        print(f"\nslow uploads: RSS after each burst {[round(r['rss_after'], 1) for r in rows]} MiB, "
              f"outside the heap {round(start, 1)} at start, {[round(o, 1) for o in outside]} MiB", flush=True)
        self.assertLess(outside[2] - start, VM_GROWTH_MIB,
                        f"RSS outside Envoy's heap after each burst: {outside} MiB; rows {rows}")
        st = self.s.stats("wasmcustom.kvsteer")
        # Every body was routed on its prompt, read as it arrived.
        self.assertEqual(st.get("wasmcustom.kvsteer_fallbacks", 0), 0, st)
        self.assertEqual(st.get("wasmcustom.kvsteer_early_scan_bodies", 0), 3 * CLIENTS, st)


class HoldBound(unittest.TestCase):
    def setUp(self):
        self.s = fleet({"body_hold_max_bytes": 8 << 20})
        self.addCleanup(self.s.close_checked)

    def test_bodies_past_the_bound_are_routed_unread_and_complete(self):
        bodies = [body_bytes(BODY_BYTES, 100 + i, False) for i in range(CLIENTS)]
        r = burst(self.s, bodies, 2.0, 8 * 1024)
        self.assertEqual(r["ok"], CLIENTS, f"{r['statuses']} {r['errors']}")
        st = self.s.stats("wasmcustom.kvsteer")
        unread = st.get("wasmcustom.kvsteer_body_hold_fallbacks", 0)
        # Two VMs hold at most 3 bodies each (8 MiB / 2.5 MB declared): at least 10 of the 16 are
        # routed before they are held.
        self.assertGreaterEqual(unread, CLIENTS - 6, st)
        self.assertEqual(st.get("wasmcustom.kvsteer_fallbacks", 0), unread, st)


if __name__ == "__main__":
    unittest.main()
