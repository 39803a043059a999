//! Routing configuration: JSON via serde, every field defaulted, unknown fields refused, and every
//! error names the field it is about (`kv_load.temperature: ...`). One file per section that has
//! rules of its own (`index`, `load`, `working_set`, `kv_load`, `kv_time`), the refusal type, and the whole document's
//! checks. A field that moved to another section is still read under its old name for one release,
//! with a warning in [`RoutingConfig::warnings`] naming the new place; both names given is refused.

mod error;
mod index;
mod kv_load;
mod kv_time;
mod load;
mod validate;
mod working_set;

pub use error::ConfigError;
pub(crate) use error::{err, non_negative};
pub use index::IndexParams;
pub use kv_load::{KvLoadParams, KvLoadPreset};
pub use kv_time::{KvTimeParams, ProfileSpec};
pub use load::{LoadParams, ReportedLoad};
pub use working_set::WorkingSetParams;

use serde::Deserialize;

use crate::health::HealthParams;

/// Which policy scores replicas.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyKind {
    RoundRobin,
    LeastLoad,
    SessionHash,
    PrefixAffinity,
    KvAffinity,
    /// The block-count cost, kvsteer's default until `kv_time` passed its validation gate
    /// (docs/reports/model-eval.md); kept by name for comparison.
    KvLoad,
    /// The cost in seconds (docs/design/design.md section 2.7): the default.
    #[default]
    KvTime,
    /// The Gateway API Inference Extension's LoRA rule, as a baseline: [`crate::policy::adapter_affinity`].
    /// Not in [`PolicyKind::ALL`]: on a fleet without adapters it is `least_load`, so the benches that
    /// compare every policy would only run `least_load` twice; the LoRA bench
    /// (`host-test/examples/lora-bench.rs`) compares it.
    AdapterAffinity,
}

impl PolicyKind {
    pub const ALL: [PolicyKind; 7] = [
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
        PolicyKind::SessionHash,
        PolicyKind::PrefixAffinity,
        PolicyKind::KvAffinity,
        PolicyKind::KvTime,
        PolicyKind::KvLoad,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            PolicyKind::RoundRobin => "round_robin",
            PolicyKind::LeastLoad => "least_load",
            PolicyKind::SessionHash => "session_hash",
            PolicyKind::PrefixAffinity => "prefix_affinity",
            PolicyKind::KvAffinity => "kv_affinity",
            PolicyKind::KvLoad => "kv_load",
            PolicyKind::KvTime => "kv_time",
            PolicyKind::AdapterAffinity => "adapter_affinity",
        }
    }
}

/// `session_hash`: a consistent-hash ring on the session key.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionHashParams {
    /// Points per replica on the ring (Ray Serve's ConsistentHashRouter uses 100).
    pub virtual_nodes: usize,
    /// Seeds the hash of session keys: which sessions share a replica is one draw of the hash, and
    /// with tens of sessions per replica the draw decides how evenly their work is spread. Every proxy
    /// of a fleet must use the same value (0 by default), or they send a session to different
    /// replicas; the benchmark varies it with its seed so the baseline is measured over draws.
    pub ring_seed: u64,
}

impl Default for SessionHashParams {
    fn default() -> Self {
        Self {
            virtual_nodes: 100,
            ring_seed: 0,
        }
    }
}

/// `least_load`: the weights of a replica's load, in decode blocks, for the policy of that name and
/// for every load-only choice (`session_hash` without a session key, `prefix_affinity` below its
/// threshold, `adapter_affinity`, a request whose body was not read). Its own section, so changing
/// `kv_load`'s coefficients or preset does not move the baseline they are compared with.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LeastLoadParams {
    /// Decode blocks one queued or requested prefill block weighs (the same default as `kv_load`'s
    /// `prefill_scale`: a prefill block costs a replica about 16 decode blocks' time).
    pub prefill_scale: f64,
    /// Decode blocks one active request weighs (0: requests count by their blocks only).
    pub active_request_weight: f64,
}

impl Default for LeastLoadParams {
    fn default() -> Self {
        Self {
            prefill_scale: 16.0,
            active_request_weight: 0.0,
        }
    }
}

/// `prefix_affinity`: the approximate index of prefixes this router sent.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PrefixAffinityParams {
    /// Fraction of the request's blocks that must match on the best replica; below it, least load.
    pub match_threshold: f64,
    /// How long a recorded prefix is trusted (ms).
    pub ttl_ms: u64,
    /// Hard cap of each approximate index (token and text), in blocks.
    pub capacity_blocks: usize,
}

impl Default for PrefixAffinityParams {
    fn default() -> Self {
        Self {
            match_threshold: 0.1,
            ttl_ms: 600_000,
            capacity_blocks: 131_072,
        }
    }
}

/// Everything the routing core is told. Read from JSON through [`RoutingDoc`], which resolves the
/// fields that moved out of `kv_load`.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(try_from = "RoutingDoc")]
pub struct RoutingConfig {
    pub policy: PolicyKind,
    /// KV block size in tokens; must equal the engines'.
    pub block_size: usize,
    /// Hard cap of the KV index in distinct blocks.
    pub index_capacity_blocks: usize,
    /// Seed of the tie-break / softmax generator.
    pub seed: u64,
    /// How a block the KV index holds counts, for every policy (the tier credits).
    pub index: IndexParams,
    /// How the load table books requests and meets the replicas' reports, for every policy that
    /// reads load.
    pub load: LoadParams,
    /// The per-replica working set, for every policy with a cache term.
    pub working_set: WorkingSetParams,
    pub kv_load: KvLoadParams,
    pub kv_time: KvTimeParams,
    pub least_load: LeastLoadParams,
    pub session_hash: SessionHashParams,
    pub prefix_affinity: PrefixAffinityParams,
    /// Replica health learned from completions (`crate::health`).
    pub health: HealthParams,
    /// Request bodies larger than this are refused by the parser (the request is then routed by load).
    pub max_body_bytes: usize,
    /// Priority classes and shedding at saturation (`crate::admission`); absent: every request is
    /// admitted, as without the feature.
    pub admission: Option<crate::admission::AdmissionConfig>,
    /// LoRA adapters: which `model` names are adapters and what loading one costs
    /// ([`crate::adapters::AdapterParams`]); absent: no request is an adapter's.
    pub adapters: Option<crate::adapters::AdapterParams>,
    /// Not a setting: what the loader noticed in the document it read (an old field name in use),
    /// one line each for the host's log ([`RoutingConfig::warnings`]). Empty for a configuration
    /// built in code.
    pub notices: Vec<String>,
}

/// A routing configuration as written: `kv_load` still with the fields that moved out of it.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RoutingDoc {
    policy: PolicyKind,
    block_size: usize,
    index_capacity_blocks: usize,
    seed: u64,
    index: index::IndexSection,
    load: load::LoadSection,
    working_set: working_set::WorkingSetSection,
    kv_load: kv_load::KvLoadSection,
    kv_time: KvTimeParams,
    least_load: LeastLoadParams,
    session_hash: SessionHashParams,
    prefix_affinity: PrefixAffinityParams,
    health: HealthParams,
    max_body_bytes: usize,
    admission: Option<crate::admission::AdmissionConfig>,
    adapters: Option<crate::adapters::AdapterParams>,
}

impl Default for RoutingDoc {
    fn default() -> Self {
        let d = RoutingConfig::default();
        Self {
            policy: d.policy,
            block_size: d.block_size,
            index_capacity_blocks: d.index_capacity_blocks,
            seed: d.seed,
            index: index::IndexSection::default(),
            load: load::LoadSection::default(),
            working_set: working_set::WorkingSetSection::default(),
            kv_load: kv_load::KvLoadSection::default(),
            kv_time: d.kv_time,
            least_load: d.least_load,
            session_hash: d.session_hash,
            prefix_affinity: d.prefix_affinity,
            health: d.health,
            max_body_bytes: d.max_body_bytes,
            admission: d.admission,
            adapters: d.adapters,
        }
    }
}

impl TryFrom<RoutingDoc> for RoutingConfig {
    /// A refusal's message starts with the path of the field it is about (`index.host_tier_credit:
    /// ...`); [`RoutingConfig::from_json`] makes that its field.
    type Error = String;

    fn try_from(d: RoutingDoc) -> Result<Self, String> {
        let mut notices = Vec::new();
        let (kv_load, moved) = d.kv_load.split();
        let index = d.index.resolve(moved.index, &mut notices)?;
        let load = d.load.resolve(moved.load, moved.load_base, &mut notices)?;
        let working_set = d.working_set.resolve(moved.working_set, &mut notices)?;
        Ok(RoutingConfig {
            policy: d.policy,
            block_size: d.block_size,
            index_capacity_blocks: d.index_capacity_blocks,
            seed: d.seed,
            index,
            load,
            working_set,
            kv_load,
            kv_time: d.kv_time,
            least_load: d.least_load,
            session_hash: d.session_hash,
            prefix_affinity: d.prefix_affinity,
            health: d.health,
            max_body_bytes: d.max_body_bytes,
            admission: d.admission,
            adapters: d.adapters,
            notices,
        })
    }
}

impl RoutingConfig {
    /// Settings that work but are on their way out (an old field name, with its new place), one line
    /// each for the host's log; nothing is refused for them.
    pub fn warnings(&self) -> Vec<String> {
        self.notices.clone()
    }
}

impl Default for RoutingConfig {
    fn default() -> Self {
        Self {
            policy: PolicyKind::KvTime,
            block_size: 16,
            index_capacity_blocks: 1_000_000,
            seed: 0x006B_7673_7465_6572, // "kvsteer"
            index: IndexParams::default(),
            load: LoadParams::default(),
            working_set: WorkingSetParams::default(),
            kv_load: KvLoadParams::default(),
            kv_time: KvTimeParams::default(),
            least_load: LeastLoadParams::default(),
            session_hash: SessionHashParams::default(),
            prefix_affinity: PrefixAffinityParams::default(),
            health: HealthParams::default(),
            max_body_bytes: 4 << 20,
            admission: None,
            adapters: None,
            notices: Vec::new(),
        }
    }
}

/// One moved field (`new_path`, formerly `old_path`): its new place's value, else its old name's
/// (with a warning in `warnings`), else `default`; both given is refused, naming the new place first.
fn pick<T>(
    new_path: &str,
    old_path: &str,
    new: Option<T>,
    old: Option<T>,
    default: T,
    warnings: &mut Vec<String>,
) -> Result<T, String> {
    match (new, old) {
        (Some(_), Some(_)) => Err(format!(
            "{new_path}: also set as {old_path}, its old name; keep only {new_path}"
        )),
        (Some(v), None) => Ok(v),
        (None, Some(v)) => {
            warnings.push(format!(
                "{old_path} is deprecated and will be removed in the next release: \
                 set {new_path} instead (it applies to every policy)"
            ));
            Ok(v)
        }
        (None, None) => Ok(default),
    }
}

/// Most virtual nodes per replica accepted (the ring has replicas x virtual_nodes points).
pub const MAX_VIRTUAL_NODES: usize = 10_000;

#[cfg(test)]
mod tests;
