"""Read the committed Envoy configurations (envoy/*.yaml) and fit them to a running stack.

The tests run the very files users get, not a look-alike generated here: `rewrite` only changes what
differs between a user's machine and a test run (ports, the replica list, the path of the .wasm) and
leaves every policy, timeout, retry and filter setting as committed.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
ENVOY_DIR = REPO / "envoy"

# Variant name (file envoy/<name>.yaml) -> what it is, for tables and messages.
VARIANTS = {
    "envoy": "kvsteer filter, override_host on x-gateway-destination-endpoint",
    "envoy-cluster-header": "kvsteer filter, one cluster per replica, cluster_header routing",
    "envoy-pd": "kvsteer filter, prefill/decode disaggregation (prefill leg a callout, decode leg via override_host)",
    "envoy-discovery": "kvsteer filter, members read at run time from kvsteer-discover (override_host on serving and feed clusters)",
    "envoy-pools": "kvsteer filter with two pools (one gateway, two models, a fleet each), override_host",
    "envoy-round-robin": "Envoy round_robin, no filter",
    "envoy-least-request": "Envoy least_request, no filter",
    "envoy-ring-hash": "Envoy ring_hash on x-session-id, no filter",
}

WASM_FILTER = "envoy.filters.http.wasm"
FEED_PREFIX = "kvsteer_feed_"
REPLICA_CLUSTER_PREFIX = "replica_"
# P/D (envoy-pd.yaml): the cluster of each prefill replica's prefill leg.
PREFILL_PREFIX = "kvsteer_prefill_"
MAIN_CLUSTER = "replicas"
# envoy-discovery.yaml: the cluster of discovered members' feeds, holding every member's feed address.
MEMBER_FEEDS_CLUSTER = "kvsteer_member_feeds"


def load(variant: str) -> dict:
    path = ENVOY_DIR / f"{variant}.yaml"
    with open(path) as f:
        return yaml.safe_load(f)


def http_filters(doc: dict) -> list[dict]:
    out = []
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                hcm = f.get("typed_config", {})
                out.extend(hcm.get("http_filters", []))
    return out


def routes(doc: dict) -> list[dict]:
    out = []
    for listener in doc["static_resources"]["listeners"]:
        for chain in listener["filter_chains"]:
            for f in chain["filters"]:
                rc = f.get("typed_config", {}).get("route_config", {})
                for vh in rc.get("virtual_hosts", []):
                    out.extend(vh.get("routes", []))
    return out


def wasm_filter(doc: dict) -> dict | None:
    """The wasm filter's `config` (a PluginConfig), or None when the variant runs without it."""
    for f in http_filters(doc):
        if f.get("name") == WASM_FILTER:
            return f["typed_config"]["config"]
    return None


def uses_wasm(doc: dict) -> bool:
    return wasm_filter(doc) is not None


def plugin_config(doc: dict) -> dict:
    """The filter's own JSON configuration, parsed."""
    w = wasm_filter(doc)
    if w is None:
        raise ValueError("no wasm filter in this configuration")
    return json.loads(w["configuration"]["value"])


def clusters(doc: dict) -> dict[str, dict]:
    return {c["name"]: c for c in doc["static_resources"]["clusters"]}


def cluster_endpoints(cluster: dict) -> list[str]:
    out = []
    for group in cluster["load_assignment"]["endpoints"]:
        for e in group["lb_endpoints"]:
            sa = e["endpoint"]["address"]["socket_address"]
            out.append(f"{sa['address']}:{sa['port_value']}")
    return out


def health_checked_clusters(doc: dict) -> list[str]:
    return [c["name"] for c in doc["static_resources"]["clusters"] if c.get("health_checks")]


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def _endpoint(template: dict, host_port: str) -> dict:
    host, _, port = host_port.rpartition(":")
    e = copy.deepcopy(template)
    sa = e["endpoint"]["address"]["socket_address"]
    sa["address"], sa["port_value"] = host, int(port)
    return e


def _single_host_cluster(template: dict, name: str, host_port: str) -> dict:
    c = copy.deepcopy(template)
    c["name"] = name
    c["load_assignment"]["cluster_name"] = name
    group = c["load_assignment"]["endpoints"][0]
    group["lb_endpoints"] = [_endpoint(group["lb_endpoints"][0], host_port)]
    c["load_assignment"]["endpoints"] = [group]
    return c


def _replica_entries(committed: list[dict], replicas: list[tuple[str, str]],
                     feeds: dict[str, str], replica_overrides: dict) -> list[dict]:
    """The plugin configuration's entries for `replicas`: entry i keeps the committed i-th entry's
    own settings (a P/D file's roles differ per replica), the first entry's beyond the committed
    count, with the name, endpoint and cluster names of this run."""
    entries = []
    for i, (name, ep) in enumerate(replicas):
        r = dict(committed[i] if i < len(committed) else committed[0])
        r["name"], r["endpoint"] = name, ep
        if "feed_cluster" in r:
            r["feed_cluster"] = FEED_PREFIX + name
        if "feed_authority" in r:
            r["feed_authority"] = ep
        if "feed_address" in r:
            r["feed_address"] = feeds.get(name, ep)
        if "cluster" in r:
            r["cluster"] = REPLICA_CLUSTER_PREFIX + name
        if "prefill_cluster" in r:
            r["prefill_cluster"] = PREFILL_PREFIX + name
        r.update(replica_overrides)
        entries.append(r)
    return entries


def pool_members(pc: dict, replicas: list[str],
                 pools: dict[str, list[str]] | None = None) -> dict[str, list[str]]:
    """Which of `replicas` (names) each pool of the plugin configuration `pc` gets: `pools` (pool
    name -> replica names) when given, else the replicas in order, each pool as many as its
    committed entry lists and the last pool the rest."""
    names = [p["name"] for p in pc["pools"]]
    if pools is not None:
        if set(pools) != set(names) or sorted(sum(pools.values(), [])) != sorted(replicas):
            raise ValueError(f"pools {pools} do not split {replicas} over {names}")
        return {n: list(pools[n]) for n in names}
    out, i = {}, 0
    for k, p in enumerate(pc["pools"]):
        take = len(replicas) - i if k == len(names) - 1 else len(p.get("replicas", []))
        out[p["name"]] = replicas[i:i + take]
        i += take
    return out


def rewrite(
    doc: dict,
    replicas: list[tuple[str, str]],
    listen_port: int,
    admin_port: int,
    wasm: str,
    plugin_overrides: dict | None = None,
    wasm_overrides: dict | None = None,
    feeds: dict[str, str] | None = None,
    replica_overrides: dict | None = None,
    extra_clusters: dict[str, str] | None = None,
    pools: dict[str, list[str]] | None = None,
) -> dict:
    """A copy of `doc` for these replicas (name, `IP:port`), ports and wasm path.

    `extra_clusters` (name -> `IP:port`) adds single-host clusters built like the feed clusters:
    the working-set exchange's peer proxies (`peers.proxies[].cluster`, docs/reports/proxies.md).

    Per-replica clusters (`kvsteer_feed_<name>`, `replica_<name>`, `kvsteer_prefill_<name>`) are
    rebuilt from the first one in the file, so the committed four-replica files serve any replica
    count; the i-th replica keeps the committed i-th entry's settings (its P/D role), and gets a
    `kvsteer_prefill_<name>` cluster when its entry has a `prefill_cluster`. `plugin_overrides` merge
    into the filter's JSON configuration, `wasm_overrides` into Envoy's wasm PluginConfig (tests only:
    to show what a setting is for by turning it off), `replica_overrides` into every replica entry
    (e.g. `{"dp_ranks": 4}`). `feeds` names replicas whose feed is served at another `IP:port` than
    their completions (tests: a flooding or slow feed beside a normal replica); their
    `kvsteer_feed_<name>` cluster points there. A configuration with `pools` (envoy-pools.yaml)
    gets its replicas split over its pools by `pool_members` (`pools`: pool name -> replica
    names); every pool's replicas are in the `replicas` cluster and get their feed clusters.
    """
    doc = copy.deepcopy(doc)
    doc["admin"]["address"]["socket_address"]["port_value"] = admin_port
    doc["static_resources"]["listeners"][0]["address"]["socket_address"]["port_value"] = listen_port

    # The filter's replica entries first: which replicas need a prefill cluster depends on them.
    # Entry i keeps the committed i-th entry's own settings (a P/D file's roles differ per replica),
    # the first entry's beyond the committed count.
    w = wasm_filter(doc)
    entries: list[dict] = []
    if w is not None:
        w.update(_merge(w, wasm_overrides or {}))
        w["vm_config"]["code"]["local"]["filename"] = wasm
        pc = json.loads(w["configuration"]["value"])
        if "pools" in pc:
            members = pool_members(pc, [n for n, _ in replicas], pools)
            endpoint = dict(replicas)
            for p in pc["pools"]:
                mine = [(n, endpoint[n]) for n in members[p["name"]]]
                # A pool with discovery only lists no static replica.
                if p.get("replicas"):
                    p["replicas"] = _replica_entries(p["replicas"], mine, feeds or {},
                                                     replica_overrides or {})
                    entries.extend(p["replicas"])
        else:
            committed = pc["replicas"]
            # A discovery file lists no static replica: its members come from the member list.
            if committed:
                entries = _replica_entries(committed, replicas, feeds or {},
                                           replica_overrides or {})
                pc["replicas"] = entries
        pc = _merge(pc, plugin_overrides or {})
        w["configuration"]["value"] = json.dumps(pc)
    prefill_names = {r["name"] for r in entries if r.get("prefill_cluster")}

    out_clusters = []
    templates: dict[str, dict] = {}
    for c in doc["static_resources"]["clusters"]:
        name = c["name"]
        for prefix in (FEED_PREFIX, REPLICA_CLUSTER_PREFIX, PREFILL_PREFIX):
            if name.startswith(prefix):
                templates.setdefault(prefix, c)
                break
        else:
            if name in (MAIN_CLUSTER, MEMBER_FEEDS_CLUSTER):
                feeds_of = (feeds or {}) if name == MEMBER_FEEDS_CLUSTER else {}
                group = c["load_assignment"]["endpoints"][0]
                tmpl = group["lb_endpoints"][0]
                group["lb_endpoints"] = [_endpoint(tmpl, feeds_of.get(n, ep)) for n, ep in replicas]
                c["load_assignment"]["endpoints"] = [group]
            out_clusters.append(c)
    for prefix, tmpl in templates.items():
        for name, ep in replicas:
            if prefix == FEED_PREFIX:
                ep = (feeds or {}).get(name, ep)
            if prefix == PREFILL_PREFIX and name not in prefill_names:
                continue
            out_clusters.append(_single_host_cluster(tmpl, prefix + name, ep))
    for name, ep in (extra_clusters or {}).items():
        out_clusters.append(_single_host_cluster(templates[FEED_PREFIX], name, ep))
    doc["static_resources"]["clusters"] = out_clusters
    return doc
