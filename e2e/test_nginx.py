"""nginx/nginx.conf and nginx/nginx-pools.conf, checked without nginx: nginx with ngx_wasm_module is in no registry CI can reach,
so the configuration is read here with a small tokenizer, its pieces are cross-checked, and its
plugin JSON is handed to the built filter (loaded by Envoy in validate mode: configuration parsing
is the same code whatever the host). host-test emulates the nginx host semantics themselves."""

from __future__ import annotations

import json
import re
import unittest
from pathlib import Path

import envoy_config
import stack

CONF = Path(__file__).resolve().parent.parent / "nginx" / "nginx.conf"
POOLS_CONF = CONF.with_name("nginx-pools.conf")


def tokens(text: str) -> list[str]:
    """nginx tokens: words, quoted strings (quotes removed), `{`, `}`, `;`; comments dropped."""
    out, i, n = [], 0, len(text)
    while i < n:
        c = text[i]
        if c.isspace():
            i += 1
        elif c == "#":
            while i < n and text[i] != "\n":
                i += 1
        elif c in "{};":
            out.append(c)
            i += 1
        elif c in "'\"":
            j = text.index(c, i + 1)
            out.append(text[i + 1:j])
            i = j + 1
        else:
            m = re.match(r"[^\s{};'\"]+", text[i:])
            out.append(m.group(0))
            i += len(m.group(0))
    return out


def parse(toks: list[str]) -> list:
    """A tree of (directive, args, children-or-None)."""
    stack_: list[list] = [[]]
    cur: list[str] = []
    for t in toks:
        if t == ";":
            stack_[-1].append((cur[0], cur[1:], None))
            cur = []
        elif t == "{":
            block: list = []
            stack_[-1].append((cur[0], cur[1:], block))
            stack_.append(block)
            cur = []
        elif t == "}":
            stack_.pop()
        else:
            cur.append(t)
    assert len(stack_) == 1 and not cur, "unbalanced configuration"
    return stack_[0]


def find(tree: list, name: str) -> list[tuple]:
    return [d for d in tree if d[0] == name]


def one(tree: list, name: str) -> tuple:
    (d,) = find(tree, name)
    return d


class NginxConf(unittest.TestCase):
    conf = CONF

    @classmethod
    def setUpClass(cls) -> None:
        cls.tree = parse(tokens(cls.conf.read_text()))
        cls.http = one(cls.tree, "http")[2]
        cls.server = one(cls.http, "server")[2]
        cls.location = next(d[2] for d in find(cls.server, "location") if d[1] == ["/v1/"])
        cls.plugin = json.loads(one(cls.location, "proxy_wasm")[1][1])
        # Every replica entry, a pooled configuration's in pool order.
        cls.replicas = cls.plugin.get("replicas") or [
            r for p in cls.plugin["pools"] for r in p["replicas"]]

    def test_wasm_block_loads_the_module_with_shared_memory_and_a_resolver(self):
        wasm = one(self.tree, "wasm")[2]
        name, path = one(wasm, "module")[1]
        self.assertEqual(path, "target/wasm32-wasip1/release/kvsteer_filter.wasm")
        self.assertEqual(one(self.location, "proxy_wasm")[1][0], name)
        # kvsteer's shared-data keys have no `namespace/` prefix: the default zone must exist.
        self.assertEqual(one(wasm, "shm_kv")[1][0], "*")
        self.assertTrue(one(wasm, "resolver")[1])

    def test_the_variable_is_declared_before_the_filter_and_used_by_proxy_pass(self):
        var = self.plugin["nginx_variable"]
        # Server-level `set`: changeable, and assigned before the location phases the filter runs in.
        name, default = one(self.server, "set")[1]
        self.assertEqual(name, "$" + var)
        self.assertEqual(default, one(self.http, "upstream")[1][0])
        self.assertEqual(one(self.location, "proxy_pass")[1], [f"http://${var}"])
        self.assertEqual(self.plugin["output"], "nginx_variable")

    def test_bodies_stay_in_memory_and_streams_unbuffered(self):
        self.assertEqual(one(self.http, "client_body_buffer_size")[1],
                         one(self.http, "client_max_body_size")[1])
        self.assertEqual(one(self.location, "proxy_buffering")[1], ["off"])
        self.assertEqual(one(self.location, "proxy_http_version")[1], ["1.1"])

    def test_replicas_agree_with_the_upstream_group(self):
        servers = [d[1][0] for d in find(one(self.http, "upstream")[2], "server")]
        self.assertEqual([r["endpoint"] for r in self.replicas], servers)
        for r in self.replicas:
            self.assertEqual(r["feed_address"], r["endpoint"])
            self.assertNotIn("feed_cluster", r)

    def test_the_filter_accepts_the_plugin_configuration(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        doc = envoy_config.rewrite(envoy_config.load("envoy"), [("r0", "127.0.0.1:18000")],
                                   10000, 9901, str(wasm))
        envoy_config.wasm_filter(doc)["configuration"]["value"] = json.dumps(self.plugin)
        ok, out = stack.envoy_validate(doc)
        self.assertTrue(ok, out)
        # And the check can fail: nginx mode without feed addresses is refused.
        bad = json.loads(json.dumps(self.plugin))
        for r in bad.get("replicas") or [r for p in bad["pools"] for r in p["replicas"]]:
            del r["feed_address"]
        envoy_config.wasm_filter(doc)["configuration"]["value"] = json.dumps(bad)
        ok, _ = stack.envoy_validate(doc)
        self.assertFalse(ok)


class NginxPoolsConf(NginxConf):
    """nginx/nginx-pools.conf: nginx.conf with two pools; every check above, and the pools'."""

    conf = POOLS_CONF

    def test_two_pools_and_nothing_else_differs(self):
        self.assertNotIn("replicas", self.plugin)
        self.assertEqual([(p["name"], p["models"]) for p in self.plugin["pools"]],
                         [("chat", ["llama-3.1-8b-instruct"]), ("big", ["llama-3.1-70b-instruct"])])
        plain = parse(tokens(CONF.read_text()))

        def without_plugin_and_pid(tree: list) -> list:
            return [(d, a if d != "proxy_wasm" else a[:1],
                     without_plugin_and_pid(c) if c is not None else None)
                    for d, a, c in tree if d != "pid"]

        self.assertEqual(without_plugin_and_pid(self.tree), without_plugin_and_pid(plain))


if __name__ == "__main__":
    unittest.main()
