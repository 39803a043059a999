"""End-to-end: data-parallel ranks through a real Envoy (docs/design/dp.md). Two simulated endpoints, each
serving 4 DP ranks (`kvsteer-sim serve --dp-ranks 4`: 4 engines behind one port, the rank taken from
`x-data-parallel-rank`, else vLLM's internal balancer), and the filter told so (`dp_ranks: 4`).

What it shows: the filter's rank header reaches the endpoint and picks the engine (a repeat of a
prompt finds its prefix cached on the rank the first one ran on, ranks other than the one vLLM's
balancer would pick for an idle endpoint included), a client's own rank header does not (removed and
counted), and every rank's feed is polled and accepted.
"""

from __future__ import annotations

import os
import time
import unittest
import urllib.request

from client import tokens
from stack import Stack, envoy_fleet

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
RANKS = 4
PROMPT = 512
BLOCK = 16


def served_per_rank(endpoint: str) -> list[float]:
    """Requests each rank of a simulated endpoint has finished (its engine's
    `vllm:request_success_total`, from `/metrics?rank=R`)."""
    out = []
    for rank in range(RANKS):
        with urllib.request.urlopen(f"http://{endpoint}/metrics?rank={rank}", timeout=10) as r:
            text = r.read().decode()
        out.append(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                       if line.startswith("vllm:request_success_total")))
    return out


def stat_sum(stack: Stack, needle: str) -> int:
    return sum(v for k, v in stack.stats(needle).items() if needle in k)


class DpRanksBehindEnvoy(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = envoy_fleet(2, TIME_SCALE, sim_args=["--dp-ranks", str(RANKS)],
                                replica_overrides={"dp_ranks": RANKS})

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_the_rank_header_picks_the_engine_and_clients_cannot(self) -> None:
        s = self.stack
        before = {r.name: served_per_rank(r.endpoint) for r in s.replicas}
        prompts = [tokens(PROMPT, 18_000 + i) for i in range(8)]
        for p in prompts:
            # A client naming rank 3 itself: the filter removes it and writes its own choice.
            res = s.send(p, headers={"x-data-parallel-rank": "3"})
            self.assertTrue(res.ok, res)
            # Spaced beyond the balancer's 100 ms stats period and a feed poll: an idle endpoint's
            # balancer would put every one of these on rank 0.
            time.sleep(0.5)
        first = {r.name: served_per_rank(r.endpoint) for r in s.replicas}
        for p in prompts:
            res = s.send(p)
            self.assertTrue(res.ok, res)
            # Served from the cache of the rank the first copy ran on: the rank header pinned it.
            self.assertGreaterEqual(res.cached_tokens, PROMPT - 2 * BLOCK, res)
            time.sleep(0.3)
        after = {r.name: served_per_rank(r.endpoint) for r in s.replicas}
        used = [(name, rank) for name in first for rank in range(RANKS)
                if first[name][rank] > before[name][rank]]
        total = sum(after[n][k] - before[n][k] for n in after for k in range(RANKS))
        self.assertEqual(total, 2 * len(prompts), (before, after))
        self.assertGreaterEqual(len(used), 3, f"fresh prompts spread over (endpoint, rank): {used}")
        self.assertTrue(any(rank != 0 for _, rank in used), used)
        on_rank_3 = sum(first[n][3] - before[n][3] for n in first)
        self.assertLess(on_rank_3, len(prompts), "the client's rank was not obeyed")
        self.assertGreaterEqual(stat_sum(s, "kvsteer_spoofed_headers_removed"), len(prompts))
        self.assertEqual(stat_sum(s, "kvsteer_feed_rank_mismatches"), 0)
        for r in s.replicas:
            self.assertGreater(s.feed_polls(r), 0)


if __name__ == "__main__":
    unittest.main()
