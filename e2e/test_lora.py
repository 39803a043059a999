"""End-to-end: LoRA adapters (`routing.adapters`, docs/reference/configuration.md) through Envoy 1.40
(`--concurrency 2`) with envoy/envoy.yaml, the built filter and 4 simulated replicas serving the
base model `sim` with 2 adapter slots each (`--max-loras 2`, an adapter load of 300 ms).

1. `FollowsTheAdapter`: two long streamed requests for adapter `sql` hold it on the replicas they
   land on (their feeds then report `sql` running there). Four short requests for `sql` with
   prompts of their own follow: each goes to a replica running `sql`, although those replicas are
   busier than the idle ones (under `kv_time` without the adapter term a busy replica costs more,
   so they would go to an idle one).
2. `AdapterBlocksAreFound`: one prompt sent twice for adapter `ops`: the second finds the first's
   blocks in the filter's index (`kvsteer_matched_tokens` grows) and is served from cache on the
   same replica: the filter hashes an adapter's prompt in the adapter's namespace, as the engines do.

No timing is asserted; waits are bounded; loopback only. Run by scripts/e2e (`scripts/e2e test_lora`);
needs the release wasm and the sim binary.
"""

from __future__ import annotations

import threading
import time
import unittest

from client import Client, Result, tokens
from stack import Stack, envoy_fleet

REPLICAS = 4
# Long enough that the first requests still run while the follow-ups are routed (about 7 ms a
# step at time scale 1, more on a loaded machine), short enough to keep the test quick.
LONG_TOKENS = 600
FEED_WAIT_S = 1.0
DONE_WAIT_S = 120.0


class LoraFleet(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = envoy_fleet(
            REPLICAS, "1",
            sim_args=["--model", "sim", "--max-loras", "2", "--lora-load-ms", "300"],
            plugin_overrides={"routing": {
                "policy": "kv_time",
                "adapters": {"base_models": ["sim"], "load_ms": 300},
            }})

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def send(self, prompt: list[int], adapter: str, max_tokens: int = 4,
             stream: bool = False) -> Result:
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=DONE_WAIT_S)
        try:
            return c.complete(prompt, max_tokens=max_tokens, stream=stream,
                              extra={"model": adapter}, ignore_eos=True)
        finally:
            c.close()

    def test_1_follows_the_adapter(self) -> None:
        long_results: list[Result] = []
        threads = []
        for i in range(2):
            t = threading.Thread(
                target=lambda i=i: long_results.append(
                    self.send(tokens(512, 100 + i), "sql", LONG_TOKENS, stream=True)))
            t.start()
            threads.append(t)
            time.sleep(0.3)
        # Let every worker's feed polls see `sql` running where the long requests went.
        time.sleep(FEED_WAIT_S)
        self.assertTrue(all(t.is_alive() for t in threads),
                        "the long requests ended before the follow-ups: the machine is too fast "
                        "for LONG_TOKENS")
        follow = [self.send(tokens(512, 200 + i), "sql") for i in range(4)]
        for t in threads:
            t.join(DONE_WAIT_S)
        self.assertEqual(len(long_results), 2)
        for r in long_results + follow:
            self.assertTrue(r.ok, f"{r.status} {r.error}")
        holders = {r.replica for r in long_results}
        placed = [r.replica for r in follow]
        self.stack.say(f"sql held on {sorted(holders)}; follow-ups on {placed}")
        self.assertTrue(all(p in holders for p in placed),
                        f"follow-ups for sql went to {placed}, sql runs on {sorted(holders)}")

    def test_2_adapter_blocks_are_found(self) -> None:
        prompt = tokens(1024, 300)
        before = self.stack.metric("kvsteer_matched_tokens")
        first = self.send(prompt, "ops")
        self.assertTrue(first.ok, f"{first.status} {first.error}")
        # The replica's feed must report the blocks before the filter can find them.
        deadline = time.monotonic() + 10
        second = None
        while time.monotonic() < deadline:
            time.sleep(FEED_WAIT_S)
            second = self.send(prompt, "ops")
            self.assertTrue(second.ok, f"{second.status} {second.error}")
            if self.stack.metric("kvsteer_matched_tokens") > before:
                break
        assert second is not None
        self.assertGreater(self.stack.metric("kvsteer_matched_tokens"), before,
                           "the adapter's prompt never matched its own cached blocks")
        self.assertEqual(second.replica, first.replica)
        self.assertGreater(second.cached_tokens, 0)


if __name__ == "__main__":
    unittest.main()
