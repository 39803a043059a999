//! One replay: a workload through the compiled filter, one policy, one seed, four identical simulated
//! replicas in virtual time. The demo and the bench both call [`replay`], so a figure in the README
//! and one in docs/reports/results.md come from the same code path.

use kvsteer_host_test::disaggregated_fleet::{PdConfig, PdStats, replay_pd, split_pd_params};
use kvsteer_host_test::oracle::Weights;
pub use kvsteer_host_test::outcome::Outcome;
use kvsteer_host_test::{FilterModule, Harness, HarnessConfig, ProxySpread};
use kvsteer_workload::{Driver, Mode, Workload};
use serde_json::{Value, json};
use std::time::Instant;

/// The filter's default `routing.seed` (docs/reference/configuration.md).
pub const ROUTER_SEED: u64 = 0x006B_7673_7465_6572;

/// The harness configuration of a replay: `policy` with the workload's block size in the filter, and
/// engines of the same block size (`crate::bench::scenario::Scenario::engine`), seeded with `seed`;
/// the router's tie-break generator gets [`ROUTER_SEED`] plus `seed` (seed 0 is the filter's default).
///
/// `policy` is a policy name or a variant of one, `NAME@KEY=VALUE@...`: each `KEY=VALUE` sets a
/// field in the policy's own section, e.g. `kv_load@overlap_credit=2` or `kv_load@preset=dynamo`
/// (see [`routing`]); or [`kvsteer_host_test::oracle::ORACLE`], the limit: the harness places every request itself
/// ([`kvsteer_host_test::oracle`]; `oracle@decode=1@stall=1` sets its [`Weights`]) while the filter, set to `round_robin` (the cheapest policy: its choice is
/// overridden), still carries the requests.
pub fn config(policy: &str, block_size: u32, seed: u64, workers: usize) -> HarnessConfig {
    if is_rank_blind(policy) {
        // The harness's part of the spec: the filter sees one replica per endpoint (no ranks).
        let kept: Vec<&str> = policy.split('@').filter(|p| *p != RANK_BLIND).collect();
        let mut cfg = config(&kept.join("@"), block_size, seed, workers);
        cfg.rank_aware = false;
        return cfg;
    }
    if let Some(weights) = Weights::from_spec(policy) {
        let mut cfg = config("round_robin", block_size, seed, workers);
        // A malformed oracle spec was refused by `check_spec` before any run; here it falls back to
        // the defaults rather than to a filter policy of that name.
        cfg.oracle = Some(weights.unwrap_or_default());
        return cfg;
    }
    let mut cfg = HarnessConfig::small(policy);
    cfg.workers = workers;
    cfg.engine = super::scenario::Scenario::engine(block_size, seed);
    // A spec that does not parse goes to the filter as it is: the filter refuses the unknown policy
    // name at configure time and the replay reports that error.
    let (policy, filter) = split_filter_fields(policy);
    for (k, v) in filter {
        cfg.filter_extra.insert(k, v);
    }
    cfg.routing = routing(&policy).unwrap_or_else(|_| json!({"policy": policy}));
    cfg.routing["block_size"] = block_size.into();
    cfg.routing["seed"] = ROUTER_SEED.wrapping_add(seed).into();
    // session_hash's only randomness is its hash's draw of which sessions share a replica: each seed
    // is another draw (seed 0 the filter's default ring), so its medians are over draws, not one.
    if policy.split('@').next() == Some("session_hash") {
        if !cfg.routing["session_hash"].is_object() {
            cfg.routing["session_hash"] = json!({});
        }
        cfg.routing["session_hash"]["ring_seed"] = seed.into();
    }
    cfg
}

/// The policy spec part (`kv_load@rank_blind`) that makes a DP fleet's router rank-blind: the filter
/// is configured with one replica per endpoint and the endpoint's own balancer (vLLM's) picks the
/// rank (`HarnessConfig::rank_aware`). No effect on a fleet without DP ranks.
pub const RANK_BLIND: &str = "rank_blind";

/// Whether a policy spec asks for rank-blind routing ([`RANK_BLIND`], after the policy name).
pub fn is_rank_blind(spec: &str) -> bool {
    spec.split('@').skip(1).any(|p| p == RANK_BLIND)
}

/// Splits the `@filter.KEY=NUMBER` parts off a policy spec: top-level filter fields (e.g.
/// `kv_load@load.reported_load=merge@filter.tick_ms=50@filter.feed_period_ms=50`, a shorter feed period);
/// returns the spec without them and the fields. The filter judges the fields at configure time.
pub fn split_filter_fields(spec: &str) -> (String, Vec<(String, Value)>) {
    let mut kept = Vec::new();
    let mut fields = Vec::new();
    for (i, part) in spec.split('@').enumerate() {
        match part
            .strip_prefix("filter.")
            .and_then(|kv| kv.split_once('='))
        {
            Some((k, v)) if i > 0 => {
                let v = v.parse::<u64>().map_or_else(|_| json!(v), |n| json!(n));
                fields.push((k.to_string(), v));
            }
            _ => kept.push(part),
        }
    }
    (kept.join("@"), fields)
}

/// The filter's `routing` section for a policy spec: `kv_load` gives `{"policy": "kv_load"}`;
/// `kv_load@overlap_credit=2@active_request_weight=32` gives
/// `{"policy": "kv_load", "kv_load": {"overlap_credit": 2.0, "active_request_weight": 32.0}}`;
/// values that are not numbers are booleans (`assume_kv_reuse=false`) or names
/// (`preset=ray_balanced`, `load.reported_load=ignore`); `section.key=value` sets another
/// section's field (`kv_time@load.reported_load=others`; a moved field under its old name,
/// `kv_load.reported_load=others`, still applies for one release, with the loader's warning).
/// Variants let the bench measure how a result depends on a policy's coefficients (the report's
/// sensitivity runs) without a configuration file per variant.
pub fn routing(spec: &str) -> Result<Value, String> {
    let (spec, _) = split_filter_fields(spec);
    let spec: String = spec
        .split('@')
        .enumerate()
        .filter(|(i, p)| *i == 0 || *p != RANK_BLIND)
        .map(|(_, p)| p)
        .collect::<Vec<_>>()
        .join("@");
    let spec = spec.as_str();
    let mut parts = spec.split('@');
    let name = parts.next().unwrap_or_default();
    if !kvsteer_core::PolicyKind::ALL
        .iter()
        .any(|k| k.name() == name)
    {
        let known: Vec<&str> = kvsteer_core::PolicyKind::ALL
            .iter()
            .map(|k| k.name())
            .collect();
        return Err(format!(
            "policy spec {spec:?}: unknown policy {name:?} (known: {})",
            known.join(", ")
        ));
    }
    let mut section = serde_json::Map::new();
    // `section.key=value` sets another section's field (`kv_time@load.reported_load=others`:
    // settings every policy reads live in sections of their own, `index`, `load`, `working_set`).
    let mut other: Vec<(String, String, Value)> = Vec::new();
    for kv in parts {
        let (k, v) = kv
            .split_once('=')
            .ok_or_else(|| format!("policy spec {spec:?}: {kv:?} is not KEY=VALUE"))?;
        // A number (an integer stays one, for integer fields), a boolean, or a name (a preset, an
        // enum value); the filter checks the field.
        let v = match (v.parse::<u64>(), v.parse::<f64>(), v) {
            (Ok(n), _, _) => json!(n),
            (_, Ok(n), _) => json!(n),
            (_, _, "true") => json!(true),
            (_, _, "false") => json!(false),
            (_, _, name) if !name.is_empty() => json!(name),
            _ => return Err(format!("policy spec {spec:?}: {k} has no value")),
        };
        match k.split_once('.') {
            Some((sec, key)) => other.push((sec.to_string(), key.to_string(), v)),
            None => {
                section.insert(k.to_string(), v);
            }
        }
    }
    let mut r = json!({ "policy": name });
    if !section.is_empty() {
        r[name] = Value::Object(section);
    }
    for (sec, key, v) in other {
        if !r[&sec].is_object() {
            r[&sec] = json!({});
        }
        r[&sec][&key] = v;
    }
    // Refuse a variant the filter would refuse, before anything runs, naming the field.
    kvsteer_core::RoutingConfig::from_json(&r.to_string())
        .map_err(|e| format!("policy spec {spec:?}: {e}"))?;
    Ok(r)
}

/// Checks a `--policies` entry before anything runs: an oracle spec ([`Weights::from_spec`]), or a spec [`routing`] accepts.
pub fn check_spec(spec: &str) -> Result<(), String> {
    match Weights::from_spec(spec) {
        Some(w) => w.map(|_| ()),
        // `@pd.KEY=NUMBER` parts are the P/D replay's (kvsteer_host_test::disaggregated_fleet), not the filter's.
        None => routing(&split_pd_params(spec)?.0).map(|_| ()),
    }
}

/// Whether a policy spec is the oracle's (`oracle`, `oracle@decode=1`, ...): the limit, which the
/// report labels as such and leaves out when it ranks the policies.
pub fn is_oracle(spec: &str) -> bool {
    Weights::from_spec(spec).is_some()
}

/// Replays `workload` driven by `mode` through the filter under `policy`; `progress(done, total)` is
/// called as requests finish.
pub fn replay(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    workers: usize,
    progress: impl FnMut(u64, u64),
) -> Result<Outcome, String> {
    replay_proxies(
        module,
        workload,
        mode,
        policy,
        seed,
        (workers, 1, ProxySpread::PerRequest),
        progress,
    )
}

/// [`replay`] through `proxies` independent proxies of `workers` worker VMs each, requests spread
/// across them as `spread` says (`topology` = `(workers, proxies, spread)`).
pub fn replay_proxies(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    topology: (usize, usize, ProxySpread),
    progress: impl FnMut(u64, u64),
) -> Result<Outcome, String> {
    replay_fleet(
        module,
        workload,
        mode,
        policy,
        seed,
        topology,
        (4, 1),
        progress,
    )
}

/// [`replay_proxies`] on `fleet` = `(endpoints, dp_ranks)`: `endpoints` engine endpoints, each with
/// `dp_ranks` data-parallel ranks (one engine each); `(4, 1)` is the matrix's fleet.
#[allow(clippy::too_many_arguments)]
pub fn replay_fleet(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    topology: (usize, usize, ProxySpread),
    fleet: (usize, usize),
    progress: impl FnMut(u64, u64),
) -> Result<Outcome, String> {
    let started = Instant::now();
    let (workers, proxies, spread) = topology;
    let mut cfg = config(policy, workload.block_size, seed, workers);
    cfg.proxies = proxies;
    cfg.proxy_spread = spread;
    cfg.replicas = fleet.0;
    cfg.dp_ranks = fleet.1;
    let mut h = Harness::new(module, cfg).map_err(|e| format!("{policy}: {e}"))?;
    h.run_workload(Driver::new(workload, mode), progress)
        .map_err(|e| format!("{policy}: {e}"))?;
    h.collect_peer_counters();
    Ok(Outcome {
        policy: policy.to_string(),
        seed,
        summary: h.summary(policy),
        ttft_ms: h.recorder.ttft_ms(),
        decode_series: h.recorder.decode_series(),
        rows: h.recorder.rows(),
        stats: h.stats.clone(),
        wall_s: started.elapsed().as_secs_f64(),
        virtual_s: h.now_us() as f64 / 1e6,
    })
}

/// One bench replay of a P/D scenario: `policy` as the bench takes it (`kv_load`, `round_robin`,
/// variants, plus `@pd.KEY=NUMBER`), engines as the bench builds them, the router's tie-break seeded
/// as the filter's is in the bench.
pub fn replay_pd_spec(
    module: &FilterModule,
    workload: Workload,
    mode: Mode,
    policy: &str,
    seed: u64,
    (prefill, decode): (usize, usize),
    progress: impl FnMut(u64, u64),
) -> Result<(Outcome, PdStats), String> {
    if is_oracle(policy) {
        return Err(format!("{policy}: the oracle has no P/D form"));
    }
    let (spec, params) = split_pd_params(policy)?;
    let mut routing = routing(&spec)?;
    let block_size = workload.block_size;
    routing["block_size"] = block_size.into();
    routing["seed"] = ROUTER_SEED.wrapping_add(seed).into();
    let engine = crate::bench::scenario::Scenario::engine(block_size, seed);
    let mut cfg = PdConfig::new(prefill, decode, engine, routing);
    cfg.params = params;
    replay_pd(module, workload, mode, &cfg, policy, seed, progress)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::bench::scenario::{Scale, pd_matrix};
    use kvsteer_host_test::oracle::ORACLE;

    #[test]
    fn session_hash_draws_its_ring_from_the_seed() {
        let c = config("session_hash", 16, 3, 2);
        assert_eq!(c.routing["session_hash"]["ring_seed"], 3);
        assert_eq!(
            config("session_hash", 16, 0, 2).routing["session_hash"]["ring_seed"],
            0
        );
        assert!(
            config("kv_load", 16, 3, 2)
                .routing
                .get("session_hash")
                .is_none()
        );
    }

    #[test]
    fn policy_specs_become_routing_sections() {
        assert_eq!(routing("kv_load").unwrap(), json!({"policy": "kv_load"}));
        assert_eq!(
            routing("kv_load@overlap_credit=2.5@active_request_weight=32").unwrap(),
            json!({"policy": "kv_load",
                   "kv_load": {"overlap_credit": 2.5, "active_request_weight": 32}})
        );
        // An integer stays one, so integer fields take it; float fields read it as a float.
        assert_eq!(
            routing("kv_load@working_set.sample=16").unwrap()["working_set"]["sample"],
            json!(16)
        );
        assert!(routing("kv_load@overlap_credit").is_err());
        assert!(routing("kv_load@overlap_credit=lots").is_err());
        // Another section's field, by its dotted name; a field that section lacks is refused.
        assert_eq!(
            routing("kv_time@speed_prior=0@load.reported_load=others").unwrap(),
            json!({"policy": "kv_time", "kv_time": {"speed_prior": 0},
                   "load": {"reported_load": "others"}})
        );
        // A moved field under its old name: still accepted (the filter applies it with a warning).
        assert_eq!(
            routing("kv_time@kv_load.reported_load=others").unwrap(),
            json!({"policy": "kv_time", "kv_load": {"reported_load": "others"}})
        );
        assert!(routing("kv_time@load.reported_load=others@kv_load.reported_load=merge").is_err());
        assert!(routing("kv_time@kv_load.no_such_field=1").is_err());
        assert_eq!(
            routing("kv_load@preset=ray_balanced@assume_kv_reuse=false").unwrap(),
            json!({"policy": "kv_load",
                   "kv_load": {"preset": "ray_balanced", "assume_kv_reuse": false}})
        );
        let e = routing("kv_load@preset=sglang").unwrap_err();
        assert!(e.contains("kv_load.preset"), "{e}");
        assert!(routing("kv_load@reported_load=").is_err());
        assert!(routing("@x=1").is_err());
        assert!(routing("nope").is_err());
        assert!(routing("kv_lod@overlap_credit=2").is_err());
        let spec = "kv_load@load.reported_load=merge@filter.tick_ms=50@filter.feed_period_ms=50";
        assert_eq!(
            routing(spec).unwrap(),
            json!({"policy": "kv_load", "load": {"reported_load": "merge"}})
        );
        let c = config(spec, 16, 0, 2);
        assert_eq!(c.plugin_config()["feed_period_ms"], json!(50));
        assert_eq!(c.plugin_config()["tick_ms"], json!(50));
        let cfg = config("kv_load@prefill_scale=4", 64, 2, 1);
        assert_eq!(cfg.routing["kv_load"]["prefill_scale"], json!(4));
        assert_eq!(cfg.routing["block_size"], json!(64));
        assert_eq!(cfg.routing["seed"], json!(ROUTER_SEED + 2));
    }

    #[test]
    fn the_oracle_is_a_harness_setting_not_a_filter_policy() {
        assert!(routing(ORACLE).is_err(), "the filter has no oracle");
        assert_eq!(check_spec(ORACLE), Ok(()));
        assert!(check_spec("kv_load@overlap_credit=2").is_ok());
        assert!(check_spec("oracle@x=1").is_err());
        assert!(check_spec("oracle@decode=1").is_ok());
        assert!(is_oracle("oracle@decode=1") && is_oracle(ORACLE) && !is_oracle("kv_load"));
        let c = config(ORACLE, 64, 1, 2);
        assert_eq!(c.oracle, Some(Weights::default()));
        assert_eq!(
            config("oracle@decode=1", 16, 0, 2).oracle.map(|w| w.decode),
            Some(1.0)
        );
        assert_eq!(c.routing["policy"], json!("round_robin"));
        assert_eq!(c.routing["block_size"], json!(64));
        assert_eq!(config("kv_load", 64, 1, 2).oracle, None);
    }

    /// Every request completes on a small RL workload under both policies; decode legs land only on
    /// decode engines (the recorder's replica is the decode one, always >= 2); kv_load's decode side
    /// sends a rollout's later turns where its earlier turns' KV already is, so its decode legs read
    /// far less over the link than round robin's.
    #[test]
    fn a_small_pd_fleet_serves_every_request() {
        let run = |policy: &str| {
            let sc = &pd_matrix(Scale::Smoke)[0];
            assert_eq!(
                (sc.id.as_str(), sc.pd_prefill, sc.endpoints),
                ("pd-rl", 2, 6)
            );
            let (w, mode) = sc.build(std::path::Path::new("traces"), 1).unwrap();
            let path = kvsteer_host_test::filter_wasm_path().unwrap_or_else(|e| panic!("{e}"));
            let module = FilterModule::load(&path).unwrap_or_else(|e| panic!("{e}"));
            let (o, st) = replay_pd_spec(&module, w, mode, policy, 1, (2, 4), |_, _| {}).unwrap();
            assert_eq!(st.failed, 0, "{policy}");
            assert_eq!(o.summary.failed, 0, "{policy}");
            assert!(st.requests > 0 && o.summary.requests as u64 == st.requests);
            assert!(o.rows.iter().all(|r| r.replica.is_none_or(|d| d >= 2)));
            assert!(st.transferred_tokens > 0 && st.transferred_tokens <= st.decode_prompt_tokens);
            // The filter's index learned the caches from the feeds.
            assert!(
                st.prefill_matched_tokens > 0,
                "{policy}: the feed never reached the index"
            );
            (o, st)
        };
        let read = |st: &PdStats| st.transferred_tokens as f64 / st.decode_prompt_tokens as f64;
        let (_, kv) = run("kv_load");
        let (_, rr) = run("round_robin");
        assert!(
            read(&kv) * 1.5 < read(&rr),
            "{} vs {}",
            read(&kv),
            read(&rr)
        );
    }
}
