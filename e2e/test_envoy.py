"""End-to-end: the built filter inside a real Envoy (V8, `--concurrency 2`) in front of simulated
replicas, all on 127.0.0.1. Run by scripts/e2e; needs the release wasm and the sim binary.

Each test class starts its own replicas and Envoy (a class that kills or loads a replica must not
disturb the others) and stops exactly those processes afterwards.
"""

from __future__ import annotations

import os
import re
import threading
import time
import unittest

import envoy_config
from client import Client, Result, tokens
from stack import Stack, envoy_fleet

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
REPLICAS = 4
# A feed poll (every 200 ms) plus the relay to the other worker (next 100 ms tick), with margin: what
# the filter learns from a feed is in use by then. Kept short on purpose: see
# test_the_cache_view_survives_an_idle_gap for what happens when no feed event arrives for longer.
FEED_SETTLE_S = 0.5
# Each worker sees the other workers' in-flight load as published at their last tick (100 ms): a
# request that has just finished on one worker still counts as load on its replica in another's view
# for up to a tick (filter/src/worker/share/mod.rs). Sequential requests that must see every replica idle are
# spaced by this much.
PEER_SETTLE_S = 0.25


def new_stack(variant: str = "envoy", plugin_overrides: dict | None = None) -> Stack:
    return envoy_fleet(REPLICAS, TIME_SCALE, variant, plugin_overrides)


def replica_of(stack: Stack, res: Result) -> str:
    """Our name (r0..) for the replica that answered."""
    r = stack.by_sim_name(res.replica)
    if r is None:
        raise AssertionError(f"answer names unknown replica {res.replica!r} ({res})")
    return r.name


def stat_sum(stack: Stack, needle: str) -> int:
    """Sum of Envoy stats whose name contains `needle` (wasm metrics carry a prefix such as
    `wasmcustom.`, and each worker's VM writes the same stat)."""
    return sum(v for k, v in stack.stats(needle).items() if needle in k)


class KvsteerBehindEnvoy(unittest.TestCase):
    """envoy/envoy.yaml: override_host on the destination header, kv_time (the default)."""

    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = new_stack("envoy")

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def seed_prefix(self, seed: int, n: int = 1024) -> tuple[list[int], str]:
        """Sends a fresh prefix once; returns it and the replica that now caches it."""
        prefix = tokens(n, seed)
        first = self.stack.send(prefix + tokens(32, seed + 1))
        self.assertTrue(first.ok, first)
        return prefix, replica_of(self.stack, first)

    def test_same_prefix_lands_on_the_replica_that_holds_it(self):
        holders = {}
        for p in range(4):
            holders[p] = self.seed_prefix(10_000 + 100 * p)
        time.sleep(FEED_SETTLE_S)
        for p, (prefix, holder) in holders.items():
            for k in range(3):
                time.sleep(PEER_SETTLE_S)
                res = self.stack.send(prefix + tokens(32, 50_000 + 100 * p + k))
                self.assertTrue(res.ok, res)
                self.assertEqual(replica_of(self.stack, res), holder,
                                 f"prefix {p} follow-up {k}: {res.cached_tokens} cached")
                # The engine itself says the prefix was reused: 64 full blocks of 16 tokens.
                self.assertGreaterEqual(res.cached_tokens, 1024, res)
                self.assertEqual(res.prompt_tokens, 1024 + 32, res)

    # A replica whose cache has not changed for a while must still count as holding its blocks. The
    # worker that polls a feed relays every batch, including empty ones that only carry the replica's
    # load; the other workers must take those as proof of a live feed. (Before 785d5e6 they skipped
    # them, marked the feed stale after 800 ms and routed on load alone: 20 misses in 108 follow-ups
    # after a 2 s pause.)
    def test_the_cache_view_survives_an_idle_gap(self):
        prefix, holder = self.seed_prefix(15_000)
        for k in range(6):
            # Longer than the staleness window after the last cache event.
            time.sleep(1.3)
            res = self.stack.send(prefix + tokens(32, 15_100 + k))
            self.assertTrue(res.ok, res)
            self.assertEqual(replica_of(self.stack, res), holder, f"after pause {k}: {res}")

    def test_a_long_prompt_is_read_as_it_arrives(self):
        # A 20K-token prompt is about 130 KB of JSON: Envoy hands it to the filter in several
        # slices, and the filter's early scan reads the ids of all but the last before the body
        # has arrived (docs/design/filter.md, "The body as it arrives"). The follow-up still lands
        # on the replica that holds the prefix, as the whole-body read would send it.
        before = stat_sum(self.stack, "kvsteer_early_scan_bodies")
        prefix, holder = self.seed_prefix(25_000, n=20_000)
        time.sleep(FEED_SETTLE_S)
        res = self.stack.send(prefix + tokens(32, 25_100))
        self.assertTrue(res.ok, res)
        self.assertEqual(replica_of(self.stack, res), holder, res)
        self.assertGreaterEqual(res.cached_tokens, 20_000 - 16, res)
        after = stat_sum(self.stack, "kvsteer_early_scan_bodies")
        self.assertGreaterEqual(after - before, 2, "both bodies were read as they arrived")

    def test_streamed_and_non_streamed_requests_both_work(self):
        prompt = tokens(300, 777)
        for chat in (False, True):
            plain = self.stack.send(prompt, max_tokens=12, chat=chat, ignore_eos=True)
            self.assertTrue(plain.ok, plain)
            self.assertEqual(plain.completion_tokens, 12)
            self.assertTrue(plain.text)
            streamed = self.stack.send(prompt, max_tokens=12, stream=True, chat=chat,
                            ignore_eos=True)
            self.assertTrue(streamed.ok, streamed)
            self.assertTrue(streamed.done, "stream closed with [DONE]")
            self.assertEqual(streamed.headers.get("content-type", "").split(";")[0],
                             "text/event-stream")
            self.assertGreaterEqual(streamed.events, 12)
            self.assertEqual(streamed.completion_tokens, 12)
            self.assertTrue(streamed.replica)

    def test_a_spoofed_destination_header_is_ignored(self):
        prefix, holder = self.seed_prefix(20_000)
        time.sleep(FEED_SETTLE_S)
        before = stat_sum(self.stack, "kvsteer_spoofed_headers_removed")
        others = [r.endpoint for r in self.stack.replicas if r.name != holder]
        spoofs = others + ["127.0.0.1:1", ",".join(others)]
        for k, spoof in enumerate(spoofs):
            time.sleep(PEER_SETTLE_S)
            res = self.stack.send(prefix + tokens(16, 21_000 + k),
                       headers={"x-gateway-destination-endpoint": spoof})
            self.assertTrue(res.ok, res)
            self.assertEqual(replica_of(self.stack, res), holder, f"spoofed {spoof}")
        # Not only inference requests: no request may carry a client's routing header upstream.
        c = Client("127.0.0.1", self.stack.listen_port)
        status, _, _ = c.request("GET", "/v1/models",
                                 headers={"x-gateway-destination-endpoint": others[0]})
        c.close()
        self.assertEqual(status, 200)
        removed = stat_sum(self.stack, "kvsteer_spoofed_headers_removed") - before
        self.assertGreaterEqual(removed, len(spoofs) + 1)

    def test_feed_polls_run_on_the_main_thread(self):
        # Envoy's main thread runs a VM of the plugin that ticks but never routes; it holds every
        # feed lease (taking it from a worker that routes, filter/src/worker/relay.rs), so the callouts stay
        # off the threads serving requests. Requests on fresh connections reach both workers.
        for k in range(16):
            self.assertTrue(self.stack.send(tokens(64, 40_000 + k)).ok)
        time.sleep(1.0)  # longer than a poll period (200 ms) plus a tick: any handover is done
        text = "\n".join(self.stack.envoy_logs())
        line = r"^\[[^\]]*\]\[(\d+)\]\[info\]\[wasm\].*kvsteer: "
        configured = re.findall(line + r"configured ", text, re.M)
        self.assertTrue(configured, "no 'configured' line with a thread id in Envoy's log")
        # Envoy configures the plugin on its main thread first, then on each worker.
        main = configured[0]
        holders = {}
        for tid, name in re.findall(line + r"VM \d+ \([^)]*\) now polls (\S+)'s feed", text,
                                    re.M):
            holders[name] = tid
        self.assertEqual(set(holders), {r.name for r in self.stack.replicas}, text[-2000:])
        for name, tid in holders.items():
            self.assertEqual(tid, main, f"{name}'s feed is polled by thread {tid}, not the main "
                             f"thread {main}")

    def test_filter_metrics_appear_in_envoy_stats(self):
        before = stat_sum(self.stack, "kvsteer_requests_routed")
        for k in range(3):
            self.assertTrue(self.stack.send(tokens(64, 30_000 + k)).ok)
        stats = self.stack.stats("kvsteer_")
        names = {k.split("kvsteer_", 1)[1] for k in stats}
        for want in ("requests_routed", "prompt_tokens", "matched_tokens",
                     "spoofed_headers_removed", "index_blocks"):
            self.assertIn(want, names, sorted(names))
        for r in self.stack.replicas:
            self.assertIn(f"feed_errors_{r.name}", names)
        self.assertGreaterEqual(stat_sum(self.stack, "kvsteer_requests_routed") - before, 3)

    def test_a_feed_outage_changes_nothing_a_client_sees(self):
        prefix = tokens(512, 40_000)
        errors_before = stat_sum(self.stack, "kvsteer_feed_errors_")
        try:
            for r in self.stack.replicas:
                self.stack.set_fault(r.name, {"feed_outage": True})
            # Long enough for the filter to mark every feed stale (3 failed polls).
            time.sleep(1.2)
            for k in range(8):
                res = self.stack.send(prefix + tokens(16, 41_000 + k), max_tokens=6,
                           stream=bool(k % 2), ignore_eos=True)
                self.assertTrue(res.ok, res)
                self.assertEqual(res.completion_tokens, 6)
            self.assertGreater(stat_sum(self.stack, "kvsteer_feed_errors_") - errors_before, 0,
                               "the outage was seen by the filter")
        finally:
            for r in self.stack.replicas:
                self.stack.set_fault(r.name, {"feed_outage": False})
        # And when the feeds come back, routing by cache comes back.
        time.sleep(2 * FEED_SETTLE_S)
        again, holder = self.seed_prefix(42_000)
        time.sleep(FEED_SETTLE_S)
        res = self.stack.send(again + tokens(16, 42_500))
        self.assertEqual(replica_of(self.stack, res), holder, res)
        self.assertGreaterEqual(res.cached_tokens, 1024, res)


class BusyReplicaAvoided(unittest.TestCase):
    """Under kv_load a replica already loaded with decode work is avoided, even by a request whose
    prefix it caches, because the prefill saved there is smaller than the load it carries. The load
    comes from traffic this proxy never saw (another router's), so the filter learns it only from the
    replica's own report in the feed: `load.reported_load: max`, the setting for fleets with several
    independent proxies (the default, `ignore`, scores on this proxy's own bookings)."""

    def test_busy_replica_is_avoided(self):
        max_reports = {"routing": {"policy": "kv_load", "load": {"reported_load": "max"}}}
        with new_stack("envoy", plugin_overrides=max_reports) as stack:
            busy = stack.replicas[0]
            prefix = tokens(256, 60_000)
            # Cache the prefix on `busy` only, by asking it directly.
            direct = Client("127.0.0.1", busy.port)
            self.assertTrue(direct.complete(prefix + tokens(16, 60_001)).ok)
            direct.close()
            # Then load it with long generations the proxy never saw (another router's traffic).
            loaders = [Client("127.0.0.1", busy.port, timeout_s=120) for _ in range(8)]
            threads = [
                threading.Thread(
                    target=c.complete,
                    args=(tokens(1024, 61_000 + i),),
                    kwargs={"max_tokens": 4000, "stream": True, "ignore_eos": True},
                    daemon=True,
                )
                for i, c in enumerate(loaders)
            ]
            for t in threads:
                t.start()
            try:
                time.sleep(FEED_SETTLE_S + 0.5)
                landed = []
                for k in range(6):
                    res = stack.send(prefix + tokens(16, 62_000 + k))
                    self.assertTrue(res.ok, res)
                    landed.append(replica_of(stack, res))
                    # Fresh prompts too: nothing cached anywhere, load decides.
                    res = stack.send(tokens(256, 63_000 + k))
                    self.assertTrue(res.ok, res)
                    landed.append(replica_of(stack, res))
                self.assertNotIn(busy.name, landed, landed)
                self.assertEqual(stack.vm_failures(), [])
            finally:
                stack.close()  # ends the loaders' streams


class ReplicaKilledMidRun(unittest.TestCase):
    """A replica that dies costs no request Envoy could retry elsewhere: non-streamed requests in
    flight on it (reset before any response) and new ones routed to it (connection refused) are
    retried on another replica. A stream that has already started cannot be retried by any proxy."""

    def test_killed_replica_costs_no_retriable_request(self):
        with new_stack("envoy") as stack:
            victim = stack.replicas[1]
            results: list[Result] = []
            lock = threading.Lock()
            stop = threading.Event()

            def worker(w: int) -> None:
                c = Client("127.0.0.1", stack.listen_port, timeout_s=60)
                k = 0
                while not stop.is_set() and k < 400:
                    res = c.complete(tokens(256, 70_000 + 1000 * w + k), max_tokens=64,
                                     ignore_eos=True)
                    with lock:
                        results.append(res)
                    k += 1
                c.close()

            threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(6)]
            for t in threads:
                t.start()
            time.sleep(2.0)
            with lock:
                before_kill = len(results)
                on_victim_before = sum(1 for r in results if r.replica == victim.sim_name)
            victim.proc.kill()
            time.sleep(3.0)
            stop.set()
            for t in threads:
                t.join(timeout=60)
            retries = stat_sum(stack, "cluster.replicas.upstream_rq_retry")
            failed = [r for r in results if not r.ok]
            self.assertGreater(before_kill, 10, "traffic was flowing before the kill")
            self.assertGreater(on_victim_before, 0, "the victim was serving before it died")
            kinds = sorted({(r.status, r.error[:80]) for r in failed})
            self.assertEqual(len(failed), 0,
                             f"{len(failed)} of {len(results)} requests failed: {kinds[:5]}")
            after = [r for r in results[before_kill:] if r.ok]
            self.assertGreater(len(after), 10, "traffic kept flowing after the kill")
            self.assertGreater(retries, 0, "Envoy retried the requests the dead replica lost")
            self.assertEqual(stack.vm_failures(), [])


    # A dead replica reports no load, so a load-aware policy would keep choosing it (it looks idle).
    # Envoy answers the filter's feed callout to a host that refuses connections with its own 503
    # ("upstream connect error ..."); the filter reads that as unreachable and, after
    # stale_after_failures polls, avoids the replica (filter/src/worker/failures.rs,
    # proxy_could_not_connect).
    def test_a_dead_replica_stops_being_chosen(self):
        with new_stack("envoy") as stack:
            victim = stack.replicas[2]
            stop = threading.Event()

            def worker(w: int) -> None:
                c = Client("127.0.0.1", stack.listen_port, timeout_s=60)
                for k in range(2000):
                    if stop.is_set():
                        break
                    c.complete(tokens(128, 90_000 + 1000 * w + k), max_tokens=8)
                c.close()

            threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(4)]
            for t in threads:
                t.start()
            time.sleep(1.0)
            victim.proc.kill()
            # Long past the feed going stale (3 polls of 200 ms) and the health checks failing (2 s).
            time.sleep(3.0)
            before = stat_sum(stack, "cluster.replicas.upstream_cx_connect_fail")
            time.sleep(2.0)
            after = stat_sum(stack, "cluster.replicas.upstream_cx_connect_fail")
            stop.set()
            for t in threads:
                t.join(timeout=60)
            self.assertEqual(after - before, 0, "requests still sent to the dead replica")


class EnvoyVariants(unittest.TestCase):
    """The other configurations in envoy/ run on the same replicas: the cluster_header variant of
    kvsteer, and Envoy's own balancers the benchmark compares against."""

    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = Stack()
        try:
            cls.stack.start_replicas(REPLICAS, extra=["--time-scale", TIME_SCALE])
        except BaseException:
            cls.stack.close()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def with_envoy(self, variant: str, **kw) -> None:
        if self.stack.envoy is not None:
            self.stack.envoy.stop()
            self.stack.procs.remove(self.stack.envoy)
        self.stack.start_envoy(variant, concurrency=2, **kw)

    def test_without_allow_on_headers_stop_iteration_requests_stall(self):
        # Why envoy.yaml sets the flag, and why Istio's WasmPlugin (which cannot set it) is not the
        # way to install kvsteer on Envoy >= 1.35 (docs/guide/istio.md): the filter pauses on the
        # request headers to read the body, and without the flag Envoy never resumes the request.
        self.with_envoy("envoy", wasm_overrides={"allow_on_headers_stop_iteration": False})
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=3)
        stalled = c.complete(tokens(64, 85_000))
        c.close()
        self.assertEqual(stalled.status, 0, stalled)
        self.assertIn("timed out", stalled.error)
        self.with_envoy("envoy")
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=3)
        fine = c.complete(tokens(64, 85_000))
        c.close()
        self.assertTrue(fine.ok, fine)

    def test_every_variant_is_tested_here(self):
        files = {p.stem for p in envoy_config.ENVOY_DIR.glob("*.yaml")}
        self.assertEqual(files, set(envoy_config.VARIANTS))

    def test_cluster_header_variant_routes_by_prefix_and_ignores_spoofs(self):
        self.with_envoy("envoy-cluster-header")
        prefix = tokens(1024, 80_000)
        first = self.stack.send(prefix + tokens(16, 80_001))
        self.assertTrue(first.ok, first)
        holder = replica_of(self.stack, first)
        time.sleep(FEED_SETTLE_S)
        others = [r.name for r in self.stack.replicas if r.name != holder]
        for k, other in enumerate(others + [None]):
            spoof = {"x-kvsteer-cluster": f"replica_{other}"} if other else {
                "x-kvsteer-cluster": "kvsteer_feed_" + holder}
            time.sleep(PEER_SETTLE_S)
            res = self.stack.send(prefix + tokens(16, 80_010 + k), headers=spoof)
            self.assertTrue(res.ok, res)
            self.assertEqual(replica_of(self.stack, res), holder, f"{spoof}: {res}")
            self.assertGreaterEqual(res.cached_tokens, 1024, res)

    def spread(self, n: int = 12, session=None) -> list[str]:
        landed = []
        for k in range(n):
            res = self.stack.send(tokens(64, 90_000 + k),
                       session=session(k) if session else None)
            self.assertTrue(res.ok, res)
            landed.append(replica_of(self.stack, res))
        return landed

    def test_round_robin_spreads(self):
        self.with_envoy("envoy-round-robin")
        self.assertGreaterEqual(len(set(self.spread())), 3)

    def test_least_request_spreads(self):
        self.with_envoy("envoy-least-request")
        self.assertGreaterEqual(len(set(self.spread())), 2)

    def test_ring_hash_keeps_a_session_on_one_replica(self):
        self.with_envoy("envoy-ring-hash")
        # Ports (so the ring) change per run: with 6 sessions, all of them hashed to one of the four
        # replicas about once in a thousand runs; with 16, about once in a billion.
        sessions = 16
        landed = self.spread(2 * sessions, session=lambda k: f"session-{k % sessions}")
        by_session: dict[int, set[str]] = {}
        for k, r in enumerate(landed):
            by_session.setdefault(k % sessions, set()).add(r)
        for s, rs in by_session.items():
            self.assertEqual(len(rs), 1, f"session {s} went to {rs}")
        self.assertGreaterEqual(len(set(landed)), 2, "sixteen sessions do not all hash to one replica")


if __name__ == "__main__":
    unittest.main()
