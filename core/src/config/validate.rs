//! Parsing and the whole document's checks; each section with rules of its own checks itself.

use super::{ConfigError, MAX_VIRTUAL_NODES, RoutingConfig, err, non_negative};
use crate::block::MAX_BLOCK_SIZE;

impl RoutingConfig {
    /// Parses and validates. An empty document (`{}`) is the default configuration.
    pub fn from_json(s: &str) -> Result<Self, ConfigError> {
        let de = &mut serde_json::Deserializer::from_str(s);
        let cfg: RoutingConfig = serde_path_to_error::deserialize(de).map_err(|e| {
            // serde_path_to_error's path includes an unknown field's own name.
            let field = e.path().to_string();
            let msg = e.into_inner().to_string();
            // A refusal of the whole document's resolution (a moved field given under both names)
            // names its field first.
            match msg.split_once(": ") {
                Some((f, m))
                    if field == "."
                        && ["index.", "load.", "working_set."]
                            .iter()
                            .any(|s| f.starts_with(s)) =>
                {
                    err(f, m)
                }
                _ => err(&field, msg),
            }
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks ranges that types alone do not.
    pub fn validate(&self) -> Result<(), ConfigError> {
        if self.block_size == 0 || self.block_size > MAX_BLOCK_SIZE {
            return Err(err(
                "block_size",
                format!("must be 1..={MAX_BLOCK_SIZE}, got {}", self.block_size),
            ));
        }
        if self.index_capacity_blocks == 0 || self.index_capacity_blocks > u32::MAX as usize {
            return Err(err("index_capacity_blocks", "must be 1..=4294967295"));
        }
        self.health.validate()?;
        self.kv_time.validate()?;
        if let Some(a) = &self.adapters {
            a.validate()?;
        }
        self.index.validate()?;
        self.working_set.validate()?;
        self.kv_load.validate()?;
        non_negative("least_load.prefill_scale", self.least_load.prefill_scale)?;
        non_negative(
            "least_load.active_request_weight",
            self.least_load.active_request_weight,
        )?;
        let t = self.prefix_affinity.match_threshold;
        if !(0.0..=1.0).contains(&t) {
            return Err(err(
                "prefix_affinity.match_threshold",
                format!("must be between 0 and 1, got {t}"),
            ));
        }
        let vn = self.session_hash.virtual_nodes;
        if vn == 0 || vn > MAX_VIRTUAL_NODES {
            return Err(err(
                "session_hash.virtual_nodes",
                format!("must be 1..={MAX_VIRTUAL_NODES}, got {vn}"),
            ));
        }
        if self.prefix_affinity.capacity_blocks == 0 {
            return Err(err("prefix_affinity.capacity_blocks", "must be >= 1"));
        }
        if self.max_body_bytes == 0 {
            return Err(err("max_body_bytes", "must be >= 1"));
        }
        if let Some(a) = &self.admission {
            a.validate()?;
        }
        Ok(())
    }
}
