"""Pools (docs/guide/pools.md) in a real nginx with Kong's ngx_wasm_module: 2 workers, two pools of
two `kvsteer-sim` replicas, all on 127.0.0.1. Run by scripts/e2e-nginx (`scripts/e2e-nginx
test_nginx_pools`); skipped without NGINX_BIN.

nginx runs `nginx/nginx-pools.conf`, rendered as e2e/test_nginx_real.py renders nginx/nginx.conf
(free ports, `reuseport` so the kernel spreads connections over both workers, an `x-nginx-worker`
answer header). Pool `chat` serves `llama-3.1-8b-instruct` on a0 and a1 (the sim's default engine),
pool `big` serves `llama-3.1-70b-instruct` on b0 and b1 (`--profile llama-3.1-70b-h100-tp4`, the
pool's `kv_time.profile` in the file). When NGINX_DEBUG_BIN (the same nginx built `--with-debug`) is
given, nginx runs that build with its error log at `debug` into a FIFO read here, which says which
worker sent which callout (`wasm new dispatch call to "IP:port"`) and when the module creates and
closes each callout's connection (`wasm created/closing fake connection`).

`NginxPools`, one nginx for the class, tests in order:

1. Each model reaches only its pool's replicas (the replicas' own finished-request counts), and the
   follow-ups of a conversation land on its first turn's replica: token-id prompts and text prompts
   (no tokenizer), every request on a fresh connection, follow-ups counted apart for the worker new
   to the conversation and the one that had routed part of it.
2. A model no pool serves gets the filter's own 404 `model_not_found`, a body without `model` 400
   (no `default_pool`); no replica sees either.
3. Every feed of both pools is polled (debug log: the callouts per worker and address), and both
   workers know both pools' feeds: a first turn sent straight to a replica (nginx never sees it),
   its follow-up through nginx 0.6 s later reaches that replica, per pool and per worker.
4. Nothing is left paused or hanging: every request above came back within its client's timeout,
   the replicas have nothing running or waiting, a last request per pool is answered, nginx logs
   nothing at `crit` or above; it prints the callouts per replica and worker, and (debug build)
   each worker kept at most 2 callout connections open.

`NginxPoolsConnections`: one worker polling both pools at a 10 ms tick with `worker_connections
512` for 30 s keeps no callout connection and has none refused. ngx_wasm_module (at 3bed2783)
keeps the connection of a callout answered while another of the same VM is still out
(docs/guide/nginx.md, "Connections"), so in nginx mode the filter sends one callout a tick and none
while one is out, across all of a VM's pools. When that bound was each pool's, a worker polling
both pools kept half its callout connections and failed this within seconds (and the shipped file
after about 7 minutes, docs/reports/notebook/nginx-pools.md).

No latency is asserted; waits and client timeouts are bounded; loopback only.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
import unittest
import urllib.request
from datetime import datetime
from pathlib import Path

import stack
from client import Client, Result, tokens
from test_nginx_real import H, NGINX_BIN, NGINX_DEBUG_BIN, Nginx, render, wait_port

CONF = Path(__file__).resolve().parent.parent / "nginx" / "nginx-pools.conf"
CHAT, BIG = "llama-3.1-8b-instruct", "llama-3.1-70b-instruct"
POOLS = {"chat": ["a0", "a1"], "big": ["b0", "b1"]}
MODEL_OF = {"chat": CHAT, "big": BIG}
WORKERS = 2
TIMEOUT_S = 30
# One feed poll (feed_period_ms 200) and the relay to the other worker (its next 100 ms tick).
SETTLE_S = 0.6
FLOOR = 0.9
# Lines the module writes on every tick's shared-data read outside a request (known, harmless).
KNOWN_ERRORS = ("cannot get scoped properties outside of a request",)


class DebugLog:
    """nginx's error log read from a FIFO (nginx built `--with-debug`, level `debug`): per worker
    pid, the callouts sent by address and the callout connections created and closed; the lines at
    `info` and above kept (at most 20,000; those of KNOWN_ERRORS only counted). The reader runs
    until nginx closes the FIFO."""

    DISPATCH = re.compile(r"\] (\d+)#\d+: .*wasm new dispatch call to \"([^\"]+)\"")
    CREATED = re.compile(r"\] (\d+)#\d+: .*wasm created fake connection")
    CLOSED = re.compile(r"\] (\d+)#\d+: .*wasm closing fake connection")

    def __init__(self, fifo: Path):
        os.mkfifo(fifo)
        self.fifo = fifo
        self.lock = threading.Lock()
        self.dispatch: dict[tuple[int, str], int] = {}
        self.conns: dict[int, list[int]] = {}
        self.lines: list[str] = []
        self.known = 0  # KNOWN_ERRORS lines, counted, not kept
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        with open(self.fifo, "rb") as f:
            for raw in f:
                line = raw.decode(errors="replace")
                with self.lock:
                    if "[debug]" not in line:
                        if any(k in line for k in KNOWN_ERRORS):
                            self.known += 1
                        elif len(self.lines) < 20_000:
                            self.lines.append(line.rstrip())
                    elif m := self.DISPATCH.search(line):
                        k = (int(m.group(1)), m.group(2))
                        self.dispatch[k] = self.dispatch.get(k, 0) + 1
                    elif m := self.CREATED.search(line):
                        self.conns.setdefault(int(m.group(1)), [0, 0])[0] += 1
                    elif m := self.CLOSED.search(line):
                        self.conns.setdefault(int(m.group(1)), [0, 0])[1] += 1

    def text(self) -> str:
        with self.lock:
            return "\n".join(self.lines)

    def snapshot(self) -> tuple[dict[tuple[int, str], int], dict[int, list[int]]]:
        with self.lock:
            return dict(self.dispatch), {w: list(v) for w, v in self.conns.items()}


class PoolsNginx:
    """Four replicas (two pools) and nginx with nginx-pools.conf on a Stack; `plugin` fields merged
    into the plugin configuration."""

    def __init__(self, s: stack.Stack, name: str, plugin: dict | None = None,
                 worker_connections: int | None = None, workers: int = WORKERS):
        self.s = s
        s.start_replicas(2, prefix="a", extra=["--model", CHAT])
        s.start_replicas(2, prefix="b",
                         extra=["--model", BIG, "--profile", "llama-3.1-70b-h100-tp4"])
        self.port = stack.free_ports(1)[0]
        self.debug = DebugLog(s.workdir / f"{name}.fifo") if NGINX_DEBUG_BIN else None
        # The replicas in the order of the file's ports: a0, a1 (chat) on 18000-18001, b0, b1
        # (big) on 18002-18003.
        conf = render(s.workdir, name, [r.port for r in s.replicas], self.port, conf=CONF,
                      plugin=plugin, worker_connections=worker_connections,
                      error_log=f"{self.debug.fifo} debug" if self.debug else None)
        if workers != WORKERS:
            text = conf.read_text()
            assert text.count(f"worker_processes {WORKERS};") == 1, "nginx-pools.conf changed"
            conf.write_text(text.replace(f"worker_processes {WORKERS};",
                                         f"worker_processes {workers};"))
        self.workers = workers
        self.nginx = Nginx(s, name, conf, NGINX_DEBUG_BIN if self.debug else "")

    def text(self) -> str:
        return self.debug.text() if self.debug else self.nginx.text()

    def known_errors(self) -> int:
        if self.debug:
            return self.debug.known
        return sum(any(k in ln for k in KNOWN_ERRORS) for ln in self.text().splitlines())

    def wait_configured(self, timeout_s: float = 180) -> float:
        """Until every worker has logged both pools configured (each compiles the module itself);
        returns the seconds waited."""
        t0 = time.monotonic()
        while True:
            lines = re.findall(r"\] (\d+)#\d+: .*kvsteer: pool (\w+): configured", self.text())
            if len(set(lines)) >= self.workers * len(POOLS):
                break
            if not self.nginx.proc.alive():
                raise stack.StackError(f"nginx exited:\n{self.nginx.proc.tail()}")
            if time.monotonic() - t0 > timeout_s:
                raise stack.StackError(f"pools not configured in {timeout_s} s: {lines}")
            time.sleep(0.2)
        wait_port(self.port)
        return time.monotonic() - t0

    def replica_metrics(self) -> dict[str, dict[str, float]]:
        """Each replica's finished, running and waiting requests, from its own /metrics."""
        out = {}
        for r in self.s.replicas:
            with urllib.request.urlopen(f"http://{r.endpoint}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            v = {"finished": 0.0, "running": 0.0, "waiting": 0.0}
            for line in text.splitlines():
                for key, name in (("finished", "vllm:request_success_total"),
                                  ("running", "vllm:num_requests_running"),
                                  ("waiting", "vllm:num_requests_waiting")):
                    if line.startswith(name + "{") or line.startswith(name + " "):
                        v[key] += float(line.rsplit(" ", 1)[1])
            out[r.name] = v
        return out

    def finished(self) -> dict[str, int]:
        return {k: int(v["finished"]) for k, v in self.replica_metrics().items()}


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class NginxPools(unittest.TestCase):
    s: stack.Stack
    p: PoolsNginx
    # Requests sent through nginx and answered, per pool, over the class's tests.
    sent: dict[str, int]
    longest_s = 0.0

    @classmethod
    def setUpClass(cls) -> None:
        cls.sent = {"chat": 0, "big": 0}
        cls.s = stack.Stack(quiet=False)
        try:
            cls.p = PoolsNginx(cls.s, "nginx-pools")
            cls.configured_s = cls.p.wait_configured()
            cls.t0 = time.monotonic()
            time.sleep(1.0)  # every feed polled once
        except BaseException:
            cls.s.close()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.s.close()

    # -- helpers ---------------------------------------------------------------------------------

    def post(self, port: int, body: dict, path: str = "/v1/completions") -> tuple[int, dict, bytes]:
        """One request on a fresh connection (through nginx: either worker may take it)."""
        c = Client(H, port, timeout_s=TIMEOUT_S)
        t = time.monotonic()
        try:
            return c.request("POST", path, json.dumps(body).encode(),
                             {"content-type": "application/json"})
        finally:
            c.close()
            type(self).longest_s = max(self.longest_s, time.monotonic() - t)

    def send(self, pool: str, prompt: list[int] | str, port: int = 0) -> tuple[str, str]:
        """`pool`'s model with `prompt`, through nginx unless `port` names a replica: the replica
        that answered (its name here) and the nginx worker (empty straight to a replica)."""
        status, headers, data = self.post(port or self.p.port, {
            "model": MODEL_OF[pool], "prompt": prompt, "max_tokens": 2})
        self.assertEqual(status, 200, data[:300])
        r = self.s.by_sim_name(headers.get("x-kvsteer-replica", ""))
        self.assertIsNotNone(r, headers)
        if not port:
            type(self).sent[pool] += 1
        return r.name, headers.get("x-nginx-worker", "")

    def conversations(self, kind: str, n: int, seed: int) -> dict:
        """`n` conversations per pool (a first turn and two follow-ups, 0.5 s apart, each on a
        fresh connection), the pools interleaved; per pool the replicas answering, and follow-ups
        [on the first turn's replica, sent] for a worker new to the conversation and one that had
        routed part of it."""
        out = {pool: {"where": [], "new": [0, 0], "seen": [0, 0]} for pool in POOLS}
        for i in range(n):
            for pool in POOLS:
                k = seed + 1000 * i + (500 if pool == "big" else 0)
                if kind == "tokens":
                    prompt: list[int] | str = tokens(512, k)
                else:
                    prompt = " ".join(f"word{(k * 7919 + j * 31) % 100003}" for j in range(400))
                first, w1 = self.send(pool, prompt)
                o = out[pool]
                o["where"].append(first)
                workers = {w1}
                for turn in range(2):
                    time.sleep(0.5)
                    if kind == "tokens":
                        prompt = prompt + tokens(128, k + 100 + turn)
                    else:
                        prompt += f" and then more for turn {turn + 2} of conversation {k}" * 10
                    got, w = self.send(pool, prompt)
                    o["where"].append(got)
                    group = o["seen"] if w in workers else o["new"]
                    workers.add(w)
                    group[0] += got == first
                    group[1] += 1
        return out

    # -- tests -----------------------------------------------------------------------------------

    def test_1_each_model_reaches_its_pool_and_follow_ups_stay(self) -> None:
        before = self.p.finished()
        sent_before = dict(self.sent)
        results = {"tokens": self.conversations("tokens", 6, 10_000),
                   "text": self.conversations("text", 6, 20_000)}
        time.sleep(0.5)
        after = self.p.finished()
        delta = {k: after[k] - before[k] for k in after}
        for kind, per in results.items():
            for pool, o in per.items():
                print(f"nginx pools, {kind} prompts, pool {pool}: follow-ups on the first turn's "
                      f"replica {o['new'][0] + o['seen'][0]}/{o['new'][1] + o['seen'][1]}: "
                      f"{o['new'][0]}/{o['new'][1]} on a worker new to the conversation, "
                      f"{o['seen'][0]}/{o['seen'][1]} on one that had routed part of it; replicas "
                      f"{ {r: o['where'].count(r) for r in sorted(set(o['where']))} }", flush=True)
        print(f"nginx pools: replicas' finished requests {delta}, sent per pool "
              f"{ {k: self.sent[k] - sent_before[k] for k in POOLS} }", flush=True)
        for pool, members in POOLS.items():
            sent = self.sent[pool] - sent_before[pool]
            self.assertEqual(sum(delta[r] for r in members), sent, f"{pool}: {delta}")
            for kind, per in results.items():
                o = per[pool]
                self.assertTrue(set(o["where"]) <= set(members), f"{kind} {pool}: {o['where']}")
                for group in ("new", "seen"):
                    got, n = o[group]
                    self.assertGreaterEqual(got, FLOOR * n, f"{kind} {pool} {group}: {got}/{n}")
        # Both workers took part in every pool's follow-ups.
        for pool in POOLS:
            new = sum(results[k][pool]["new"][1] for k in results)
            self.assertGreaterEqual(new, 2, f"{pool}: too few follow-ups on the other worker")

    def test_2_unknown_and_missing_models_are_answered_by_the_filter(self) -> None:
        before = self.p.finished()
        for name in ("gpt-4", "llama-3.1-8b"):
            for i in range(4):  # fresh connections: both workers answer some
                status, headers, data = self.post(self.p.port, {
                    "model": name, "prompt": tokens(64, 30 + i), "max_tokens": 2})
                self.assertEqual(status, 404, data[:300])
                self.assertEqual(json.loads(data), {"error": {
                    "message": f"The model `{name}` does not exist.",
                    "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
                self.assertNotIn("x-kvsteer-replica", headers)
        status, headers, data = self.post(self.p.port, {"prompt": tokens(64, 40), "max_tokens": 2})
        self.assertEqual(status, 400, data[:300])
        self.assertEqual(json.loads(data)["error"]["type"], "invalid_request_error")
        self.assertNotIn("x-kvsteer-replica", headers)
        time.sleep(0.5)
        after = self.p.finished()
        self.assertEqual(after, before, "a refused request reached a replica")
        print(f"nginx pools: 8 unknown models answered 404 model_not_found, 1 body without model "
              f"400; replicas' counts unchanged {after}", flush=True)

    def test_3_both_pools_feeds_are_polled_and_known_to_both_workers(self) -> None:
        # A first turn straight to a replica: only its feed can tell the filter.
        per: dict[tuple[str, str], list[int]] = {}
        for i in range(24):
            r = self.s.replicas[i % 4]
            pool = "chat" if r.name in POOLS["chat"] else "big"
            p = tokens(1024, 50_000 + i)
            home, _ = self.send(pool, p, port=r.port)
            self.assertEqual(home, r.name)
            time.sleep(SETTLE_S)
            got, w = self.send(pool, p + tokens(64, 60_000 + i))
            v = per.setdefault((pool, w), [0, 0])
            v[0] += got == home
            v[1] += 1
        summary = {f"{pool} via {w}": f"{v[0]}/{v[1]}" for (pool, w), v in sorted(per.items())}
        print(f"nginx pools: follow-ups of a directly warmed replica routed there, per pool and "
              f"worker: {summary}", flush=True)
        polled = self.polls()
        for pool in POOLS:
            workers = {w for (p, w) in per if p == pool}
            self.assertEqual(len(workers), WORKERS, f"{pool}: both workers served: {summary}")
        for (pool, w), v in per.items():
            self.assertGreaterEqual(v[0], v[1] - 1, f"{pool} via worker {w}: {summary}")
        if polled is None:
            return
        took = time.monotonic() - self.t0
        for r in self.s.replicas:
            n = sum(polled.get(r.endpoint, {}).values())
            # feed_period_ms 200: five a second at best; at least one a second.
            self.assertGreaterEqual(n, took, f"{r.name} polled {n} times in {took:.0f} s: {polled}")

    def polls(self) -> dict[str, dict[int, int]] | None:
        """Callouts sent so far, by address and worker pid (None without the debug build)."""
        if not self.p.debug:
            return None
        dispatch, conns = self.p.debug.snapshot()
        out: dict[str, dict[int, int]] = {}
        for (w, host), n in dispatch.items():
            out.setdefault(host, {})[w] = n
        names = {r.endpoint: r.name for r in self.s.replicas}
        took = time.monotonic() - self.t0
        shown = {names.get(h, h): v for h, v in out.items()}
        shown = {k: shown[k] for k in sorted(shown)}
        print(f"nginx pools: feed callouts per replica and worker in {took:.0f} s since the "
              f"workers configured: {shown}; callout connections per worker [created, closed] "
              f"{conns}", flush=True)
        return out

    def test_4_nothing_is_left_paused(self) -> None:
        for pool in POOLS:
            self.send(pool, tokens(256, 70_000 + len(pool)))
        deadline = time.monotonic() + 10
        while True:
            m = self.p.replica_metrics()
            busy = {k: v for k, v in m.items() if v["running"] or v["waiting"]}
            if not busy or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        self.assertEqual(busy, {}, "requests still running or waiting on a replica")
        self.assertTrue(self.p.nginx.proc.alive())
        bad = [ln for ln in self.p.text().splitlines()
               if re.search(r"\[(crit|alert|emerg)\]", ln)]
        self.assertEqual(bad, [])
        errors: dict[str, int] = {}
        for ln in self.p.text().splitlines():
            if "[error]" in ln and not any(k in ln for k in KNOWN_ERRORS):
                key = re.sub(r"^.*?\] \d+#\d+: (\*\d+ )?", "", ln)[:100]
                errors[key] = errors.get(key, 0) + 1
        print(f"nginx pools: longest request {self.longest_s:.2f} s (client timeout {TIMEOUT_S} "
              f"s); sent per pool {self.sent}; error lines {errors} besides "
              f"{self.p.known_errors()} like {KNOWN_ERRORS[0]!r}", flush=True)
        self.assertLess(self.longest_s, TIMEOUT_S)
        self.polls()  # what the workers polled, and their callout connections (printed)
        if self.p.debug:
            _, conns = self.p.debug.snapshot()
            self.assertTrue(conns)
            for w, (created, closed) in conns.items():
                # At most the one callout out now (and one answered in between the two counts).
                self.assertLessEqual(created - closed, 2, f"worker {w} kept connections: {conns}")


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class NginxPoolsConnections(unittest.TestCase):
    """One worker polling both pools' feeds, 30 s at a 10 ms tick (feeds every 20 ms) with
    `worker_connections 512`, as e2e/test_nginx_real's soak runs one pool: no callout connection is
    kept and none is refused, and every request is answered.

    One worker (`worker_processes 1`) makes certain what two workers do whenever one of them holds
    the feed leases of both pools (common: the first worker to tick often takes every lease). The
    filter must then still have one callout out at a time for the whole VM, not one per pool: the
    module keeps the connection of a callout answered while another of the VM is out. Before the
    bound was the VM's, this worker kept about one connection a tick and ran out within 5 s."""

    SOAK_S = 30
    TICK_MS = 10

    @classmethod
    def setUpClass(cls) -> None:
        cls.s = stack.Stack(quiet=False)
        try:
            cls.p = PoolsNginx(cls.s, "nginx-pools-soak", worker_connections=512, workers=1,
                               plugin={"tick_ms": cls.TICK_MS, "feed_period_ms": 2 * cls.TICK_MS,
                                       "feed_timeout_ms": 1000})
            cls.p.wait_configured()
            cls.configured_at = time.time()
            t0 = time.monotonic()
            cls.routed = 0
            cls.failed: dict[str, int] = {}
            while time.monotonic() - t0 < cls.SOAK_S:
                for pool in POOLS:
                    c = Client(H, cls.p.port, timeout_s=5)
                    try:
                        r: Result = c.complete(tokens(128, int(time.monotonic() * 1000) % 10 ** 6),
                                               max_tokens=1, extra={"model": MODEL_OF[pool]})
                    finally:
                        c.close()
                    cls.routed += r.ok
                    if not r.ok:
                        key = f"{r.status} {r.error[:50]}"
                        cls.failed[key] = cls.failed.get(key, 0) + 1
                time.sleep(1.0)
            cls.took = time.monotonic() - t0
            cls.log = cls.p.text()
            cls.conns = cls.p.debug.snapshot()[1] if cls.p.debug else None
        except BaseException:
            cls.s.close()
            raise
        cls.s.close()

    def test_polling_keeps_no_connections_and_none_is_refused(self) -> None:
        counts: dict[str, int] = {}
        first: dict[str, str] = {}
        for bad in ("worker_connections are not enough", "dispatch failed", "is stale",
                    "no feed from", "unreachable"):
            found = [ln for ln in self.log.splitlines() if bad in ln]
            counts[bad] = len(found)
            if found:
                # nginx stamps its lines in local time, to the second.
                at = datetime.strptime(found[0][:19], "%Y/%m/%d %H:%M:%S").timestamp()
                first[bad] = f"{at - self.configured_at:+.0f} s"
        print(f"nginx pools soak, 1 worker: {self.took:.0f} s at tick {self.TICK_MS} ms, "
              f"worker_connections 512: callout connections [created, closed] "
              f"{self.conns if self.conns is not None else '(needs NGINX_DEBUG_BIN)'}; requests "
              f"answered {self.routed}, failed {sum(self.failed.values())} {self.failed}; log "
              f"lines {counts}, the first after the workers configured {first}",
              flush=True)
        self.assertEqual(counts, {k: 0 for k in counts})
        self.assertEqual(self.failed, {})
        if self.conns is not None:
            for w, (created, closed) in self.conns.items():
                self.assertLessEqual(created - closed, 2, f"worker {w}: {self.conns}")


if __name__ == "__main__":
    unittest.main()
