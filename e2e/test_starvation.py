"""End-to-end: no healthy replica starved under `kv_time`, through Envoy 1.40 (`--concurrency 2`)
with envoy/envoy.yaml, the built filter and 4 simulated replicas.

The workload is chat behind one shared system prompt, the shape on which `kv_load`, the default
policy before `kv_time`, has been seen sending a whole run to three of four healthy replicas: once some replicas
held the shared prompt, the others never looked cheap. 80 sessions arrive open-loop at 8 a second
(2 a second per replica, as in lab/tests/no_starved_replica.rs), each on its own thread and
connection, 2 to 4 turns each; every prompt is the same 2,048-token system prompt, then the
session's history (each turn appends a made-up reply to the previous one and a new user message),
sent as token ids with `x-session-id`, streamed, with 150 to 300 output tokens. Before the sessions
start one request puts the system prompt on one replica (a fleet that has been serving holds it
somewhere), so every other replica that receives a request does so because the policy chose a
replica without the prompt.

Asserted under `routing.policy: kv_time`: no request fails, and every replica of N receives at
least 1/(4N) of the requests, counted from the filter's `kvsteer_decisions_kv_time_<replica>`
counters and again from the replica that answered each request (`x-kvsteer-replica`). A quarter of
a fair share, not a fair share: `kv_time` may rightly keep a replica lighter (a cold replica must
first prefill the shared prompt, and while the holders are lightly loaded they answer sooner), but a
replica that is idle while the others' batches grow costs only its own prefill, so once the holders
cost more it is chosen, and from then on it holds the prompt too. At this load the holders' batches
do grow (each replica's `vllm:num_requests_running` and `waiting` are sampled and printed); at half
of it `kv_time` was seen leaving one replica without requests, rightly by its prediction.

The same workload then runs under `kv_load` (the default before `kv_time`), shorter (48 sessions),
and its split is printed, not asserted: leaving replicas without requests here is the known limit
of that cost.

The replicas run at time scale 1 whatever `E2E_TIME_SCALE` says: `kv_time` predicts in the
profile's seconds and learns each replica's speed from streamed first tokens against the wall
clock, so at the suite's scale 10 (replicas ten times faster than their profile, beyond
`speed_bound`'s 4) a replica that has served a cold prefill would look up to four times faster
than one that has not yet, which is no property of the fleet. Real time also needs ten times fewer
requests a second from the client for the same batches, which a loaded 2-core machine can send.

Run by scripts/e2e (`scripts/e2e test_starvation`); needs the release wasm and the sim binary.
About 55 s on 2 cores.
"""

from __future__ import annotations

import random
import sys
import threading
import time
import unittest
from dataclasses import dataclass, field

from client import Client, Result, tokens
from stack import Stack, envoy_fleet
from test_proxies import replica_gauges

REPLICAS = 4
# Simulated time = wall time (see the module's doc).
SIM_TIME_SCALE = "1"
# The sims' default engine profile (sim/src/profile.rs, `Profile::llama31_8b_h100`), by its name
# among the router's built-in profiles (core/src/speed.rs).
PROFILE = "llama-3.1-8b-h100"
SYSTEM_TOKENS = 2048
SEED = 7
SESSIONS = 80
SESSIONS_PER_S = 8.0
# kv_load's run: the first sessions of the same workload, enough to show its split.
BASELINE_SESSIONS = 48
# No turn starts later than this after the first session's arrival (each run normally ends well
# before: about 20 s under kv_time).
RUN_LIMIT_S = 30.0
# A feed poll (every 200 ms) plus the relay to the other worker (next 100 ms tick), with margin.
FEED_SETTLE_S = 0.5
# How often the replicas' own gauges are sampled while the workload runs.
SAMPLE_S = 0.25


@dataclass
class Turn:
    # What this turn appends to the session's history: a made-up reply to the previous turn (none
    # on the first) and the user's new message.
    new: list[int]
    max_tokens: int
    think_s: float


@dataclass
class ChatSession:
    id: str
    arrival_s: float
    turns: list[Turn]


def chat_workload(seed: int, sessions: int, sessions_per_s: float) -> tuple[list[int],
                                                                           list[ChatSession]]:
    """The shared system prompt and `sessions` chat sessions arriving with exponential gaps at
    `sessions_per_s`: 2 to 4 turns each, each turn a new user message of 64 to 320 tokens (after a
    made-up reply of 64 to 192 tokens to the previous turn) asking for 150 to 300 tokens, 0.2 to
    0.6 s of thinking between turns. Deterministic in `seed`."""
    rng = random.Random(seed)
    base = 1_000_003 * seed
    system = tokens(SYSTEM_TOKENS, base)
    out: list[ChatSession] = []
    t = 0.0
    for i in range(sessions):
        t += rng.expovariate(sessions_per_s)
        turns = []
        for k in range(rng.randint(2, 4)):
            key = base + 1000 * (i + 1) + 10 * k
            reply = tokens(rng.randint(64, 192), key + 1) if k else []
            turns.append(Turn(reply + tokens(rng.randint(64, 320), key + 2),
                              max_tokens=rng.randint(150, 300),
                              think_s=rng.uniform(0.2, 0.6) if k else 0.0))
        out.append(ChatSession(f"chat-{seed}-{i}", t, turns))
    return system, out


@dataclass
class Sent:
    session: str
    turn: int
    result: Result
    # Our name (r0..) of the replica that answered; empty when none did.
    replica: str
    # When the request was sent, seconds from the first session's arrival.
    sent_s: float


@dataclass
class RunReport:
    policy: str
    planned: int
    sent: list[Sent] = field(default_factory=list)
    # The filter's decisions per replica during the sessions (the warm-up's not counted).
    decisions: dict[str, int] = field(default_factory=dict)
    # Per replica: the largest and mean running and waiting counts sampled.
    gauges: dict[str, dict[str, float]] = field(default_factory=dict)
    wall_s: float = 0.0
    # The replica the warm-up request went to: the first to hold the system prompt.
    warm: str = ""

    def served(self, names: list[str]) -> dict[str, int]:
        return {n: sum(1 for s in self.sent if s.replica == n) for n in names}

    def summary(self, names: list[str]) -> str:
        total = max(1, sum(self.decisions.values()))
        split = " / ".join(f"{self.decisions.get(n, 0)}" for n in names)
        shares = " / ".join(f"{self.decisions.get(n, 0) / total:.0%}" for n in names)
        served = " / ".join(str(v) for v in self.served(names).values())
        lines = [f"{self.policy}: {len(self.sent)} of {self.planned} requests sent in "
                 f"{self.wall_s:.1f} s, warm-up on {self.warm}; decisions {'/'.join(names)} = "
                 f"{split} ({shares}); served {served}"]
        for n in names:
            mine = sorted((s for s in self.sent if s.replica == n), key=lambda s: s.sent_s)
            first = (f"first request at {mine[0].sent_s:.1f} s with "
                     f"{mine[0].result.cached_tokens} tokens cached" if mine else "no request")
            g = self.gauges.get(n)
            gauges = (f"running max {g['running_max']:.0f} mean {g['running_mean']:.1f}, "
                      f"waiting max {g['waiting_max']:.0f} mean {g['waiting_mean']:.1f}"
                      if g else "no gauges")
            lines.append(f"  {n}: {first}; {gauges}")
        return "\n".join(lines)


def decisions(stack: Stack, policy: str) -> dict[str, int]:
    """The filter's `kvsteer_decisions_<policy>_<replica>` counters from Envoy's /stats (with its
    `wasmcustom.` prefix), summed should a build list one per worker."""
    prefix = f"kvsteer_decisions_{policy}_"
    out: dict[str, int] = {}
    for k, v in stack.stats(prefix).items():
        name = k.rsplit(prefix, 1)[-1]
        out[name] = out.get(name, 0) + v
    return out


def run_workload(stack: Stack, policy: str, system: list[int],
                 sessions: list[ChatSession]) -> RunReport:
    """One warm-up request (the system prompt onto one replica), then every session through Envoy,
    each on its own thread and connection from its arrival, streamed, while a thread samples the
    replicas' gauges. Bounded: no turn starts after RUN_LIMIT_S, every request has a 60 s timeout
    and every thread is joined with a deadline."""
    report = RunReport(policy, planned=sum(len(s.turns) for s in sessions))
    lock = threading.Lock()
    done = threading.Event()

    c = Client("127.0.0.1", stack.listen_port, timeout_s=60)
    try:
        warm = c.complete(system + tokens(32, 1), max_tokens=8, stream=True, session="warm-up")
    finally:
        c.close()
    if not warm.ok:
        raise AssertionError(f"warm-up request failed: {warm}")
    w = stack.by_sim_name(warm.replica)
    report.warm = w.name if w else warm.replica
    time.sleep(FEED_SETTLE_S)
    before = decisions(stack, policy)
    start = time.monotonic()
    deadline = start + RUN_LIMIT_S

    def session(s: ChatSession) -> None:
        delay = start + s.arrival_s - time.monotonic()
        if delay > 0:
            time.sleep(delay)
        c = Client("127.0.0.1", stack.listen_port, timeout_s=60)
        history = list(system)
        try:
            for k, turn in enumerate(s.turns):
                time.sleep(turn.think_s)
                if time.monotonic() > deadline:
                    return
                history += turn.new
                sent_s = time.monotonic() - start
                res = c.complete(history, max_tokens=turn.max_tokens, stream=True,
                                 session=s.id, ignore_eos=True)
                r = stack.by_sim_name(res.replica)
                with lock:
                    report.sent.append(Sent(s.id, k, res, r.name if r else "", sent_s))
                if not res.ok:
                    return
        finally:
            c.close()

    def sample() -> None:
        seen: dict[str, list[dict[str, float]]] = {r.name: [] for r in stack.replicas}
        while not done.wait(SAMPLE_S):
            for r in stack.replicas:
                try:
                    seen[r.name].append(replica_gauges(r.endpoint))
                except OSError:
                    continue
        for name, samples in seen.items():
            if samples:
                report.gauges[name] = {
                    f"{k}_{agg}": f([s[k] for s in samples])
                    for k in ("running", "waiting")
                    for agg, f in (("max", max), ("mean", lambda v: sum(v) / len(v)))
                }

    threads = [threading.Thread(target=session, args=(s,), daemon=True) for s in sessions]
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    for t in threads:
        t.start()
    for t in threads:
        # The last turn starts by the deadline and its request times out 60 s later at most.
        t.join(max(0.1, deadline + 65 - time.monotonic()))
    done.set()
    sampler.join(5)
    report.wall_s = time.monotonic() - start
    after = decisions(stack, policy)
    report.decisions = {n: v - before.get(n, 0) for n, v in after.items()}
    return report


def fleet(policy: str) -> Stack:
    routing: dict = {"policy": policy}
    if policy == "kv_time":
        routing["kv_time"] = {"profile": PROFILE}
    return envoy_fleet(REPLICAS, SIM_TIME_SCALE, "envoy", {"routing": routing})


class NoReplicaStarved(unittest.TestCase):
    def test_kv_time_gives_every_replica_a_quarter_of_a_fair_share(self):
        names = [f"r{i}" for i in range(REPLICAS)]
        system, sessions = chat_workload(SEED, SESSIONS, SESSIONS_PER_S)
        with fleet("kv_time") as stack:
            run = run_workload(stack, "kv_time", system, sessions)
            stack.close_checked()
        print("\n" + run.summary(names), file=sys.stderr, flush=True)

        # The default, for contrast: printed, not asserted.
        with fleet("kv_load") as stack:
            base = run_workload(stack, "kv_load", system, sessions[:BASELINE_SESSIONS])
            stack.close_checked()
        print(base.summary(names), file=sys.stderr, flush=True)

        failed = [(s.session, s.turn, s.result.status, s.result.error[:80])
                  for s in run.sent if not s.result.ok]
        self.assertEqual(failed, [], f"{len(failed)} of {len(run.sent)} requests failed")
        floor = len(run.sent) / (4 * REPLICAS)
        served = run.served(names)
        for n in names:
            self.assertGreaterEqual(run.decisions.get(n, 0), floor,
                                    f"{n}: decisions under a quarter of a fair share\n"
                                    + run.summary(names))
            self.assertGreaterEqual(served[n], floor,
                                    f"{n}: answers under a quarter of a fair share\n"
                                    + run.summary(names))


if __name__ == "__main__":
    unittest.main()
