//! The adapter's own Prometheus metrics (`GET /metrics`), mirrored from [`Stats`] at each scrape.

use crate::state::{AdapterState, BAD_PAYLOAD_LABELS, ResetReason, Skip, Stats};
use kvsteer_core::feed::Tier;
use prometheus::{Encoder, IntCounter, IntCounterVec, IntGauge, IntGaugeVec, Opts, Registry};

/// Counters fed by the I/O side (not part of the pure state).
#[derive(Debug, Default, Clone)]
pub struct IoStats {
    pub scrapes_ok: u64,
    pub scrapes_failed: u64,
    pub metrics_lines_bad: u64,
    pub replay_requests: u64,
    pub replay_failed: u64,
    pub zmq_errors: u64,
    pub feed_unavailable: u64,
    pub feed_bad_query: u64,
}

pub struct Metrics {
    registry: Registry,
    batches: IntCounter,
    events: IntCounterVec,
    blocks: IntCounterVec,
    skipped: IntCounterVec,
    removals_unknown: IntCounter,
    cap_evictions: IntCounter,
    hash_conflicts: IntCounter,
    bad_payloads: IntCounterVec,
    bad_events: IntCounter,
    gaps: IntCounter,
    gap_batches: IntCounter,
    gaps_recovered: IntCounter,
    replayed_batches: IntCounter,
    resets: IntCounterVec,
    polls: IntCounterVec,
    io: IntCounterVec,
    epoch: IntGauge,
    held: IntGaugeVec,
    max_blocks: IntGauge,
    log_hashes: IntGauge,
    block_size: IntGauge,
}

fn c(r: &Registry, name: &str, help: &str) -> IntCounter {
    let m = IntCounter::new(name, help).expect("valid metric");
    r.register(Box::new(m.clone())).expect("unique metric");
    m
}

fn cv(r: &Registry, name: &str, help: &str, label: &str) -> IntCounterVec {
    let m = IntCounterVec::new(Opts::new(name, help), &[label]).expect("valid metric");
    r.register(Box::new(m.clone())).expect("unique metric");
    m
}

fn g(r: &Registry, name: &str, help: &str) -> IntGauge {
    let m = IntGauge::new(name, help).expect("valid metric");
    r.register(Box::new(m.clone())).expect("unique metric");
    m
}

/// Raises a counter to `v` (counters only go up; the pure stats are monotonic).
fn to(ctr: &IntCounter, v: u64) {
    let cur = ctr.get();
    if v > cur {
        ctr.inc_by(v - cur);
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    pub fn new() -> Self {
        // Kept whole: one registration per metric, a flat list.
        let r = Registry::new();
        Self {
            batches: c(
                &r,
                "kvsteer_feed_engine_batches_total",
                "Engine event batches applied (replayed ones included).",
            ),
            events: cv(
                &r,
                "kvsteer_feed_engine_events_total",
                "Engine events by type (stored, removed, cleared, unknown).",
                "type",
            ),
            blocks: cv(
                &r,
                "kvsteer_feed_blocks_total",
                "Blocks stored, removed, or stored again in a tier already held (duplicate).",
                "op",
            ),
            skipped: cv(
                &r,
                "kvsteer_feed_blocks_skipped_total",
                "Stored blocks not indexed, by reason.",
                "reason",
            ),
            removals_unknown: c(
                &r,
                "kvsteer_feed_removals_unknown_total",
                "Removals of engine hashes not held in that tier.",
            ),
            cap_evictions: c(
                &r,
                "kvsteer_feed_cap_evictions_total",
                "Blocks dropped to stay under --max-blocks.",
            ),
            hash_conflicts: c(
                &r,
                "kvsteer_feed_hash_conflicts_total",
                "Engine hashes stored again with other contents.",
            ),
            bad_payloads: cv(
                &r,
                "kvsteer_feed_bad_payloads_total",
                "Engine messages refused, by reason.",
                "reason",
            ),
            bad_events: c(
                &r,
                "kvsteer_feed_bad_events_total",
                "Engine events of a known type that could not be read.",
            ),
            gaps: c(
                &r,
                "kvsteer_feed_seq_gaps_total",
                "Gaps in the engine's sequence numbers.",
            ),
            gap_batches: c(
                &r,
                "kvsteer_feed_seq_gap_batches_total",
                "Engine batches missing in those gaps.",
            ),
            gaps_recovered: c(
                &r,
                "kvsteer_feed_seq_gaps_recovered_total",
                "Gaps filled by the engine's replay endpoint.",
            ),
            replayed_batches: c(
                &r,
                "kvsteer_feed_replayed_batches_total",
                "Batches applied from replay.",
            ),
            resets: cv(
                &r,
                "kvsteer_feed_resets_total",
                "Views dropped and new epochs started, by reason.",
                "reason",
            ),
            polls: cv(
                &r,
                "kvsteer_feed_polls_total",
                "Feed answers by kind (incremental, resync).",
                "kind",
            ),
            io: cv(
                &r,
                "kvsteer_feed_io_total",
                "I/O outcomes: scrape_ok, scrape_failed, metrics_line_bad, replay_request, replay_failed, zmq_error, feed_unavailable, feed_bad_query.",
                "what",
            ),
            epoch: g(
                &r,
                "kvsteer_feed_epoch",
                "Current feed epoch (low 63 bits).",
            ),
            held: {
                let m = IntGaugeVec::new(
                    Opts::new("kvsteer_feed_blocks_held", "Engine blocks held, by tier."),
                    &["tier"],
                )
                .expect("valid metric");
                r.register(Box::new(m.clone())).expect("unique metric");
                m
            },
            max_blocks: g(&r, "kvsteer_feed_max_blocks", "Bound on blocks held."),
            log_hashes: g(
                &r,
                "kvsteer_feed_log_hashes",
                "Hashes retained by the feed log.",
            ),
            block_size: g(
                &r,
                "kvsteer_feed_block_size",
                "Block size in use (0 until known).",
            ),
            registry: r,
        }
    }

    /// Mirrors the state and I/O counters, then renders the text exposition.
    pub fn render(&self, st: &AdapterState, io: &IoStats) -> String {
        let s: &Stats = st.stats();
        to(&self.batches, s.batches);
        for (k, v) in [
            ("stored", s.events_stored),
            ("removed", s.events_removed),
            ("cleared", s.events_cleared),
            ("unknown", s.events_unknown),
        ] {
            to(&self.events.with_label_values(&[k]), v);
        }
        for (k, v) in [
            ("stored", s.blocks_stored),
            ("removed", s.blocks_removed),
            ("duplicate", s.blocks_duplicate),
        ] {
            to(&self.blocks.with_label_values(&[k]), v);
        }
        for (i, sk) in Skip::ALL.iter().enumerate() {
            to(
                &self.skipped.with_label_values(&[sk.label()]),
                s.blocks_skipped[i],
            );
        }
        to(&self.removals_unknown, s.removals_unknown);
        to(&self.cap_evictions, s.cap_evictions);
        to(&self.hash_conflicts, s.hash_conflicts);
        for (i, l) in BAD_PAYLOAD_LABELS.iter().enumerate() {
            to(
                &self.bad_payloads.with_label_values(&[l]),
                s.bad_payloads[i],
            );
        }
        to(&self.bad_events, s.bad_events);
        to(&self.gaps, s.gaps);
        to(&self.gap_batches, s.gap_batches);
        to(&self.gaps_recovered, s.gaps_recovered);
        to(&self.replayed_batches, s.replayed_batches);
        for (i, r) in ResetReason::ALL.iter().enumerate() {
            to(&self.resets.with_label_values(&[r.label()]), s.resets[i]);
        }
        to(
            &self.polls.with_label_values(&["incremental"]),
            s.polls_incremental,
        );
        to(&self.polls.with_label_values(&["resync"]), s.polls_resync);
        for (k, v) in [
            ("scrape_ok", io.scrapes_ok),
            ("scrape_failed", io.scrapes_failed),
            ("metrics_line_bad", io.metrics_lines_bad),
            ("replay_request", io.replay_requests),
            ("replay_failed", io.replay_failed),
            ("zmq_error", io.zmq_errors),
            ("feed_unavailable", io.feed_unavailable),
            ("feed_bad_query", io.feed_bad_query),
        ] {
            to(&self.io.with_label_values(&[k]), v);
        }
        self.epoch.set((st.epoch() >> 1) as i64);
        for t in Tier::ALL {
            self.held
                .with_label_values(&[t.name()])
                .set(st.blocks_in(t) as i64);
        }
        self.max_blocks.set(st.max_blocks() as i64);
        self.log_hashes.set(st.log_hashes() as i64);
        self.block_size.set(st.block_size().unwrap_or(0) as i64);
        let mut out = Vec::new();
        prometheus::TextEncoder::new()
            .encode(&self.registry.gather(), &mut out)
            .expect("text encoding into a Vec");
        String::from_utf8(out).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::StateConfig;

    #[test]
    fn renders_every_family() {
        let mut st = AdapterState::new(StateConfig::default(), 3);
        st.count_bad_payload("topic");
        let m = Metrics::new();
        let text = m.render(&st, &IoStats::default());
        assert!(text.contains("kvsteer_feed_bad_payloads_total{reason=\"topic\"} 1"));
        assert!(text.contains("kvsteer_feed_resets_total{reason=\"gap\"} 0"));
        assert!(text.contains("kvsteer_feed_blocks_held{tier=\"gpu\"} 0"));
        // Rendering twice does not double counters.
        st.count_bad_payload("topic");
        let text = m.render(&st, &IoStats::default());
        assert!(text.contains("kvsteer_feed_bad_payloads_total{reason=\"topic\"} 2"));
    }
}
