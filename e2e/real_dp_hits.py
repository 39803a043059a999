"""How much of a multi-turn workload a real vLLM engine with data-parallel ranks answers from cache,
routed by kvsteer with rank awareness against rank-blind (run by hand; docs/guide/real-vllm.md).

One vLLM 0.32 CPU server with `--data-parallel-size 2` (each rank its own core and KV cache, 128
blocks of 32 tokens), `kvsteer-feed --dp-ranks 2` beside it, and Envoy with the release filter
(`kv_load`, the replica declared `dp_ranks: 2`), all on 127.0.0.1, as e2e/test_real_vllm_dp.py starts
them. The same workload is sent twice, with fresh token ids each time (so the second pass finds
nothing of the first), the prefix caches reset in between:

- `rank-aware`: through Envoy: the filter picks the rank and writes `x-data-parallel-rank`;
- `rank-blind`: straight to the engine's port without a rank header: with one endpoint this is what
  any router that does not know the ranks amounts to (it can only pick the endpoint); vLLM's own
  balancer picks the rank from its queue counts (docs/design/dp.md).

Workload: SESSIONS multi-turn sessions, TURNS turns each; a turn's prompt is the previous turn's
prompt plus GROW new tokens (first turn FIRST tokens); turns are sent turn by turn across the
sessions (session order shuffled per turn, seeded), CLIENTS at a time. Prints, per mode, the prompt
tokens of turns after the first, those the engine answered from cache (`cached_tokens`) and the
share; each rank's own prefix-cache counters.

Usage: KVSTEER_E2E_VLLM=1 .venv/bin/python e2e/real_dp_hits.py [--sessions 8] [--turns 4]
       [--clients 2] [--seed 1]
(scripts/e2e-vllm builds and installs what it needs; run it once first, or build `kvsteer-feed` and
the release filter and run scripts/vllm-install.)
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from client import Client, tokens  # noqa: E402
from test_real_vllm import http, log, prom, require_vllm  # noqa: E402
from test_real_vllm_dp import RANKS, DpStack  # noqa: E402

FIRST, GROW = 512, 64


def rank_counters(text: str) -> list[tuple[float, float]]:
    """Per rank: prompt tokens looked up in its prefix cache, and those found (vLLM's counters,
    labelled with the engine index, the rank)."""
    return [(prom(text, "vllm:prefix_cache_queries_total", engine=str(r)),
             prom(text, "vllm:prefix_cache_hits_total", engine=str(r))) for r in range(RANKS)]


def run_pass(target: tuple[str, int], sessions: int, turns: int, clients: int, seed: int,
             base: int) -> tuple[int, int, int]:
    """Sends the workload to `target`; (prompt tokens after the first turn, of them cached, failed)."""
    prompts = [tokens(FIRST, base + 1000 * s) for s in range(sessions)]
    rng = random.Random(seed)
    totals = [0, 0, 0]
    lock = threading.Lock()
    for turn in range(turns):
        order = list(range(sessions))
        rng.shuffle(order)
        queue = list(order)

        def worker() -> None:
            c = Client(*target, timeout_s=120)
            try:
                while True:
                    with lock:
                        if not queue:
                            return
                        s = queue.pop(0)
                    res = c.complete(prompts[s], max_tokens=4, ignore_eos=True,
                                     extra={"model": "tiny", "temperature": 0})
                    with lock:
                        if not res.ok:
                            totals[2] += 1
                        elif turn > 0:
                            totals[0] += len(prompts[s])
                            totals[1] += res.cached_tokens
            finally:
                c.close()

        threads = [threading.Thread(target=worker) for _ in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        # The filter sees each turn's blocks (adapter, then two feed polls) before the next turn.
        time.sleep(0.6)
        for s in range(sessions):
            prompts[s] = prompts[s] + tokens(GROW, base + 1000 * s + 100 + turn)
    return totals[0], totals[1], totals[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sessions", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--clients", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    require_vllm()
    s = DpStack()
    rows = []
    try:
        e = s.start_all()
        for mode, target, base in [("rank-aware (kvsteer)", ("127.0.0.1", s.listen_port), 200_000),
                                   ("rank-blind (vLLM's balancer)", ("127.0.0.1", e.port), 600_000)]:
            http(f"http://{e.endpoint}/reset_prefix_cache", "POST", b"{}")
            time.sleep(1)
            before = rank_counters(e.engine_metrics())
            t0 = time.monotonic()
            prompt, cached, failed = run_pass(target, a.sessions, a.turns, a.clients, a.seed, base)
            took = time.monotonic() - t0
            after = rank_counters(e.engine_metrics())
            per_rank = [f"rank {r}: {int(h - hb)}/{int(q - qb)}"
                        for r, ((q, h), (qb, hb)) in enumerate(zip(after, before))]
            rows.append((mode, prompt, cached, failed, ", ".join(per_rank), took))
            log(f"{mode}: {cached}/{prompt} cached, {failed} failed, {took:.1f} s")
    finally:
        s.close()
    print(f"\n{a.sessions} sessions x {a.turns} turns (first {FIRST} tokens, +{GROW} a turn), "
          f"{a.clients} clients, seed {a.seed}\n")
    print("| routing | prompt tokens after turn 1 | answered from cache | share | failed "
          "| engine hits/queries per rank (all turns) | wall s |")
    print("|---|---:|---:|---:|---:|---|---:|")
    for mode, prompt, cached, failed, ranks, took in rows:
        share = 100.0 * cached / prompt if prompt else 0.0
        print(f"| {mode} | {prompt:,} | {cached:,} | {share:.1f}% | {failed} | {ranks} | {took:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
