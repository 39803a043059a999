"""The Istio manifests (istio/*.yaml): every document parses and is a well-formed Kubernetes object, the
pieces agree with each other (names, ports, headers, clusters), and the Envoy configuration they embed
is accepted by Envoy 1.40 with the built filter configured from the manifests' own plugin JSON. No
cluster runs here: what Istio itself would do with them is documented in docs/guide/istio.md, not tested."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import unittest
from pathlib import Path

import yaml

import envoy_config
import stack

ISTIO = Path(__file__).resolve().parent.parent / "istio"
KNOWN = {
    ("v1", "Service"), ("apps/v1", "StatefulSet"),
    ("networking.istio.io/v1", "Gateway"), ("networking.istio.io/v1", "VirtualService"),
    ("networking.istio.io/v1", "DestinationRule"), ("security.istio.io/v1", "PeerAuthentication"),
    ("networking.istio.io/v1alpha3", "EnvoyFilter"), ("extensions.istio.io/v1alpha1", "WasmPlugin"),
}


def documents() -> dict[str, list[dict]]:
    out = {}
    for path in sorted(ISTIO.glob("*.yaml")):
        with open(path) as f:
            out[path.name] = [d for d in yaml.safe_load_all(f) if d is not None]
    return out


def find(kind: str, name: str) -> dict:
    for docs in documents().values():
        for d in docs:
            if d["kind"] == kind and d["metadata"]["name"] == name:
                return d
    raise KeyError(f"{kind}/{name}")


def patches(ef: dict, apply_to: str) -> list[dict]:
    return [p for p in ef["spec"]["configPatches"] if p["applyTo"] == apply_to]


def wasm_config(name: str = "kvsteer-filter") -> dict:
    (ext,) = patches(find("EnvoyFilter", name), "EXTENSION_CONFIG")
    return ext["patch"]["value"]["typed_config"]["config"]


def plugin_json() -> dict:
    return json.loads(wasm_config()["configuration"]["value"])


class Manifests(unittest.TestCase):
    def test_every_document_is_a_known_well_formed_object(self):
        docs = documents()
        self.assertGreaterEqual(set(docs), {"vllm.yaml", "gateway.yaml", "kvsteer-cluster.yaml",
                                            "kvsteer-filter.yaml", "wasmplugin.yaml"})
        for name, ds in docs.items():
            self.assertTrue(ds, f"{name} is empty")
            for d in ds:
                self.assertIn((d.get("apiVersion"), d.get("kind")), KNOWN, name)
                self.assertTrue(d["metadata"]["name"], name)
                self.assertIn(d["metadata"]["namespace"], ("llm", "istio-system"), name)
                self.assertIsInstance(d.get("spec"), dict, name)

    def test_statefulset_and_services_agree(self):
        sts = find("StatefulSet", "vllm")
        headless = find("Service", sts["spec"]["serviceName"])
        self.assertEqual(headless["spec"]["clusterIP"], "None")
        labels = sts["spec"]["template"]["metadata"]["labels"]
        self.assertEqual(sts["spec"]["selector"]["matchLabels"], labels)
        for svc in (headless, find("Service", "vllm")):
            self.assertEqual(svc["spec"]["selector"], labels)
        ports = {p["containerPort"] for c in sts["spec"]["template"]["spec"]["containers"]
                 for p in c["ports"]}
        self.assertEqual({p["targetPort"] for p in headless["spec"]["ports"]}, ports)

    def test_filter_config_matches_the_fleet_and_the_clusters(self):
        sts = find("StatefulSet", "vllm")
        ns = sts["metadata"]["namespace"]
        headless = sts["spec"]["serviceName"]
        pc = plugin_json()
        names = [f"vllm-{i}" for i in range(sts["spec"]["replicas"])]
        self.assertEqual([r["name"] for r in pc["replicas"]], names)
        added = {p["patch"]["value"]["name"]: p["patch"]["value"]
                 for p in patches(find("EnvoyFilter", "kvsteer-cluster"), "CLUSTER")
                 if p["patch"]["operation"] == "ADD"}
        for r in pc["replicas"]:
            feed = added[r["feed_cluster"]]
            self.assertIn(feed["type"], ("STRICT_DNS", "STATIC"), "never ORIGINAL_DST")
            (ep,) = feed["load_assignment"]["endpoints"][0]["lb_endpoints"]
            sa = ep["endpoint"]["address"]["socket_address"]
            self.assertEqual(sa["address"], f"{r['name']}.{headless}.{ns}.svc.cluster.local")
            self.assertEqual(r["feed_authority"], f"{sa['address']}:{sa['port_value']}")
            self.assertEqual(r["endpoint"].rsplit(":", 1)[1], "8000")

    def test_override_host_is_merged_into_the_service_cluster(self):
        (merge,) = [p for p in patches(find("EnvoyFilter", "kvsteer-cluster"), "CLUSTER")
                    if p["patch"]["operation"] == "MERGE"]
        svc = find("Service", "vllm")
        self.assertEqual(merge["match"]["cluster"]["service"],
                         f"{svc['metadata']['name']}.{svc['metadata']['namespace']}.svc.cluster.local")
        self.assertEqual(merge["match"]["cluster"]["portNumber"], svc["spec"]["ports"][0]["port"])
        lb = merge["patch"]["value"]["load_balancing_policy"]["policies"][0]["typed_extension_config"]
        self.assertEqual(lb["name"], "envoy.load_balancing_policies.override_host")
        self.assertEqual(lb["typed_config"]["override_host_sources"],
                         [{"header": plugin_json()["destination_header"]}])

    def test_retries_and_outlier_detection_match_envoy_yaml(self):
        vs = find("VirtualService", "vllm")
        (route,) = vs["spec"]["http"]
        retry_on = route["retries"]["retryOn"].split(",")
        doc = envoy_config.load("envoy")
        (envoy_route,) = envoy_config.routes(doc)
        self.assertEqual(sorted(retry_on),
                         sorted(envoy_route["route"]["retry_policy"]["retry_on"].split(",")))
        self.assertIn("5xx", retry_on)
        self.assertEqual(route["retries"]["attempts"],
                         envoy_route["route"]["retry_policy"]["num_retries"])
        od = find("DestinationRule", "vllm")["spec"]["trafficPolicy"]["outlierDetection"]
        envoy_od = envoy_config.clusters(doc)["replicas"]["outlier_detection"]
        self.assertEqual(od["consecutive5xxErrors"], envoy_od["consecutive_5xx"])
        self.assertEqual(od["baseEjectionTime"], envoy_od["base_ejection_time"])
        self.assertEqual(od["interval"], envoy_od["interval"])
        self.assertEqual(od["maxEjectionPercent"], envoy_od["max_ejection_percent"])

    def test_filter_is_declared_with_the_flags_a_wasmplugin_cannot_set(self):
        w = wasm_config()
        self.assertIs(w["allow_on_headers_stop_iteration"], True)
        self.assertEqual(w["failure_policy"], "FAIL_OPEN")
        self.assertTrue(w["vm_config"]["code"]["remote"]["http_uri"]["uri"].startswith("oci://"))
        ef = find("EnvoyFilter", "kvsteer-filter")
        (ext,) = patches(ef, "EXTENSION_CONFIG")
        (slot,) = patches(ef, "HTTP_FILTER")
        self.assertEqual(slot["patch"]["operation"], "INSERT_BEFORE")
        self.assertEqual(slot["match"]["listener"]["filterChain"]["filter"]["subFilter"]["name"],
                         "envoy.filters.http.router")
        self.assertEqual(slot["patch"]["value"]["name"], ext["patch"]["value"]["name"])

    def test_wasmplugin_carries_the_same_configuration(self):
        wp = find("WasmPlugin", "kvsteer")
        spec = wp["spec"]
        self.assertEqual(spec["failStrategy"], "FAIL_OPEN")
        self.assertEqual(spec["phase"], "UNSPECIFIED_PHASE")
        self.assertTrue(spec["url"].startswith("oci://"))
        self.assertEqual(spec["url"], wasm_config()["vm_config"]["code"]["remote"]["http_uri"]["uri"])
        mine, theirs = dict(spec["pluginConfig"]), plugin_json()
        # Istio leaves vm_id empty: the WasmPlugin form needs a prefix of its own.
        self.assertNotEqual(mine.pop("shared_key_prefix"), "")
        theirs.pop("shared_key_prefix")
        self.assertEqual(mine, theirs)

    def test_envoy_accepts_the_embedded_configuration_with_the_built_filter(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        ok, out = stack.envoy_validate(istio_as_bootstrap(str(wasm)))
        self.assertTrue(ok, out)


def istio_as_bootstrap(wasm: str, filter_name: str = "kvsteer-filter",
                       cluster_filters: tuple[str, ...] = ("kvsteer-cluster",)) -> dict:
    """envoy/envoy.yaml with Istio's pieces in place of its own: the wasm filter config from
    kvsteer-filter.yaml (module read from disk instead of the registry), the service cluster with
    kvsteer-cluster.yaml's MERGE applied, and its ADDed feed clusters (addresses made local, since
    validation does not resolve cluster DNS names). `filter_name` and `cluster_filters` name other
    EnvoyFilters to take them from (kvsteer-pools.yaml's); the MERGE is the first's."""
    doc = envoy_config.load("envoy")
    w = copy.deepcopy(wasm_config(filter_name))
    w["vm_config"]["code"] = {"local": {"filename": wasm}}
    for f in envoy_config.http_filters(doc):
        if f["name"] == envoy_config.WASM_FILTER:
            f["typed_config"]["config"] = w
    efs = [find("EnvoyFilter", n) for n in cluster_filters]
    ef = efs[0]
    clusters = []
    for c in doc["static_resources"]["clusters"]:
        if c["name"] == "replicas":
            c = copy.deepcopy(c)
            c.pop("load_balancing_policy")
            for p in patches(ef, "CLUSTER"):
                if p["patch"]["operation"] == "MERGE":
                    c.update(copy.deepcopy(p["patch"]["value"]))
            clusters.append(c)
    pc = json.loads(w["configuration"]["value"])
    group = clusters[0]["load_assignment"]["endpoints"][0]
    tmpl = group["lb_endpoints"][0]
    group["lb_endpoints"] = []
    for r in pc.get("replicas") or [r for p in pc["pools"] for r in p["replicas"]]:
        e = copy.deepcopy(tmpl)
        host, _, port = r["endpoint"].rpartition(":")
        e["endpoint"]["address"]["socket_address"].update(address=host, port_value=int(port))
        group["lb_endpoints"].append(e)
    for p in (p for e in efs for p in patches(e, "CLUSTER")):
        if p["patch"]["operation"] == "ADD":
            c = copy.deepcopy(p["patch"]["value"])
            c["type"] = "STATIC"
            c.pop("dns_lookup_family", None)
            for g in c["load_assignment"]["endpoints"]:
                for e in g["lb_endpoints"]:
                    e["endpoint"]["address"]["socket_address"]["address"] = "127.0.0.1"
            clusters.append(c)
    doc["static_resources"]["clusters"] = clusters
    return doc


def engine_args(sts: dict) -> list[str]:
    (engine,) = [c for c in sts["spec"]["template"]["spec"]["containers"] if c["name"] == "engine"]
    return engine["args"]


def arg(args: list[str], flag: str) -> str | None:
    for a in args:
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    return None


class Pools(unittest.TestCase):
    """istio/kvsteer-pools.yaml: kvsteer-filter.yaml with two pools (vllm.yaml's fleet, and a 70B
    fleet declared there), checked against the fleets it names and by Envoy with the built filter."""

    def test_the_filter_is_kvsteer_filter_yaml_but_its_configuration(self):
        mine, theirs = copy.deepcopy(wasm_config("kvsteer-filter-pools")), wasm_config()
        mine.pop("configuration")
        self.assertEqual(mine, {k: v for k, v in theirs.items() if k != "configuration"})
        pools_ef, ef = find("EnvoyFilter", "kvsteer-filter-pools"), find("EnvoyFilter", "kvsteer-filter")
        self.assertEqual(patches(pools_ef, "HTTP_FILTER"), patches(ef, "HTTP_FILTER"))
        self.assertEqual(pools_ef["spec"]["workloadSelector"], ef["spec"]["workloadSelector"])
        pc = json.loads(wasm_config("kvsteer-filter-pools")["configuration"]["value"])
        flat = plugin_json()
        flat.pop("replicas")
        pools = pc.pop("pools")
        self.assertEqual(pc, flat, "gateway-wide settings as kvsteer-filter.yaml's")
        self.assertEqual(pools[0]["replicas"], plugin_json()["replicas"], "chat is vllm.yaml's fleet")

    def test_each_pool_serves_its_fleets_model_on_its_pods(self):
        pc = json.loads(wasm_config("kvsteer-filter-pools")["configuration"]["value"])
        chat, big = pc["pools"]
        fleets = {"chat": find("StatefulSet", "vllm"), "big": find("StatefulSet", "vllm-70b")}
        for pool in (chat, big):
            sts = fleets[pool["name"]]
            args = engine_args(sts)
            served = arg(args, "--served-model-name") or arg(args, "--model")
            self.assertEqual(pool["models"], [served], pool["name"])
            name = sts["metadata"]["name"]
            self.assertEqual([r["name"] for r in pool["replicas"]],
                             [f"{name}-{i}" for i in range(sts["spec"]["replicas"])])
        self.assertEqual(arg(engine_args(fleets["big"]), "--tensor-parallel-size"), "4")
        self.assertEqual(big["routing"]["kv_time"]["profile"], "llama-3.1-70b-h100-tp4")
        added = {p["patch"]["value"]["name"]: p["patch"]["value"]
                 for p in patches(find("EnvoyFilter", "kvsteer-cluster-70b"), "CLUSTER")
                 if p["patch"]["operation"] == "ADD"}
        sts = fleets["big"]
        headless = sts["spec"]["serviceName"]
        self.assertEqual(set(added), {r["feed_cluster"] for r in big["replicas"]})
        for r in big["replicas"]:
            (ep,) = added[r["feed_cluster"]]["load_assignment"]["endpoints"][0]["lb_endpoints"]
            sa = ep["endpoint"]["address"]["socket_address"]
            self.assertEqual(sa["address"], f"{r['name']}.{headless}.llm.svc.cluster.local")
            self.assertEqual(r["feed_authority"], f"{sa['address']}:{sa['port_value']}")

    def test_the_vllm_service_holds_both_fleets(self):
        # override_host only sends to hosts of the routed cluster: the `vllm` Service's.
        svc = find("Service", "vllm")["spec"]["selector"]
        sts = find("StatefulSet", "vllm-70b")
        labels = sts["spec"]["template"]["metadata"]["labels"]
        self.assertLessEqual(svc.items(), labels.items())
        self.assertEqual(sts["spec"]["selector"]["matchLabels"], labels)
        self.assertEqual(find("Service", sts["spec"]["serviceName"])["spec"]["selector"], labels)

    def test_envoy_accepts_the_embedded_configuration_with_the_built_filter(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        doc = istio_as_bootstrap(str(wasm), "kvsteer-filter-pools",
                                 ("kvsteer-cluster", "kvsteer-cluster-70b"))
        self.assertEqual(len(envoy_config.cluster_endpoints(
            envoy_config.clusters(doc)["replicas"])), 6)
        ok, out = stack.envoy_validate(doc)
        self.assertTrue(ok, out)


class PluginConfigRenderer(unittest.TestCase):
    """istio/plugin-config: the replica list from `kubectl get pods -o json`."""

    def run_it(self, pods: dict, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, str(ISTIO / "plugin-config"), *args],
                              input=json.dumps(pods), capture_output=True, text=True, timeout=60)

    @staticmethod
    def pod(name: str, ip: str | None, is_ready: bool = True) -> dict:
        status = {"conditions": [{"type": "Ready", "status": "True" if is_ready else "False"}]}
        if ip:
            status["podIP"] = ip
        return {"metadata": {"name": name, "namespace": "llm"}, "status": status}

    def test_ready_pods_with_ips_in_name_order(self):
        pods = {"items": [self.pod("vllm-1", "10.0.0.2"), self.pod("vllm-0", "10.0.0.1"),
                          self.pod("vllm-2", None), self.pod("vllm-3", "10.0.0.4", False),
                          self.pod("vllm-4", "fd00::5")]}
        p = self.run_it(pods)
        self.assertEqual(p.returncode, 0, p.stderr)
        cfg = json.loads(p.stdout)
        self.assertEqual([(r["name"], r["endpoint"]) for r in cfg["replicas"]],
                         [("vllm-0", "10.0.0.1:8000"), ("vllm-1", "10.0.0.2:8000"),
                          ("vllm-4", "[fd00::5]:8000")])
        self.assertEqual(cfg["replicas"][0]["feed_authority"],
                         "vllm-0.vllm-pods.llm.svc.cluster.local:8001")
        # Same keys as the committed configuration, so a rendered one drops straight in.
        self.assertEqual(set(cfg), set(plugin_json()))

    def test_refuses_input_without_a_usable_pod(self):
        for bad in ({"items": []}, {"items": [self.pod("vllm-0", None)]}):
            p = self.run_it(bad)
            self.assertEqual(p.returncode, 1)
            self.assertIn("no Ready pod", p.stderr)
        p = subprocess.run([sys.executable, str(ISTIO / "plugin-config")], input="not json",
                           capture_output=True, text=True, timeout=60)
        self.assertEqual(p.returncode, 1)

    def test_rendered_config_is_accepted_by_the_filter(self):
        wasm = stack.wasm_path()
        if not wasm.exists():
            self.skipTest(f"filter not built at {wasm}")
        pods = {"items": [self.pod(f"vllm-{i}", f"10.0.0.{i + 1}") for i in range(4)]}
        p = self.run_it(pods)
        self.assertEqual(p.returncode, 0, p.stderr)
        doc = istio_as_bootstrap(str(wasm))
        w = envoy_config.wasm_filter(doc)
        w["configuration"]["value"] = p.stdout
        ok, out = stack.envoy_validate(doc)
        self.assertTrue(ok, out)


if __name__ == "__main__":
    unittest.main()
