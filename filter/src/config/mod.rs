//! The filter's plugin configuration (JSON, delivered in `on_configure`).
//!
//! Everything has a default except the replica list (which may be empty when a `discovery` section
//! reads the members at run time). Unknown fields are refused with a message that
//! names them: a typo in a production config must not silently fall back to a default.
//!
//! This file holds [`FilterConfig`] and its entry points (`from_json`, `validate`, `warnings`);
//! each concept's types, defaults, checks and tests are in a file of its own: `replicas.rs` (the
//! replica list and its data-parallel ranks), `headers.rs` (the header names and the output mode),
//! `feeds.rs` (feed polling), `pd.rs` (prefill/decode), `peers.rs` (other proxies), `discovery.rs`
//! (membership at run time), `tokenizer.rs` (the `tokenizer` section) and `admission.rs` (shedding
//! against the rest). `tests.rs` holds the fixtures they share and the tests of the whole.

use kvsteer_core::config::RoutingConfig;
use serde::Deserialize;

mod admission;
mod discovery;
mod feeds;
mod headers;
mod pd;
mod peers;
mod pools;
mod replicas;
mod tokenizer;
pub use discovery::{DEFAULT_DISCOVERY_PATH, DiscoverySection, slot_name};
pub use headers::OutputMode;
pub use pd::PdSection;
pub use peers::{DEFAULT_PEER_PATH, DEFAULT_PEER_TOKEN_HEADER, PeerSpec, PeersSection};
pub use pools::{GatewayConfig, MAX_POOLS, PoolChoice, PoolConfig};
pub(crate) use replicas::valid_name;
pub use replicas::{MAX_UNITS, ReplicaSpec, Unit};
pub use tokenizer::TokenizerSection;

fn d_prefix() -> String {
    "kvsteer".into()
}
fn d_peer_ttl() -> u64 {
    5000
}
fn d_early_max() -> usize {
    64 << 20
}
fn d_hold_max() -> usize {
    64 << 20
}
fn d_true() -> bool {
    true
}

#[derive(Clone, Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FilterConfig {
    /// The static replicas; absent or empty only with a `discovery` section (`validate` says so).
    #[serde(default)]
    pub replicas: Vec<ReplicaSpec>,
    /// The routing units built from `replicas` at configure time (one per data-parallel rank)
    /// and the discovery slots after them; never read from JSON. The router, the load table, the
    /// shared records and the metrics are indexed by unit, and discovery seats members here, so
    /// `replicas` stays the list as the operator wrote it.
    #[serde(skip)]
    pub units: Vec<Unit>,
    /// Policy, coefficients, block size, index cap: see the routing section of
    /// docs/reference/configuration.md.
    #[serde(default)]
    pub routing: RoutingConfig,
    /// How often each replica's feed is polled.
    #[serde(default = "feeds::d_feed_period")]
    pub feed_period_ms: u64,
    /// Timer period: peer load is exchanged every tick, feeds polled when their period is due.
    #[serde(default = "feeds::d_tick")]
    pub tick_ms: u64,
    #[serde(default = "feeds::d_feed_timeout")]
    pub feed_timeout_ms: u64,
    /// The longest wait between polls of a replica that cannot be reached (connection refused or
    /// reset): after the polls that mark it down, the wait doubles from two periods up to this (at
    /// or below `feed_period_ms`: no backoff, every period as before).
    #[serde(default = "feeds::d_feed_backoff_max")]
    pub feed_backoff_max_ms: u64,
    /// Consecutive failed polls after which a replica's cache view is treated as stale.
    #[serde(default = "feeds::d_stale_after")]
    pub stale_after_failures: u32,
    /// Events asked per poll; an answer with more is refused (counted as oversized).
    #[serde(default = "feeds::d_max_events")]
    pub feed_max_events: u32,
    /// Feed answers with a body over this many bytes are refused unread (counted as oversized): the
    /// feed goes stale, the replica is not marked down.
    #[serde(default = "feeds::d_feed_max_bytes")]
    pub feed_max_bytes: usize,
    /// Block hashes (and events) this worker applies to its index per tick, all replicas together;
    /// a larger batch is applied in slices over the next ticks.
    #[serde(default = "feeds::d_feed_apply_blocks")]
    pub feed_apply_blocks_per_tick: u32,
    /// Microseconds of the proxy's clock this worker may spend applying feed batches per tick, all
    /// replicas together (0: no time bound, only the block budget). A block count alone bounds the
    /// stall per tick only on a machine as fast as the one it was sized on; a slow or busy machine
    /// takes milliseconds for the same count, during which the worker serves no request. Each
    /// replica with work left still gets a first slice of up to 256 blocks a tick whatever the
    /// clock says, so every batch completes. 500 us is 0.5% of the default 100 ms tick.
    #[serde(default = "feeds::d_feed_apply_us")]
    pub feed_apply_us_per_tick: u32,
    /// Prepended to the feed path, for replicas whose feed sits behind a path prefix.
    #[serde(default = "feeds::d_feed_path_prefix")]
    pub feed_path_prefix: String,
    #[serde(default = "headers::d_session_header")]
    pub session_header: String,
    #[serde(default = "headers::d_destination_header")]
    pub destination_header: String,
    /// Header carrying the chosen data-parallel rank (vLLM reads `X-data-parallel-rank`), written
    /// only for replicas with `dp_ranks` > 1; a client's copy is always removed, like the destination
    /// header's: clients never pick a rank themselves.
    #[serde(default = "headers::d_rank_header")]
    pub rank_header: String,
    #[serde(default)]
    pub output: OutputMode,
    #[serde(default = "headers::d_cluster_header")]
    pub cluster_header: String,
    #[serde(default = "headers::d_nginx_variable")]
    pub nginx_variable: String,
    /// Prefix of shared-data keys. Istio leaves `vm_id` empty, so keys from several plugins would meet:
    /// give each plugin its own prefix.
    #[serde(default = "d_prefix")]
    pub shared_key_prefix: String,
    /// A peer worker's published load older than this is ignored (the worker is gone).
    #[serde(default = "d_peer_ttl")]
    pub peer_ttl_ms: u64,
    /// Destination-header mode: append the router's second choice (`IP:port,IP:port`) so Envoy's
    /// override_host policy retries there.
    #[serde(default = "d_true")]
    pub retry_backup: bool,
    /// Read a request body's slices as they arrive (Envoy hands each one over while the body is
    /// buffered) and follow a token-id prompt's ids as they come, so that little of the read is
    /// left for after the last byte (docs/design/filter.md, "The body as it arrives"). false: read
    /// the body only once it has all arrived.
    #[serde(default = "d_true")]
    pub early_body_scan: bool,
    /// Bytes of request bodies one VM may hold for the early scan, all its streams together (each
    /// counted by its buffer's capacity). A stream whose next slice would pass it is read only at
    /// the end, as without the scan, so slow uploads cannot make the VM's memory grow past it. The
    /// scan keeps only the part of a body it has not read yet (about one slice of a token-id
    /// prompt), so this is reached only by bodies whose members before the prompt are that large.
    #[serde(default = "d_early_max")]
    pub early_body_scan_max_bytes: usize,
    /// Bytes of request bodies the proxy may buffer for one VM's streams while the filter holds
    /// them for their route, all its streams together (each counted by what has arrived, or by its
    /// `content-length` up to `routing.max_body_bytes` when it declares one). The proxy must buffer
    /// a body until the filter has routed it, so without a bound many slow uploads make the proxy
    /// hold all of them at once; a stream that would pass it is routed by load at once, its body
    /// unread (`kvsteer_body_hold_fallbacks`), and flows on unbuffered by the filter.
    #[serde(default = "d_hold_max")]
    pub body_hold_max_bytes: usize,
    /// A response header that carries, for each request `kv_time` routes, every candidate's cost
    /// terms and the winner (docs/reference/configuration.md); absent (the default): none. Set only here: a
    /// client cannot ask for it, and an upstream's header of the same name is replaced.
    #[serde(default)]
    pub explain_header: Option<String>,
    /// Tokenize text prompts as the engine does (chat template + BPE) for the exact KV identity.
    /// Absent: text prompts keep the approximate identity (see docs/design/tokenizer.md).
    #[serde(default)]
    pub tokenizer: Option<TokenizerSection>,
    /// Prefill/decode disaggregation settings (used only when some replica has a role other than
    /// `both`).
    #[serde(default)]
    pub pd: PdSection,
    /// The working-set exchange with other proxies (docs/reports/proxies.md). Absent (the default):
    /// this proxy polls no peer and answers the reserved path with 404.
    #[serde(default)]
    pub peers: Option<PeersSection>,
    /// Membership read at run time (docs/design/discovery.md); `None`: the static list only.
    #[serde(default)]
    pub discovery: Option<DiscoverySection>,
}

/// A refused configuration is the routing core's [`ConfigError`], its field named by the dotted path
/// from the plugin configuration's root (`replicas[0].endpoint`), so the filter, `kvsteer-check` and
/// the routing core refuse with one type.
pub use kvsteer_core::ConfigError;

/// Refuses the plugin configuration's `field`: printed `field: message`.
fn err<T>(field: impl Into<String>, message: impl Into<String>) -> Result<T, ConfigError> {
    Err(ConfigError::at(field, message))
}

impl FilterConfig {
    /// Reads the plugin configuration, refuses what is wrong, builds the routing units (each
    /// data-parallel rank one) and adds the discovery slots: the configuration the filter runs with.
    pub fn from_json(bytes: &[u8]) -> Result<FilterConfig, ConfigError> {
        let mut cfg: FilterConfig = serde_json::from_slice(bytes)
            .map_err(|e| ConfigError::at("plugin configuration", e.to_string()))?;
        cfg.validate()?;
        cfg.build_units()?;
        cfg.add_discovery_slots();
        Ok(cfg)
    }

    /// Refuses the first setting that is wrong, by its field; each section's checks are in its
    /// file, called in this order.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.replicas.is_empty() && self.discovery.is_none() {
            return err(
                "replicas",
                "at least one replica is required (or a discovery section)",
            );
        }
        if let Some(d) = &self.discovery {
            d.validate(self)?;
        }
        self.validate_replicas()?;
        self.validate_headers()?;
        self.validate_feed_polling()?;
        if !valid_name(&self.shared_key_prefix) {
            return err(
                "shared_key_prefix",
                format!(
                    "{:?} must be 1-64 of [A-Za-z0-9._-]",
                    self.shared_key_prefix
                ),
            );
        }
        if !self.feed_path_prefix.is_empty() && !self.feed_path_prefix.starts_with('/') {
            return err("feed_path_prefix", "must start with '/'");
        }
        self.routing
            .validate()
            .map_err(|e| ConfigError::at("routing", e.to_string()))?;
        self.validate_admission()?;
        self.validate_pd()?;
        if let Some(p) = &self.peers {
            p.validate(self.tick_ms)?;
        }
        self.validate_tokenizer()
    }

    /// What a valid configuration is still likely wrong about: settings that work but do not fit
    /// together, one line each for the proxy's log (nothing is refused for them). Kept beside
    /// [`FilterConfig::validate`] so every cross-check of the configuration is in one place.
    pub fn warnings(&self) -> Vec<String> {
        use kvsteer_core::config::{PolicyKind, ReportedLoad};
        // The routing section's own: a setting under its old name (still applied for one release).
        let mut out = self.routing.warnings();
        if self.peers.is_some()
            && self.routing.policy == PolicyKind::KvLoad
            && !matches!(
                self.routing.load.reported_load,
                ReportedLoad::Merge | ReportedLoad::Others
            )
        {
            // Measured (docs/reports/proxies.md): the peers' working set without their load gathers
            // cold sessions on replicas whose queues this proxy cannot see.
            out.push(
                "peers is meant for routing.load.reported_load merge or others: without either \
                 this proxy sees every proxy's sessions but only its own load"
                    .into(),
            );
        }
        out
    }
}

#[cfg(test)]
mod tests;
