//! The `kv_load` section: the block-count cost's coefficients, its presets from published routers,
//! and their checks.

use serde::Deserialize;

use super::load::{LoadParams, ReportedLoad};
use super::{ConfigError, err, index, load, non_negative, working_set};

/// The fields `kv_load` gave up to other sections, as written under their old names (each as its
/// new section would hold them), and the values its preset gives the moved `load` fields.
pub(super) struct Moved {
    pub index: index::IndexSection,
    pub load: load::LoadSection,
    /// What the `load` fields are when neither their new nor their old name gives them: the
    /// preset's, else the defaults (a preset kept setting them when they moved).
    pub load_base: LoadParams,
    pub working_set: working_set::WorkingSetSection,
}

/// Coefficients of the `kv_load` cost (docs/design/design.md section 2.1). Its defaults are
/// kvsteer's own (see `Default`); NVIDIA Dynamo's KV router's are the `dynamo` preset.
/// Read from JSON as part of a [`super::RoutingConfig`], through [`KvLoadSection`].
#[derive(Clone, Debug, PartialEq)]
pub struct KvLoadParams {
    /// A named set of the fields below, from a published router (see [`KvLoadPreset`]); fields given
    /// next to it in the same section override the preset's values.
    pub preset: Option<KvLoadPreset>,
    /// Weight of prefill blocks against decode blocks.
    pub prefill_scale: f64,
    /// `c`: how much a cached block discounts the request's prefill blocks.
    pub overlap_credit: f64,
    /// `d`: the overlap credit decays on a replica whose queued prefill exceeds the least-loaded
    /// candidate's: `credit = c / (1 + d * excess_prefill_blocks / request_blocks)`. 0 (Dynamo's
    /// default) keeps the full credit; Ray's "balanced" preset uses 1, so a busy cache holder stops
    /// attracting every request of its prefix.
    pub overlap_credit_decay: f64,
    /// `q`: weight of the prefill already queued on a replica against the request's own uncached
    /// blocks. 1 (Dynamo's and Ray's formula) prices a block waited for like a block computed; below
    /// 1, a move must save more than the prefill it adds, because the queue ahead is work the fleet
    /// does anyway while a move adds work (and evicts another session's cache to hold it).
    pub queue_weight: f64,
    /// The queue's weight for a request no replica holds any of; `None` (the default): `queue_weight`
    /// for every request. `queue_weight` below 1 protects a session's cache against a move, and a
    /// request nothing is cached for has nothing to protect, so its wait can count in full. Between
    /// the two by the share of the request the best-placed replica holds: `queue_weight + (cold -
    /// queue_weight) * (1 - best overlap / request blocks)`.
    pub cold_queue_weight: Option<f64>,
    /// The queue's weight for a short prompt; `None` (the default): as for any other. `queue_weight`
    /// below 1 stands for what a move costs beyond the request's own uncached blocks: the contexts it
    /// pushes out of the destination's cache to hold the request. A short prompt pushes out little,
    /// and its time to first token is mostly the queue it waits behind, so its wait can count more.
    /// Applies in full to prompts of at most `short_prompt_tokens`, fading linearly to the other
    /// weights at twice that.
    pub short_queue_weight: Option<f64>,
    /// With `short_queue_weight`: the prompt length (tokens) up to which it applies in full.
    pub short_prompt_tokens: f64,
    /// Price prefill in decode time (kvsteer's cost, docs/design/design.md section 2): the prefill term is
    /// scaled by `(1 + context / attention_context_tokens) * 256 / expected_output`, so a block of
    /// prefill weighs more for a long context (attention grows with it) and less for a request that
    /// will decode for long (it pays every decode block beside it at every step). `prefill_scale` is
    /// then the weight for a short request expecting 256 output tokens. Off in the presets.
    pub time_cost: bool,
    /// With `time_cost`: the context length at which a prefill token's attention costs as much as its
    /// linear layers (about 25,000 for Llama-3.1-8B: 4 x 32 layers x 4,096 FLOP per context token
    /// against 2 x 8B per token; larger for wider models).
    pub attention_context_tokens: f64,
    /// `w`: cost per active request.
    pub active_request_weight: f64,
    /// 0: argmin with seeded random tie-break; > 0: softmax sampling.
    pub temperature: f64,
    /// Count a prefix block active on a replica once however many requests share it, and charge a
    /// request only the blocks not already active there (Dynamo's `router_assume_kv_reuse`).
    pub assume_kv_reuse: bool,
    /// Weight of the working-set term; 0 turns it off. The term prices the cache a placement makes
    /// a replica lose: the prompt blocks requested there within `working_set.window_ms` are its
    /// working set, and a placement that grows it past the replica's cache costs `overflow_weight`
    /// times the prefill of what the cache stops keeping ([`resident_value`]
    /// (crate::policy::kv_load::resident_value), [`crate::working_set`]).
    pub overflow_weight: f64,
    /// Prefix-cache size of one replica in tokens; 0: learned from the feed, as the most blocks the
    /// replica has held once it has evicted one (until then, like the largest another has shown).
    pub replica_cache_tokens: f64,
    /// How the cache's value falls past its size ([`crate::policy::kv_load::resident_value`]).
    pub overflow_softness: f64,
    /// Scale `overflow_weight` by how far the traffic's reuse share (the share of recently requested
    /// blocks that had been requested before) is above this floor: nothing at or below it, all of
    /// it at a share of 1 ([`crate::policy::kv_load::reuse_ramp`]). 0: the weight as given.
    pub overflow_reuse_floor: f64,
    /// Book queued prefill in time ([`crate::load::prefill_work`]: each uncached token weighted by
    /// its attention over its context) and price a replica's queue by that, not by the incoming
    /// request's attention. With `time_cost` only (otherwise the queue is in tokens, as before).
    pub queue_in_time: bool,
}

impl KvLoadParams {
    /// Whether queued prefill is booked and priced in time: `queue_in_time`, which needs the time
    /// cost. The router's bookings and `kv_load`'s pricing both ask here, so they cannot disagree.
    pub fn queue_in_time_active(&self) -> bool {
        self.queue_in_time && self.time_cost
    }
}

/// Named `kv_load` settings from routers users would otherwise pick (docs/reference/configuration.md).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KvLoadPreset {
    /// NVIDIA Dynamo 1.6's KV router defaults: c 1, d 0, prefill scale 1, w 0, argmin, prompt blocks
    /// from admission, shared blocks once, scored on the router's own bookings.
    Dynamo,
    /// Ray Serve LLM's "balanced" coding-agent preset: c 0.5, d 1, prefill scale 1, w 32 blocks,
    /// argmin, decode progress on.
    RayBalanced,
    /// Ray Serve LLM's "KV-biased" preset: c 2, d 0, prefill scale 1, w 0, decode progress on.
    RayKvBiased,
}

impl KvLoadPreset {
    /// The preset's values for every `kv_load` field; the `load` fields it sets are
    /// [`KvLoadPreset::load`]'s.
    pub fn params(self) -> KvLoadParams {
        let common = KvLoadParams {
            preset: Some(self),
            prefill_scale: 1.0,
            temperature: 0.0,
            assume_kv_reuse: true,
            // Their formula: queued and own prefill blocks alike, no time cost, no working-set term.
            queue_weight: 1.0,
            time_cost: false,
            overflow_weight: 0.0,
            ..KvLoadParams::default()
        };
        match self {
            KvLoadPreset::Dynamo => KvLoadParams {
                overlap_credit: 1.0,
                overlap_credit_decay: 0.0,
                active_request_weight: 0.0,
                ..common
            },
            KvLoadPreset::RayBalanced => KvLoadParams {
                overlap_credit: 0.5,
                overlap_credit_decay: 1.0,
                active_request_weight: 32.0,
                ..common
            },
            KvLoadPreset::RayKvBiased => KvLoadParams {
                overlap_credit: 2.0,
                overlap_credit_decay: 0.0,
                active_request_weight: 0.0,
                ..common
            },
        }
    }

    /// The preset's values for the fields that moved to the `load` section, which a preset still
    /// sets (unless `load`, or the old name under `kv_load`, gives them): Dynamo's accounting
    /// (prompt blocks from admission), scored on the router's own bookings, decode progress on in
    /// Ray's presets.
    pub fn load(self) -> LoadParams {
        LoadParams {
            reported_load: ReportedLoad::Ignore,
            prompt_blocks_at_admission: true,
            use_output_hint: match self {
                KvLoadPreset::Dynamo => false,
                KvLoadPreset::RayBalanced | KvLoadPreset::RayKvBiased => true,
            },
        }
    }
}

/// The `kv_load` section as written: every field optional, so a field given next to a preset
/// overrides it and the rest come from the preset (or the defaults). Deserializing through it keeps
/// serde's field paths in errors, wherever the section is embedded (the filter's configuration too).
/// It still reads the fields that moved to other sections under their old names, for one release
/// ([`KvLoadSection::split`]).
#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub(super) struct KvLoadSection {
    preset: Option<KvLoadPreset>,
    prefill_scale: Option<f64>,
    overlap_credit: Option<f64>,
    overlap_credit_decay: Option<f64>,
    queue_weight: Option<f64>,
    cold_queue_weight: Option<f64>,
    short_queue_weight: Option<f64>,
    short_prompt_tokens: Option<f64>,
    time_cost: Option<bool>,
    attention_context_tokens: Option<f64>,
    active_request_weight: Option<f64>,
    temperature: Option<f64>,
    host_tier_credit: Option<f64>,
    disk_tier_credit: Option<f64>,
    use_output_hint: Option<bool>,
    prompt_blocks_at_admission: Option<bool>,
    assume_kv_reuse: Option<bool>,
    reported_load: Option<ReportedLoad>,
    replica_cache_tokens: Option<f64>,
    working_set_window_ms: Option<f64>,
    working_set_sample: Option<u64>,
    overflow_weight: Option<f64>,
    overflow_softness: Option<f64>,
    working_set_from_feed: Option<bool>,
    overflow_reuse_floor: Option<f64>,
    queue_in_time: Option<bool>,
}

impl KvLoadSection {
    /// The section's own values (a preset's, overridden by the fields given beside it), and the
    /// moved fields given here under their old names.
    pub(super) fn split(self) -> (KvLoadParams, Moved) {
        let s = self;
        let moved = Moved {
            index: index::IndexSection {
                host_tier_credit: s.host_tier_credit,
                disk_tier_credit: s.disk_tier_credit,
            },
            load: load::LoadSection {
                reported_load: s.reported_load,
                prompt_blocks_at_admission: s.prompt_blocks_at_admission,
                use_output_hint: s.use_output_hint,
            },
            load_base: s.preset.map(KvLoadPreset::load).unwrap_or_default(),
            working_set: working_set::WorkingSetSection {
                window_ms: s.working_set_window_ms,
                sample: s.working_set_sample,
                from_feed: s.working_set_from_feed,
            },
        };
        let base = s.preset.map(KvLoadPreset::params).unwrap_or_default();
        let params = KvLoadParams {
            preset: s.preset,
            prefill_scale: s.prefill_scale.unwrap_or(base.prefill_scale),
            overlap_credit: s.overlap_credit.unwrap_or(base.overlap_credit),
            overlap_credit_decay: s.overlap_credit_decay.unwrap_or(base.overlap_credit_decay),
            queue_weight: s.queue_weight.unwrap_or(base.queue_weight),
            cold_queue_weight: s.cold_queue_weight.or(base.cold_queue_weight),
            short_queue_weight: s.short_queue_weight.or(base.short_queue_weight),
            short_prompt_tokens: s.short_prompt_tokens.unwrap_or(base.short_prompt_tokens),
            time_cost: s.time_cost.unwrap_or(base.time_cost),
            attention_context_tokens: s
                .attention_context_tokens
                .unwrap_or(base.attention_context_tokens),
            active_request_weight: s
                .active_request_weight
                .unwrap_or(base.active_request_weight),
            temperature: s.temperature.unwrap_or(base.temperature),
            assume_kv_reuse: s.assume_kv_reuse.unwrap_or(base.assume_kv_reuse),
            replica_cache_tokens: s.replica_cache_tokens.unwrap_or(base.replica_cache_tokens),
            overflow_weight: s.overflow_weight.unwrap_or(base.overflow_weight),
            overflow_softness: s.overflow_softness.unwrap_or(base.overflow_softness),
            overflow_reuse_floor: s.overflow_reuse_floor.unwrap_or(base.overflow_reuse_floor),
            queue_in_time: s.queue_in_time.unwrap_or(base.queue_in_time),
        };
        (params, moved)
    }
}

impl Default for KvLoadParams {
    fn default() -> Self {
        // kvsteer's defaults: Dynamo's accounting, scored on the router's own bookings, with prefill
        // priced in decode time (`time_cost`): a move re-prefills a whole context (up to ~100K tokens
        // on coding agents, with attention growing with its length), which block counts alone
        // undervalue against decode blocks, while a request that decodes for long (RL stragglers)
        // gains most from a lightly loaded replica. The queue already on a replica weighs a quarter
        // of the request's own uncached blocks: the fleet computes that queue wherever this request
        // goes, but a move adds its prefill and evicts another session's cache to hold it. Measured
        // in docs/reports/results.md (the ablation table walks from the dynamo preset to these).
        Self {
            preset: None,
            prefill_scale: 16.0,
            overlap_credit: 1.0,
            overlap_credit_decay: 0.0,
            queue_weight: 0.25,
            cold_queue_weight: None,
            short_queue_weight: None,
            short_prompt_tokens: 16_384.0,
            time_cost: true,
            attention_context_tokens: 25_000.0,
            active_request_weight: 0.0,
            temperature: 0.0,
            assume_kv_reuse: true,
            replica_cache_tokens: 0.0,
            overflow_weight: 0.3,
            overflow_softness: 0.25,
            overflow_reuse_floor: 0.0,
            queue_in_time: false,
        }
    }
}

impl KvLoadParams {
    /// Checks ranges that types alone do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let k = self;
        non_negative("kv_load.prefill_scale", k.prefill_scale)?;
        non_negative("kv_load.overlap_credit", k.overlap_credit)?;
        non_negative("kv_load.overlap_credit_decay", k.overlap_credit_decay)?;
        non_negative("kv_load.queue_weight", k.queue_weight)?;
        if let Some(c) = k.cold_queue_weight {
            non_negative("kv_load.cold_queue_weight", c)?;
        }
        if let Some(c) = k.short_queue_weight {
            non_negative("kv_load.short_queue_weight", c)?;
        }
        non_negative("kv_load.short_prompt_tokens", k.short_prompt_tokens)?;
        non_negative("kv_load.replica_cache_tokens", k.replica_cache_tokens)?;
        non_negative("kv_load.overflow_weight", k.overflow_weight)?;
        non_negative("kv_load.overflow_softness", k.overflow_softness)?;
        if !(k.attention_context_tokens.is_finite() && k.attention_context_tokens >= 1.0) {
            return Err(err(
                "kv_load.attention_context_tokens",
                format!(
                    "must be a finite number >= 1, got {}",
                    k.attention_context_tokens
                ),
            ));
        }
        non_negative("kv_load.active_request_weight", k.active_request_weight)?;
        non_negative("kv_load.temperature", k.temperature)?;
        let v = k.overflow_reuse_floor;
        if !(0.0..=1.0).contains(&v) {
            return Err(err(
                "kv_load.overflow_reuse_floor",
                format!("must be between 0 and 1, got {v}"),
            ));
        }
        Ok(())
    }
}
