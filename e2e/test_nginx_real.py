"""kvsteer in a real nginx with Kong's ngx_wasm_module, in front of 4 simulated replicas, all on
127.0.0.1 (scripts/e2e-nginx builds nginx and runs this; skipped without NGINX_BIN).

nginx runs `nginx/nginx.conf` as shipped, with only what a test run must change: the replicas' and
the listener's ports (free ones), the module's path, the pid file, and two additions that measure,
not route: `reuseport` on the listener (so the kernel spreads connections over both workers and each
worker's routing is seen) and an `x-nginx-worker` answer header. The baseline is the same file and
the same nginx without the filter (no `wasm{}` block, no `proxy_wasm`): `$kvsteer_upstream` keeps its
default, the upstream group, balanced round robin.

NGINX_PLUGIN_JSON merges fields into the plugin configuration of `NginxReal`'s nginx (to measure
what one costs). The soak (`NginxSoak`) runs feed polling alone for NGINX_SOAK_S seconds (default 120) at a tick of
NGINX_SOAK_TICK_MS (default 10, a tenth of the shipped 100: 120 s stand for 20 minutes of ticks)
with `worker_connections 512`, and counts each worker's callout connections from the module's debug
log when NGINX_DEBUG_BIN (an nginx built `--with-debug`) is given.
"""

from __future__ import annotations

import json
import os
import re
import socket
import statistics
import threading
import time
import unittest
from pathlib import Path

import stack
from client import Client, Result, tokens

CONF = Path(__file__).resolve().parent.parent / "nginx" / "nginx.conf"
NGINX_BIN = os.environ.get("NGINX_BIN", "")
NGINX_DEBUG_BIN = os.environ.get("NGINX_DEBUG_BIN", "")
H = "127.0.0.1"


def sub1(pattern: str, repl: str, text: str, flags: int = 0) -> str:
    """re.sub that must match exactly once: a changed nginx.conf fails here, loudly."""
    out, n = re.subn(pattern, repl, text, count=0, flags=flags)
    if n != 1:
        raise AssertionError(f"nginx.conf: {pattern!r} matched {n} times")
    return out


def render(workdir: Path, name: str, ports: list[int], listen: int, *, filter_on: bool = True,
           plugin: dict | None = None, worker_connections: int | None = None,
           error_log: str | None = None, conf: Path = CONF) -> Path:
    """`nginx/nginx.conf` (or `conf`, a file shaped like it: nginx/nginx-pools.conf) for this run
    (see the module's docstring); returns the file written."""
    text = conf.read_text()
    wasm = stack.wasm_path()
    for i, p in enumerate(ports):
        text = text.replace(f"127.0.0.1:{18000 + i}", f"127.0.0.1:{p}")
    text = sub1(r"listen 127\.0\.0\.1:10000;", f"listen 127.0.0.1:{listen} reuseport;", text)
    text = sub1(r"^pid \S+;", f"pid {workdir}/{name}.pid;", text, re.M)
    text = sub1(r"(proxy_pass http://\$kvsteer_upstream;)",
                r"\1\n            add_header x-nginx-worker $pid always;", text)
    if error_log:
        text = sub1(r"^error_log \S+ \w+;", f"error_log {error_log};", text, re.M)
    if worker_connections:
        text = sub1(r"worker_connections \d+;", f"worker_connections {worker_connections};", text)
    if filter_on:
        text = sub1(r"module kvsteer \S+;", f"module kvsteer {wasm};", text)
        if plugin:
            m = re.search(r"proxy_wasm kvsteer '(\{.*?\})';", text, re.S)
            assert m, "nginx.conf: no proxy_wasm JSON"
            cfg = json.loads(m.group(1))
            cfg.update(plugin)
            text = text[:m.start(1)] + json.dumps(cfg) + text[m.end(1):]
    else:
        start = text.index("\nwasm {")
        end = text.index("\n}\n", start) + 3
        text = text[:start] + text[end:]
        text = sub1(r"\n\s*proxy_wasm kvsteer '\{.*?\}';", "", text, re.S)
    path = workdir / f"{name}.conf"
    path.write_text(text)
    return path


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def short(sim_name: str) -> str:
    return sim_name.split("_")[0] if sim_name else "-"


class Nginx:
    """One nginx (master and workers) started by a Stack."""

    def __init__(self, s: stack.Stack, name: str, conf: Path, binary: str = ""):
        (s.workdir / "logs").mkdir(exist_ok=True)
        self.proc = s.spawn(name, [binary or NGINX_BIN, "-p", str(s.workdir), "-c", str(conf),
                                   "-g", "daemon off;"])
        self.log = self.proc.log

    def workers(self) -> list[int]:
        pid = self.proc.popen.pid
        try:
            return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        except OSError:
            return []

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_configured(self, workers: int = 2, timeout_s: float = 180) -> None:
        # Each worker compiles the 7.5 MB module on its own (6-9 s here, more on a loaded machine).
        deadline = time.monotonic() + timeout_s
        while self.text().count("kvsteer: configured") < workers:
            if not self.proc.alive():
                raise stack.StackError(f"nginx exited:\n{self.proc.tail()}")
            if time.monotonic() > deadline:
                raise stack.StackError(f"the filter not configured in {timeout_s} s:\n{self.proc.tail()}")
            time.sleep(0.2)


def wait_port(port: int, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((H, port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise stack.StackError(f"nothing listens on {port}")


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class NginxReal(unittest.TestCase):
    """Routing checks through nginx + the filter; the latency against the same nginx without it."""

    @classmethod
    def setUpClass(cls) -> None:
        cls.s = stack.Stack(quiet=False)
        try:
            cls.s.start_replicas(4)
            ports = [r.port for r in cls.s.replicas]
            cls.port, cls.base_port = stack.free_ports(2)
            # NGINX_PLUGIN_JSON: fields merged into the shipped plugin configuration, to measure
            # one (e.g. '{"feed_period_ms": 3600000}': the feeds polled once, the latency without).
            plugin = json.loads(os.environ.get("NGINX_PLUGIN_JSON") or "{}")
            conf = render(cls.s.workdir, "nginx-filter", ports, cls.port, plugin=plugin)
            base = render(cls.s.workdir, "nginx-baseline", ports, cls.base_port, filter_on=False)
            cls.nginx = Nginx(cls.s, "nginx-filter", conf)
            cls.base = Nginx(cls.s, "nginx-baseline", base)
            cls.nginx.wait_configured()
            wait_port(cls.port)
            wait_port(cls.base_port)
            time.sleep(1.0)  # every feed polled once
        except BaseException:
            cls.s.close()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.s.close()

    def client(self) -> Client:
        c = Client(H, self.port, timeout_s=30)
        self.addCleanup(c.close)
        return c

    def once(self, port: int, prompt: list[int], **kw) -> "Result":
        """One request on a connection of its own (either worker may take it), closed after."""
        c = Client(H, port, timeout_s=120)
        try:
            return c.complete(prompt, **kw)
        finally:
            c.close()

    def test_1_prefix_routing(self) -> None:
        same = hits = 0
        c = self.client()
        for i in range(8):
            p = tokens(512, 100 + i)
            a = c.complete(p, max_tokens=4)
            time.sleep(0.5)  # the feed reports a's blocks (feed_period_ms 200)
            b = c.complete(p + tokens(256, 9100 + i), max_tokens=4)
            self.assertTrue(a.ok and b.ok, (a.error, b.error))
            same += a.replica == b.replica
            hits += b.cached_tokens >= 512 - 16
        print(f"nginx: token follow-ups on the first turn's replica {same}/8, with its prefix cached "
              f"{hits}/8", flush=True)
        self.assertGreaterEqual(same, 7)
        self.assertGreaterEqual(hits, 7)

    def test_2_text_prompts(self) -> None:
        """Text prompts (no tokenizer): each worker VM keeps its own records of where a text went
        and publishes a journal of them in shared data every tick, which the other applies. So a
        follow-up must reach the first turn's replica also through the worker that routed none of
        the conversation before. 24 conversations of a ~4 KB first turn and two follow-ups, every
        request on a fresh connection (`reuseport`: the kernel picks the worker; `x-nginx-worker`
        says which), 0.5 s apart (5 ticks)."""
        h = {"content-type": "application/json"}

        def send(text: str) -> tuple[int, dict, bytes]:
            c = Client(H, self.port, timeout_s=30)
            try:
                body = {"model": "sim", "prompt": text, "max_tokens": 4}
                return c.request("POST", "/v1/completions", json.dumps(body).encode(), h)
            finally:
                c.close()

        # [on the first turn's replica, follow-ups] for a worker new to the conversation and one
        # that had routed part of it; cache hits over all follow-ups.
        new, seen = [0, 0], [0, 0]
        hits = n = 0
        for i in range(24):
            text = " ".join(f"word{(i * 7919 + k * 31) % 100003}" for k in range(400))
            s1, h1, _ = send(text)
            self.assertEqual(s1, 200)
            first = h1.get("x-kvsteer-replica")
            workers = {h1.get("x-nginx-worker")}
            for turn in range(2):
                time.sleep(0.5)
                text += f" and then some more text for turn {turn + 2} of conversation {i}" * 10
                s2, h2, d2 = send(text)
                self.assertEqual(s2, 200)
                w = h2.get("x-nginx-worker")
                group = seen if w in workers else new
                workers.add(w)
                group[0] += h2.get("x-kvsteer-replica") == first
                group[1] += 1
                usage = json.loads(d2).get("usage") or {}
                hits += (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0) > 0
                n += 1
        print(f"nginx: text follow-ups on the first turn's replica {new[0] + seen[0]}/{n}: "
              f"{new[0]}/{new[1]} on a worker new to the conversation, {seen[0]}/{seen[1]} on one "
              f"that had routed part of it; cache hits {hits}/{n}", flush=True)
        self.assertGreaterEqual(new[1], 6, "too few follow-ups reached the other worker")
        self.assertGreaterEqual(new[0], 0.9 * new[1], f"new worker: {new[0]}/{new[1]}")
        self.assertGreaterEqual(seen[0], 0.9 * seen[1], f"same worker: {seen[0]}/{seen[1]}")

    def test_3_workers_share_what_the_feeds_say(self) -> None:
        """A replica warmed directly (nginx never saw the request): only its feed can tell the
        filter, and only one worker polls it; each worker must still send the follow-up there."""
        per: dict[int, list[int]] = {}
        for i in range(24):
            r = self.s.replicas[i % 4]
            p = tokens(1024, 5000 + i)
            d = self.once(r.port, p, max_tokens=1)
            self.assertTrue(d.ok, d.error)
            time.sleep(0.6)
            res = self.once(self.port, p + tokens(64, 7000 + i), max_tokens=1)
            self.assertTrue(res.ok, res.error)
            w = int(res.headers.get("x-nginx-worker", "0"))
            per.setdefault(w, []).append(int(res.replica == d.replica))
        summary = {w: f"{sum(v)}/{len(v)}" for w, v in per.items()}
        print(f"nginx: follow-ups of a directly warmed replica routed there, per worker: {summary}",
              flush=True)
        self.assertEqual(len(per), 2, f"both workers served: {summary}")
        for w, v in per.items():
            self.assertGreaterEqual(sum(v), len(v) - 1, f"worker {w}: {summary}")

    def test_4_streams_pass_through_and_release_their_load(self) -> None:
        r = self.once(self.port, tokens(256, 1), max_tokens=20, stream=True)
        self.assertTrue(r.ok and r.done and r.events > 1, (r.error, r.events))
        prefix = tokens(2048, 4242)
        warm = self.once(self.port, prefix, max_tokens=1)
        self.assertTrue(warm.ok)
        time.sleep(0.5)
        res: list = []

        def long(i: int) -> None:
            res.append(self.once(self.port, prefix + tokens(32, 4300 + i), max_tokens=400,
                                 stream=True, ignore_eos=True))

        ths = [threading.Thread(target=long, args=(i,)) for i in range(8)]
        for t in ths:
            t.start()
            time.sleep(0.05)
        time.sleep(0.5)
        c = self.client()
        during = [short(c.complete(tokens(64, 4400 + i), max_tokens=1).replica) for i in range(16)]
        for t in ths:
            t.join(timeout=180)
        hot = [short(x.replica) for x in res]
        self.assertTrue(all(x.ok and x.done for x in res), [x.error for x in res])
        top = max(set(hot), key=hot.count)
        time.sleep(1.0)
        after = [short(c.complete(tokens(64, 4500 + i), max_tokens=1).replica) for i in range(24)]
        print(f"nginx: 8 streams on {sorted(hot)}; cold probes on {top} while they ran "
              f"{during.count(top)}/16, after {after.count(top)}/24", flush=True)
        self.assertLessEqual(during.count(top), 2, during)
        self.assertGreaterEqual(after.count(top), 1, f"{top}'s load released: {after}")

    def test_5_bad_bodies_reach_the_replica(self) -> None:
        cases = [b'{"prompt": [1,2,3', b"[1,2,3]", b'{"prompt": {"a": 1}, "max_tokens": 2}',
                 b'{"prompt": [-1, 5], "max_tokens": 2}', bytes(range(256)) * 8]
        c = self.client()
        for body in cases:
            s, h, d = c.request("POST", "/v1/completions", body,
                                            {"content-type": "application/json"})
            self.assertTrue(400 <= s < 500, (body[:40], s, d[:120]))
        # A chunked body (no content-length) is routed like any other.
        s = socket.create_connection((H, self.port), timeout=10)
        body = json.dumps({"model": "sim", "prompt": tokens(64, 2), "max_tokens": 2}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\nConnection: close\r\n\r\n"
                  + f"{len(body):x}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        data = b""
        while chunk := s.recv(65536):
            data += chunk
        s.close()
        self.assertTrue(data.startswith(b"HTTP/1.1 200"), data[:200])
        st, _, _ = c.request("GET", "/v1/models")
        self.assertEqual(st, 200)
        self.assertTrue(c.complete(tokens(64, 3), max_tokens=2).ok)

    def _latency(self, plen: int, n: int) -> tuple[list[float], list[float]]:
        """n sequential keep-alive requests per side, in alternating blocks of 25 (drift on a shared
        machine hits both sides alike); distinct prompts, max_tokens 1."""
        out: dict[int, list[float]] = {self.port: [], self.base_port: []}
        clients = {p: Client(H, p) for p in out}
        for c in clients.values():
            self.addCleanup(c.close)
        for p, c in clients.items():
            for i in range(20):
                c.complete(tokens(plen, 10 ** 6 + p * 100 + i), max_tokens=1)
        i = 0
        while len(out[self.port]) < n:
            for p, c in clients.items():
                for _ in range(25):
                    r = c.complete(tokens(plen, 2 * 10 ** 6 + p * 10_000 + i), max_tokens=1)
                    i += 1
                    self.assertTrue(r.ok, r.error)
                    out[p].append(r.total_s * 1e3)
        return out[self.port], out[self.base_port]

    def test_6_added_latency(self) -> None:
        for plen, n in ((64, 400), (1024, 300)):
            f, b = self._latency(plen, n)
            d50, d99 = pct(f, .5) - pct(b, .5), pct(f, .99) - pct(b, .99)
            print(f"nginx latency, {plen} tokens, {n} requests each: filter p50 {pct(f, .5):.3f} "
                  f"p99 {pct(f, .99):.3f} ms, baseline p50 {pct(b, .5):.3f} p99 {pct(b, .99):.3f} ms: "
                  f"added p50 {d50:+.3f} ms, p99 {d99:+.3f} ms (means {statistics.mean(f):.3f} / "
                  f"{statistics.mean(b):.3f})", flush=True)
            self.assertLess(d50, 3.0)

    def test_7_a_killed_replica(self) -> None:
        victim = self.s.replicas[3]
        victim.proc.kill()
        seen: dict[str, int] = {}
        fails = 0
        c = self.client()
        for i in range(40):
            r = c.complete(tokens(128, 800 + i), max_tokens=1)
            k = short(r.replica) if r.ok else f"error {r.status}"
            seen[k] = seen.get(k, 0) + 1
            fails += not r.ok
            time.sleep(0.05)
        print(f"nginx: 40 requests after killing {victim.name}: {seen}", flush=True)
        deadline = time.monotonic() + 10
        while f"{victim.name} is unreachable" not in self.nginx.text():
            self.assertLess(time.monotonic(), deadline, "the filter never saw the replica go")
            time.sleep(0.2)
        self.assertEqual(fails, 0, seen)
        self.assertNotIn(victim.name, seen)


def _count_debug_log(fifo: Path, counts: dict, lines: list[str], stop: threading.Event) -> None:
    """Reads nginx's error log from a FIFO: counts the module's fake-connection lines per worker
    pid (a callout from `on_tick` runs on a connection of its own that the module calls fake: no
    client behind it), keeps the filter's lines and those at warn and above (at most 2,000)."""
    created = re.compile(r"\] (\d+)#\d+: .*wasm created fake connection")
    closed = re.compile(r"\] (\d+)#\d+: .*wasm closing fake connection")
    with open(fifo, "rb") as f:
        for raw in f:
            line = raw.decode(errors="replace")
            if "fake connection" in line:
                if m := created.search(line):
                    counts.setdefault(int(m.group(1)), [0, 0])[0] += 1
                elif m := closed.search(line):
                    counts.setdefault(int(m.group(1)), [0, 0])[1] += 1
            elif len(lines) < 2000 and re.search(
                    r"\[(warn|error|crit|alert|emerg)\]|\[info\].*kvsteer: ", line):
                lines.append(line.rstrip())
            if stop.is_set():
                break


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class NginxSoak(unittest.TestCase):
    """Feed polling for a long stretch of ticks: no connection kept, none refused, no feed lost."""

    def test_feed_polling_keeps_no_connections(self) -> None:
        soak_s = float(os.environ.get("NGINX_SOAK_S", "120"))
        tick = int(os.environ.get("NGINX_SOAK_TICK_MS", "10"))
        debug = bool(NGINX_DEBUG_BIN)
        with stack.Stack(quiet=False) as s:
            s.start_replicas(4)
            port = stack.free_ports(1)[0]
            counts: dict[int, list[int]] = {}
            lines: list[str] = []
            stop = threading.Event()
            error_log = None
            if debug:
                fifo = s.workdir / "error.fifo"
                os.mkfifo(fifo)
                reader = threading.Thread(target=_count_debug_log, args=(fifo, counts, lines, stop),
                                          daemon=True)
                reader.start()
                error_log = f"{fifo} debug"
            conf = render(s.workdir, "nginx-soak", [r.port for r in s.replicas], port,
                          plugin={"tick_ms": tick, "feed_period_ms": 2 * tick,
                                  "feed_timeout_ms": 1000},
                          worker_connections=512, error_log=error_log)
            n = Nginx(s, "nginx-soak", conf, NGINX_DEBUG_BIN if debug else "")
            text = (lambda: "\n".join(lines)) if debug else n.text
            deadline = time.monotonic() + 180
            while text().count("kvsteer: configured") < 2:
                self.assertTrue(n.proc.alive(), n.proc.tail())
                self.assertLess(time.monotonic(), deadline, "the filter not configured")
                time.sleep(0.2)
            wait_port(port)
            t0 = time.monotonic()
            start = {w: list(v) for w, v in counts.items()}
            c = Client(H, port, timeout_s=10)
            self.addCleanup(c.close)
            routed = 0
            while time.monotonic() - t0 < soak_s:
                # Now and then a request, so the workers route while they poll.
                r = c.complete(tokens(256, int(time.monotonic() * 1000) % 10 ** 6), max_tokens=1)
                routed += r.ok
                time.sleep(min(5.0, max(0.0, soak_s - (time.monotonic() - t0))))
            took = time.monotonic() - t0
            # Prefix routing still works after the soak.
            p = tokens(1024, 4711)
            a = c.complete(p, max_tokens=1)
            time.sleep(0.5)
            b = c.complete(p + tokens(64, 4712), max_tokens=1)
            stop.set()
            log = text()
            # What the module said went wrong with callouts (a timed-out poll, a refused connection).
            errors: dict[str, int] = {}
            for ln in log.splitlines():
                if "[error]" in ln or "[crit]" in ln or "[alert]" in ln:
                    key = re.sub(r"^.*?\] \d+#\d+: (\*\d+ )?", "", ln)[:90]
                    errors[key] = errors.get(key, 0) + 1
            print(f"nginx soak: error lines {errors}", flush=True)
            summary = {w: {"created": v[0] - start.get(w, [0, 0])[0],
                           "closed": v[1] - start.get(w, [0, 0])[1]} for w, v in counts.items()}
            print(f"nginx soak: {took:.0f} s at tick {tick} ms ({took * 1000 / tick:.0f} ticks a "
                  f"worker, {took * 1000 / tick / 36000:.2f} h at the shipped 100 ms), "
                  f"worker_connections 512; callout connections per worker "
                  f"{summary if debug else '(needs NGINX_DEBUG_BIN)'}; requests routed {routed}",
                  flush=True)
            for bad in ("worker_connections are not enough", "failed creating fake connection",
                        "refused proxy_http_call", "is stale", "unreachable"):
                found = [ln for ln in log.splitlines() if bad in ln]
                self.assertFalse(found, f"{len(found)} lines like: {found[:3]}")
            self.assertTrue(a.ok and b.ok and a.replica == b.replica, (a, b))
            if debug:
                total = sum(v["created"] for v in summary.values())
                # At least one poll every 4 ticks per worker.
                self.assertGreater(total, took * 1000 / tick / 4)
                for w, v in summary.items():
                    # What is still open: at most one callout in flight per replica.
                    self.assertLessEqual(v["created"] - v["closed"], 4, summary)


if __name__ == "__main__":
    unittest.main()
