//! LoRA adapters: which adapter a request asks for, and where each replica stands with it.
//!
//! vLLM serves an adapter when the OpenAI `model` field names it (`--lora-modules name=path`, or one
//! loaded at run time); a replica holds at most `--max-loras` adapters on the GPU at once, and a
//! request whose adapter is not there waits for it to be loaded before its first token. The feed's
//! adapter section ([`crate::feed::AdapterReport`]) says which adapters each replica's running and
//! waiting requests use and how many slots it has; the router keeps it per replica as an
//! [`AdapterView`] and tells the policy, per replica, an [`AdapterFit`] for the request.

use serde::Deserialize;

use crate::config::ConfigError;
use crate::feed::AdapterReport;

/// Most names in `adapters.base_models`.
pub const MAX_BASE_MODELS: usize = 64;

/// `adapters`: how the router tells a request for an adapter from one for a base model, and what
/// loading an adapter costs. Absent from the configuration: no request is an adapter's, and no
/// policy sees any adapter term (as before the feature).
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdapterParams {
    /// Model names that are base models, not adapters (default: none). A request whose `model` is
    /// not one of these names an adapter; a request without `model` names none. vLLM serves the base
    /// under its `--served-model-name` and every adapter under its own name, so listing the served
    /// names is enough.
    pub base_models: Vec<String>,
    /// Milliseconds a replica takes to load an adapter it does not hold before the request's first
    /// token (default 300). An assumption of the order of reading a rank-16 adapter of an 8B model
    /// (tens to a few hundred MB) from local disk and copying it to the GPU, not a measured figure:
    /// set it from the engine's own logs.
    pub load_ms: f64,
}

impl Default for AdapterParams {
    fn default() -> Self {
        AdapterParams {
            base_models: Vec::new(),
            load_ms: 300.0,
        }
    }
}

impl AdapterParams {
    pub fn validate(&self) -> Result<(), ConfigError> {
        let err = |field: &str, message: String| ConfigError::routing(field, message);
        if !(self.load_ms.is_finite() && (0.0..=600_000.0).contains(&self.load_ms)) {
            return Err(err(
                "adapters.load_ms",
                format!("must be 0..=600000 ms, got {}", self.load_ms),
            ));
        }
        if self.base_models.len() > MAX_BASE_MODELS {
            return Err(err(
                "adapters.base_models",
                format!("at most {MAX_BASE_MODELS} names"),
            ));
        }
        if self
            .base_models
            .iter()
            .any(|m| m.is_empty() || m.len() > 255)
        {
            return Err(err(
                "adapters.base_models",
                "a model name must be 1-255 bytes".into(),
            ));
        }
        Ok(())
    }

    /// The adapter a request for `model` asks for: the name, unless it is a base model's.
    pub fn adapter_of<'a>(&self, model: Option<&'a str>) -> Option<&'a str> {
        model.filter(|m| !m.is_empty() && !self.base_models.iter().any(|b| b == m))
    }

    /// [`AdapterParams::load_ms`] in seconds.
    pub fn load_s(&self) -> f64 {
        self.load_ms / 1000.0
    }
}

/// One replica's adapters as its feed last reported them, names kept as hashes (8 bytes each,
/// whatever the names' length).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AdapterView {
    /// Adapter slots (`--max-loras`); 0: not known.
    slots: u32,
    /// Adapters running or waiting there.
    held: Vec<u64>,
    /// Distinct adapters of its running requests: the slots in use.
    occupied: u32,
}

impl AdapterView {
    pub fn new(r: &AdapterReport) -> AdapterView {
        let mut running: Vec<u64> = r.running.iter().map(|n| name_hash(n)).collect();
        running.sort_unstable();
        running.dedup();
        let occupied = running.len() as u32;
        let mut held = running;
        held.extend(r.waiting.iter().map(|n| name_hash(n)));
        held.sort_unstable();
        held.dedup();
        AdapterView {
            slots: r.slots,
            held,
            occupied,
        }
    }

    /// Where a request for adapter `name` (hashed with [`name_hash`]) stands here.
    pub fn fit(&self, name: u64) -> AdapterFit {
        if self.held.binary_search(&name).is_ok() {
            AdapterFit::Held
        } else if self.slots == 0 || self.occupied < self.slots {
            AdapterFit::FreeSlot
        } else {
            AdapterFit::Full
        }
    }
}

/// Where a request's adapter stands on one replica.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum AdapterFit {
    /// The request names no adapter, or the replica does not report its adapters: no adapter term.
    #[default]
    Unknown,
    /// Loaded or being loaded there (a running or waiting request uses it).
    Held,
    /// Not there, and a slot is free (or the slots are not known): it must be loaded.
    FreeSlot,
    /// Not there, and every slot is taken by a running request's adapter: it must be loaded in
    /// place of one.
    Full,
}

impl AdapterFit {
    /// Whether the replica must load the adapter before the request's first token.
    pub fn must_load(self) -> bool {
        matches!(self, AdapterFit::FreeSlot | AdapterFit::Full)
    }
}

/// A name's hash (FNV-1a, 64 bits): stable across proxies and builds.
pub fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_names_an_adapter_unless_it_is_a_base() {
        let p = AdapterParams {
            base_models: vec!["llama".into()],
            ..AdapterParams::default()
        };
        assert_eq!(p.adapter_of(Some("sql-lora")), Some("sql-lora"));
        assert_eq!(p.adapter_of(Some("llama")), None);
        assert_eq!(p.adapter_of(None), None);
        assert_eq!(p.adapter_of(Some("")), None);
        assert!(p.validate().is_ok());
        let bad = AdapterParams {
            load_ms: f64::NAN,
            ..AdapterParams::default()
        };
        assert_eq!(bad.validate().unwrap_err().field, "adapters.load_ms");
    }

    #[test]
    fn fit_reads_held_then_free_slots() {
        let r = AdapterReport {
            slots: 2,
            running: vec!["a".into(), "b".into(), "a".into()],
            waiting: vec!["c".into()],
        };
        let v = AdapterView::new(&r);
        assert_eq!(v.fit(name_hash("a")), AdapterFit::Held);
        assert_eq!(v.fit(name_hash("c")), AdapterFit::Held);
        assert_eq!(v.fit(name_hash("d")), AdapterFit::Full);
        let one = AdapterView::new(&AdapterReport {
            slots: 2,
            running: vec!["a".into()],
            waiting: vec![],
        });
        assert_eq!(one.fit(name_hash("d")), AdapterFit::FreeSlot);
        assert!(AdapterFit::Full.must_load() && !AdapterFit::Held.must_load());
        assert!(!AdapterFit::Unknown.must_load());
    }
}
