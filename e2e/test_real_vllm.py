"""End-to-end against real engines: two vLLM 0.32 CPU engines (tiny random-weight Llama, block size
32, one core each), a `kvsteer-feed` adapter beside each, and Envoy with the release filter in front,
all on 127.0.0.1. Run by scripts/e2e-vllm (docs/guide/real-vllm.md), which installs vLLM into .vllm/ and
sets KVSTEER_E2E_VLLM=1; without it every test here is skipped (scripts/e2e discovers this file too,
and the engines cost minutes and 6 GB).

What it checks, in order (the tests share the engines: starting them is most of the cost):
  1. a long shared token-id prefix follows the engine that caches it, once its adapter has reported
     it (the engine says so too: `cached_tokens`);
  2. after `POST /reset_prefix_cache` on that engine (AllBlocksCleared), the filter no longer credits
     it: the next request goes where the feed says the prefix now is;
  3. blocks the engine evicts (a small KV cache, flooded) leave the filter's view;
  4. an adapter restart is a new epoch: the filter resyncs, the adapter relearns the engine's history
     through replay, and routing by cache resumes;
  5. killing an adapter under load fails no client request;
  6. (E2E_VLLM_ENGINE_RESTART=1, the default) an engine killed under load fails no retriable request,
     and its restart is a new epoch in the feed with an empty view.

Which engine served a request: Envoy adds `x-kvsteer-replica: %UPSTREAM_REMOTE_ADDRESS%` to responses
(test configuration only), cross-checked with the filter's own decision counters and the engine's
`usage.prompt_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import json
import os
import random
import signal
import sys
import threading
import time
import unittest
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import envoy_config
from client import Client, Result, tokens
from stack import REPO, Proc, Replica, Stack, StackError, envoy_path, free_ports, target_dir
from stack import prom, wait_http, wasm_path

ENABLED = os.environ.get("KVSTEER_E2E_VLLM") == "1"
VLLM_BIN = Path(os.environ.get("VLLM_BIN") or REPO / ".vllm" / "venv" / "bin" / "vllm")
MODEL_DIR = Path(os.environ.get("VLLM_MODEL_DIR") or REPO / ".vllm" / "tiny-llama")
BLOCK = 32
# A small KV cache (the default here is 16,384 blocks) so that a handful of requests evicts.
GPU_BLOCKS = 128
MAX_MODEL_LEN = 2048
PREFIX = 1024  # 32 blocks
ENGINE_START_S = float(os.environ.get("E2E_VLLM_START_S", "300"))
ENGINE_RESTART = os.environ.get("E2E_VLLM_ENGINE_RESTART", "1") == "1"
# A finished request's booking leaves the other worker's view within a tick (100 ms).
PEER_SETTLE_S = 0.25
REPLICA_HEADER = "x-kvsteer-replica"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def http(url: str, method: str = "GET", body: bytes | None = None, timeout: float = 5) -> bytes:
    req = urllib.request.Request(url, data=body, method=method,
                                 headers={"content-type": "application/json"} if body else {})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def wait_until(what: str, pred, timeout_s: float, every_s: float = 0.1):
    """Polls `pred` until it returns something truthy; fails naming `what` (and the last value)."""
    deadline = time.monotonic() + timeout_s
    last = None
    while True:
        try:
            last = pred()
        except (urllib.error.URLError, ConnectionError, OSError, ValueError) as e:
            last = e
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s} s (last: {last!r})")
        time.sleep(every_s)


def group_members(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group `pgid`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(pid))
    return out


@dataclass
class Engine:
    """One vLLM engine and the adapter beside it."""

    name: str
    index: int
    port: int
    zmq_port: int
    replay_port: int
    adapter_port: int
    engine: Proc | None = None
    adapter: Proc | None = None
    starts: int = 0
    adapter_starts: int = 0

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def adapter_url(self) -> str:
        return f"http://127.0.0.1:{self.adapter_port}"

    def health(self) -> dict:
        return json.loads(http(self.adapter_url + "/health"))

    def adapter_metrics(self) -> str:
        return http(self.adapter_url + "/metrics").decode()

    def engine_metrics(self) -> str:
        return http(f"http://{self.endpoint}/metrics").decode()


class RealStack(Stack):
    """A Stack whose replicas are vLLM engines and whose feed clusters point at the adapters."""

    def __init__(self, gpu_blocks: int | None = GPU_BLOCKS, max_model_len: int = MAX_MODEL_LEN,
                 workdir: Path | None = None, model_dir: Path | None = None,
                 tokenizer: bool = False, adapter_args: list[str] | None = None) -> None:
        # gpu_blocks None: the engine's own count from VLLM_CPU_KVCACHE_SPACE (the fidelity run).
        # model_dir None: MODEL_DIR. tokenizer: the engines load the model folder's tokenizer (text
        # prompts) instead of --skip-tokenizer-init. adapter_args: added to every adapter's command.
        super().__init__(workdir=workdir, quiet=False)
        self.engines: list[Engine] = []
        self.cache_root = self.workdir / "vllm-cache"
        self.gpu_blocks, self.max_model_len = gpu_blocks, max_model_len
        self.model_dir, self.tokenizer = model_dir or MODEL_DIR, tokenizer
        self.adapter_args = adapter_args or []

    def close(self) -> None:
        self.stop_engines(self.engines)
        super().close()

    def start_fleet(self, replicas: int, start_s: float = ENGINE_START_S) -> float:
        """Starts `replicas` engines named v0, v1, ... with an adapter beside each (the adapters
        first: they bind the ZMQ endpoints the engines' PUB sockets connect to) and waits for them;
        returns the seconds the engines took to come up."""
        ports = free_ports(4 * replicas)
        for i in range(replicas):
            self.engines.append(Engine(f"v{i}", i, *ports[4 * i:4 * i + 4]))
        for e in self.engines:
            self.start_adapter(e)
        return self.start_engines(start_s)

    def serve_engines(self, timeout_s: float = 20) -> None:
        """Makes the started engines the stack's replicas (what Envoy's configuration lists) and
        waits until every adapter has learned its engine's block count (its first load report),
        so a feed poll never meets an adapter that cannot yet say how big the cache is."""
        self.replicas = [Replica(e.name, e.port, e.engine) for e in self.engines]
        for e in self.engines:
            wait_until(f"{e.name}'s adapter learns the engine's block count",
                       lambda e=e: prom(e.adapter_metrics(), "kvsteer_feed_max_blocks") > 0,
                       timeout_s)

    def start_engines(self, start_s: float = ENGINE_START_S) -> float:
        """Starts every engine of the stack, then waits for each (they load in parallel); returns the
        seconds they took."""
        t0 = time.monotonic()
        for e in self.engines:
            self.start_engine(e)
        for e in self.engines:
            self.wait_engine(e, start_s)
        return time.monotonic() - t0

    def stop_engines(self, engines: list[Engine], kill: bool = False) -> None:
        """Stops (SIGTERM, or SIGKILL with `kill`) the engines' process groups together, SIGKILLs
        what is left of them after 8 s, and unlinks the POSIX shared memory their processes had
        mapped: vLLM leaves `/dev/shm/psm_*` segments behind even on SIGTERM (its resource tracker
        goes down with the group), and an API server may exit before its engine core, which is then
        orphaned."""
        groups: list[int] = []
        procs: list[Proc] = []
        segments: set[str] = set()
        for e in engines:
            p = e.engine
            if p is None:
                continue
            e.engine = None
            if p in self.procs:
                self.procs.remove(p)
            group = p.popen.pid
            groups.append(group)
            procs.append(p)
            for pid in group_members(group):
                try:
                    with open(f"/proc/{pid}/maps") as f:
                        segments.update(line.split()[-1] for line in f
                                        if "/dev/shm/psm_" in line)
                except (OSError, IndexError):
                    continue
            try:
                os.killpg(group, signal.SIGKILL if kill else signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + (2 if kill else 8)
        while any(group_members(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        for g in groups:
            if group_members(g):
                try:
                    os.killpg(g, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + 5
        while any(group_members(g) for g in groups) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in procs:
            p.popen.poll()  # reap
        for seg in segments:
            try:
                os.unlink(seg)
            except OSError:
                pass

    def spawn_env(self, what: str, argv: list[str], env: dict[str, str]) -> Proc:
        """Stack.spawn with these variables added to the environment (through env(1), which execs:
        the pid, and so the process group Stack stops, stays the program's)."""
        return self.spawn(what, ["env", *(f"{k}={v}" for k, v in env.items()), *argv])

    def engine_env(self, e: Engine) -> dict[str, str]:
        cache = self.cache_root / e.name
        cpus = os.cpu_count() or 1
        return {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            # One core each (`auto` would put every engine on core 0).
            "VLLM_CPU_OMP_THREADS_BIND": str(e.index % cpus),
            "VLLM_SERVER_DEV_MODE": "1",  # POST /reset_prefix_cache
            # Every cache inside this run's temporary folder.
            "VLLM_CACHE_ROOT": str(cache),
            "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"),
            "TRITON_CACHE_DIR": str(cache / "triton"),
            "HF_HOME": str(cache / "hf"),
            "XDG_CACHE_HOME": str(cache / "xdg"),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }

    def start_engine(self, e: Engine, extra: list[str] | None = None) -> None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq",
                  "endpoint": f"tcp://127.0.0.1:{e.zmq_port}",
                  "replay_endpoint": f"tcp://127.0.0.1:{e.replay_port}", "topic": "kv-events"}
        argv = [str(VLLM_BIN), "serve", str(self.model_dir), "--served-model-name", "tiny",
                "--load-format", "dummy",
                *([] if self.tokenizer else ["--skip-tokenizer-init"]), "--enforce-eager",
                "--enable-prefix-caching", "--block-size", str(BLOCK),
                "--enable-prompt-tokens-details", "--host", "127.0.0.1", "--port", str(e.port),
                "--max-model-len", str(self.max_model_len), "--kv-events-config", json.dumps(events)]
        if self.gpu_blocks is not None:
            argv += ["--num-gpu-blocks-override", str(self.gpu_blocks)]
        argv += extra or []
        e.engine = self.spawn_env(f"vllm-{e.name}-{e.starts}", argv, self.engine_env(e))
        e.starts += 1

    def start_adapter(self, e: Engine, extra: list[str] | None = None) -> None:
        feed = Path(os.environ.get("KVSTEER_FEED") or target_dir() / "release" / "kvsteer-feed")
        if not feed.exists():
            raise StackError(f"{feed} not built: cargo build --release --bin kvsteer-feed")
        argv = [str(feed), "--listen", f"127.0.0.1:{e.adapter_port}",
                "--zmq-endpoint", f"tcp://127.0.0.1:{e.zmq_port}", "--topic", "kv-events",
                "--replay-endpoint", f"tcp://127.0.0.1:{e.replay_port}",
                "--metrics-url", f"http://{e.endpoint}/metrics", "--block-size", str(BLOCK),
                *self.adapter_args, *(extra or [])]
        env = {"RUST_LOG": os.environ.get("RUST_LOG", "info")}
        e.adapter = self.spawn_env(f"feed-{e.name}-{e.adapter_starts}", argv, env)
        e.adapter_starts += 1
        wait_http(e.adapter_url + "/health", 10, e.adapter)

    def wait_engine(self, e: Engine, timeout_s: float) -> None:
        assert e.engine is not None
        wait_http(f"http://{e.endpoint}/health", timeout_s, e.engine)

    def start_envoy_real(self, plugin_overrides: dict | None = None,
                         replica_overrides: dict | None = None,
                         extra_clusters: dict[str, str] | None = None,
                         concurrency: int = 2) -> None:
        wasm = wasm_path()
        if not wasm.exists():
            raise StackError(f"filter not built at {wasm}")
        self.listen_port, self.admin_port = free_ports(2)
        self.variant = "envoy"
        doc = envoy_config.rewrite(
            envoy_config.load("envoy"),
            replicas=[(e.name, e.endpoint) for e in self.engines],
            listen_port=self.listen_port, admin_port=self.admin_port, wasm=str(wasm),
            plugin_overrides=plugin_overrides or {"routing": {"policy": "kv_load", "block_size": BLOCK}},
            replica_overrides=replica_overrides, extra_clusters=extra_clusters,
        )
        # Feed callouts go to the adapters, not the engines (docs/guide/feed-adapter.md).
        adapters = {envoy_config.FEED_PREFIX + e.name: e.adapter_port for e in self.engines}
        for c in doc["static_resources"]["clusters"]:
            if c["name"] in adapters:
                for group in c["load_assignment"]["endpoints"]:
                    for ep in group["lb_endpoints"]:
                        ep["endpoint"]["address"]["socket_address"]["port_value"] = adapters[c["name"]]
        # Name the engine that answered (vLLM does not).
        for listener in doc["static_resources"]["listeners"]:
            for chain in listener["filter_chains"]:
                for f in chain["filters"]:
                    for vh in f["typed_config"]["route_config"]["virtual_hosts"]:
                        vh["response_headers_to_add"] = [{
                            "header": {"key": REPLICA_HEADER, "value": "%UPSTREAM_REMOTE_ADDRESS%"},
                            "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]
        path = self.workdir / "envoy-real-vllm.json"
        path.write_text(json.dumps(doc, indent=1))
        argv = [str(envoy_path()), "-c", str(path), "--concurrency", str(concurrency),
                "--base-id", str(random.randint(1000, 4_000_000)), "--log-level", "warn",
                "--component-log-level", os.environ.get("E2E_ENVOY_LOG", "wasm:info")]
        self.envoy = self.spawn("envoy-real-vllm", argv)
        wait_http(f"http://127.0.0.1:{self.admin_port}/ready", 30, self.envoy)
        self.wait_healthy(30)
        self.wait_feeds(30)


def require_vllm() -> None:
    if not VLLM_BIN.exists() or not (MODEL_DIR / "config.json").exists():
        raise StackError(f"no vLLM at {VLLM_BIN} / {MODEL_DIR}: run scripts/vllm-install")


def feed_polls(stack: Stack, e: Engine) -> int:
    """Feed polls of `e`'s adapter the filter has completed with a 2xx (callouts count under
    `internal.`)."""
    prefix = f"cluster.{envoy_config.FEED_PREFIX}{e.name}."
    s = stack.stats(prefix)
    # Not summed: Envoy counts a callout under both names (e2e/stack.py, `feed_polls`).
    return max(s.get(prefix + "upstream_rq_2xx", 0),
               s.get(prefix + "internal.upstream_rq_2xx", 0))


class VllmCase(unittest.TestCase):
    """What the real-engine classes share: a stack their setUpClass starts (checking for vLLM with
    `require_vllm`), stopped at the end with the timings they noted logged. No tests of its own."""

    stack: RealStack
    timings: dict[str, float]

    @classmethod
    def tearDownClass(cls) -> None:
        log("timings: " + ", ".join(f"{k} {v:.1f}" for k, v in cls.timings.items()))
        cls.stack.close_checked()


@unittest.skipUnless(ENABLED, "real vLLM engines: run scripts/e2e-vllm (sets KVSTEER_E2E_VLLM=1)")
class RealVllm(VllmCase):
    timings: dict[str, float] = {}

    @classmethod
    def setUpClass(cls) -> None:
        require_vllm()
        s = cls.stack = RealStack()
        try:
            log(f"vLLM: {VLLM_BIN}, model {MODEL_DIR}")
            cls.timings["engines_start_s"] = s.start_fleet(2)
            log(f"engines ready in {cls.timings['engines_start_s']:.1f} s")
            s.serve_engines()
            t1 = time.monotonic()
            s.start_envoy_real()
            log(f"envoy ready in {time.monotonic() - t1:.1f} s: "
                f"listen 127.0.0.1:{s.listen_port}, admin 127.0.0.1:{s.admin_port}")
        except BaseException:
            s.close()
            raise

    def setUp(self) -> None:
        self.t0 = time.monotonic()

    def tearDown(self) -> None:
        self.timings[self.id().rsplit(".", 1)[-1]] = time.monotonic() - self.t0

    # -- helpers --------------------------------------------------------------------------------

    @property
    def engines(self) -> list[Engine]:
        return self.stack.engines

    def other(self, e: Engine) -> Engine:
        return next(x for x in self.engines if x is not e)

    def by_endpoint(self, ep: str) -> Engine:
        for e in self.engines:
            if e.endpoint == ep:
                return e
        raise AssertionError(f"answer from unknown upstream {ep!r}")

    def stat(self, needle: str) -> int:
        return sum(v for k, v in self.stack.stats(needle).items() if needle in k)

    def decisions(self) -> dict[str, int]:
        return {e.name: self.stat(f"kvsteer_decisions_kv_load_{e.name}") for e in self.engines}

    def complete(self, host_port: tuple[str, int], prompt: list[int], max_tokens: int = 4,
                 stream: bool = False, timeout_s: float = 60) -> Result:
        c = Client(*host_port, timeout_s=timeout_s)
        try:
            return c.complete(prompt, max_tokens=max_tokens, stream=stream, ignore_eos=True,
                              extra={"model": "tiny", "temperature": 0})
        finally:
            c.close()

    def direct(self, e: Engine, prompt: list[int], max_tokens: int = 4) -> Result:
        """Straight to an engine, past the router (another client's traffic)."""
        res = self.complete(("127.0.0.1", e.port), prompt, max_tokens)
        self.assertTrue(res.ok, res)
        return res

    def routed(self, prompt: list[int], max_tokens: int = 4) -> tuple[Engine, Result, int]:
        """Through Envoy, on a fresh connection: (engine that served it, result, tokens the filter
        matched on the engine it chose)."""
        time.sleep(PEER_SETTLE_S)
        before_d, before_m = self.decisions(), self.stat("kvsteer_matched_tokens")
        res = self.complete(("127.0.0.1", self.stack.listen_port), prompt, max_tokens)
        self.assertTrue(res.ok, res)
        served = self.by_endpoint(res.headers.get(REPLICA_HEADER, ""))
        after_d = self.decisions()
        chosen = [n for n in after_d if after_d[n] > before_d[n]]
        self.assertEqual(chosen, [served.name], f"filter chose {chosen}, {served.name} served")
        matched = self.stat("kvsteer_matched_tokens") - before_m
        return served, res, matched

    def stored(self, e: Engine) -> float:
        """Blocks `e`'s adapter has taken in since it started."""
        return prom(e.adapter_metrics(), "kvsteer_feed_blocks_total", op="stored")

    def wait_stored(self, e: Engine, since: float, n: int = PREFIX // BLOCK) -> None:
        """Until `e`'s adapter has stored `n` more blocks than `since`, and the filter has read it."""
        wait_until(f"{e.name}'s adapter stores {n} blocks",
                   lambda: self.stored(e) >= since + n, 10)
        self.settle(e)

    def feed_polls(self, e: Engine) -> int:
        return feed_polls(self.stack, e)

    def settle(self, e: Engine) -> None:
        """Until the filter has polled `e`'s feed twice more (what the adapter holds now has been
        read), plus a tick for the relay to the other worker."""
        n = self.feed_polls(e)
        wait_until(f"two more polls of {e.name}'s feed", lambda: self.feed_polls(e) >= n + 2, 10,
                   0.05)
        time.sleep(PEER_SETTLE_S)

    def nudge(self, e: Engine, seed: int, until, what: str) -> None:
        """Short requests straight to `e` until `until()` holds. An idle vLLM publishes nothing (a
        cleared cache is announced with its next step's events), and a SUB socket that has just been
        bound misses what is published before the engine's PUB has reconnected to it."""
        for k in range(5):
            self.direct(e, tokens(40, seed + k), max_tokens=1)
            try:
                wait_until(what, until, 3)
                return
            except AssertionError:
                continue
        raise AssertionError(f"{what}: not after 5 requests to {e.name}")

    def blocks(self, e: Engine) -> int:
        return int(e.health()["blocks"])

    # -- tests ----------------------------------------------------------------------------------

    def test_1_shared_prefix_lands_on_the_engine_that_holds_it(self):
        # One prefix seeded through the router (it lands on either engine), one sent straight to the
        # other engine (so both adapters' feeds are exercised).
        pa = tokens(PREFIX, 1_000)
        since = {e.name: self.stored(e) for e in self.engines}
        holder_a, _, _ = self.routed(pa + tokens(32, 1_001))
        holder_b = self.other(holder_a)
        self.wait_stored(holder_a, since[holder_a.name])
        pb = tokens(PREFIX, 2_000)
        since_b = self.stored(holder_b)
        self.direct(holder_b, pb + tokens(32, 2_001))
        self.wait_stored(holder_b, since_b)
        for k in range(3):
            for prefix, holder, seed in ((pa, holder_a, 1_100), (pb, holder_b, 2_100)):
                served, res, matched = self.routed(prefix + tokens(32, seed + k))
                self.assertEqual(served.name, holder.name, f"follow-up {k}: {res}")
                self.assertGreaterEqual(matched, PREFIX, "the filter saw the cached prefix")
                self.assertGreaterEqual(res.cached_tokens, PREFIX, res)
                self.assertEqual(res.prompt_tokens, PREFIX + 32, res)

    def test_2_a_reset_cache_is_no_longer_preferred(self):
        p = tokens(PREFIX, 3_000)
        since = {e.name: self.stored(e) for e in self.engines}
        holder, _, _ = self.routed(p + tokens(32, 3_001))
        other = self.other(holder)
        self.wait_stored(holder, since[holder.name])
        # The other engine caches the prefix's first 8 blocks (another client's traffic).
        since_o = self.stored(other)
        self.direct(other, p[:256] + tokens(64, 3_002))
        self.wait_stored(other, since_o, 8)
        # Cost (kv_load, 33-block request, prefill x8, credit 2): holder 0 + 33, other 8*17 + 33.
        served, res, matched = self.routed(p + tokens(32, 3_003))
        self.assertEqual(served.name, holder.name, res)
        self.assertGreaterEqual(matched, PREFIX)
        cleared_before = prom(holder.adapter_metrics(), "kvsteer_feed_engine_events_total",
                              type="cleared")
        epoch = holder.health()["epoch"]
        ok = wait_until(f"{holder.name} resets its prefix cache", lambda: json.loads(
            http(f"http://{holder.endpoint}/reset_prefix_cache", "POST", b"{}"))["success"], 10, 0.5)
        self.assertTrue(ok)
        # vLLM publishes AllBlocksCleared with the next scheduler step's events: an idle engine says
        # nothing until its next request. Nudge it with a short one of its own.
        self.nudge(holder, 3_010, lambda: prom(
            holder.adapter_metrics(), "kvsteer_feed_engine_events_total", type="cleared")
            > cleared_before, f"{holder.name}'s adapter sees AllBlocksCleared")
        self.assertEqual(holder.health()["epoch"], epoch, "a clear is an event, not a new epoch")
        self.assertLess(self.blocks(holder), 8, holder.health())
        self.settle(holder)
        # Now the holder costs 8*33 + 33 and the other engine (8 blocks) 8*17 + 33.
        served, res, matched = self.routed(p + tokens(32, 3_005))
        self.assertEqual(served.name, other.name, f"after the reset: {res}")
        self.assertEqual(matched, 256, "the filter credits only the other engine's 8 blocks")
        self.assertEqual(res.cached_tokens, 256, res)

    def test_3_evicted_blocks_leave_the_view(self):
        e = self.engines[1]
        q = tokens(PREFIX, 4_000)
        since = self.stored(e)
        self.direct(e, q + tokens(32, 4_001))
        self.wait_stored(e, since)
        served, res, matched = self.routed(q + tokens(32, 4_002))
        self.assertEqual(served.name, e.name, res)
        self.assertGreaterEqual(matched, PREFIX)
        removed = prom(e.adapter_metrics(), "kvsteer_feed_blocks_total", op="removed")
        # Flood it with fresh prompts: 5 x 33 blocks > 128, so q's blocks (the oldest) are evicted.
        for k in range(5):
            self.direct(e, tokens(PREFIX + 32, 4_100 + k))
        wait_until(f"{e.name}'s adapter sees evictions", lambda: prom(
            e.adapter_metrics(), "kvsteer_feed_blocks_total", op="removed") >= removed + PREFIX // BLOCK,
            10)
        self.assertLessEqual(self.blocks(e), GPU_BLOCKS)
        self.settle(e)
        served, res, matched = self.routed(q + tokens(32, 4_003))
        self.assertEqual(matched, 0, f"evicted blocks still credited ({served.name})")
        self.assertEqual(res.cached_tokens, 0, f"{served.name} still had them: {res}")

    def test_4_adapter_restart_resyncs(self):
        e = self.engines[0]
        r = tokens(PREFIX, 5_000)
        since = self.stored(e)
        self.direct(e, r + tokens(32, 5_001))
        self.wait_stored(e, since)
        old_epoch = e.health()["epoch"]
        resets = self.stat("kvsteer_feed_resets")
        assert e.adapter is not None
        e.adapter.stop()
        # Without its feed the filter marks the engine down (its feed cluster refuses connections)
        # and routes around it; clients see nothing.
        for k in range(3):
            res = self.complete(("127.0.0.1", self.stack.listen_port), tokens(64, 5_100 + k))
            self.assertTrue(res.ok, res)
        self.stack.procs.remove(e.adapter)
        self.stack.start_adapter(e)
        new_epoch = e.health()["epoch"]
        self.assertNotEqual(new_epoch, old_epoch)
        # Its first engine batch makes it ask the engine's replay buffer for the history from 0. (That
        # batch may already have come: vLLM's PUB connects, so libzmq queues what it publishes while
        # the adapter is away and delivers it on reconnection.)
        self.nudge(e, 5_010, lambda: e.health()["blocks"] >= PREFIX // BLOCK,
                   f"{e.name}'s new adapter relearns r through replay")
        self.assertGreater(prom(e.adapter_metrics(), "kvsteer_feed_replayed_batches_total"), 0)
        wait_until("the filter takes the new epoch's snapshot",
                   lambda: self.stat("kvsteer_feed_resets") > resets, 10)
        wait_until(f"the filter sees {e.name} up again",
                   lambda: self.stat(f"kvsteer_down_{e.name}") == 0, 10)
        self.settle(e)
        served, res, matched = self.routed(r + tokens(32, 5_003))
        self.assertEqual(served.name, e.name, res)
        self.assertGreaterEqual(matched, PREFIX)
        self.assertGreaterEqual(res.cached_tokens, PREFIX, res)

    def run_load(self, seconds: float, results: list[Result], stop: threading.Event,
                 workers: int = 2, streams: bool = True) -> list[threading.Thread]:
        lock = threading.Lock()
        shared = tokens(512, 6_000)

        def worker(w: int) -> None:
            deadline = time.monotonic() + seconds
            k = 0
            while not stop.is_set() and time.monotonic() < deadline and k < 2_000:
                prompt = (shared if k % 2 else []) + tokens(64, 6_100 + 1_000 * w + k)
                res = self.complete(("127.0.0.1", self.stack.listen_port), prompt, max_tokens=8,
                                    stream=streams and k % 3 == 0)
                with lock:
                    results.append(res)
                k += 1

        threads = [threading.Thread(target=worker, args=(w,), daemon=True) for w in range(workers)]
        for t in threads:
            t.start()
        return threads

    def test_5_killing_an_adapter_fails_no_request(self):
        e = self.engines[1]
        results: list[Result] = []
        stop = threading.Event()
        threads = self.run_load(60, results, stop)
        try:
            time.sleep(2.0)
            n_before = len(results)
            assert e.adapter is not None
            e.adapter.kill()
            self.stack.procs.remove(e.adapter)
            # Past stale_after_failures (3) polls of 200 ms: the filter has given up on the feed.
            down = wait_until(f"the filter marks {e.name} down", lambda: self.stat(
                f"kvsteer_down_{e.name}") > 0, 10)
            time.sleep(2.0)
            n_outage = len(results)
            self.stack.start_adapter(e)
            wait_until(f"the filter sees {e.name} up again",
                       lambda: self.stat(f"kvsteer_down_{e.name}") == 0, 10)
            time.sleep(2.0)
        finally:
            stop.set()
            for t in threads:
                t.join(timeout=60)
        failed = [r for r in results if not r.ok]
        log(f"adapter kill: {len(results)} requests ({n_outage - n_before} during the outage), "
            f"{len(failed)} failed; filter marked it down: {bool(down)}")
        self.assertEqual(failed, [], f"{len(failed)} of {len(results)} failed")
        self.assertGreater(n_outage - n_before, 3, "traffic flowed during the outage")
        self.assertGreater(len(results) - n_outage, 3, "and after it")

    @unittest.skipUnless(ENGINE_RESTART, "E2E_VLLM_ENGINE_RESTART=0")
    def test_6_engine_restart_is_a_new_epoch(self):
        e = self.engines[1]
        u = tokens(PREFIX, 7_000)
        since = self.stored(e)
        self.direct(e, u + tokens(32, 7_001))
        self.wait_stored(e, since)
        old_epoch = e.health()["epoch"]
        restarts = prom(e.adapter_metrics(), "kvsteer_feed_resets_total", reason="engine_restart")
        results: list[Result] = []
        stop = threading.Event()
        # Non-streamed requests only: Envoy retries a request whose engine dies before answering; a
        # stream that has started cannot be retried by any proxy.
        threads = self.run_load(5, results, stop, streams=False)
        time.sleep(1.5)
        self.stack.stop_engines([e], kill=True)
        for t in threads:
            t.join(timeout=60)
        failed = [r for r in results if not r.ok]
        self.assertEqual(failed, [], f"{len(failed)} of {len(results)} failed")
        t0 = time.monotonic()
        self.stack.start_engine(e)
        self.stack.wait_engine(e, ENGINE_START_S)
        self.timings["engine_restart_s"] = time.monotonic() - t0
        log(f"{e.name} restarted in {self.timings['engine_restart_s']:.1f} s")
        # The adapter sees the new process_start_time_seconds (or sequence numbers from 0 again).
        self.nudge(e, 7_010, lambda: prom(
            e.adapter_metrics(), "kvsteer_feed_resets_total", reason="engine_restart") > restarts,
            f"{e.name}'s adapter resets on the engine restart")
        self.assertNotEqual(e.health()["epoch"], old_epoch)
        wait_until("the engine is healthy for Envoy",
                   lambda: self.stack.host_health("replicas").get(e.endpoint) == "healthy", 15)
        wait_until(f"the filter polls {e.name}'s feed again",
                   lambda: self.stat(f"kvsteer_down_{e.name}") == 0
                   and self.stat(f"kvsteer_feed_stale_{e.name}") == 0, 15)
        self.settle(e)
        served, res, matched = self.routed(u + tokens(32, 7_003))
        self.assertEqual(matched, 0, f"the restarted engine's old cache is still credited: {served}")
        self.assertEqual(res.cached_tokens, 0, res)
        # Routing by cache works on the restarted engine.
        v = tokens(PREFIX, 7_100)
        since = self.stored(e)
        self.direct(e, v + tokens(32, 7_101))
        self.wait_stored(e, since)
        served, res, matched = self.routed(v + tokens(32, 7_102))
        view = {k: self.stat(f"kvsteer_{k}_{e.name}") for k in ("ejected", "down", "feed_stale")}
        self.assertEqual(served.name, e.name, f"{res}; the filter's gauges for {e.name}: {view}")
        self.assertGreaterEqual(matched, PREFIX)


if __name__ == "__main__":
    unittest.main()
