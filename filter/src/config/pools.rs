//! Pools: one gateway, several fleets, the request's `model` choosing among them
//! (docs/design/pools.md). A pool is a whole [`FilterConfig`] of its own, built from the gateway's
//! settings with the pool's `replicas`, `discovery`, `tokenizer` and `routing` (merged field by
//! field over the gateway's `routing`), so each pool gets its own router, load table, learned
//! speeds, health and shared-data keys, and nothing of one pool's state is in reach of another's
//! decisions. A configuration without `pools` is one unnamed pool serving every model, read by
//! [`FilterConfig::from_json`] exactly as before.

use super::{ConfigError, FilterConfig, MAX_UNITS, err, headers::valid_header};
use serde::Deserialize;
use serde_json::{Map, Value};
use std::collections::HashMap;

/// Pools in one configuration, at most: each pool polls, shares and keeps its own index, and a
/// gateway fronting more models than this should group them.
pub const MAX_POOLS: usize = 64;

/// Index capacity a pool gets at least when it does not set its own (blocks).
const MIN_POOL_INDEX_BLOCKS: usize = 65_536;

/// The fields of a `pools` entry.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct PoolSection {
    name: String,
    #[serde(default)]
    models: Vec<String>,
    #[serde(default)]
    replicas: Option<Value>,
    #[serde(default)]
    discovery: Option<Value>,
    #[serde(default)]
    routing: Option<Value>,
    #[serde(default)]
    tokenizer: Option<Value>,
}

/// One pool: its name (`None` for the single pool of a configuration without `pools`), the
/// models it serves (empty: every model, for the unnamed pool) and its filter configuration.
#[derive(Clone, Debug)]
pub struct PoolConfig {
    pub name: Option<String>,
    pub models: Vec<String>,
    pub cfg: FilterConfig,
}

/// The plugin configuration as the gateway runs it: its pools and how a request picks one.
#[derive(Clone, Debug)]
pub struct GatewayConfig {
    pub pools: Vec<PoolConfig>,
    /// The pool that takes a body without `model` (`default_pool`); `None`: such a body is
    /// answered 400. The unnamed pool takes every request.
    pub default_pool: Option<usize>,
    /// A header naming the model, written by the operator's chain (`model_header`), read when the
    /// body's `model` cannot be (an unread body); the body's `model` wins over it.
    pub model_header: Option<String>,
    models: HashMap<String, usize>,
    /// Whether the configuration names pools: kept apart from `pools`, which the filter takes out.
    named: bool,
}

/// Where a request goes by its model.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PoolChoice {
    Pool(usize),
    /// A model no pool serves: 404 `model_not_found`.
    Unknown,
    /// No model and no default pool: 400.
    Missing,
}

impl GatewayConfig {
    /// Reads the plugin configuration: with `pools`, every pool checked and built; without, the
    /// configuration as one unnamed pool.
    pub fn from_json(bytes: &[u8]) -> Result<GatewayConfig, ConfigError> {
        let v: Value = serde_json::from_slice(bytes)
            .map_err(|e| ConfigError::at("plugin configuration", e.to_string()))?;
        let pooled = v.as_object().is_some_and(|o| o.contains_key("pools"));
        if !pooled {
            for field in ["default_pool", "model_header"] {
                if v.get(field).is_some() {
                    return err(field, "is read only beside pools");
                }
            }
            let cfg = FilterConfig::from_json(bytes)?;
            return Ok(GatewayConfig {
                pools: vec![PoolConfig {
                    name: None,
                    models: Vec::new(),
                    cfg,
                }],
                default_pool: Some(0),
                model_header: None,
                models: HashMap::new(),
                named: false,
            });
        }
        let Value::Object(mut top) = v else {
            unreachable!("checked above")
        };
        Self::from_pools(&mut top)
    }

    fn from_pools(top: &mut Map<String, Value>) -> Result<GatewayConfig, ConfigError> {
        for field in ["replicas", "discovery", "tokenizer", "peers"] {
            if top.contains_key(field) {
                let why = if field == "peers" {
                    "is not supported beside pools yet"
                } else {
                    "belongs in each pool beside pools"
                };
                return err(field, why);
            }
        }
        let sections: Vec<PoolSection> =
            serde_json::from_value(top.remove("pools").unwrap_or(Value::Null))
                .map_err(|e| ConfigError::at("pools", e.to_string()))?;
        let (default_name, model_header) = gateway_fields(top)?;
        if sections.is_empty() || sections.len() > MAX_POOLS {
            return err("pools", format!("must hold 1 to {MAX_POOLS} pools"));
        }
        let models = check_sections(&sections)?;
        let default_pool = match &default_name {
            None => None,
            Some(n) => match sections.iter().position(|p| &p.name == n) {
                Some(i) => Some(i),
                None => return err("default_pool", format!("{n:?} names no pool")),
            },
        };
        if let Some(i) = sections
            .iter()
            .enumerate()
            .position(|(i, p)| p.models.is_empty() && default_pool != Some(i))
        {
            return err(
                format!("pools[{i}].models"),
                "only the default pool may serve no named model",
            );
        }
        let pools = build_pools(top, sections)?;
        Ok(GatewayConfig {
            pools,
            default_pool,
            model_header,
            models,
            named: true,
        })
    }

    /// Whether the configuration names pools (else one unnamed pool takes every request).
    pub fn pooled(&self) -> bool {
        self.named
    }

    /// The pool for a request's model: the model's pool, the default pool for none, or a refusal.
    /// The unnamed pool takes every request.
    pub fn choose(&self, model: Option<&str>) -> PoolChoice {
        if !self.pooled() {
            return PoolChoice::Pool(0);
        }
        match model {
            Some(m) => self
                .models
                .get(m)
                .map_or(PoolChoice::Unknown, |&i| PoolChoice::Pool(i)),
            None => self
                .default_pool
                .map_or(PoolChoice::Missing, PoolChoice::Pool),
        }
    }

    /// What a valid configuration is still likely wrong about, for the proxy's log: each pool's
    /// own warnings, named by pool.
    pub fn warnings(&self) -> Vec<String> {
        self.pools
            .iter()
            .flat_map(|p| {
                let name = p.name.clone();
                p.cfg.warnings().into_iter().map(move |w| match &name {
                    Some(n) => format!("pool {n}: {w}"),
                    None => w,
                })
            })
            .collect()
    }
}

/// `default_pool` and `model_header`, taken out of the top level (they are the gateway's, not a
/// pool's).
fn gateway_fields(
    top: &mut Map<String, Value>,
) -> Result<(Option<String>, Option<String>), ConfigError> {
    let default_name = match top.remove("default_pool") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s),
        Some(_) => return err("default_pool", "must be a pool's name"),
    };
    let model_header = match top.remove("model_header") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) if valid_header(&s) => Some(s),
        Some(other) => {
            return err(
                "model_header",
                format!("{other} must be a lowercase header name"),
            );
        }
    };
    Ok((default_name, model_header))
}

/// Each pool's own fields checked by path; the map of every model to its pool.
fn check_sections(sections: &[PoolSection]) -> Result<HashMap<String, usize>, ConfigError> {
    let mut models: HashMap<String, usize> = HashMap::new();
    for (i, p) in sections.iter().enumerate() {
        let at = format!("pools[{i}]");
        if !valid_pool_name(&p.name) {
            return err(
                format!("{at}.name"),
                format!("{:?} must be 1-32 of [a-z0-9-]", p.name),
            );
        }
        if let Some(j) = sections[..i].iter().position(|q| q.name == p.name) {
            return err(
                format!("{at}.name"),
                format!("{:?} is already pools[{j}]'s", p.name),
            );
        }
        for (k, m) in p.models.iter().enumerate() {
            if m.is_empty() || m.len() > 256 {
                return err(format!("{at}.models[{k}]"), "must be 1-256 bytes");
            }
            if let Some(&j) = models.get(m) {
                return err(
                    format!("{at}.models[{k}]"),
                    format!("{m:?} is already pools[{j}]'s"),
                );
            }
            models.insert(m.clone(), i);
        }
        if p.replicas.is_none() && p.discovery.is_none() {
            return err(
                format!("{at}.replicas"),
                "a pool needs replicas or a discovery section",
            );
        }
        if let Some(r) = &p.routing {
            for gateway_wide in ["max_body_bytes"] {
                if r.get(gateway_wide).is_some() {
                    return err(
                        format!("{at}.routing.{gateway_wide}"),
                        "is the gateway's: set it in the top-level routing section",
                    );
                }
            }
            if r.pointer("/admission/priority_header").is_some() {
                return err(
                    format!("{at}.routing.admission.priority_header"),
                    "is read with the request's headers, before its pool is known: set it \
                     in the top-level routing section",
                );
            }
        }
    }
    Ok(models)
}

/// Every pool's whole configuration, then the checks across pools: units in all, and no endpoint
/// in two pools.
fn build_pools(
    top: &Map<String, Value>,
    sections: Vec<PoolSection>,
) -> Result<Vec<PoolConfig>, ConfigError> {
    let n = sections.len();
    let mut pools = Vec::with_capacity(n);
    let own_capacity: Vec<bool> = sections
        .iter()
        .map(|p| {
            p.routing
                .as_ref()
                .is_some_and(|r| r.get("index_capacity_blocks").is_some())
        })
        .collect();
    for (i, p) in sections.into_iter().enumerate() {
        let cfg = pool_config(top, &p, n).map_err(|e| in_pool(e, i))?;
        pools.push(PoolConfig {
            name: Some(p.name),
            models: p.models,
            cfg,
        });
    }
    let units: usize = pools.iter().map(|p| p.cfg.units.len()).sum();
    if units > MAX_UNITS {
        return err(
            "pools",
            format!(
                "{units} routing units in all (replicas, ranks and discovery slots); at most {MAX_UNITS}"
            ),
        );
    }
    let mut endpoints: HashMap<&str, usize> = HashMap::new();
    for (i, p) in pools.iter().enumerate() {
        for (k, r) in p.cfg.replicas.iter().enumerate() {
            if let Some(&j) = endpoints.get(r.endpoint.as_str())
                && j != i
            {
                return err(
                    format!("pools[{i}].replicas[{k}].endpoint"),
                    format!(
                        "{:?} is already in pools[{j}]: its load would be booked in two tables",
                        r.endpoint
                    ),
                );
            }
            endpoints.insert(&r.endpoint, i);
        }
    }
    spread_index_capacity(&mut pools, &own_capacity, units);
    Ok(pools)
}

/// Pool names go into shared-data keys and metric names, so they are short and plain; no `_`,
/// so a metric name splits at the first `_` after the pool.
fn valid_pool_name(s: &str) -> bool {
    (1..=32).contains(&s.len())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// A pool's error, its field path under `pools[i]` where the field is the pool's own.
fn in_pool(mut e: ConfigError, i: usize) -> ConfigError {
    let own = ["replicas", "discovery", "routing", "tokenizer", "units"]
        .iter()
        .any(|f| {
            e.field == *f
                || e.field.starts_with(&format!("{f}."))
                || e.field.starts_with(&format!("{f}["))
        });
    if own {
        e.field = format!("pools[{i}].{}", e.field);
    } else {
        e.message = format!("{} (in pools[{i}])", e.message);
    }
    e
}

/// `over` merged into `base` field by field: objects merged member by member, anything else
/// replaced.
fn merge(base: &mut Value, over: &Value) {
    match (base, over) {
        (Value::Object(b), Value::Object(o)) => {
            for (k, v) in o {
                match b.get_mut(k) {
                    Some(slot) => merge(slot, v),
                    None => {
                        b.insert(k.clone(), v.clone());
                    }
                }
            }
        }
        (b, o) => *b = o.clone(),
    }
}

/// The pool's whole configuration: the gateway's settings, the pool's sections, its own
/// shared-data keys (`<shared_key_prefix>/<pool>`: pool names hold no `/`, so two pools' keys
/// never meet) and a share of the per-tick feed budget.
fn pool_config(
    top: &Map<String, Value>,
    p: &PoolSection,
    pools: usize,
) -> Result<FilterConfig, ConfigError> {
    let roles = p.replicas.as_ref().and_then(Value::as_array);
    if roles.is_some_and(|rs| {
        rs.iter()
            .any(|r| r.get("role").is_some_and(|x| x != "both"))
    }) {
        return err(
            "replicas",
            "prefill/decode roles are not supported in pools yet",
        );
    }
    let mut obj = top.clone();
    for (field, v) in [
        ("replicas", &p.replicas),
        ("discovery", &p.discovery),
        ("tokenizer", &p.tokenizer),
    ] {
        if let Some(v) = v {
            obj.insert(field.into(), v.clone());
        }
    }
    if let Some(r) = &p.routing {
        let mut routing = obj
            .remove("routing")
            .unwrap_or_else(|| Value::Object(Map::new()));
        merge(&mut routing, r);
        obj.insert("routing".into(), routing);
    }
    let bytes = serde_json::to_vec(&Value::Object(obj))
        .map_err(|e| ConfigError::at("plugin configuration", e.to_string()))?;
    let mut cfg = FilterConfig::from_json(&bytes)?;
    if cfg.disaggregated() {
        return err(
            "replicas",
            "prefill/decode roles are not supported in pools yet",
        );
    }
    cfg.shared_key_prefix = format!("{}/{}", cfg.shared_key_prefix, p.name);
    // The budget bounds one VM's stall per tick, all pools together.
    let n = u32::try_from(pools).unwrap_or(u32::MAX).max(1);
    cfg.feed_apply_blocks_per_tick = (cfg.feed_apply_blocks_per_tick / n).max(256);
    if cfg.feed_apply_us_per_tick > 0 {
        cfg.feed_apply_us_per_tick = (cfg.feed_apply_us_per_tick / n).max(1);
    }
    Ok(cfg)
}

/// A pool that does not set `routing.index_capacity_blocks` gets the gateway's times its share of
/// all routing units (at least [`MIN_POOL_INDEX_BLOCKS`]), so a VM with many pools at their
/// defaults holds about what one fleet's default index does.
fn spread_index_capacity(pools: &mut [PoolConfig], own: &[bool], units: usize) {
    let units = units.max(1);
    for (p, &own) in pools.iter_mut().zip(own) {
        if own {
            continue;
        }
        let gateway = p.cfg.routing.index_capacity_blocks;
        let share = gateway.saturating_mul(p.cfg.units.len()) / units;
        p.cfg.routing.index_capacity_blocks = share.max(MIN_POOL_INDEX_BLOCKS).min(gateway);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TWO: &str = r#"{
        "routing": {"policy": "kv_time", "block_size": 16},
        "shared_key_prefix": "gw",
        "default_pool": "chat",
        "model_header": "x-gateway-model-name",
        "pools": [
          {"name": "chat", "models": ["llama-8b", "sql-lora"],
           "replicas": [{"name": "r0", "endpoint": "10.0.0.1:8000", "feed_cluster": "f0"},
                        {"name": "r1", "endpoint": "10.0.0.2:8000", "feed_cluster": "f1"}]},
          {"name": "big", "models": ["llama-70b"],
           "replicas": [{"name": "r0", "endpoint": "10.0.1.1:8000", "feed_cluster": "g0"}],
           "routing": {"block_size": 32, "kv_time": {"profile": "llama-3.1-70b-h100-tp4"}}}
        ]}"#;

    fn refused(json: &str) -> String {
        GatewayConfig::from_json(json.as_bytes())
            .unwrap_err()
            .to_string()
    }

    /// `TWO` with `edit` applied to its JSON.
    fn two_with(edit: impl FnOnce(&mut Value)) -> String {
        let mut v: Value = serde_json::from_str(TWO).unwrap();
        edit(&mut v);
        v.to_string()
    }

    #[test]
    fn pools_get_their_own_routing_keys_and_budget() {
        let g = GatewayConfig::from_json(TWO.as_bytes()).unwrap();
        assert!(g.pooled());
        assert_eq!(g.pools.len(), 2);
        let (chat, big) = (&g.pools[0].cfg, &g.pools[1].cfg);
        assert_eq!(chat.routing.block_size, 16);
        // Merged field by field: the pool's block size, the gateway's policy.
        assert_eq!(big.routing.block_size, 32);
        assert_eq!(big.routing.policy, chat.routing.policy);
        assert_eq!(chat.shared_key_prefix, "gw/chat");
        assert_eq!(big.shared_key_prefix, "gw/big");
        assert_eq!(chat.feed_apply_blocks_per_tick, 8192 / 2);
        assert_eq!(chat.feed_apply_us_per_tick, 250);
        // Index capacity by share of units: 2 of 3 and 1 of 3, at least 65,536.
        assert_eq!(chat.routing.index_capacity_blocks, 666_666);
        assert_eq!(big.routing.index_capacity_blocks, 333_333);
        assert_eq!(g.model_header.as_deref(), Some("x-gateway-model-name"));
    }

    #[test]
    fn the_model_picks_the_pool() {
        let g = GatewayConfig::from_json(TWO.as_bytes()).unwrap();
        assert_eq!(g.choose(Some("llama-8b")), PoolChoice::Pool(0));
        assert_eq!(g.choose(Some("sql-lora")), PoolChoice::Pool(0));
        assert_eq!(g.choose(Some("llama-70b")), PoolChoice::Pool(1));
        assert_eq!(g.choose(Some("gpt-4")), PoolChoice::Unknown);
        assert_eq!(g.choose(Some("")), PoolChoice::Unknown);
        assert_eq!(g.choose(None), PoolChoice::Pool(0));
        let no_default = two_with(|v| {
            v.as_object_mut().unwrap().remove("default_pool");
        });
        let g = GatewayConfig::from_json(no_default.as_bytes()).unwrap();
        assert_eq!(g.choose(None), PoolChoice::Missing);
    }

    #[test]
    fn without_pools_one_unnamed_pool_takes_everything() {
        let json = r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000","feed_cluster":"f"}]}"#;
        let g = GatewayConfig::from_json(json.as_bytes()).unwrap();
        assert!(!g.pooled());
        assert_eq!(g.choose(Some("anything")), PoolChoice::Pool(0));
        assert_eq!(g.choose(None), PoolChoice::Pool(0));
        let plain = FilterConfig::from_json(json.as_bytes()).unwrap();
        let one = &g.pools[0].cfg;
        assert_eq!(one.shared_key_prefix, plain.shared_key_prefix);
        assert_eq!(
            one.feed_apply_blocks_per_tick,
            plain.feed_apply_blocks_per_tick
        );
        assert_eq!(
            one.routing.index_capacity_blocks,
            plain.routing.index_capacity_blocks
        );
        let stray =
            r#"{"replicas":[{"name":"r0","endpoint":"127.0.0.1:8000"}],"default_pool":"a"}"#;
        assert!(
            refused(stray).contains("default_pool"),
            "{}",
            refused(stray)
        );
    }

    #[test]
    fn bad_pools_are_refused_by_path() {
        let cases: Vec<(String, &str)> = vec![
            (
                two_with(|v| v["pools"][1]["models"][0] = "llama-8b".into()),
                "pools[1].models[0]: \"llama-8b\" is already pools[0]'s",
            ),
            (
                two_with(|v| v["pools"][1]["name"] = "chat".into()),
                "pools[1].name",
            ),
            (
                two_with(|v| v["pools"][1]["name"] = "Big_1".into()),
                "pools[1].name",
            ),
            (
                two_with(|v| v["default_pool"] = "nope".into()),
                "default_pool",
            ),
            (
                two_with(|v| {
                    v["pools"][1].as_object_mut().unwrap().remove("replicas");
                }),
                "pools[1].replicas: a pool needs replicas",
            ),
            (
                two_with(|v| v["pools"][1]["models"] = serde_json::json!([])),
                "pools[1].models: only the default pool",
            ),
            (
                two_with(|v| v["pools"][1]["replicas"][0]["endpoint"] = "10.0.0.1:8000".into()),
                "pools[1].replicas[0].endpoint",
            ),
            (
                two_with(|v| v["pools"][1]["routing"]["max_body_bytes"] = 5.into()),
                "pools[1].routing.max_body_bytes",
            ),
            (
                two_with(|v| v["pools"][1]["routing"]["block_size"] = 0.into()),
                "pools[1].routing",
            ),
            (
                two_with(|v| v["pools"][1]["replicas"][0]["endpoint"] = "nohost".into()),
                "pools[1].replicas[0].endpoint",
            ),
            (
                two_with(|v| v["pools"][1]["colour"] = "red".into()),
                "pools: unknown field `colour`",
            ),
            (
                two_with(|v| v["replicas"] = serde_json::json!([])),
                "replicas: belongs in each pool",
            ),
            (
                two_with(|v| v["model_header"] = "X Model".into()),
                "model_header",
            ),
            (
                two_with(|v| v["pools"] = serde_json::json!([])),
                "pools: must hold 1 to 64",
            ),
            (
                two_with(|v| v["pools"][1]["replicas"][0]["role"] = "prefill".into()),
                "prefill/decode",
            ),
        ];
        for (json, expect) in cases {
            let e = refused(&json);
            assert!(e.contains(expect), "expected {expect:?} in {e:?}");
        }
    }

    #[test]
    fn sixteen_pools_of_sixteen_fit_and_a_257th_unit_does_not() {
        let pool = |i: usize, n: usize| {
            let reps: Vec<String> = (0..n)
                .map(|k| format!(r#"{{"name":"r{k}","endpoint":"10.{i}.{k}.1:8000","feed_cluster":"f{i}_{k}"}}"#))
                .collect();
            format!(
                r#"{{"name":"p{i}","models":["m{i}"],"replicas":[{}]}}"#,
                reps.join(",")
            )
        };
        let pools: Vec<String> = (0..16).map(|i| pool(i, 16)).collect();
        let json = format!(r#"{{"pools":[{}]}}"#, pools.join(","));
        let g = GatewayConfig::from_json(json.as_bytes()).unwrap();
        assert_eq!(g.pools.len(), 16);
        assert_eq!(g.pools[3].cfg.routing.index_capacity_blocks, 65_536);
        let mut more = pools.clone();
        more.push(pool(16, 1));
        let json = format!(r#"{{"pools":[{}]}}"#, more.join(","));
        assert!(refused(&json).contains("at most 256"), "{}", refused(&json));
    }
}
