"""End-to-end against a real engine with data-parallel ranks (docs/design/dp.md): one vLLM 0.32 CPU server
with `--data-parallel-size 2` (two engine cores, one per CPU core, each its own KV cache, behind one
HTTP port), a `kvsteer-feed --dp-ranks 2` beside it, and Envoy with the release filter in front, the
replica declared with `dp_ranks: 2`; all on 127.0.0.1. Run by scripts/e2e-vllm after
test_real_vllm.py (the same gate, KVSTEER_E2E_VLLM=1; skipped otherwise).

What it checks:
  1. each rank publishes its KV events on its own socket (the base port plus the rank) stamped with
     its rank, and the adapter keeps them apart: a prompt the filter sent to rank R is in rank R's
     feed only;
  2. vLLM serves each request on the rank the filter's `x-data-parallel-rank` header names (the
     engine's own per-rank counters, `engine="R"`), for fresh prompts and repeats alike;
  3. a repeat of a prompt goes to the rank that caches it and the engine answers it from that
     cache (`cached_tokens`), on both ranks, also when the client sends a rank header of its own
     naming the other rank (the filter removes it).
"""

from __future__ import annotations

import socket
import time
import unittest

from client import Client, Result, tokens
from stack import Replica, free_ports
from test_real_vllm import (BLOCK, ENABLED, ENGINE_START_S, PEER_SETTLE_S, REPLICA_HEADER, Engine,
                            RealStack, VllmCase, feed_polls, http, log, prom, require_vllm,
                            wait_until)

RANKS = 2
RANK_HEADER = "x-data-parallel-rank"
PROMPT = 1024  # 32 blocks; each rank's cache holds 128


def port_pairs(n: int) -> list[int]:
    """`n` ports `p` with `p` and `p + 1` both free now: vLLM offsets each rank's event and replay
    sockets by the rank."""
    out: list[int] = []
    while len(out) < n:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", 0))
        p = s.getsockname()[1]
        t = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            t.bind(("127.0.0.1", p + 1))
        except OSError:
            continue
        finally:
            s.close()
            t.close()
        if p not in out and p + 1 not in out and p - 1 not in out:
            out.append(p)
    return out


class DpStack(RealStack):
    """One engine serving two DP ranks, and its adapter subscribed to both ranks' sockets."""

    def engine_env(self, e: Engine) -> dict[str, str]:
        env = super().engine_env(e)
        # Rank 0 on core 0, rank 1 on core 1 (vLLM splits the list by `|`, one entry a rank).
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(r) for r in range(RANKS))
        return env

    def start_engine(self, e: Engine) -> None:
        super().start_engine(e, extra=["--data-parallel-size", str(RANKS)])

    def start_adapter(self, e: Engine) -> None:
        super().start_adapter(e, extra=["--dp-ranks", str(RANKS)])

    def adapter_metrics(self, rank: int) -> str:
        """The adapter's `/metrics` for one rank's view."""
        return http(f"{self.engines[0].adapter_url}/metrics?rank={rank}").decode()

    def start_all(self) -> Engine:
        """Starts the adapter, the engine (its start time in `engine_start_s`), and, once the adapter
        knows every rank's block count, Envoy with the replica declared `dp_ranks`."""
        zmq, replay = port_pairs(2)
        port, adapter = free_ports(2)
        e = Engine("v0", 0, port, zmq, replay, adapter)
        self.engines.append(e)
        # The adapter first: it binds the ZMQ endpoints the ranks connect their PUB sockets to.
        self.start_adapter(e)
        t0 = time.monotonic()
        self.start_engine(e)
        self.wait_engine(e, ENGINE_START_S)
        self.engine_start_s = time.monotonic() - t0
        log(f"vLLM with {RANKS} DP ranks ready in {self.engine_start_s:.1f} s")
        self.replicas = [Replica(e.name, e.port, e.engine)]
        for r in range(RANKS):
            wait_until(f"the adapter learns rank {r}'s block count",
                       lambda r=r: prom(self.adapter_metrics(r), "kvsteer_feed_max_blocks") > 0, 20)
        self.start_envoy_real(replica_overrides={"dp_ranks": RANKS})
        return e


@unittest.skipUnless(ENABLED, "real vLLM engines: run scripts/e2e-vllm (sets KVSTEER_E2E_VLLM=1)")
class RealVllmDp(VllmCase):
    stack: DpStack
    timings: dict[str, float] = {}

    @classmethod
    def setUpClass(cls) -> None:
        require_vllm()
        s = cls.stack = DpStack()
        try:
            s.start_all()
            cls.timings["engine_start_s"] = s.engine_start_s
        except BaseException:
            s.close()
            raise

    # -- helpers --------------------------------------------------------------------------------

    def adapter_metrics(self, rank: int) -> str:
        return self.stack.adapter_metrics(rank)

    def engine(self) -> Engine:
        return self.stack.engines[0]

    def stat(self, needle: str) -> int:
        return sum(v for k, v in self.stack.stats(needle).items() if needle in k)

    def decisions(self) -> list[int]:
        return [self.stat(f"kvsteer_decisions_kv_load_v0_dp{r}") for r in range(RANKS)]

    def queries(self) -> list[float]:
        """Prompt tokens each rank's engine has looked up in its prefix cache (vLLM labels each
        engine's metrics with its index, the rank)."""
        text = self.engine().engine_metrics()
        return [prom(text, "vllm:prefix_cache_queries_total", engine=str(r)) for r in range(RANKS)]

    def stored(self, rank: int) -> float:
        return prom(self.adapter_metrics(rank), "kvsteer_feed_blocks_total", op="stored")

    def feed_polls(self) -> int:
        return feed_polls(self.stack, self.engine())

    def routed(self, prompt: list[int], headers: dict[str, str] | None = None) -> tuple[int, Result]:
        """Through Envoy: (the rank that served it, by the engine's own counters, the result). Checks
        that it is the rank the filter chose."""
        time.sleep(PEER_SETTLE_S)
        before_d, before_q = self.decisions(), self.queries()
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=60)
        try:
            res = c.complete(prompt, max_tokens=4, headers=headers, ignore_eos=True,
                             extra={"model": "tiny", "temperature": 0})
        finally:
            c.close()
        self.assertTrue(res.ok, res)
        self.assertEqual(res.headers.get(REPLICA_HEADER), self.engine().endpoint)
        after_d = self.decisions()
        chosen = [r for r in range(RANKS) if after_d[r] > before_d[r]]
        served = wait_until("the engine counts the request on one rank", lambda: [
            r for r, (a, b) in enumerate(zip(self.queries(), before_q)) if a >= b + len(prompt)], 5)
        self.assertEqual(served, chosen, f"the filter chose rank {chosen}, rank {served} served")
        return served[0], res

    def settle(self, rank: int, since: float, n: int) -> None:
        """Until rank `rank`'s view in the adapter has `n` more blocks than `since` and the filter has
        polled the feed twice since (each rank's feed is polled on the same cluster)."""
        wait_until(f"rank {rank}'s view stores {n} blocks", lambda: self.stored(rank) >= since + n, 10)
        polls = self.feed_polls()
        wait_until("two more feed polls per rank", lambda: self.feed_polls() >= polls + 2 * RANKS, 10,
                   0.05)
        time.sleep(PEER_SETTLE_S)

    # -- tests ----------------------------------------------------------------------------------

    def test_requests_run_on_the_rank_the_filter_picks_and_repeats_find_its_cache(self):
        # Fresh prompts until one has landed on each rank (the filter breaks ties between idle ranks
        # at random; bounded), each checked against the engine's own per-rank counters. The last
        # one per rank is kept: a rank's cache holds 4 of them.
        homes: dict[int, list[int]] = {}
        for k in range(12):
            prompt = tokens(PROMPT, 50_000 + 10_000 * k)
            before = [self.stored(r) for r in range(RANKS)]
            rank, res = self.routed(prompt)
            self.settle(rank, before[rank], PROMPT // BLOCK)
            other = 1 - rank
            self.assertLess(self.stored(other), before[other] + PROMPT // BLOCK,
                            f"prompt {k}: rank {rank}'s blocks are not in rank {other}'s view")
            homes[rank] = prompt
            if len(homes) == RANKS:
                break
        self.assertEqual(sorted(homes), list(range(RANKS)),
                         f"fresh prompts reached both ranks: {sorted(homes)}")
        log(f"fresh prompts: {k + 1} sent before each rank had one")
        self.assertEqual(prom(self.adapter_metrics(0), "kvsteer_feed_bad_payloads_total",
                              reason="dp_rank"), 0)
        self.assertEqual(self.stat("kvsteer_feed_rank_mismatches"), 0)
        # Repeats (extended by a few tokens) go where their prompt is cached and are answered from
        # that rank's cache, also with a client's rank header naming the other rank.
        for rank, prompt in sorted(homes.items()):
            for n, headers in enumerate([None, {RANK_HEADER: str(1 - rank)}]):
                again = prompt + tokens(40, 90_000 + 100 * rank + n)
                matched = self.stat("kvsteer_matched_tokens")
                served, res = self.routed(again, headers)
                self.assertEqual(served, rank, f"rank {rank} repeat {n}: served on rank {served}")
                self.assertGreaterEqual(self.stat("kvsteer_matched_tokens") - matched, PROMPT,
                                        "the filter saw the prefix on that rank")
                self.assertGreaterEqual(res.cached_tokens or 0, PROMPT - BLOCK,
                                        f"rank {rank} repeat {n}: the engine's cache answered: {res}")
                log(f"rank {rank} repeat {n} (client rank header {headers}): served on rank "
                    f"{served}, {res.cached_tokens} of {len(again)} prompt tokens cached")
        self.assertGreaterEqual(self.stat("kvsteer_spoofed_headers_removed"), 2)


if __name__ == "__main__":
    unittest.main()
