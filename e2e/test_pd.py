"""End-to-end: prefill/decode disaggregation through a real Envoy (docs/design/pd.md), with the committed
`envoy/envoy-pd.yaml`. Four simulated replicas, r0 and r1 prefill, r2 and r3 decode (`kvsteer-sim
serve` answers `kv_transfer_params` on a prefill leg and reads the prompt over its modelled link on a
decode leg with `do_remote_prefill`).

What it shows: the filter makes the prefill leg itself (a callout to the prefill replica's cluster) and
sends the client's request on to a decode replica with the prefill answer's `kv_transfer_params`;
multi-turn sessions, streamed and not, all complete; a session's later turns find their prefix cached
on the prefill side (the prefill replica's own prefix-cache counters) and the decode replica reads
the prompt over the link (the sim's `kvsteer_sim:remote_prefill_tokens`); a prefill replica that
answers 500 costs the clients nothing (each failed leg is sent once more, to the other prefill
replica); both answering 500 give the client a 502 naming the prefill leg, both down a 503; the
filter's bookings and releases agree once traffic stops (no load left booked).
"""

from __future__ import annotations

import json
import os
import time
import unittest
import urllib.request

from client import Result, tokens
from stack import Stack, envoy_fleet

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
BLOCK = 16
PREFILL = ("r0", "r1")
DECODE = ("r2", "r3")
# Two feed periods (200 ms) and a tick: the filter has seen the caches the last request left.
FEED_SETTLE_S = 0.5


def sim_counter(endpoint: str, name: str) -> float:
    """A counter from a simulated replica's `/metrics` (Prometheus text), summed over its labels."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=10) as r:
        text = r.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and not line.startswith("#"))


def counters(stack: Stack, names: tuple[str, ...], metric: str) -> dict[str, float]:
    return {n: sim_counter(stack.replica(n).endpoint, metric) for n in names}


def stat_sum(stack: Stack, needle: str) -> int:
    return sum(v for k, v in stack.stats(needle).items() if k.endswith(needle))


def settled_bookings(stack: Stack) -> tuple[int, int]:
    """The filter's bookings and releases, summed over its workers, once they have stopped moving
    (the counters follow each worker's tick)."""
    last = (-1, -1)
    for _ in range(50):
        time.sleep(0.25)
        now = (stat_sum(stack, "kvsteer_bookings"), stat_sum(stack, "kvsteer_releases"))
        if now == last and now[0] == now[1]:
            break
        last = now
    return last


def start(cls) -> None:
    cls.stack = envoy_fleet(4, TIME_SCALE, "envoy-pd")


class PdBehindEnvoy(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        start(cls)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_sessions_run_both_legs_and_find_their_caches(self) -> None:
        s = self.stack
        prompt_hits = counters(s, PREFILL, "vllm:prefix_cache_hits")
        read = counters(s, PREFILL + DECODE, "kvsteer_sim:remote_prefill_tokens")
        split_before = stat_sum(s, "kvsteer_pd_requests")
        sent = 0
        for session in range(3):
            prompt = tokens(600, 31_000 + session)
            for turn in range(3):
                stream = (session + turn) % 2 == 0
                res = s.send(prompt, max_tokens=6, stream=stream, session=f"s{session}",
                           ignore_eos=True)
                sent += 1
                what = f"session {session} turn {turn} (stream {stream})"
                self.assertTrue(res.ok, f"{what}: {res}")
                self.assertTrue(res.done, f"{what}: {res}")
                self.assertEqual(res.completion_tokens, 6, f"{what}: {res}")
                answered = s.by_sim_name(res.replica)
                self.assertIsNotNone(answered, res)
                self.assertIn(answered.name, DECODE, f"{what}: the client's answer is a decode leg's")
                hits = counters(s, PREFILL, "vllm:prefix_cache_hits")
                gained = sum(hits[n] - prompt_hits[n] for n in PREFILL)
                if turn > 0:
                    # The prefill leg went where the session's earlier turns are cached.
                    self.assertGreaterEqual(gained, len(prompt) - 200 - 2 * BLOCK,
                                            f"{what}: prefill-side hits {prompt_hits} -> {hits}")
                prompt_hits = hits
                time.sleep(FEED_SETTLE_S)
                prompt = prompt + tokens(200, 32_000 + 10 * session + turn)
        after = counters(s, PREFILL + DECODE, "kvsteer_sim:remote_prefill_tokens")
        moved = {n: after[n] - read[n] for n in after}
        for n in PREFILL:
            self.assertEqual(moved[n], 0, f"a prefill replica reads nothing: {moved}")
        # Each session's first turn is read whole over the link (600 tokens, 3 sessions); later turns
        # read only what the decode replica lacks.
        self.assertGreaterEqual(sum(moved[n] for n in DECODE), 3 * 600, moved)
        self.assertEqual(stat_sum(s, "kvsteer_pd_requests") - split_before, sent)
        self.assertEqual(stat_sum(s, "kvsteer_pd_prefill_failures"), 0)
        booked, released = settled_bookings(s)
        self.assertEqual(booked, released, "no load left booked")
        self.assertGreaterEqual(booked, 2 * sent)

    def test_chat_requests_run_both_legs_too(self) -> None:
        s = self.stack
        before = stat_sum(s, "kvsteer_pd_requests")
        for stream in (False, True):
            res = s.send(tokens(120, 33_000), max_tokens=4, stream=stream, chat=True)
            self.assertTrue(res.ok, res)
            self.assertIn(s.by_sim_name(res.replica).name, DECODE)
        self.assertEqual(stat_sum(s, "kvsteer_pd_requests") - before, 2)


class PdPrefillFailures(unittest.TestCase):
    """Prefill replicas failing, then down: the client always gets a clear error, never a hang, and
    no load stays booked."""

    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        start(cls)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def error_of(self, res: Result) -> dict:
        return json.loads(res.error)["error"]

    def prefill_legs(self) -> dict[str, int]:
        """Prefill legs Envoy sent to each prefill replica's cluster (retries included)."""
        st = self.stack.stats("kvsteer_prefill_")
        return {n: st.get(f"cluster.kvsteer_prefill_{n}.upstream_rq_total", 0) for n in PREFILL}

    def test_a_failing_prefill_replica_costs_clients_nothing(self) -> None:
        # Runs first (name order). A session's first turn caches its prompt on one prefill replica,
        # which then answers 500: each later turn's prefill leg, drawn there by the cache, is sent
        # once more to the other prefill replica and the client is served; once the failing replica
        # is ejected its legs go to the other one directly.
        s = self.stack
        before = self.prefill_legs()
        prompt = tokens(3000, 35_000)
        first = s.send(prompt, max_tokens=4, session="f")
        self.assertTrue(first.ok, first)
        after = self.prefill_legs()
        (cached,) = [n for n in PREFILL if after[n] > before[n]]
        time.sleep(FEED_SETTLE_S)
        self.stack.set_fault(cached, {"error_rate": 1.0})
        try:
            for turn in range(5):
                prompt = prompt + tokens(100, 35_100 + turn)
                res = s.send(prompt, max_tokens=4, session="f", stream=turn % 2 == 0)
                self.assertTrue(res.ok, f"turn {turn}: {res}")
                self.assertIn(s.by_sim_name(res.replica).name, DECODE, res)
        finally:
            self.stack.set_fault(cached, {"error_rate": 0.0})
        self.assertGreaterEqual(stat_sum(s, "kvsteer_pd_prefill_retries"), 1)
        self.assertEqual(stat_sum(s, "kvsteer_pd_prefill_failures"), 0)
        (other,) = [n for n in PREFILL if n != cached]
        self.assertGreaterEqual(self.prefill_legs()[other] - after[other], 5,
                                "every turn's prefill leg ended on the other replica")
        booked, released = settled_bookings(s)
        self.assertEqual(booked, released, "no load left booked")

    def test_prefill_500s_give_502_and_a_dead_prefill_side_503(self) -> None:
        s = self.stack
        ok = s.send(tokens(100, 34_000), max_tokens=4)
        self.assertTrue(ok.ok, ok)
        for n in PREFILL:
            self.stack.set_fault(n, {"error_rate": 1.0})
        for i in range(4):
            res = s.send(tokens(100, 34_100 + i), max_tokens=4, stream=i % 2 == 0)
            self.assertEqual(res.status, 502, res)
            err = self.error_of(res)
            self.assertEqual(err["leg"], "prefill", err)
            self.assertIn(err["replica"], PREFILL, err)
            self.assertIn("status 500", err["message"], err)
        # One failure a client request, whether or not its leg was sent on to the other replica.
        self.assertEqual(stat_sum(s, "kvsteer_pd_prefill_failures"), 4)
        for n in PREFILL:
            self.stack.set_fault(n, {"error_rate": 0.0})
        # Both prefill replicas gone: once their feeds fail (3 polls), a 503 without a callout.
        for n in PREFILL:
            s.replica(n).proc.stop()
        deadline = time.monotonic() + 15
        while True:
            res = s.send(tokens(100, 34_200), max_tokens=4)
            self.assertIn(res.status, (502, 503), res)
            self.assertEqual(self.error_of(res)["leg"], "prefill", res)
            if res.status == 503:
                break
            self.assertLess(time.monotonic(), deadline, "the prefill side never seen down")
            time.sleep(0.3)
        self.assertGreaterEqual(stat_sum(s, "kvsteer_pd_unavailable"), 1)
        booked, released = settled_bookings(s)
        self.assertEqual(booked, released, "no load left booked")


if __name__ == "__main__":
    unittest.main()
