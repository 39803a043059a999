//! Setup the integration tests of this crate and of `kvsteer-lab` share: the compiled filter
//! loaded once per test binary, a harness after its first feed polls, reproducible token ids and
//! the checks every test ends with. Panics (with the build command when the filter is not built):
//! it is for tests only.

use crate::{FilterModule, Harness, HarnessConfig, filter_wasm_path};
use std::sync::OnceLock;

/// The real filter (`kvsteer_filter.wasm`). Panics with the build command when it is not built.
pub fn module() -> &'static FilterModule {
    static M: OnceLock<FilterModule> = OnceLock::new();
    M.get_or_init(|| {
        let path = filter_wasm_path().unwrap_or_else(|e| panic!("{e}"));
        FilterModule::load(&path).unwrap_or_else(|e| panic!("{e}"))
    })
}

/// A harness with `cfg`, after half a second of virtual time (its first feed polls).
pub fn harness_with(cfg: HarnessConfig) -> Harness {
    let mut h = Harness::new(module(), cfg).unwrap_or_else(|e| panic!("{e}"));
    h.run_for(500_000).unwrap_or_else(|e| panic!("{e}"));
    h
}

/// `n` pseudo-random token ids from `seed` (distinct seeds share no block).
pub fn tokens(seed: u64, n: usize) -> Vec<u32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 100_000) as u32
        })
        .collect()
}

/// Asserts that no worker trapped, the host noticed no ABI misuse, nothing was logged at `critical`,
/// and the filter's load accounting found no request it could not release.
pub fn assert_clean(h: &Harness) {
    let anomalies = h
        .proxy()
        .metric("kvsteer_release_anomalies")
        .map_or(0, |m| m.value);
    assert_eq!(anomalies, 0, "release anomalies");
    for w in h.workers() {
        assert!(!w.is_dead(), "worker {} died", w.index());
        assert!(w.notes().is_empty(), "ABI misuse: {:?}", w.notes());
        let counts = w.log_counts();
        assert_eq!(counts[5], 0, "critical logs: {:?}", w.logs());
    }
}
