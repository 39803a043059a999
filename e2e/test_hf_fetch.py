"""End-to-end: a Hugging Face tokenizer bundle fetched at run time (`tokenizer.huggingface.fetch`,
docs/design/tokenizer.md) through a real Envoy with 4 worker threads.

The bundle is Llama 3.1's (`tokenizer/scripts/hf-fetch` puts it in target/tokenizers/llama3_1). It is
served by the feed adapter (`kvsteer-feed --model-dir DIR --model-name llama3_1`, GET
/kvsteer/tokenizer) when its binary is built, else by a small HTTP server this test starts on
127.0.0.1 with the same framing. The 4 simulated replicas tokenize with the same bundle
(`kvsteer-sim --huggingface DIR`: its own chat template, as an engine serving the model does), so
their feeds report the blocks of the ids the filter computes once its bundle is loaded.

- `FetchedBundle`: the configuration names the bundle's SHA-256 (computed here from the files, not
  read from the server) and model. Every worker VM (4, plus Envoy's main thread's) fetches and loads
  its own copy (one `loaded` log line each); then text chats on fresh connections keep to their
  first turn's replica and are served from its cache. Printed: the affinity and cached tokens.
- `BadDigest`: the same with another digest: every VM refuses the bundle with a log line naming the
  digest mismatch, `kvsteer_tokenizer_ready` stays 0, and chats are still routed (approximately).

Without the bundle files the test is skipped, saying so, unless `CI=true` (then it fails).
Run by scripts/e2e (`E2E_NO_BUILD=1 scripts/e2e test_hf_fetch`); about a minute on 2 cores.
"""

from __future__ import annotations

import hashlib
import http.server
import os
import threading
import time
import unittest
from pathlib import Path

from client import Client, cached_tokens, chat_completion, prose
from stack import Stack, free_ports, target_dir, wait_http
from test_envoy import FEED_SETTLE_S, PEER_SETTLE_S, REPLICAS, TIME_SCALE, stat_sum

REPO = Path(__file__).resolve().parent.parent
WORKERS = 4
MODEL = "llama3_1"
CLUSTER = "kvsteer_tokenizer"
CONVERSATIONS = 8
FOLLOW_UPS = 2
AFFINITY_FLOOR = 0.9
LOAD_TIMEOUT_S = 60


def bundle_dir() -> Path:
    base = os.environ.get("KVSTEER_HF_DIR")
    return (Path(base) if base else REPO / "target" / "tokenizers") / MODEL


def files_or_skip() -> tuple[bytes, bytes]:
    d = bundle_dir()
    try:
        return (d / "tokenizer.json").read_bytes(), (d / "tokenizer_config.json").read_bytes()
    except OSError:
        msg = f"no Llama 3.1 bundle in {d} (run tokenizer/scripts/hf-fetch)"
        if os.environ.get("CI") == "true":
            raise AssertionError(msg)
        print(f"\ntest_hf_fetch: {msg}: skipped", flush=True)
        raise unittest.SkipTest(msg)


def frame(model: str, tokenizer_json: bytes, config: bytes) -> bytes:
    """The bundle as kvsteer_core::bundle frames it (core/src/bundle.rs)."""
    head = (f"kvsteer-tokenizer-bundle 1\nmodel {model}\ntokenizer.json {len(tokenizer_json)}\n"
            f"tokenizer_config.json {len(config)}\n\n")
    return head.encode() + tokenizer_json + config


def serve_bundle(stack: Stack, body: bytes) -> str:
    """Starts a server of the bundle; its `IP:port`. kvsteer-feed when built, else a static one."""
    feed = Path(os.environ.get("KVSTEER_FEED", target_dir() / "release" / "kvsteer-feed"))
    if feed.exists():
        http_port, zmq_port = free_ports(2)
        stack.spawn("kvsteer-feed", [str(feed), "--listen", f"127.0.0.1:{http_port}",
                                     "--zmq-endpoint", f"tcp://127.0.0.1:{zmq_port}",
                                     "--model-dir", str(bundle_dir()), "--model-name", MODEL])
        wait_http(f"http://127.0.0.1:{http_port}/health", 20)
        c = Client("127.0.0.1", http_port)
        try:
            status, _, served = c.request("GET", "/kvsteer/tokenizer", b"", {})
        finally:
            c.close()
        assert status == 200 and served == body, "kvsteer-feed frames the bundle as core does"
        stack.say(f"bundle served by kvsteer-feed on 127.0.0.1:{http_port}")
        stack.bundle_server = "kvsteer-feed --model-dir"
        return f"127.0.0.1:{http_port}"

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            self.send_response(200)
            self.send_header("content-type", "application/vnd.kvsteer.tokenizer-bundle")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    stack.bundle_server = "a static server started by the test"
    stack.say(f"bundle served by a static server on 127.0.0.1:{server.server_port} "
              f"(no kvsteer-feed binary at {feed})")
    return f"127.0.0.1:{server.server_port}"


def start(sha256: str) -> Stack:
    json_bytes, config = files_or_skip()
    body = frame(MODEL, json_bytes, config)
    s = Stack()
    try:
        where = serve_bundle(s, body)
        s.start_replicas(REPLICAS, extra=["--time-scale", TIME_SCALE,
                                          "--huggingface", str(bundle_dir())])
        fetch = {"cluster": CLUSTER, "sha256": sha256, "model": MODEL}
        s.start_envoy("envoy", concurrency=WORKERS,
                      plugin_overrides={"tokenizer": {"huggingface": {"fetch": fetch}}},
                      extra_clusters={CLUSTER: where})
    except BaseException:
        s.close()
        raise
    return s


def bundle_lines(stack: Stack, what: str) -> list[str]:
    return [ln for text in stack.envoy_logs() for ln in text.splitlines()
            if "tokenizer bundle from" in ln and what in ln]


def wait_lines(stack: Stack, what: str, n: int) -> list[str]:
    deadline = time.monotonic() + LOAD_TIMEOUT_S
    while len(bundle_lines(stack, what)) < n and time.monotonic() < deadline:
        time.sleep(0.2)
    return bundle_lines(stack, what)


class FetchedBundle(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        json_bytes, config = files_or_skip()
        cls.sha256 = hashlib.sha256(frame(MODEL, json_bytes, config)).hexdigest()
        cls.stack = start(cls.sha256)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_every_worker_loads_the_bundle_and_follow_ups_keep_their_replica(self) -> None:
        t0 = time.monotonic()
        loaded = wait_lines(self.stack, "loaded (", WORKERS + 1)
        waited = time.monotonic() - t0
        self.assertGreaterEqual(len(loaded), WORKERS + 1, self.stack.envoy_logs()[-1][-3000:])
        self.assertTrue(all(self.sha256 in ln and f"model {MODEL}" in ln for ln in loaded), loaded)
        self.assertEqual(bundle_lines(self.stack, "refused"), [])
        convos = []
        for c in range(CONVERSATIONS):
            messages = [{"role": "system", "content": prose(3_000 + c, 600)},
                        {"role": "user", "content": prose(c, 40)}]
            doc = chat_completion(self.stack.listen_port, messages, model=MODEL)
            messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
            convos.append((messages, doc["_replica"]))
            time.sleep(PEER_SETTLE_S)
        time.sleep(FEED_SETTLE_S)
        total = same = hits = 0
        for turn in range(FOLLOW_UPS):
            for c, (messages, home) in enumerate(convos):
                messages.append({"role": "user", "content": prose(100 * c + turn + 1, 30)})
                doc = chat_completion(self.stack.listen_port, messages, model=MODEL)
                messages.append({"role": "assistant", "content": doc["choices"][0]["message"]["content"]})
                total += 1
                same += doc["_replica"] == home
                hits += cached_tokens(doc) > 0
                time.sleep(PEER_SETTLE_S)
        exact = stat_sum(self.stack, "kvsteer_tokenizer_exact")
        load_ms = sorted(int(ln.rsplit(" in ", 1)[1].split()[0]) for ln in loaded)
        print(f"\nfetched Llama 3.1 bundle from {self.stack.bundle_server}, Envoy --concurrency "
              f"{WORKERS}: {len(loaded)} VMs loaded it (check and parse {load_ms} ms; all loaded "
              f"{waited:.1f} s after Envoy was ready); follow-ups on their first turn's replica {same}/{total}, "
              f"served from its cache {hits}/{total}; kvsteer_tokenizer_exact {exact}", flush=True)
        self.assertGreaterEqual(same / total, AFFINITY_FLOOR)
        self.assertGreaterEqual(hits / total, AFFINITY_FLOOR)
        self.assertGreaterEqual(exact, CONVERSATIONS * (1 + FOLLOW_UPS))
        self.assertEqual(stat_sum(self.stack, "kvsteer_tokenizer_bundle_refused"), 0)


class BadDigest(unittest.TestCase):
    stack: Stack

    @classmethod
    def setUpClass(cls) -> None:
        cls.stack = start("0" * 64)

    @classmethod
    def tearDownClass(cls) -> None:
        cls.stack.close_checked()

    def test_a_bundle_with_another_digest_is_refused_and_routing_continues(self) -> None:
        refused = wait_lines(self.stack, "refused: digest mismatch", WORKERS + 1)
        self.assertGreaterEqual(len(refused), WORKERS + 1, self.stack.envoy_logs()[-1][-3000:])
        routed = 0
        for c in range(8):
            doc = chat_completion(self.stack.listen_port, [{"role": "user", "content": prose(c, 50)}],
                                  model=MODEL)
            routed += bool(self.stack.by_sim_name(doc["_replica"]))
        print(f"\nbundle with another digest: {len(refused)} refusals logged, e.g. "
              f"{refused[0].split('kvsteer: ')[-1][:160]!r}; {routed}/8 chats routed", flush=True)
        self.assertEqual(routed, 8)
        self.assertEqual(stat_sum(self.stack, "kvsteer_tokenizer_exact"), 0)
        self.assertGreaterEqual(stat_sum(self.stack, "kvsteer_tokenizer_bundle_refused"), WORKERS + 1)
        self.assertEqual(stat_sum(self.stack, "kvsteer_tokenizer_ready"), 0)
        self.assertEqual(bundle_lines(self.stack, "loaded ("), [])


if __name__ == "__main__":
    unittest.main()
