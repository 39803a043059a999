"""The committed Envoy configurations (envoy/*.yaml): what docs/guide/envoy.md promises is in them, and Envoy
1.40 itself accepts each one with the built filter loaded and configured from its plugin JSON."""

from __future__ import annotations

import unittest

import envoy_config
import stack

DEST_HEADER = "x-gateway-destination-endpoint"


def connection_manager(doc: dict) -> dict:
    hcm = doc["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    return hcm


class EveryVariant(unittest.TestCase):
    def test_envoy_accepts_every_variant_with_the_built_filter(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        for variant in envoy_config.VARIANTS:
            with self.subTest(variant=variant):
                doc = envoy_config.load(variant)
                names = [n for n in envoy_config.clusters(doc) if n.startswith("kvsteer_feed_")]
                reps = [(f"r{i}", f"127.0.0.1:{18000 + i}") for i in range(len(names) or 4)]
                ok, out = stack.envoy_validate(envoy_config.rewrite(
                    doc, reps, 10000, 9901, str(wasm)))
                self.assertTrue(ok, out)

    def test_the_filter_refuses_a_bad_plugin_configuration(self):
        # Proof that the check above really runs the filter's configuration parser.
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        doc = envoy_config.rewrite(envoy_config.load("envoy"), [("r0", "127.0.0.1:18000")],
                                   10000, 9901, str(wasm), plugin_overrides={"no_such_field": 1})
        ok, out = stack.envoy_validate(doc)
        self.assertFalse(ok)
        self.assertIn("kvsteer", out)

    def test_shared_settings(self):
        for variant in envoy_config.VARIANTS:
            with self.subTest(variant=variant):
                doc = envoy_config.load(variant)
                hcm = connection_manager(doc)
                self.assertEqual(hcm["request_timeout"], "0s")
                self.assertEqual(hcm["stream_idle_timeout"], "600s")
                listener = doc["static_resources"]["listeners"][0]
                self.assertEqual(listener["per_connection_buffer_limit_bytes"], 16 * 1024 * 1024)
                for route in envoy_config.routes(doc):
                    self.assertEqual(route["route"]["timeout"], "0s")
                    self.assertEqual(route["request_body_buffer_limit"], 16 * 1024 * 1024)
                    retry_on = route["route"]["retry_policy"]["retry_on"].split(",")
                    self.assertIn("reset", retry_on)
                    self.assertIn("connect-failure", retry_on)
                    if route["route"].get("cluster") == "replicas":
                        # A replica failing fast costs the client nothing: the retry goes to the
                        # next host (docs/guide/envoy.md). Not on a one-host cluster_header route,
                        # where it would go back to the replica that failed.
                        self.assertIn("5xx", retry_on)
                        self.assertEqual(
                            route["route"]["retry_policy"]["retry_host_predicate"][0]["name"],
                            "envoy.retry_host_predicates.previous_hosts")
                    else:
                        self.assertNotIn("5xx", retry_on)
                main = envoy_config.clusters(doc)["replicas"]
                od = main["outlier_detection"]
                self.assertEqual(od["consecutive_5xx"], 5)
                self.assertEqual(od["base_ejection_time"], "10s")
                self.assertLessEqual(od["max_ejection_percent"], 50)
                hc = main["health_checks"][0]
                self.assertEqual(hc["http_health_check"]["path"], "/health")
                self.assertEqual(len(envoy_config.cluster_endpoints(main)), 4)
                self.assertEqual(doc["static_resources"]["listeners"][0]["address"]
                                 ["socket_address"]["address"], "127.0.0.1")


class KvsteerVariants(unittest.TestCase):
    def check_filter(self, doc: dict) -> dict:
        w = envoy_config.wasm_filter(doc)
        self.assertIsNotNone(w)
        self.assertIs(w["allow_on_headers_stop_iteration"], True)
        self.assertEqual(w["failure_policy"], "FAIL_OPEN")
        self.assertEqual(w["vm_config"]["runtime"], "envoy.wasm.runtime.v8")
        self.assertEqual(w["configuration"]["@type"],
                         "type.googleapis.com/google.protobuf.StringValue")
        names = [f["name"] for f in envoy_config.http_filters(doc)]
        self.assertEqual(names[-1], "envoy.filters.http.router")
        self.assertLess(names.index("envoy.filters.http.wasm"), names.index("envoy.filters.http.router"))
        pc = envoy_config.plugin_config(doc)
        clusters = envoy_config.clusters(doc)
        endpoints = envoy_config.cluster_endpoints(clusters["replicas"])
        self.assertEqual([r["endpoint"] for r in pc["replicas"]], endpoints)
        for r in pc["replicas"]:
            feed = clusters[r["feed_cluster"]]
            # A callout target must be a plain cluster, never ORIGINAL_DST.
            self.assertEqual(feed["type"], "STATIC")
            self.assertEqual(envoy_config.cluster_endpoints(feed), [r["endpoint"]])
        return pc

    def test_override_host_variant(self):
        doc = envoy_config.load("envoy")
        pc = self.check_filter(doc)
        self.assertEqual(pc["output"], "destination_header")
        self.assertEqual(pc["destination_header"], DEST_HEADER)
        lb = envoy_config.clusters(doc)["replicas"]["load_balancing_policy"]["policies"][0]
        cfg = lb["typed_extension_config"]
        self.assertEqual(cfg["name"], "envoy.load_balancing_policies.override_host")
        self.assertEqual(cfg["typed_config"]["override_host_sources"], [{"header": DEST_HEADER}])
        fb = cfg["typed_config"]["fallback_policy"]["policies"][0]["typed_extension_config"]
        self.assertEqual(fb["name"], "envoy.load_balancing_policies.round_robin")

    def test_cluster_header_variant(self):
        doc = envoy_config.load("envoy-cluster-header")
        pc = self.check_filter(doc)
        self.assertEqual(pc["output"], "cluster_header")
        clusters = envoy_config.clusters(doc)
        first, fallback = envoy_config.routes(doc)
        self.assertEqual(first["route"]["cluster_header"], pc["cluster_header"])
        self.assertEqual(fallback["route"]["cluster"], "replicas")
        for r in pc["replicas"]:
            self.assertEqual(envoy_config.cluster_endpoints(clusters[r["cluster"]]), [r["endpoint"]])

    def test_pools_variant(self):
        # envoy-pools.yaml: every pool's replicas in the one `replicas` cluster, in order, each with
        # a STATIC feed cluster; the stats_tags rule that makes the pool a Prometheus label
        # (e2e/test_pools.py sees it work).
        doc = envoy_config.load("envoy-pools")
        w = envoy_config.wasm_filter(doc)
        self.assertIs(w["allow_on_headers_stop_iteration"], True)
        self.assertEqual(w["failure_policy"], "FAIL_OPEN")
        pc = envoy_config.plugin_config(doc)
        self.assertNotIn("replicas", pc)
        self.assertEqual([p["name"] for p in pc["pools"]], ["chat", "big"])
        clusters = envoy_config.clusters(doc)
        members = [r for p in pc["pools"] for r in p["replicas"]]
        self.assertEqual([r["endpoint"] for r in members],
                         envoy_config.cluster_endpoints(clusters["replicas"]))
        for r in members:
            feed = clusters[r["feed_cluster"]]
            self.assertEqual(feed["type"], "STATIC")
            self.assertEqual(envoy_config.cluster_endpoints(feed), [r["endpoint"]])
        self.assertEqual(doc["stats_config"]["stats_tags"], [{
            "tag_name": "kvsteer_pool",
            "regex": r"^wasmcustom\.kvsteer_pool_(([a-z0-9-]+)_)"}])
        # The test fleet's split of replicas over the pools, as e2e/test_pools.py asks for it.
        reps = [(f"r{i}", f"127.0.0.1:{18000 + i}") for i in range(5)]
        fitted = envoy_config.plugin_config(envoy_config.rewrite(
            doc, reps, 10000, 9901, "x.wasm", pools={"chat": ["r4", "r0"], "big": ["r1", "r2", "r3"]}))
        self.assertEqual([[r["name"] for r in p["replicas"]] for p in fitted["pools"]],
                         [["r4", "r0"], ["r1", "r2", "r3"]])
        self.assertEqual(fitted["pools"][1]["routing"],
                         {"kv_time": {"profile": "llama-3.1-70b-h100-tp4"}})
        with self.assertRaises(ValueError):
            envoy_config.rewrite(doc, reps, 10000, 9901, "x.wasm", pools={"chat": ["r0"]})


class Peers(unittest.TestCase):
    def test_peers_have_no_filter_and_their_balancer(self):
        want = {"envoy-round-robin": "ROUND_ROBIN", "envoy-least-request": "LEAST_REQUEST",
                "envoy-ring-hash": "RING_HASH"}
        for variant, policy in want.items():
            doc = envoy_config.load(variant)
            self.assertFalse(envoy_config.uses_wasm(doc))
            self.assertEqual(envoy_config.clusters(doc)["replicas"]["lb_policy"], policy)
        (route,) = envoy_config.routes(envoy_config.load("envoy-ring-hash"))
        self.assertEqual(route["route"]["hash_policy"], [{"header": {"header_name": "x-session-id"}}])


if __name__ == "__main__":
    unittest.main()
