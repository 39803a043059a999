"""Real engines, real text, through a real nginx: e2e/test_real_vllm_text.py's measurement with nginx
(2 workers, Kong's ngx_wasm_module, `nginx/nginx.conf` rendered as e2e/test_nginx_real.py does) in
front instead of Envoy. Run by `scripts/e2e-nginx --vllm` (opt-in twice: nginx with the module, and
vLLM installed by scripts/vllm-install); skipped without NGINX_BIN or KVSTEER_E2E_VLLM=1.

Two vLLM 0.32 CPU engines serve a tiny random-weight Llama with Llama 3.1's tokenizer (the model
folder made at test time, as test_real_vllm_text.py makes it, from tokenizer/scripts/hf-fetch's
files; skipped without them unless `CI=true`), a `kvsteer-feed --model-dir` beside each. The filter's
configuration is the shipped one with the engines as replicas (`feed_address`: the adapter's
`IP:port`), `kv_load` at vLLM's block size (32, as the Envoy test), and the `tokenizer` section
fetching the bundle from the first adapter. Two additions measure, not route: `x-nginx-worker` (the
worker's pid) and `x-kvsteer-replica` (`$upstream_addr`: the engine nginx proxied to).

The test waits until both workers have logged the bundle loaded (with the digest computed here from
the files), then sends 12 chat conversations of three turns, every request on a fresh connection (the
kernel picks the worker: `reuseport`). Half the first turns go through nginx, the other half straight
to the engine holding fewer conversations (so both engines hold some, and a follow-up of a first
turn nginx never saw can only find its engine by the adapter's feed and the filter's exact token
ids). It checks that at least 90% of the follow-ups land on their first turn's engine and are
served from its prefix cache (`cached_tokens` > 0), and 90% of each kind apart: through a worker new
to the conversation (another routed part of it; at least 4 of them), through one that had, and the
first follow-ups of the first turns nginx never saw; and that vLLM's own prefix-cache hit counters
add up to the answers' cached tokens. It prints the figures (per kind of worker, the cached share,
vLLM's counters).
"""

from __future__ import annotations

import hashlib
import re
import time
import unittest

from client import cached_tokens
from stack import free_ports
from test_nginx_real import NGINX_BIN, Nginx, render, sub1, wait_port
from test_nginx_text import chat
from test_real_vllm import BLOCK, ENABLED, Engine, VllmCase, http, log, prom, wait_until
from test_real_vllm_text import ASSISTANT, MODEL, start_text_fleet, system_prompt, user_text

WORKERS = 2
CONVERSATIONS = 12
FOLLOW_UPS = 2
FLOOR = 0.9
LOAD_TIMEOUT_S = 90
PEER_SETTLE_S = 0.3  # three ticks: the relay in shared data reaches the other worker


def render_for_engines(workdir, engines: list[Engine], listen: int, plugin: dict):
    """nginx.conf for these engines: the plugin's replicas are the engines with their adapters'
    feeds, the `replicas` upstream group (nginx's default and fallback) holds the engines only, and
    answers name the engine (`x-kvsteer-replica: $upstream_addr`)."""
    conf = render(workdir, "nginx-vllm", [e.port for e in engines], listen, plugin=plugin)
    text = conf.read_text()
    text, n = re.subn(r"\n\s*server 127\.0\.0\.1:1800\d [^\n]*;", "", text)
    if n != 4 - len(engines):
        raise AssertionError(f"nginx.conf: {n} upstream servers left over, not {4 - len(engines)}")
    text = sub1(r"(add_header x-nginx-worker \$pid always;)",
                r"\1\n            add_header x-kvsteer-replica $upstream_addr always;", text)
    conf.write_text(text)
    return conf


@unittest.skipUnless(ENABLED and NGINX_BIN,
                     "real vLLM behind nginx: run scripts/e2e-nginx --vllm (sets NGINX_BIN and "
                     "KVSTEER_E2E_VLLM=1; vLLM from scripts/vllm-install)")
class NginxRealVllmText(VllmCase):
    timings: dict[str, float] = {}

    @classmethod
    def setUpClass(cls) -> None:
        s, cls.sha256 = start_text_fleet(cls.timings)
        cls.stack = s
        try:
            t1 = time.monotonic()
            cls.port = free_ports(1)[0]
            fetch = {"cluster": f"127.0.0.1:{s.engines[0].adapter_port}", "sha256": cls.sha256,
                     "model": MODEL}
            plugin = {
                "replicas": [{"name": e.name, "endpoint": e.endpoint,
                              "feed_address": f"127.0.0.1:{e.adapter_port}"} for e in s.engines],
                "routing": {"policy": "kv_load", "block_size": BLOCK},
                "tokenizer": {"huggingface": {"fetch": fetch}},
            }
            conf = render_for_engines(s.workdir, s.engines, cls.port, plugin)
            cls.nginx = Nginx(s, "nginx-vllm", conf)
            cls.nginx.wait_configured(WORKERS)
            wait_port(cls.port)
            cls.timings["nginx_start_s"] = time.monotonic() - t1
            log(f"nginx ready in {cls.timings['nginx_start_s']:.1f} s ({WORKERS} workers)")
        except BaseException:
            s.close()
            raise

    # -- helpers --------------------------------------------------------------------------------

    @property
    def engines(self) -> list[Engine]:
        return self.stack.engines

    def bundle_lines(self, what: str) -> list[str]:
        return [ln for ln in self.nginx.text().splitlines()
                if "tokenizer bundle from" in ln and what in ln]

    def by_endpoint(self, ep: str) -> Engine:
        for e in self.engines:
            if e.endpoint == ep:
                return e
        raise AssertionError(f"answer from unknown upstream {ep!r}")

    def polls(self, e: Engine) -> float:
        """Feed answers `e`'s adapter has given (to either worker)."""
        return prom(e.adapter_metrics(), "kvsteer_feed_polls_total")

    def settle(self) -> None:
        """Until every adapter has answered two more feed polls, plus ticks for the relay."""
        n = {e.name: self.polls(e) for e in self.engines}
        for e in self.engines:
            wait_until(f"two more polls of {e.name}'s feed",
                       lambda e=e: self.polls(e) >= n[e.name] + 2, 10, 0.05)
        time.sleep(PEER_SETTLE_S)

    def stored(self, e: Engine) -> float:
        return prom(e.adapter_metrics(), "kvsteer_feed_blocks_total", op="stored")

    def prefix_counters(self) -> dict[str, tuple[float, float]]:
        out = {}
        for e in self.engines:
            m = e.engine_metrics()
            out[e.name] = (prom(m, "vllm:prefix_cache_hits_total"),
                           prom(m, "vllm:prefix_cache_queries_total"))
        return out

    def through_nginx(self, messages: list[dict]) -> tuple[dict, Engine, str]:
        time.sleep(PEER_SETTLE_S)
        doc, upstream, worker = chat(self.port, messages, model="tiny", max_tokens=4)
        self.assertTrue(worker, "answered by an nginx worker")
        return doc, self.by_endpoint(upstream), worker

    # -- the test --------------------------------------------------------------------------------

    def test_text_follow_ups_find_their_engines_cache_through_nginx(self):
        t0 = time.monotonic()
        wait_until(f"{WORKERS} workers load the bundle",
                   lambda: len(self.bundle_lines("loaded (")) >= WORKERS, LOAD_TIMEOUT_S, 0.2)
        loaded = self.bundle_lines("loaded (")
        self.timings["bundle_loaded_s"] = time.monotonic() - t0
        self.assertEqual(len(loaded), WORKERS, loaded)
        self.assertTrue(all(self.sha256 in ln and f"model {MODEL}" in ln for ln in loaded), loaded)
        self.assertEqual(self.bundle_lines("refused"), [])
        for e in self.engines:
            self.assertEqual(hashlib.sha256(http(e.adapter_url + "/kvsteer/tokenizer", timeout=20))
                             .hexdigest(), self.sha256, e.name)
        t1 = time.monotonic()

        convos = []
        since = {e.name: self.stored(e) for e in self.engines}
        for c in range(CONVERSATIONS):
            messages = [{"role": "system", "content": system_prompt(c)},
                        {"role": "user", "content": user_text(c, 0)}]
            if c % 2 == 0:
                doc, home, worker = self.through_nginx(messages)
                workers = {worker}
            else:
                # Another client's traffic, straight to the engine with fewer conversations.
                home = min(self.engines, key=lambda e: sum(cv["home"] is e for cv in convos))
                doc, _, _ = chat(home.port, messages, model="tiny", max_tokens=4)
                workers = set()
            messages.append({"role": "assistant", "content": ASSISTANT})
            convos.append({"messages": messages, "home": home, "workers": workers,
                           "prompt": doc["usage"]["prompt_tokens"]})
        firsts = [cv["prompt"] for cv in convos]
        self.assertGreater(min(firsts), 4 * BLOCK, f"first turns span several blocks: {firsts}")
        for e in self.engines:
            n = sum(cv["prompt"] // BLOCK for cv in convos if cv["home"] is e)
            wait_until(f"{e.name}'s adapter stores its first turns' {n} blocks",
                       lambda e=e, n=n: self.stored(e) >= since[e.name] + n, 10)
        self.settle()
        counters0 = self.prefix_counters()

        total = same = hits = full = 0
        # [on the first turn's engine and served from its cache, follow-ups]: through a worker new
        # to the conversation (another had routed part of it), through one that had, and the first
        # follow-ups of first turns nginx never saw (no worker had routed any of it).
        new, seen, direct = [0, 0], [0, 0], [0, 0]
        cached_sum = prompt_sum = 0
        for turn in range(1, FOLLOW_UPS + 1):
            for c, cv in enumerate(convos):
                cv["messages"].append({"role": "user", "content": user_text(c, turn)})
                doc, engine, worker = self.through_nginx(cv["messages"])
                cv["messages"].append({"role": "assistant", "content": ASSISTANT})
                cached = cached_tokens(doc)
                expected = cv["prompt"] // BLOCK * BLOCK
                cv["prompt"] = doc["usage"]["prompt_tokens"]
                ok = engine is cv["home"] and cached > 0
                group = (direct if not cv["workers"] else seen if worker in cv["workers"]
                         else new)
                cv["workers"].add(worker)
                group[0] += ok
                group[1] += 1
                total += 1
                same += engine is cv["home"]
                hits += ok
                full += cached == expected
                cached_sum += cached
                prompt_sum += cv["prompt"]
                log(f"conversation {c} turn {turn}: {engine.name} (first turn {cv['home'].name}), "
                    f"worker {worker}, prompt {cv['prompt']}, cached {cached} (previous turn's full "
                    f"blocks {expected})")
            self.settle()
        counters1 = self.prefix_counters()
        self.timings["conversations_s"] = time.monotonic() - t1
        engine_hits = {n: (counters1[n][0] - counters0[n][0], counters1[n][1] - counters0[n][1])
                       for n in counters1}
        homes = {e.name: sum(cv["home"] is e for cv in convos) for e in self.engines}
        load_ms = sorted(int(ln.rsplit(" in ", 1)[1].split()[0]) for ln in loaded)
        print(f"\nreal text through nginx, {WORKERS} workers ({len(loaded)} loaded the fetched "
              f"bundle, check and parse {load_ms} ms, all within "
              f"{self.timings['bundle_loaded_s']:.1f} s of the workers' configuration), "
              f"{CONVERSATIONS} conversations (first turns {min(firsts)}-{max(firsts)} tokens, "
              f"homes {homes}, half sent straight to an engine), {total} follow-ups: on their first "
              f"turn's engine {same}/{total}, there and served from its cache {hits}/{total} "
              f"({new[0]}/{new[1]} through a worker new to the conversation, {seen[0]}/{seen[1]} "
              f"through one that had routed part of it; {direct[0]}/{direct[1]} of the first "
              f"follow-ups of first turns nginx never saw); cached exactly the previous turn's full "
              f"blocks {full}/{total}; cached share of the follow-ups' prompt tokens "
              f"{cached_sum}/{prompt_sum} = {cached_sum / prompt_sum:.1%}; vLLM prefix-cache "
              f"hits/queries over the follow-ups "
              + ", ".join(f"{n} {int(h)}/{int(q)}" for n, (h, q) in engine_hits.items()), flush=True)
        self.assertGreaterEqual(same / total, FLOOR, f"{same}/{total} on their first turn's engine")
        self.assertGreaterEqual(hits / total, FLOOR, f"{hits}/{total} served from its cache")
        self.assertGreaterEqual(new[1], 4, f"too few follow-ups through a new worker: {new}")
        self.assertGreaterEqual(new[0], FLOOR * new[1], f"new worker: {new}")
        self.assertGreaterEqual(seen[0], FLOOR * seen[1], f"same worker: {seen}")
        self.assertGreaterEqual(direct[0], FLOOR * direct[1], f"first turns nginx never saw: {direct}")
        self.assertEqual(sum(h for h, _ in engine_hits.values()), cached_sum,
                         "vLLM's counters agree with the answers' cached_tokens")
        self.assertEqual(len(self.bundle_lines("loaded (")), WORKERS)


if __name__ == "__main__":
    unittest.main()
