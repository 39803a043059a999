"""End-to-end: pools (docs/guide/pools.md), one gateway in front of two fleets, through Envoy 1.40
(`--concurrency 2`) with envoy/envoy-pools.yaml, the built filter and 4 simulated replicas.

Pool `chat` serves `llama-3.1-8b-instruct` on replicas a0 and a1 (the default engine profile,
Llama-3.1-8B on an H100); pool `big` serves `llama-3.1-70b-instruct` on b0 and b1 (the sim's
built-in `llama-3.1-70b-h100-tp4` profile, the pool's `kv_time.profile` in the file). No
`default_pool`; the explain header is turned on. One stack for the class; its tests run in order:

1. Each model reaches only its pool's replicas (the replicas' own finished-request counts and the
   replica each answer names), and a conversation's follow-ups land on its first turn's replica.
2. The explain header starts `pool=<name>; winner=`.
3. A model no pool serves gets the filter's 404 `model_not_found` body, a body without `model`
   400, a body over `routing.max_body_bytes` without the model header 413; no replica sees any.
   With the header (`model_header`) an unread body goes to the header's pool, while a body the
   filter reads goes where its own `model` says, whatever the header.
4. Envoy's /stats names the pools' metrics `kvsteer_pool_<pool>_...` with the counts the test
   sent, `kvsteer_models_unknown` and `kvsteer_models_missing` are the 404s and 400s, and the
   file's stats_tags rule turns the pool into a label in /stats/prometheus
   (`kvsteer_pool_requests_routed{kvsteer_pool="big"}`: Envoy prints its `wasmcustom` stats
   without a prefix there).
5. `kvsteer-check` accepts the bootstrap and the plugin configuration the test ran.
6. After SIGKILL of b1, `big`'s requests go to b0 once the filter marks b1 down or ejects it,
   without errors, while `chat`'s keep being split over a0 and a1 without errors.

No timing is asserted; waits are bounded; loopback only. Run by scripts/e2e (`scripts/e2e
test_pools`); needs the release wasm, the sim and kvsteer-check (target/release).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import threading
import time
import unittest
import urllib.request

import envoy_config
from client import Client, Result, tokens
from stack import Stack, target_dir

TIME_SCALE = os.environ.get("E2E_TIME_SCALE", "10")
CHAT, BIG = "llama-3.1-8b-instruct", "llama-3.1-70b-instruct"
POOLS = {"chat": ["a0", "a1"], "big": ["b0", "b1"]}
MODEL_OF = {"chat": CHAT, "big": BIG}
EXPLAIN = "x-kvsteer-explain"
MODEL_HEADER = "x-gateway-model-name"
# Bodies over this are not read (routing.max_body_bytes): their pool comes from MODEL_HEADER.
MAX_BODY = 65536
# A feed poll (200 ms) and the relay to the other worker (next 100 ms tick), with margin.
FEED_SETTLE_S = 0.6
DOWN_WAIT_S = 15.0


def check_path():
    return target_dir() / "release" / "kvsteer-check"


class TwoPools(unittest.TestCase):
    stack: Stack
    # Requests each pool served through the gateway, and the filter's own answers, over the
    # class's tests (test 4 compares them with Envoy's counters).
    routed: dict[str, int]
    unknown = 0
    missing = 0

    @classmethod
    def setUpClass(cls) -> None:
        cls.routed = {"chat": 0, "big": 0}
        s = Stack()
        try:
            s.start_replicas(2, prefix="a", extra=["--time-scale", TIME_SCALE, "--model", CHAT])
            s.start_replicas(2, prefix="b", extra=["--time-scale", TIME_SCALE, "--model", BIG,
                                                   "--profile", "llama-3.1-70b-h100-tp4"])
            s.start_envoy("envoy-pools", concurrency=2, pools=POOLS,
                          plugin_overrides={"explain_header": EXPLAIN,
                                            "model_header": MODEL_HEADER,
                                            "routing": {"max_body_bytes": MAX_BODY}})
        except BaseException:
            s.close()
            raise
        cls.stack = s

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    # -- helpers ---------------------------------------------------------------------------------

    def send(self, pool: str, prompt: list[int], max_tokens: int = 4) -> Result:
        """One completion for `pool`'s model on a fresh connection (so requests spread over
        Envoy's workers), counted in `routed` when answered."""
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=60)
        try:
            res = c.complete(prompt, max_tokens=max_tokens, extra={"model": MODEL_OF[pool]})
        finally:
            c.close()
        if res.ok:
            type(self).routed[pool] += 1
        return res

    def raw(self, body: dict, headers: dict | None = None) -> tuple[int, dict, bytes]:
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=30)
        try:
            return c.request("POST", "/v1/completions", json.dumps(body).encode(),
                             {"content-type": "application/json", **(headers or {})})
        finally:
            c.close()

    def replica_of(self, res: Result) -> str:
        r = self.stack.by_sim_name(res.replica)
        self.assertIsNotNone(r, f"answer names unknown replica {res.replica!r} ({res})")
        return r.name

    def served(self) -> dict[str, int]:
        """Each live replica's finished requests, from its own /metrics."""
        out = {}
        for r in self.stack.replicas:
            if not r.proc.alive():
                continue
            with urllib.request.urlopen(f"http://{r.endpoint}/metrics", timeout=5) as resp:
                text = resp.read().decode()
            out[r.name] = int(sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                                  if line.startswith("vllm:request_success_total")))
        return out

    def settle(self, before: dict[str, int], want: int, timeout_s: float = 10.0) -> dict[str, int]:
        """The replicas' counts once they have finished `want` requests more than `before` (a
        replica counts a request after the client has its answer)."""
        deadline = time.monotonic() + timeout_s
        while True:
            now = self.served()
            if sum(now.values()) - sum(before.values()) >= want or time.monotonic() > deadline:
                return {k: now[k] - before.get(k, 0) for k in now}
            time.sleep(0.05)

    def wasm_stats(self) -> dict[str, int]:
        return {k.removeprefix("wasmcustom."): v
                for k, v in self.stack.stats("wasmcustom.kvsteer").items()}

    def load(self, pool: str, seed: int, clients: int = 4, each: int = 6) -> list[Result]:
        """`clients` concurrent clients each sending `each` distinct prompts to `pool`."""
        out: list[Result] = []
        lock = threading.Lock()

        def run(n: int) -> None:
            for i in range(each):
                res = self.send(pool, tokens(256, seed + 1000 * n + i), max_tokens=24)
                with lock:
                    out.append(res)

        threads = [threading.Thread(target=run, args=(n,), daemon=True) for n in range(clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        return out

    # -- tests -----------------------------------------------------------------------------------

    def test_1_each_model_reaches_only_its_pool_and_follow_ups_stay(self):
        before = self.served()
        firsts: dict[tuple[str, int], tuple[list[int], str]] = {}
        sent = {"chat": 0, "big": 0}
        for k in range(4):
            for pool in POOLS:
                prefix = tokens(1024, 10_000 + 100 * k + (50 if pool == "big" else 0))
                res = self.send(pool, prefix + tokens(32, 90_000 + k))
                self.assertTrue(res.ok, res)
                sent[pool] += 1
                where = self.replica_of(res)
                self.assertIn(where, POOLS[pool], f"{pool}'s request answered by {where}")
                firsts[(pool, k)] = (prefix, where)
        time.sleep(FEED_SETTLE_S)
        moved = []
        for (pool, k), (prefix, where) in firsts.items():
            for turn in range(2):
                time.sleep(0.25)
                res = self.send(pool, prefix + tokens(32, 95_000 + 10 * k + turn))
                self.assertTrue(res.ok, res)
                sent[pool] += 1
                got = self.replica_of(res)
                self.assertIn(got, POOLS[pool], f"{pool}'s follow-up answered by {got}")
                if got != where:
                    moved.append((pool, k, turn, where, got))
        self.assertEqual(moved, [], "follow-ups left their first turn's replica")
        delta = self.settle(before, sum(sent.values()))
        for pool, members in POOLS.items():
            self.assertEqual(sum(delta[r] for r in members), sent[pool],
                             f"{pool}: replicas' own counts {delta}, sent {sent}")
        print(f"\nfirst turns on {[v[1] for v in firsts.values()]}; replicas' counts {delta}",
              flush=True)

    def test_2_the_explain_header_names_the_pool(self):
        for pool, members in POOLS.items():
            res = self.send(pool, tokens(300, 20_000 + len(pool)))
            self.assertTrue(res.ok, res)
            explain = res.headers.get(EXPLAIN, "")
            self.assertTrue(explain.startswith(f"pool={pool}; winner="), explain)
            # The winner is an index in the pool's own replicas (two of them).
            winner = int(re.match(r"pool=[a-z0-9-]+; winner=(\d+)", explain).group(1))
            self.assertIn(winner, (0, 1), explain)
            self.assertEqual(members[winner], self.replica_of(res), explain)

    def test_3_unknown_and_missing_models_are_answered_by_the_filter(self):
        before = self.served()
        for name in ("gpt-4", "llama-3.1-8b"):
            status, headers, data = self.raw({"model": name, "prompt": tokens(64, 3),
                                              "max_tokens": 4})
            self.assertEqual(status, 404, data)
            type(self).unknown += 1
            body = json.loads(data)
            self.assertEqual(body, {"error": {
                "message": f"The model `{name}` does not exist.",
                "type": "invalid_request_error", "param": "model", "code": "model_not_found"}})
            self.assertNotIn("x-kvsteer-replica", headers)
        status, headers, data = self.raw({"prompt": tokens(64, 4), "max_tokens": 4})
        self.assertEqual(status, 400, data)
        type(self).missing += 1
        self.assertEqual(json.loads(data)["error"]["type"], "invalid_request_error", data)
        self.assertNotIn("x-kvsteer-replica", headers)
        # A body over routing.max_body_bytes is not read: without the model header it has no
        # pool, and is refused.
        oversized = {"model": CHAT, "prompt": tokens(20_000, 5), "max_tokens": 2}
        self.assertGreater(len(json.dumps(oversized)), MAX_BODY)
        status, headers, data = self.raw(oversized)
        self.assertEqual(status, 413, data)
        self.assertNotIn("x-kvsteer-replica", headers)
        time.sleep(0.5)
        self.assertEqual(self.served(), before, "a refused request reached a replica")

    def test_3b_the_model_header_places_only_unread_bodies(self):
        # Over the limit, the header's pool takes it (routed by load there).
        oversized = {"model": CHAT, "prompt": tokens(20_000, 6), "max_tokens": 2}
        status, headers, data = self.raw(oversized, {MODEL_HEADER: BIG})
        self.assertEqual(status, 200, data)
        self.assertIn(self.stack.by_sim_name(headers["x-kvsteer-replica"]).name, POOLS["big"])
        type(self).routed["big"] += 1
        # A body the filter reads: its own model wins over the header.
        c = Client("127.0.0.1", self.stack.listen_port, timeout_s=60)
        try:
            res = c.complete(tokens(64, 7), extra={"model": CHAT}, headers={MODEL_HEADER: BIG})
        finally:
            c.close()
        self.assertTrue(res.ok, res)
        type(self).routed["chat"] += 1
        self.assertIn(self.replica_of(res), POOLS["chat"])
        self.assertTrue(res.headers.get(EXPLAIN, "").startswith("pool=chat; "), res.headers)

    def test_4_metrics_are_named_by_pool(self):
        st = self.wasm_stats()
        for pool, members in POOLS.items():
            self.assertEqual(st.get(f"kvsteer_pool_{pool}_requests_routed"), self.routed[pool],
                             f"{pool}: {st}")
            decided = sum(st.get(f"kvsteer_pool_{pool}_decisions_kv_time_{r}", 0)
                          for r in members)
            self.assertEqual(decided, self.routed[pool], f"{pool}: {st}")
        self.assertNotIn("kvsteer_requests_routed", st)
        # The big pool's engines run the 70B TP4 profile: their feeds report a cache of another
        # size than chat's (25,600 and 26,875 blocks of 16 tokens today).
        chat_cache = st.get("kvsteer_pool_chat_cache_size_blocks_a0", 0)
        big_cache = st.get("kvsteer_pool_big_cache_size_blocks_b0", 0)
        self.assertGreater(chat_cache, 0, st)
        self.assertGreater(big_cache, 0, st)
        self.assertNotEqual(chat_cache, big_cache)
        self.assertEqual(st.get("kvsteer_models_unknown"), self.unknown)
        # At least the readable bodies without a model (docs/reference/metrics.md counts the
        # refused unread body of test 3 here too; this filter does not yet).
        self.assertGreaterEqual(st.get("kvsteer_models_missing", 0), self.missing)
        # Envoy's Prometheus output, with envoy-pools.yaml's stats_tags rule: the pool a label.
        # Envoy 1.40 prints the `wasmcustom` namespace's stats without a prefix.
        prom = self.stack.admin("/stats/prometheus")
        shown = "\n".join(ln for ln in prom.splitlines() if ln.startswith("kvsteer_"))
        for pool in POOLS:
            m = re.search(r'^kvsteer_pool_requests_routed\{kvsteer_pool="' + pool + r'"\} (\d+)$',
                          prom, re.M)
            self.assertIsNotNone(m, shown)
            self.assertEqual(int(m.group(1)), self.routed[pool])
            m = re.search(r'^kvsteer_pool_down_b1\{kvsteer_pool="big"\} 0$', prom, re.M)
            self.assertIsNotNone(m, shown)
            # The rule took the pool out of every name.
            self.assertNotIn(f"kvsteer_pool_{pool}_", prom)
        m = re.search(r"^kvsteer_models_unknown\{\} (\d+)$", prom, re.M)
        self.assertIsNotNone(m, shown)
        self.assertEqual(int(m.group(1)), self.unknown)

    def test_5_kvsteer_check_accepts_what_ran(self):
        exe = check_path()
        if not exe.exists():
            self.fail(f"kvsteer-check not built at {exe}: "
                      "`cargo build --release --bin kvsteer-check`")
        bootstrap = self.stack.workdir / "envoy-pools.json"
        p = subprocess.run([str(exe), str(bootstrap)], capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn("ok: 2 pools", p.stdout)
        plugin = envoy_config.plugin_config(json.loads(bootstrap.read_text()))
        self.assertEqual(plugin["explain_header"], EXPLAIN)
        p = subprocess.run([str(exe), "-"], input=json.dumps(plugin), capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 0, p.stdout + p.stderr)
        self.assertIn(f"pool chat: models {CHAT}; 2 replicas", p.stdout)
        self.assertIn(f"pool big: models {BIG}; 2 replicas", p.stdout)
        # The same configuration with a model in both pools is refused, by path.
        plugin["pools"][1]["models"].append(CHAT)
        p = subprocess.run([str(exe), "-"], input=json.dumps(plugin), capture_output=True,
                           text=True, timeout=60)
        self.assertEqual(p.returncode, 1, p.stdout + p.stderr)
        self.assertIn(f'pools[1].models[1]: "{CHAT}" is already pools[0]\'s', p.stdout + p.stderr)

    def test_6_a_dead_replica_moves_its_pool_only(self):
        def split(results: list[Result]) -> dict[str, int]:
            out: dict[str, int] = {}
            for r in results:
                self.assertTrue(r.ok, r)
                out[self.replica_of(r)] = out.get(self.replica_of(r), 0) + 1
            return out

        chat_before = split(self.load("chat", 30_000))
        big_before = split(self.load("big", 40_000, clients=2, each=4))
        self.assertEqual(set(chat_before), set(POOLS["chat"]), chat_before)
        self.assertEqual(set(big_before), set(POOLS["big"]), big_before)

        self.stack.replica("b1").proc.kill()
        killed_at = time.monotonic()
        transition: list[str] = []
        marked = False
        i = 0
        while time.monotonic() - killed_at < DOWN_WAIT_S:
            res = self.send("big", tokens(128, 50_000 + i), max_tokens=2)
            i += 1
            transition.append(self.replica_of(res) if res.ok else f"error {res.status}")
            st = self.wasm_stats()
            if st.get("kvsteer_pool_big_down_b1") == 1 or st.get("kvsteer_pool_big_ejected_b1") == 1:
                marked = True
                break
            time.sleep(0.1)
        marked_after = time.monotonic() - killed_at
        self.assertTrue(marked, f"b1 neither down nor ejected {DOWN_WAIT_S} s after its SIGKILL")
        # The worker that did not see the failure learns it from shared data at its next tick.
        time.sleep(0.3)
        big_after = split(self.load("big", 60_000, clients=2, each=4))
        chat_after = split(self.load("chat", 70_000))
        st = self.wasm_stats()
        print(f"\nchat before {chat_before}, after {chat_after}; big before {big_before}, "
              f"after {big_after}; b1 marked after {marked_after:.2f} s, requests meanwhile "
              f"{transition}; down {st.get('kvsteer_pool_big_down_b1')}, ejected "
              f"{st.get('kvsteer_pool_big_ejected_b1')}", flush=True)
        self.assertTrue(all(t in POOLS["big"] for t in transition), transition)
        self.assertEqual(big_after, {"b0": 8}, big_after)
        self.assertEqual(set(chat_after), set(POOLS["chat"]), chat_after)
        for r in POOLS["chat"]:
            self.assertGreaterEqual(chat_after[r], 6, f"chat's split moved: {chat_after}")
        for r in POOLS["chat"]:
            self.assertEqual(st.get(f"kvsteer_pool_chat_down_{r}", 0), 0)
            self.assertEqual(st.get(f"kvsteer_pool_chat_ejected_{r}", 0), 0)


if __name__ == "__main__":
    unittest.main()
