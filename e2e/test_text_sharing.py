"""End-to-end: a text conversation's follow-ups find its first turn's replica through a real Envoy
with 4 worker threads (`--concurrency 4`, so 4 worker VMs and the main thread's), envoy/envoy.yaml,
the built filter, 4 simulated replicas, and no `tokenizer` section.

Without a tokenizer a text prompt has only the approximate identity: it is matched against where
the proxy itself sent earlier prompts, and each worker VM keeps its own index of that. Envoy hands
each fresh connection to one of its workers, so a follow-up reaches its first turn's worker about
one time in four here. The workers share their text-prompt records through shared data
(`filter/src/worker/share/text.rs`), so the others know the first turn's replica too.

Conversations: a system prompt of about 9,000 characters of their own, a first user turn, then two
follow-ups (the whole history and a new user message), each on a fresh connection. The follow-ups
start after every first turn was sent, so the filter has to remember each first turn across the
others. The worker each request went through is read from Envoy's per-worker listener counters.
Printed: the affinity (follow-ups answered by their first turn's replica / follow-ups), overall and
for the follow-ups that went through a worker that had routed none of the conversation's turns
before. Asserted: at least 90% of each. Before the sharing (the previous filter build, run with
`KVSTEER_WASM=<an older kvsteer_filter.wasm>`) a follow-up on a worker new to the conversation was
routed by load alone: 20 of 48 overall (42%), 8 of 32 (25%) through a worker new to the
conversation, in one run; with the sharing 48 of 48 and 33 of 33 (CHANGELOG.md, 2026-12-06).

Run by scripts/e2e (`scripts/e2e test_text_sharing`); needs the release wasm and the sim binary.
About 30 s on 2 cores.
"""

from __future__ import annotations

import time
import unittest

from client import chat_completion, prose
from stack import Stack
from test_envoy import PEER_SETTLE_S, REPLICAS, TIME_SCALE, stat_sum

CONVERSATIONS = 24
FOLLOW_UPS = 2
WORKERS = 4
# What the follow-ups must reach, overall and among those that went through a worker new to their
# conversation.
AFFINITY_FLOOR = 0.9
# Between a first turn and its first follow-up: at least this (the admission is published at its
# worker's next tick, 100 ms, and applied at each other worker's next one).
SHARE_SETTLE_S = 0.3

class Workers:
    """Which Envoy worker took each fresh connection, from the listener's per-worker counters
    (`listener.<address>.worker_<n>.downstream_cx_total`)."""

    def __init__(self, stack: Stack):
        self.stack = stack
        self.last = self.counts()

    def counts(self) -> dict[str, int]:
        return {k: v for k, v in self.stack.stats("downstream_cx_total").items()
                if ".worker_" in k and k.startswith("listener.")}

    def took(self) -> str:
        """The worker whose count moved since the last call ("" when none or several did)."""
        now = self.counts()
        moved = [k.split(".worker_")[1].split(".")[0] for k, v in now.items()
                 if v != self.last.get(k, 0)]
        self.last = now
        return moved[0] if len(moved) == 1 else ""


def chat(stack: Stack, messages: list[dict]) -> tuple[str, str]:
    """One chat completion on a fresh connection: the replica that answered (our name) and its
    answer's text."""
    doc = chat_completion(stack.listen_port, messages)
    r = stack.by_sim_name(doc["_replica"])
    if r is None:
        raise AssertionError(f"answer names no replica of ours: {doc['_replica']!r}")
    return r.name, doc["choices"][0]["message"]["content"]


class TextFollowUpsAcrossWorkers(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        s = Stack()
        try:
            s.start_replicas(REPLICAS, extra=["--time-scale", TIME_SCALE])
            s.start_envoy("envoy", concurrency=WORKERS)
        except BaseException:
            s.close()
            raise
        cls.stack = s

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_text_follow_ups_find_their_first_turns_replica(self) -> None:
        workers = Workers(self.stack)
        convos = []
        for c in range(CONVERSATIONS):
            messages = [{"role": "system", "content": prose(5_000 + c, 1_200)},
                        {"role": "user", "content": prose(c, 40)}]
            home, answer = chat(self.stack, messages)
            messages.append({"role": "assistant", "content": answer})
            convos.append((messages, home, {workers.took()}))
            time.sleep(PEER_SETTLE_S)
        time.sleep(SHARE_SETTLE_S)
        total = same = elsewhere = same_elsewhere = 0
        for turn in range(FOLLOW_UPS):
            for c, (messages, home, seen) in enumerate(convos):
                messages.append({"role": "user", "content": prose(100 * c + turn + 1, 30)})
                replica, answer = chat(self.stack, messages)
                messages.append({"role": "assistant", "content": answer})
                worker = workers.took()
                total += 1
                same += replica == home
                # A worker that has routed none of this conversation's turns: it can know the
                # conversation only from the others.
                if worker and "" not in seen and worker not in seen:
                    elsewhere += 1
                    same_elsewhere += replica == home
                seen.add(worker)
                time.sleep(PEER_SETTLE_S)
        applied = stat_sum(self.stack, "kvsteer_text_records_applied")
        print(f"\ntext follow-ups on their first turn's replica, Envoy --concurrency {WORKERS}: "
              f"{same}/{total} ({same / total:.0%}); through a worker new to the conversation: "
              f"{same_elsewhere}/{elsewhere} ({same_elsewhere / max(elsewhere, 1):.0%}); "
              f"kvsteer_text_records_applied {applied}", flush=True)
        self.assertGreater(elsewhere, total // 2, "Envoy spread the connections over its workers")
        self.assertGreaterEqual(same / total, AFFINITY_FLOOR)
        self.assertGreaterEqual(same_elsewhere / elsewhere, AFFINITY_FLOOR)
        self.assertEqual(stat_sum(self.stack, "kvsteer_text_records_refused"), 0)


if __name__ == "__main__":
    unittest.main()
