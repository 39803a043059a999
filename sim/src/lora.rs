//! LoRA adapter slots, as vLLM V1 has them (docs/design/simulator.md, "LoRA adapters"): a request
//! names an adapter by its OpenAI `model`; the engine holds at most `slots` adapters on the GPU
//! (`--max-loras`) and runs a batch with at most that many distinct adapters (its scheduler passes
//! over a waiting request whose adapter would be one too many, and takes the next). Admitting a
//! request whose adapter is not resident loads it in place of the least recently used adapter that
//! no running request uses, and the load adds `load_us` to that step: vLLM loads adapters in the
//! model runner before the step's forward pass, so the whole batch waits for it, not only the
//! request.
//!
//! What is simplified: one tier (vLLM also keeps up to `--max-cpu-loras` adapters in host memory,
//! from which a load is faster than from disk); every load takes the same time.

use hashbrown::HashMap;
use kvsteer_core::feed::AdapterReport;

/// The engine's adapter slots and load time. `slots` 0: LoRA off (every request runs on the base
/// model, whatever its `model`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LoraConfig {
    /// Adapters resident on the GPU at once (vLLM `--max-loras`; default 0: off).
    pub slots: u32,
    /// Microseconds one adapter load adds to the step that admits its request (default 300,000). An
    /// assumption, not a measured figure: the order of reading a rank-16 adapter of an 8B model
    /// (tens to a few hundred MB of safetensors) from local disk and copying it to the GPU.
    pub load_us: u64,
}

impl Default for LoraConfig {
    fn default() -> Self {
        LoraConfig {
            slots: 0,
            load_us: 300_000,
        }
    }
}

/// Adapter names (interned), the resident set in recency order, and the loads done.
#[derive(Clone, Debug, Default)]
pub struct LoraSlots {
    cfg: LoraConfig,
    names: Vec<String>,
    ids: HashMap<String, u32>,
    /// Resident adapters, least recently used first.
    resident: Vec<u32>,
    /// Adapter loads since the engine started (cumulative across restarts).
    pub loads: u64,
}

impl LoraSlots {
    pub fn new(cfg: LoraConfig) -> LoraSlots {
        LoraSlots {
            cfg,
            ..LoraSlots::default()
        }
    }

    pub fn enabled(&self) -> bool {
        self.cfg.slots > 0
    }

    /// The id of adapter `name` (interned on first sight); `None` with LoRA off.
    pub fn intern(&mut self, name: &str) -> Option<u32> {
        if !self.enabled() {
            return None;
        }
        if let Some(&id) = self.ids.get(name) {
            return Some(id);
        }
        let id = self.names.len() as u32;
        self.names.push(name.to_string());
        self.ids.insert(name.to_string(), id);
        Some(id)
    }

    /// Whether a request for `adapter` may join a batch whose running requests use `running`
    /// (distinct adapters): it is one of them, or a slot is left for it.
    pub fn admissible(&self, adapter: Option<u32>, running: &[u32]) -> bool {
        match adapter {
            None => true,
            Some(a) => running.contains(&a) || running.len() < self.cfg.slots as usize,
        }
    }

    /// Makes `adapter` resident for a request being admitted beside `running` (its batch's distinct
    /// adapters) and marks it most recently used; returns the microseconds the load adds to the
    /// step (0 when it was resident). Evicts the least recently used adapter no running request
    /// uses; [`LoraSlots::admissible`] guarantees there is one when the slots are full.
    pub fn acquire(&mut self, adapter: u32, running: &[u32]) -> u64 {
        if let Some(i) = self.resident.iter().position(|&a| a == adapter) {
            self.resident.remove(i);
            self.resident.push(adapter);
            return 0;
        }
        if self.resident.len() >= self.cfg.slots as usize
            && let Some(i) = self.resident.iter().position(|a| !running.contains(a))
        {
            self.resident.remove(i);
        }
        self.resident.push(adapter);
        self.loads += 1;
        self.cfg.load_us
    }

    /// Drops every resident adapter (an engine restart).
    pub fn clear(&mut self) {
        self.resident.clear();
    }

    /// Adapters resident now, least recently used first (tests, diagnostics).
    pub fn resident(&self) -> Vec<&str> {
        self.resident
            .iter()
            .map(|&a| self.names[a as usize].as_str())
            .collect()
    }

    /// What the feed reports, as vLLM's `vllm:lora_requests_info` does: the adapters of the running
    /// requests and of the waiting ones, and the slots. `None` with LoRA off.
    pub fn report(
        &self,
        running: impl Iterator<Item = u32>,
        waiting: impl Iterator<Item = u32>,
    ) -> Option<AdapterReport> {
        if !self.enabled() {
            return None;
        }
        let names = |ids: &mut dyn Iterator<Item = u32>| {
            let mut v: Vec<u32> = ids.collect();
            v.sort_unstable();
            v.dedup();
            v.into_iter()
                .map(|a| self.names[a as usize].clone())
                .collect()
        };
        Some(
            AdapterReport {
                slots: self.cfg.slots,
                running: names(&mut { running }),
                waiting: names(&mut { waiting }),
            }
            .bounded(),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_least_recently_used_idle_adapter_is_evicted() {
        let mut s = LoraSlots::new(LoraConfig {
            slots: 2,
            load_us: 500,
        });
        let [a, b, c] = ["a", "b", "c"].map(|n| s.intern(n).unwrap());
        assert_eq!(s.acquire(a, &[]), 500);
        assert_eq!(s.acquire(b, &[a]), 500);
        assert_eq!(s.acquire(a, &[a, b]), 0, "resident: no load");
        // b is now least recently used: c replaces it.
        assert_eq!(s.acquire(c, &[a]), 500);
        assert_eq!(s.resident(), vec!["a", "c"]);
        // A running adapter is never evicted, even when least recently used.
        assert_eq!(s.acquire(b, &[a]), 500);
        assert_eq!(s.resident(), vec!["a", "b"]);
        assert_eq!(s.loads, 4);
        assert!(s.admissible(Some(c), &[a]));
        assert!(!s.admissible(Some(c), &[a, b]));
        assert!(s.admissible(Some(a), &[a, b]) && s.admissible(None, &[a, b]));
    }

    #[test]
    fn off_means_no_adapters_and_no_report() {
        let mut s = LoraSlots::new(LoraConfig::default());
        assert_eq!(s.intern("a"), None);
        assert_eq!(s.report([].into_iter(), [].into_iter()), None);
        let mut on = LoraSlots::new(LoraConfig {
            slots: 4,
            load_us: 1,
        });
        let (a, b) = (on.intern("a").unwrap(), on.intern("b").unwrap());
        let r = on.report([a, a].into_iter(), [b].into_iter()).unwrap();
        assert_eq!(
            (r.slots, r.running, r.waiting),
            (4, vec!["a".into()], vec!["b".into()])
        );
    }
}
