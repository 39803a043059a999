//! Sharing in-flight load between Envoy's worker VMs.
//!
//! Envoy runs one VM per worker thread and the VMs share no memory, so each worker's router only sees
//! the requests that worker admitted. Every tick each worker publishes its own per-replica totals in
//! shared data under `<prefix>:load:<worker>` and reads everyone else's, which the router adds to its own
//! view. The picture of other workers' load is therefore at most one tick old (plus the reader's own tick
//! phase): a burst that arrives within one tick on two workers can put both bursts on one replica. That is
//! safe, not wrong: the replica's own reported load (feed) and the next tick correct it, and a stale peer
//! view can only misjudge by the load admitted within one tick.
//!
//! Record layout: `published_ms u64` (little-endian), then the core's `LoadTotals::encode_all` bytes.

use kvsteer_core::load::LoadTotals;

pub fn encode(published_ms: u64, totals: &[LoadTotals]) -> Vec<u8> {
    let mut out = published_ms.to_le_bytes().to_vec();
    out.extend_from_slice(&LoadTotals::encode_all(totals));
    out
}

/// Decodes a peer record; `None` for anything malformed or for a different replica count (a worker
/// still running an older configuration).
pub fn decode(bytes: &[u8], replicas: usize) -> Option<(u64, Vec<LoadTotals>)> {
    let ts = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let totals = LoadTotals::decode_all(&bytes[8..]).ok()?;
    (totals.len() == replicas).then_some((ts, totals))
}

/// Shared-data key of a worker's load record.
pub fn load_key(prefix: &str, worker: u32) -> String {
    format!("{prefix}:load:{worker}")
}

/// Shared-data key of the worker-id counter.
pub fn workers_key(prefix: &str) -> String {
    format!("{prefix}:workers")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_and_refusals() {
        let t = vec![
            LoadTotals {
                prefill_tokens: 5,
                decode_blocks: 6,
                active_requests: 7,
            },
            LoadTotals {
                prefill_tokens: u64::MAX,
                decode_blocks: 0,
                active_requests: 1,
            },
        ];
        let b = encode(99, &t);
        assert_eq!(decode(&b, 2), Some((99, t)));
        assert_eq!(decode(&b, 3), None);
        for cut in 0..b.len() {
            assert_eq!(decode(&b[..cut], 2), None);
        }
    }
}
