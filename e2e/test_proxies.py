"""End-to-end: two independent Envoy processes (each `--concurrency 2`, each its own filter VMs and
shared data) in front of the same two simulated replicas (docs/reports/proxies.md). Nothing passes
between the Envoys but the replicas' feeds: proxy B learns of a long decode sent through proxy A only
from the replica's report. `RestartOneProxy`: B is drained, stopped and started again under client
traffic split over both (docs/reports/proxies.md, "Restarting a proxy"). `WorkingSetExchange`: with `peers`
configured, each Envoy polls the other for its working-set journals (docs/reports/proxies.md, "Working set
across proxies").

Run by scripts/e2e (`scripts/e2e test_proxies`); needs the release wasm and the sim binary.
"""

from __future__ import annotations

import os
import statistics
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from client import Client, Result, tokens
from stack import Stack, free_ports

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
# A feed poll of B (every 200 ms) after the long decode started, plus the relay to B's other worker
# (next 100 ms tick), with margin.
FEED_SETTLE_S = 0.8


def decode_blocks(endpoint: str) -> float:
    """The replica's own `kvsteer_sim:decode_blocks` gauge."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2) as r:
        text = r.read().decode()
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
               if ln.startswith("kvsteer_sim:decode_blocks"))


def replica_gauges(endpoint: str) -> dict[str, float]:
    """Requests running and waiting and KV blocks decoding on a replica, from its own metrics."""
    with urllib.request.urlopen(f"http://{endpoint}/metrics", timeout=2) as r:
        text = r.read().decode()
    out = {"running": 0.0, "waiting": 0.0, "decode_blocks": 0.0}
    names = {"vllm:num_requests_running": "running", "vllm:num_requests_waiting": "waiting",
             "kvsteer_sim:decode_blocks": "decode_blocks"}
    for ln in text.splitlines():
        name = ln.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            out[names[name]] += float(ln.rsplit(" ", 1)[1])
    return out


def overrides_for(reported_load: str, **kv_load) -> dict:
    """Under `kv_load`, the policy the reported-load modes were designed and measured with
    (docs/reports/proxies.md): a replica's reported decode blocks against this proxy's own bookings
    decide where it sends. (`kv_time`, the default, prices the same load in seconds, and at two
    replicas may rightly put a short request beside one long decode.)"""
    return {"routing": {"policy": "kv_load",
                        "load": {"reported_load": reported_load},
                        "kv_load": dict(kv_load)}}


def two_envoys(reported_load: str, **kv_load) -> tuple[Stack, Stack]:
    """Replicas and Envoy A in one stack; Envoy B in a second stack sharing A's replicas (B stops
    only its own Envoy). `kv_load` adds other `routing.kv_load` fields."""
    overrides = overrides_for(reported_load, **kv_load)
    a, b = Stack(), Stack()
    try:
        a.start_replicas(2, extra=["--time-scale", TIME_SCALE])
        # Distinct node ids, as separate proxies of a fleet have: each filter mixes its own into the
        # tie-break seed (docs/reports/proxies.md, "Tie-breaks").
        a.start_envoy("envoy", concurrency=2, plugin_overrides=overrides, node_id="proxy-a")
        b.replicas = a.replicas
        b.start_envoy("envoy", concurrency=2, plugin_overrides=overrides, node_id="proxy-b")
    except BaseException:
        b.close()
        a.close()
        raise
    return a, b


class TwoEnvoysOneFleet(unittest.TestCase):
    """A long decode through Envoy A; then four short requests at once through Envoy B. With
    `reported_load: merge`, or `others` without the working-set term (the configuration recommended
    for several proxies), B keeps all four off the replica decoding A's request; with `ignore` it
    balances them over both replicas as if both were idle (it sees only its own bookings)."""

    def run_case(self, reported_load: str, **kv_load) -> tuple[str, list[str]]:
        a, b = two_envoys(reported_load, **kv_load)
        long_result: list[Result] = []
        try:
            client = Client("127.0.0.1", a.listen_port, timeout_s=120)
            t = threading.Thread(
                target=lambda: long_result.append(client.complete(
                    tokens(4096, 70_000), max_tokens=8000, stream=True, ignore_eos=True)),
                daemon=True)
            t.start()
            # Which replica took it: the one whose own gauge shows its decode.
            deadline = time.monotonic() + 10
            busy = None
            while busy is None and time.monotonic() < deadline:
                loads = {r.name: decode_blocks(r.endpoint) for r in a.replicas}
                hot = [n for n, v in loads.items() if v >= 200]
                busy = hot[0] if len(hot) == 1 else None
                time.sleep(0.05)
            self.assertIsNotNone(busy, "the long request is decoding on one replica")
            time.sleep(FEED_SETTLE_S)
            results: list[Result] = [None] * 4  # type: ignore[list-item]

            def short(i: int) -> None:
                c = Client("127.0.0.1", b.listen_port)
                try:
                    results[i] = c.complete(tokens(64, 71_000 + i), max_tokens=200,
                                            ignore_eos=True)
                finally:
                    c.close()

            shorts = [threading.Thread(target=short, args=(i,), daemon=True) for i in range(4)]
            for s in shorts:
                s.start()
            for s in shorts:
                s.join(60)
            landed = []
            for r in results:
                self.assertTrue(r is not None and r.ok, r)
                rep = a.by_sim_name(r.replica)
                self.assertIsNotNone(rep, r)
                landed.append(rep.name)
            # The long decode is still running: the contrast above is not an artefact of it ending.
            self.assertEqual(long_result, [], "the long decode outlived the test's requests")
            self.assertEqual(a.vm_failures() + b.vm_failures(), [])
            # Envoy answers the filter's `node.id` property with `--service-node`: every VM of A
            # (at least its two workers) read A's id, every VM of B read B's.
            for stack, node in ((a, "proxy-a"), (b, "proxy-b")):
                ids = stack.node_ids_logged()
                self.assertGreaterEqual(len(ids), 2, ids)
                self.assertEqual(set(ids), {node})
            return busy, landed
        finally:
            b.close()
            a.close()  # ends the long stream

    def test_merge_steers_the_other_proxy_away_from_a_reported_decode(self):
        busy, landed = self.run_case("merge")
        self.assertNotIn(busy, landed, f"B sent to the replica decoding A's request: {landed}")

    def test_others_without_the_working_set_term_steers_the_other_proxy_away(self):
        # The configuration docs/reports/proxies.md recommends for several proxies.
        busy, landed = self.run_case("others", overflow_weight=0)
        self.assertNotIn(busy, landed, f"B sent to the replica decoding A's request: {landed}")

    def test_ignore_cannot_see_the_other_proxys_decode(self):
        busy, landed = self.run_case("ignore")
        self.assertIn(busy, landed, f"B balanced its own four over both replicas: {landed}")


# -- the working-set exchange between the two Envoys ----------------------------------------------

PEER_TOKEN = "e2e-peer-token-0123456789"


def exchanging_envoys(peers: bool, routing: dict | None = None) -> tuple[Stack, Stack]:
    """Two Envoys over the same two replicas; with `peers`, each lists the other as its peer proxy
    (a STATIC cluster to the other's listener) with a shared token (docs/reports/proxies.md, "Working set
    across proxies"). Ports are taken up front: each Envoy's configuration names the other's.
    `routing`: the plugin's `routing` section (default: `kv_load` with `merge`)."""
    a, b = Stack(), Stack()
    try:
        a.start_replicas(2, extra=["--time-scale", TIME_SCALE])
        b.replicas = a.replicas
        ports = {"a": free_ports(2), "b": free_ports(2)}
        for stack, me, other, node in ((a, "a", "b", "proxy-a"), (b, "b", "a", "proxy-b")):
            overrides = {"routing": routing} if routing else overrides_for("merge")
            clusters = None
            if peers:
                overrides["peers"] = {
                    "proxies": [{"cluster": f"kvsteer_peer_{other}"}],
                    "token": PEER_TOKEN,
                }
                clusters = {f"kvsteer_peer_{other}": f"127.0.0.1:{ports[other][0]}"}
            stack.start_envoy("envoy", concurrency=2, plugin_overrides=overrides, node_id=node,
                              listen_port=ports[me][0], admin_port=ports[me][1],
                              extra_clusters=clusters)
    except BaseException:
        b.close()
        a.close()
        raise
    return a, b


class WorkingSetExchange(unittest.TestCase):
    """Eight sessions, each turn 1 through Envoy A and turn 2 through Envoy B. With the exchange on,
    B applies A's admissions and so sees the sessions' contexts as reused: a working set; without
    it B saw each session once and estimates none. A client's request for the reserved path is
    answered by the filter (403 without the token) and never reaches a replica."""

    def run_case(self, peers: bool, routing: dict | None = None) -> tuple[int, int, int]:
        a, b = exchanging_envoys(peers, routing)
        try:
            ca = Client("127.0.0.1", a.listen_port, timeout_s=60)
            cb = Client("127.0.0.1", b.listen_port, timeout_s=60)
            prompts = [tokens(2048, 90_000 + s) for s in range(8)]
            for s, p in enumerate(prompts):
                r = ca.complete(p, max_tokens=8, session=f"s{s}")
                self.assertTrue(r.ok, r)
            # A's journals reach B within a tick plus a poll.
            time.sleep(1.0)
            for s, p in enumerate(prompts):
                r = cb.complete(p + tokens(64, 91_000 + s), max_tokens=8, session=f"s{s}")
                self.assertTrue(r.ok, r)
            time.sleep(0.5)
            applied = stat_sum(b, "kvsteer_peer_entries_applied")
            ws = stat_sum(b, "kvsteer_working_set_blocks")
            # A client asking for the reserved path: refused by the filter, never forwarded.
            for headers in ({}, {"x-kvsteer-peer-token": "wrong-token-0123456789"}):
                status, _, body = ca.request("GET", "/.kvsteer/working-set?after=", headers=headers)
                self.assertEqual(status, 403 if peers else 404, body)
                self.assertLess(len(body), 64, "no journal")
            ca.close()
            cb.close()
            time.sleep(0.3)  # the counters are brought up to date on the next tick
            refused = stat_sum(a, "kvsteer_peer_requests_refused")
            self.assertEqual(a.vm_failures() + b.vm_failures(), [])
            if peers:
                self.assertGreater(stat_sum(a, "kvsteer_peer_requests_served"), 0)
                self.assertEqual(stat_sum(b, "kvsteer_peer_answers_refused"), 0)
            return applied, ws, refused
        finally:
            b.close()
            a.close()

    def test_with_the_exchange_the_other_proxy_sees_the_sessions(self):
        applied, ws, refused = self.run_case(True)
        self.assertGreater(applied, 0)
        self.assertGreater(ws, 0, "B sees A's first turns as its sessions' contexts")
        self.assertGreaterEqual(refused, 2)

    def test_kv_time_with_others_exchanges_its_working_set_too(self):
        # The setting recommended for several proxies running `kv_time` (docs/reports/proxies.md,
        # "`peers` with `kv_time` on nine new draws"): its eviction term keeps a working set, and
        # the other proxy applies this one's admissions to it.
        routing = {"policy": "kv_time", "load": {"reported_load": "others"}}
        applied, ws, refused = self.run_case(True, routing)
        self.assertGreater(applied, 0)
        self.assertGreater(ws, 0, "B sees A's first turns as its sessions' contexts")
        self.assertGreaterEqual(refused, 2)

    def test_without_it_the_other_proxy_sees_each_session_once(self):
        applied, ws, refused = self.run_case(False)
        self.assertEqual(applied, 0)
        self.assertEqual(ws, 0)
        self.assertGreaterEqual(refused, 2)


# -- restarting one proxy ------------------------------------------------------------------------

# The load balancer's health check: Envoy's `GET /ready` on the admin port every CHECK_S; a proxy
# leaves the rotation at its first failed check and comes back after RISE passes in a row.
CHECK_S = 0.1
RISE = 3
# Client traffic: CLIENTS threads, each sending one streamed completion after the other (a short
# pause between), at most PER_CLIENT each.
CLIENTS = 3
PER_CLIENT = 400
PAUSE_S = 0.02
# Streams in flight on B when its drain begins, long enough to outlast the start of the drain.
WITNESSES = 2
WITNESS_TOKENS = 2000
# The long decode sent through A while B is down: it must outlast B's restart and the probes.
LONG_PROMPT = 4096
LONG_TOKENS = 20_000
# From the restarted proxy's first feed polls to the probes: the next tick (100 ms) relays the
# reports to its other worker; the same margin as FEED_SETTLE_S. (With 0.3 s, one run in three had
# one probe of four on the busy replica; not explained yet.)
RELAY_S = FEED_SETTLE_S


def admin_post(stack: Stack, path: str) -> str:
    req = urllib.request.Request(f"http://127.0.0.1:{stack.admin_port}{path}", data=b"",
                                 method="POST")
    with urllib.request.urlopen(req, timeout=5) as r:
        return r.read().decode()


def stat_sum(stack: Stack, needle: str) -> int:
    """Sum of Envoy stats whose name contains `needle` (each worker's VM writes the same stat)."""
    return sum(v for k, v in stack.stats(needle).items() if needle in k)


@dataclass
class Proxy:
    """One proxy as the load balancer sees it. `process` names the Envoy process now behind it (B#1,
    then B#2 after the restart); `generation` grows each time it leaves the rotation, so clients
    drop their keep-alive connections to it."""

    name: str
    stack: Stack
    process: str
    in_rotation: bool = False
    passes: int = 0
    in_flight: int = 0
    generation: int = 0


@dataclass
class Sent:
    phase: str
    process: str
    what: str
    result: Result
    t0: float  # time.monotonic() when it was sent


class LoadBalancer:
    """What an operator runs in front of gateway replicas (a cloud load balancer, a Kubernetes
    Service): round robin over the proxies whose health check passes. It counts the requests it
    has in flight on each proxy, as a load balancer's connection draining does, and the requests
    sent to each Envoy process."""

    def __init__(self, proxies: list[Proxy]):
        self.proxies = proxies
        self.lock = threading.Lock()
        self.next = 0
        self.sent_to: dict[str, int] = {}
        self.log: list[Sent] = []
        self.phase = "both"
        self.stop = threading.Event()
        self.checker = threading.Thread(target=self.check_loop, daemon=True)

    def start(self) -> None:
        self.checker.start()

    def close(self) -> None:
        self.stop.set()
        self.checker.join(5)

    def check_loop(self) -> None:
        while not self.stop.is_set():
            for p in self.proxies:
                try:
                    with urllib.request.urlopen(
                            f"http://127.0.0.1:{p.stack.admin_port}/ready", timeout=1) as r:
                        ok = r.status == 200
                except (urllib.error.URLError, ConnectionError, OSError):
                    ok = False
                with self.lock:
                    if not ok:
                        if p.in_rotation:
                            p.generation += 1
                        p.in_rotation, p.passes = False, 0
                    else:
                        p.passes += 1
                        if p.passes >= RISE:
                            p.in_rotation = True
            self.stop.wait(CHECK_S)

    def acquire(self, through: Proxy | None = None) -> tuple[Proxy, str, str, int]:
        """A proxy for the next request (the next in rotation, or `through`), counted in flight:
        (proxy, its process, the phase, its generation)."""
        deadline = time.monotonic() + 10
        while True:
            with self.lock:
                if through is not None:
                    p = through
                else:
                    up = [q for q in self.proxies if q.in_rotation]
                    p = up[self.next % len(up)] if up else None
                    self.next += 1
                if p is not None:
                    p.in_flight += 1
                    self.sent_to[p.process] = self.sent_to.get(p.process, 0) + 1
                    return p, p.process, self.phase, p.generation
            if time.monotonic() > deadline:
                raise AssertionError("no proxy in rotation for 10 s")
            time.sleep(0.01)

    def release(self, p: Proxy, sent: Sent) -> None:
        with self.lock:
            p.in_flight -= 1
            self.log.append(sent)

    def send(self, what: str, prompt: list[int], through: Proxy | None = None,
             clients: dict | None = None, **kw) -> Sent:
        """One completion through the balancer; `clients` keeps one keep-alive connection per proxy
        (for one thread), else a connection is opened for this request."""
        p, process, phase, gen = self.acquire(through)
        t0 = time.monotonic()
        c = None
        try:
            if clients is not None:
                held = clients.get(p.name)
                if held is not None and held[0] != gen:
                    held[1].close()
                    held = None
                if held is None:
                    held = (gen, Client("127.0.0.1", p.stack.listen_port, timeout_s=120))
                    clients[p.name] = held
                c = held[1]
            else:
                c = Client("127.0.0.1", p.stack.listen_port, timeout_s=120)
            res = c.complete(prompt, **kw)
        finally:
            if clients is None and c is not None:
                c.close()
        sent = Sent(phase, process, what, res, t0)
        self.release(p, sent)
        return sent

    def wait(self, cond, what: str, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if cond():
                    return
            if time.monotonic() > deadline:
                raise AssertionError(f"{what}: not within {timeout_s} s")
            time.sleep(0.02)


def ttft_figures(log: list[Sent]) -> str:
    """Client-side time to first event of the background streams, per phase and Envoy process."""
    groups: dict[tuple[str, str], list[float]] = {}
    for s in log:
        if s.what == "traffic" and s.result.ok:
            groups.setdefault((s.phase, s.process), []).append(s.result.ttfb_s * 1000)
    rows = []
    for (phase, process), v in groups.items():
        v.sort()
        p90 = v[min(len(v) - 1, int(0.9 * len(v)))]
        rows.append(f"  {phase:<14} {process:<4} n={len(v):<4} p50 {statistics.median(v):6.1f} ms"
                    f"  p90 {p90:6.1f} ms  max {v[-1]:6.1f} ms")
    return "\n".join(rows)


class RestartOneProxy(unittest.TestCase):
    """Two Envoys (`reported_load: merge`) behind a load balancer, client traffic split over both;
    B is restarted the way an operator does it: `POST /healthcheck/fail` (its `/ready` answers 503,
    the balancer takes it out; Envoy still serves what reaches it and closes each connection after
    its response), wait until nothing is in flight on it, `POST /drain_listeners`, SIGTERM, start
    again with the same configuration and ports, back into the rotation when `/ready` passes.

    Asserted: no request fails, the streams in flight on B when the drain began included; every
    request that reached an Envoy was routed by the filter (`kvsteer_requests_routed` equals what
    the balancer sent that process; no `kvsteer_fallbacks`); the restarted B, 0.8 s after its
    first feed polls (the background clients held until the other replica is idle), keeps four
    concurrent requests off the replica decoding a long request sent through A while B was down. The TTFTs are printed, not asserted (no timing assertions)."""

    def setUp(self) -> None:
        self.a, self.b = two_envoys("merge")
        self.addCleanup(self.a.close)
        self.addCleanup(self.b.close)

    def test_a_drained_and_restarted_proxy_loses_nothing_and_starts_informed(self):
        a, b = self.a, self.b
        t_start = time.monotonic()
        pa, pb = Proxy("A", a, "A"), Proxy("B", b, "B#1")
        lb = LoadBalancer([pa, pb])
        lb.start()
        self.addCleanup(lb.close)
        lb.wait(lambda: pa.in_rotation and pb.in_rotation, "both proxies in rotation")

        stop = threading.Event()
        # Set while the probes go: the background clients wait, so the free replica holds nothing
        # but the probes and any probe on the busy one is B#2 not knowing its load, not a queue of
        # background requests on the free one that a slow machine let grow (CI, 2026-12-03: one
        # probe of four on the busy replica, not reproduced here in six runs, two with the CPUs
        # saturated).
        hold = threading.Event()

        def traffic(n: int) -> None:
            clients: dict = {}
            try:
                for i in range(PER_CLIENT):
                    if stop.is_set():
                        break
                    while hold.is_set() and not stop.is_set():
                        time.sleep(0.01)
                    lb.send("traffic", tokens(96, 80_000 + 1000 * n + i), clients=clients,
                            max_tokens=32, stream=True, ignore_eos=True)
                    time.sleep(PAUSE_S)
            finally:
                for _, c in clients.values():
                    c.close()

        threads = [threading.Thread(target=traffic, args=(n,), daemon=True)
                   for n in range(CLIENTS)]
        for t in threads:
            t.start()
        self.addCleanup(stop.set)
        time.sleep(2.0)

        # Streams on B that will be in flight when its drain begins.
        witnesses: list[Sent] = []
        wt = [threading.Thread(target=lambda k=k: witnesses.append(lb.send(
            "witness", tokens(256, 90_000 + k), through=pb, max_tokens=WITNESS_TOKENS,
            stream=True, ignore_eos=True)), daemon=True) for k in range(WITNESSES)]
        for t in wt:
            t.start()
        time.sleep(0.5)

        # 1. Out of the rotation.
        with lb.lock:
            lb.phase = "B draining"
        t_drain = time.monotonic()
        self.assertEqual(admin_post(b, "/healthcheck/fail").strip(), "OK")
        active_at_drain = b.stats("http.inference.downstream_rq_active").get(
            "http.inference.downstream_rq_active", 0)
        self.assertEqual(witnesses, [], "the witness streams were in flight when the drain began")
        self.assertGreaterEqual(active_at_drain, WITNESSES)
        # 2. Wait for the balancer to take it out and for what it had in flight to finish.
        lb.wait(lambda: not pb.in_rotation and pb.in_flight == 0, "B drained", 60)
        for t in wt:
            t.join(10)
        self.assertEqual(b.stats("http.inference.downstream_rq_active").get(
            "http.inference.downstream_rq_active"), 0, "nothing in flight on B")
        with lb.lock:
            sent_b1 = lb.sent_to.get("B#1", 0)
        routed_b1 = stat_sum(b, "kvsteer_requests_routed")
        fallbacks_b1 = stat_sum(b, "kvsteer_fallbacks")
        # 3. Stop accepting, stop.
        admin_post(b, "/drain_listeners")
        b.envoy.stop()
        with lb.lock:
            lb.phase = "B down"

        # A long decode through A while B is down: B's next process never sees it but in the feed.
        long_result: list[Sent] = []
        lt = threading.Thread(target=lambda: long_result.append(lb.send(
            "long", tokens(LONG_PROMPT, 95_000), through=pa, max_tokens=LONG_TOKENS, stream=True,
            ignore_eos=True)), daemon=True)
        lt.start()
        deadline = time.monotonic() + 10
        busy = None
        while busy is None and time.monotonic() < deadline:
            loads = {r.name: decode_blocks(r.endpoint) for r in a.replicas}
            hot = [n for n, v in loads.items() if v >= 200]
            busy = hot[0] if len(hot) == 1 else None
            time.sleep(0.05)
        self.assertIsNotNone(busy, "the long request is decoding on one replica")

        # 4. Start B again: same configuration, same ports. The probes below go as soon as its
        # first feed polls are in, not when start_envoy returns (that also waits for Envoy's
        # health checks of the replicas, a second or two).
        pb.process = "B#2"
        started: list[BaseException | None] = []
        # The thread that starts Envoy lives as long as the test: the kernel's parent-death signal
        # (stack.py, PR_SET_PDEATHSIG) fires when the forking thread ends, not the process.
        keep = threading.Event()
        self.addCleanup(keep.set)

        def start_b() -> None:
            try:
                b.start_envoy("envoy", concurrency=2, listen_port=b.listen_port,
                              admin_port=b.admin_port, plugin_overrides=overrides_for("merge"),
                              node_id="proxy-b")
                started.append(None)
            except BaseException as e:  # re-raised below
                started.append(e)
            keep.wait()

        st = threading.Thread(target=start_b, daemon=True)
        st.start()
        t_restart = time.monotonic()
        polls: dict[str, int] = {}
        t_ready = t_polled = 0.0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not started:
            try:
                if not t_ready and b.admin("/ready").strip() == "LIVE":
                    t_ready = time.monotonic()
                    with lb.lock:
                        lb.phase = "B restarted"
                polls = {r.name: b.feed_polls(r) for r in a.replicas}
            except (urllib.error.URLError, ConnectionError, OSError):
                pass
            if t_ready and polls and all(v > 0 for v in polls.values()):
                t_polled = time.monotonic()
                break
            time.sleep(0.02)
        self.assertTrue(t_polled, f"B#2 polled every feed: {polls}, {started}")

        # 5. Right away (one tick for the relay to B's other worker, with margin), four at once
        # through B: none to the replica decoding A's long request.
        time.sleep(RELAY_S)
        # Printed, not asserted: how many feed answers B#2 had per replica when its polls were first
        # seen and when the probes go. Each of B#2's workers polls every feed itself until it holds a
        # snapshot (no lease without an epoch), so 1 means one worker's view only.
        polls_at_probe = {r.name: b.feed_polls(r) for r in a.replicas}
        print(f"\nB#2 feed answers per replica: {polls} at the first poll, {polls_at_probe} "
              f"{RELAY_S} s later when the probes go", file=sys.stderr)
        hold.set()
        free = [r for r in a.replicas if r.name != busy]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and any(
                replica_gauges(r.endpoint)["running"] + replica_gauges(r.endpoint)["waiting"] > 0
                for r in free):
            time.sleep(0.02)
        gauges_at_probe = {r.name: replica_gauges(r.endpoint) for r in a.replicas}
        print(f"replicas when the probes go: {gauges_at_probe}", file=sys.stderr)
        probes: list[Sent] = [None] * 4  # type: ignore[list-item]

        def probe(i: int) -> None:
            probes[i] = lb.send("probe", tokens(64, 97_000 + i), through=pb, max_tokens=200,
                                ignore_eos=True)

        pt = [threading.Thread(target=probe, args=(i,), daemon=True) for i in range(4)]
        for t in pt:
            t.start()
        for t in pt:
            t.join(60)
        hold.clear()
        self.assertEqual(long_result, [], "the long decode outlived the probes")
        deadline = time.monotonic() + 60
        while not started and time.monotonic() < deadline:
            time.sleep(0.05)
        self.assertEqual(started, [None], "B#2 started")
        lb.wait(lambda: pb.in_rotation, "B back in rotation", 10)
        landed = []
        for s in probes:
            self.assertTrue(s is not None and s.result.ok, s)
            rep = a.by_sim_name(s.result.replica)
            self.assertIsNotNone(rep, s)
            landed.append(rep.name)
        self.assertNotIn(busy, landed, f"the restarted B sent to the replica decoding A's request:"
                                       f" {landed}; replicas then: {gauges_at_probe}")

        # 6. Traffic goes on through both until the long decode ends.
        lt.join(120)
        stop.set()
        for t in threads:
            t.join(60)
        lb.close()

        log = list(lb.log)
        failed = [s for s in log if not s.result.ok]
        self.assertEqual(failed, [], f"{len(failed)} of {len(log)} requests failed")
        self.assertEqual(len(witnesses), WITNESSES)
        for w in witnesses:
            self.assertTrue(w.result.done and w.result.completion_tokens == WITNESS_TOKENS, w)
        streaming = sum(1 for w in witnesses if w.t0 + w.result.ttfb_s < t_drain)
        self.assertEqual(len(long_result), 1)
        self.assertEqual(long_result[0].result.completion_tokens, LONG_TOKENS, long_result)

        def count(phase: str, process: str) -> int:
            return sum(1 for s in log if s.what == "traffic" and s.phase == phase
                       and s.process == process)

        # The traffic really was split, moved to A while B was out, and came back to B.
        self.assertGreater(count("both", "A"), 0)
        self.assertGreater(count("both", "B#1"), 0)
        self.assertGreater(count("B down", "A"), 0)
        self.assertGreater(count("B restarted", "B#2"), 0)

        # Every request that reached an Envoy got a routing decision from the filter.
        self.assertEqual((routed_b1, fallbacks_b1), (sent_b1, 0), "B#1: routed, fallbacks")
        with lb.lock:
            sent_a, sent_b2 = lb.sent_to.get("A", 0), lb.sent_to.get("B#2", 0)
        self.assertEqual((stat_sum(a, "kvsteer_requests_routed"), stat_sum(a, "kvsteer_fallbacks")),
                         (sent_a, 0), "A: routed, fallbacks")
        self.assertEqual((stat_sum(b, "kvsteer_requests_routed"), stat_sum(b, "kvsteer_fallbacks")),
                         (sent_b2, 0), "B#2: routed, fallbacks")
        self.assertEqual(a.vm_failures() + b.vm_failures(), [])

        after_drain_b1 = sum(1 for s in log if s.phase == "B draining" and s.process == "B#1"
                             and s.what == "traffic")
        long_end = long_result[0].t0 + long_result[0].result.total_s
        b2_during = [s for s in log if s.process == "B#2" and s.what == "traffic"
                     and s.t0 + s.result.total_s < long_end]
        b2_busy = [s for s in b2_during if a.by_sim_name(s.result.replica).name == busy]
        b2_first = min((s.t0 for s in log if s.process == "B#2"), default=0.0)
        print(f"\n{len(log)} requests, {len(failed)} failed; {active_at_drain} in flight on B at "
              f"the drain ({WITNESSES} witness streams of {WITNESS_TOKENS} tokens, {streaming} of "
              f"them already streaming, done "
              f"{', '.join(f'{w.t0 + w.result.total_s - t_drain:.2f}' for w in witnesses)} s "
              f"after the drain began), {after_drain_b1} more sent to B before the balancer saw "
              f"it fail; sent A {sent_a}, B#1 {sent_b1}, B#2 {sent_b2}. B#2 ready "
              f"{t_ready - t_restart:.2f} s after its start, every feed polled "
              f"{t_polled - t_ready:.2f} s after ready {polls}, first request from the balancer "
              f"{b2_first - t_ready:.2f} s after ready; long decode on {busy}; the probes on "
              f"{landed}; of B#2's {len(b2_during)} other requests that ended before the long "
              f"decode, {len(b2_busy)} on {busy}. TTFT (time to first event) of the background "
              f"streams:\n{ttft_figures(log)}\nwall {time.monotonic() - t_start:.1f} s",
              file=sys.stderr, flush=True)

if __name__ == "__main__":
    unittest.main()
