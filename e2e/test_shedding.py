"""End-to-end: shedding at saturation (`routing.admission`, docs/design/admission.md) through Envoy
1.40 (`--concurrency 2`) with envoy/envoy.yaml, the built filter and 4 simulated replicas.

The fleet is saturated by critical requests: 8 of them, each a distinct 48K-token prompt with 64
output tokens, not streamed (so each stays booked as queued prefill until it completes: the filter
moves a request's prefill to decode at its first streamed token); `kv_load` sends each to the least
queued replica, two a replica. The replicas run at time scale 1, so each prefill takes about 2.6 s
of wall time, more on a loaded machine, never less, and the predicted wait of a new request on any
replica is 96K queued tokens at the profile's 27 us a token, 2.6 s (`Retry-After: 3`), against the
sheddable bound of 0.5 s.

Once the filter has routed all 8 (its `kvsteer_requests_routed` counter) and the workers have
exchanged their bookings (half a second: a tick publishes, the next reads), a mix follows on fresh
connections: sheddable requests (the trusted header `x-kvsteer-priority: sheddable`, and two with no
header whose model, `batch-sim`, `model_classes` names sheddable) and small critical ones. Asserted: every sheddable request is answered at once with 429, a `Retry-After` of
whole seconds >= 1 and the OpenAI error body (`error.type` `rate_limit_exceeded`); every critical
request completes with 200; the filter counts what it did (`kvsteer_shed_sheddable`,
`kvsteer_admitted_critical`); and once traffic stops `kvsteer_bookings` equals `kvsteer_releases`
(no booking leaked by a shed request), read from Envoy's /stats with the prefix `wasmcustom.`.

No timing is asserted: a slower machine only makes the critical requests last longer, which keeps
the queue up while the mix is sent. Loops are bounded; loopback only.

Run by scripts/e2e (`scripts/e2e test_shedding`); needs the release wasm and the sim binary.
About 13 s on 2 cores.
"""

from __future__ import annotations

import json
import threading
import time
import unittest

from client import Client, Result, tokens
from stack import Stack, envoy_fleet

REPLICAS = 4
SIM_TIME_SCALE = "1"
HEADER = "x-kvsteer-priority"
BATCH_MODEL = "batch-sim"
ADMISSION = {
    "priority_header": HEADER,
    "trust_priority_header": True,
    "bounds_s": {"standard": 30, "sheddable": 0.5},
    # The other way to class a request, with nothing to trust: its model name.
    "model_classes": {BATCH_MODEL: "sheddable"},
}
BIG_PROMPT = 48 * 1024
CRITICAL_LOAD = 8
SHEDDABLE = 6
CRITICAL_SMALL = 3
BY_MODEL = 2
# Bounded waits (each normally a fraction of this).
ROUTED_WAIT_S = 30.0
SETTLE_WAIT_S = 10.0


class Shedding(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = envoy_fleet(
            REPLICAS, SIM_TIME_SCALE,
            plugin_overrides={"routing": {"policy": "kv_load", "admission": ADMISSION}})

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def send(self, prompt: list[int], max_tokens: int, cls_name: str | None,
             model: str | None = None) -> Result:
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=120)
        try:
            return c.complete(prompt, max_tokens=max_tokens, ignore_eos=True,
                              headers={HEADER: cls_name} if cls_name else {},
                              extra={"model": model} if model else None)
        finally:
            c.close()

    def test_sheddable_requests_get_429_and_critical_ones_complete(self):
        routed0 = self.stack.metric("kvsteer_requests_routed")
        heavy: list[Result] = [Result(status=-1)] * CRITICAL_LOAD

        def run_heavy(i: int) -> None:
            heavy[i] = self.send(tokens(BIG_PROMPT, 91_000 + i), 64, "critical")

        threads = [threading.Thread(target=run_heavy, args=(i,)) for i in range(CRITICAL_LOAD)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + ROUTED_WAIT_S
        while self.stack.metric("kvsteer_requests_routed") < routed0 + CRITICAL_LOAD:
            self.assertLess(time.monotonic(), deadline, "the critical load was not routed")
            time.sleep(0.05)
        # One tick publishes a worker's bookings, the next tick of the other worker reads them.
        time.sleep(0.5)

        shed: list[Result] = []
        small: list[Result] = []
        for i in range(SHEDDABLE):
            shed.append(self.send(tokens(256, 92_000 + i), 8, "sheddable"))
            if i < CRITICAL_SMALL:
                small.append(self.send(tokens(256, 93_000 + i), 8, "critical"))
        # No header: the class comes from the model name (`model_classes`).
        for i in range(BY_MODEL):
            shed.append(self.send(tokens(256, 94_000 + i), 8, None, model=BATCH_MODEL))
        for t in threads:
            t.join(timeout=120)
        self.assertFalse(any(t.is_alive() for t in threads), "a critical request never ended")

        for r in shed:
            self.assertEqual(r.status, 429, r)
            retry = r.headers.get("retry-after", "")
            self.assertTrue(retry.isdigit() and int(retry) >= 1, r.headers)
            body = json.loads(r.error)
            self.assertEqual(body["error"]["type"], "rate_limit_exceeded", body)
            self.assertEqual(body["error"]["code"], 429, body)
            self.assertIn("sheddable", body["error"]["message"])
        for r in heavy + small:
            self.assertEqual(r.status, 200, r)
            self.assertTrue(r.ok, r)
        print(f"\n  sheddable: {len(shed)} of {len(shed)} answered 429, Retry-After "
              f"{sorted({r.headers['retry-after'] for r in shed})} s; critical: "
              f"{len(heavy) + len(small)} completed", flush=True)

        # The counters the filter mirrors from its totals are published on its next tick.
        deadline = time.monotonic() + SETTLE_WAIT_S
        while True:
            s = self.stack.stats("wasmcustom.")
            booked = s.get("wasmcustom.kvsteer_bookings", -1)
            released = s.get("wasmcustom.kvsteer_releases", -2)
            shed_n = s.get("wasmcustom.kvsteer_shed_sheddable", 0)
            critical_n = s.get("wasmcustom.kvsteer_admitted_critical", 0)
            if (booked == released and shed_n >= SHEDDABLE + BY_MODEL
                    and critical_n >= CRITICAL_LOAD + CRITICAL_SMALL):
                break
            if time.monotonic() > deadline:
                self.fail(f"bookings {booked}, releases {released}, shed {shed_n}, "
                          f"critical admitted {critical_n}")
            time.sleep(0.1)
        self.assertEqual(s.get("wasmcustom.kvsteer_shed_critical", 0), 0)
        self.assertEqual(s.get("wasmcustom.kvsteer_priority_headers_removed", 0), 0)
        print(f"  bookings {booked} = releases {released}; kvsteer_shed_sheddable {shed_n}, "
              f"kvsteer_admitted_critical {critical_n}", flush=True)


if __name__ == "__main__":
    unittest.main()
