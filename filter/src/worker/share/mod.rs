//! Sharing in-flight load, health and working sets between the worker VMs of one proxy (the `peers`
//! configuration section is about other proxies: [`crate::worker::exchange`]).
//!
//! Envoy runs one VM per worker thread and the VMs share no memory, so each worker's router only sees
//! the requests that worker admitted. Every tick each worker publishes its own per-replica totals in
//! shared data under `<prefix>:load:<worker>` and reads everyone else's, which the router adds to its own
//! view. The picture of other workers' load is therefore at most one tick old (plus the reader's own tick
//! phase): a burst that arrives within one tick on two workers can put both bursts on one replica. That is
//! safe, not wrong: the replica's own reported load (feed) and the next tick correct it, and a stale peer
//! view can only misjudge by the load admitted within one tick.
//!
//! Every worker first takes a number from a shared counter ([`claim_worker_id`]); each tick it
//! [`publish`]es its own record and reads the others' ([`worker_count`], [`read_fresh`]). All of it goes
//! through a [`SharedStore`], so it is tested natively.
//!
//! Record layout: `published_ms u64` (little-endian), then the core's `LoadTotals::encode_all` bytes of
//! the worker's bookings, then (optional, for `reported_load` `merge`) the same encoding of its
//! bookings made since each replica's report was polled (`Router::local_load_since`) and of what it
//! released since of requests that report holds (`Router::local_released_since`), and (for
//! `reported_load` `others`) of its requests that report holds (`Router::local_held`); a record
//! without the last part (an older filter) reads as holding nothing.
//!
//! The working set (`kvsteer_core::working_set`): each worker publishes the journal of its recent
//! admissions under `<prefix>:ws:<worker>` (the core's encoding, which starts with `published_ms`)
//! and applies the others' new entries ([`publish_working_set`], [`read_working_set_fresh`]).
//!
//! The approximate text identity's records (`kvsteer_core::approx`): each worker publishes the
//! journal of its own text-prompt admissions under `<prefix>:text:<worker>` and applies the others'
//! new entries into its own index, so a text follow-up on another worker finds its first turn's
//! replica (`text.rs`).
//!
//! Records of one value per replica are shared the same way ([`PerReplica`]; [`publish_records`],
//! [`read_records_fresh`]), under `<prefix>:<kind>:<worker>`: `published_ms u64`, then the core's
//! fixed-width encoding (`kvsteer_core::record`). The kinds: health learned from completions
//! (`kvsteer_core::health`, `health`), each worker's own decayed success and failure counts;
//! `kv_time`'s estimates of each replica's speed (`kvsteer_core::speed`, `speed`), so a proxy with
//! N workers learns a slow replica from all its requests, not from one worker's Nth; and, with
//! `kv_time`'s `head_progress`, each worker's view of the prefill in progress on each replica
//! (`kvsteer_core::load::PrefillHead`, `head`), since the head of a replica's queue may be another
//! worker's request.

mod text;
mod tick;

pub use text::{TextSharing, read_text_fresh, text_key};
pub use tick::{Sharing, WORKING_SET_KEEP_TICKS};

use crate::host::store::SharedStore;
use kvsteer_core::health::HealthCounts;
use kvsteer_core::load::{LoadTotals, PrefillHead};
use kvsteer_core::record::Record;
use kvsteer_core::speed::SpeedEstimate;

pub fn encode(published_ms: u64, rec: &WorkerLoad) -> Vec<u8> {
    let mut out = published_ms.to_le_bytes().to_vec();
    out.extend_from_slice(&LoadTotals::encode_all(&rec.totals));
    out.extend_from_slice(&LoadTotals::encode_all(&rec.since));
    out.extend_from_slice(&LoadTotals::encode_all(&rec.released));
    out.extend_from_slice(&LoadTotals::encode_all(&rec.held));
    out
}

/// What a worker publishes: its bookings, per replica, and for `reported_load` `merge` its bookings
/// since each replica's report was polled and what it released since of requests the report holds.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkerLoad {
    pub totals: Vec<LoadTotals>,
    pub since: Vec<LoadTotals>,
    pub released: Vec<LoadTotals>,
    /// Its requests each replica's current report holds (`Router::local_held`), for `others`.
    pub held: Vec<LoadTotals>,
}

/// Decodes a peer record (its publication time and load); `None` for anything malformed or for a
/// different replica count (a worker still running an older configuration). A record with the
/// bookings alone (an older filter) reads as nothing since the polls.
pub fn decode(bytes: &[u8], replicas: usize) -> Option<(u64, WorkerLoad)> {
    let ts = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let mut parts = Vec::new();
    let mut rest = &bytes[8..];
    while !rest.is_empty() && parts.len() < 4 {
        let (v, after) = LoadTotals::decode_front(rest).ok()?;
        if v.len() != replicas {
            return None;
        }
        parts.push(v);
        rest = after;
    }
    if !rest.is_empty() || !matches!(parts.len(), 1 | 3 | 4) {
        return None;
    }
    let zeros = vec![LoadTotals::default(); replicas];
    let mut it = parts.into_iter();
    let totals = it.next()?;
    Some((
        ts,
        WorkerLoad {
            totals,
            since: it.next().unwrap_or_else(|| zeros.clone()),
            released: it.next().unwrap_or_else(|| zeros.clone()),
            held: it.next().unwrap_or(zeros),
        },
    ))
}

/// Shared-data key of a worker's load record.
pub fn load_key(prefix: &str, worker: u32) -> String {
    format!("{prefix}:load:{worker}")
}

/// A per-replica record kind a worker publishes every tick beside its load, under
/// `<prefix>:<KEY>:<worker>`: `published_ms u64` (little-endian), then the core's
/// [`Record::encode_all`] bytes of one record per replica.
pub trait PerReplica: Record {
    /// The key's middle part.
    const KEY: &'static str;
}

/// Health learned from completions: each worker's own decayed outcome counts.
impl PerReplica for HealthCounts {
    const KEY: &'static str = "health";
}

/// `kv_time`'s estimates of each replica's speed from this worker's own requests.
impl PerReplica for SpeedEstimate {
    const KEY: &'static str = "speed";
}

/// This worker's view of the prefill in progress on each replica (`kv_time` with
/// `head_progress`).
impl PerReplica for PrefillHead {
    const KEY: &'static str = "head";
}

/// Shared-data key of worker `worker`'s records of kind `T`.
pub fn records_key<T: PerReplica>(prefix: &str, worker: u32) -> String {
    format!("{prefix}:{}:{worker}", T::KEY)
}

/// Publishes worker `me`'s own records of kind `T` (one per replica), as of `now_ms`.
pub fn publish_records<T: PerReplica>(
    store: &dyn SharedStore,
    prefix: &str,
    me: u32,
    now_ms: u64,
    records: &[T],
) {
    let mut out = now_ms.to_le_bytes().to_vec();
    out.extend_from_slice(&T::encode_all(records));
    store.overwrite(&records_key::<T>(prefix, me), &out);
}

/// Reads a [`publish_records`] record: `(published_ms, records)`; `None` for anything malformed
/// or for a different replica count.
pub fn decode_records<T: PerReplica>(bytes: &[u8], replicas: usize) -> Option<(u64, Vec<T>)> {
    let ts = u64::from_le_bytes(bytes.get(0..8)?.try_into().ok()?);
    let records = T::decode_all(&bytes[8..]).ok()?;
    (records.len() == replicas).then_some((ts, records))
}

/// Worker `peer`'s records of kind `T` with their publication time, if readable
/// ([`decode_records`]), for `replicas` replicas, and at most `ttl_ms` old at `now_ms`.
pub fn read_records_fresh<T: PerReplica>(
    store: &dyn SharedStore,
    prefix: &str,
    peer: u32,
    replicas: usize,
    now_ms: u64,
    ttl_ms: u64,
) -> Option<(u64, Vec<T>)> {
    let (record, _) = store.get(&records_key::<T>(prefix, peer))?;
    decode_records(&record, replicas).filter(|(ts, _)| now_ms.saturating_sub(*ts) <= ttl_ms)
}

/// Shared-data key of the time of `replica`'s last health probe, proxy-wide.
pub fn probe_key(prefix: &str, replica: usize) -> String {
    format!("{prefix}:probe:{replica}")
}

/// Claims `replica`'s health probe for this worker, so the whole proxy sends one per `interval_ms`
/// however many workers it runs: `Ok` when the last probe (any worker's) is at least `interval_ms`
/// old and this worker's conditional write of `now_ms` won; otherwise `Err` with when the probe was
/// last sent (`now_ms` for a race lost just now).
pub fn claim_probe(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    now_ms: u64,
    interval_ms: u64,
) -> Result<(), u64> {
    let key = probe_key(prefix, replica);
    let (last, cas) = match store.get(&key) {
        Some((v, cas)) => (
            <[u8; 8]>::try_from(v.as_slice()).map_or(0, u64::from_le_bytes),
            Some(cas),
        ),
        None => (0, None),
    };
    if now_ms.saturating_sub(last) < interval_ms {
        return Err(last);
    }
    if store.set(&key, &now_ms.to_le_bytes(), cas) {
        Ok(())
    } else {
        Err(now_ms)
    }
}

/// Shared-data key of the worker-id counter.
pub fn workers_key(prefix: &str) -> String {
    format!("{prefix}:workers")
}

/// Workers that claimed a number so far (the counter), at most 1024.
pub fn worker_count(store: &dyn SharedStore, prefix: &str) -> u32 {
    store
        .get(&workers_key(prefix))
        .and_then(|(v, _)| <[u8; 4]>::try_from(v.as_slice()).ok())
        .map_or(0, u32::from_le_bytes)
        .min(1024)
}

/// Takes a unique worker number from the shared counter (CAS loop, 32 tries), so each worker publishes
/// its load under its own key. `None` when every try lost the race or the store refuses writes: load
/// then stays per worker.
pub fn claim_worker_id(store: &dyn SharedStore, prefix: &str) -> Option<u32> {
    let key = workers_key(prefix);
    for _ in 0..32 {
        let (current, cas) = match store.get(&key) {
            Some((v, cas)) => (
                <[u8; 4]>::try_from(v.as_slice()).map_or(0, u32::from_le_bytes),
                Some(cas),
            ),
            None => (0, None),
        };
        let next = current.wrapping_add(1);
        if store.set(&key, &next.to_le_bytes(), cas) {
            return Some(current);
        }
    }
    None
}

/// Publishes worker `me`'s load record, stamped `now_ms`.
pub fn publish(store: &dyn SharedStore, prefix: &str, me: u32, now_ms: u64, rec: &WorkerLoad) {
    store.overwrite(&load_key(prefix, me), &encode(now_ms, rec));
}

/// Worker `peer`'s load, if its record is readable, for `replicas` replicas, and at most `ttl_ms`
/// old; `None` otherwise (a worker that went away, or one on another configuration).
pub fn read_fresh(
    store: &dyn SharedStore,
    prefix: &str,
    peer: u32,
    replicas: usize,
    now_ms: u64,
    ttl_ms: u64,
) -> Option<WorkerLoad> {
    let (record, _) = store.get(&load_key(prefix, peer))?;
    match decode(&record, replicas) {
        Some((ts, rec)) if now_ms.saturating_sub(ts) <= ttl_ms => Some(rec),
        _ => None,
    }
}

/// Shared-data key of a worker's working-set journal.
pub fn working_set_key(prefix: &str, worker: u32) -> String {
    format!("{prefix}:ws:{worker}")
}

/// Publishes worker `me`'s working-set journal (already stamped by the core).
pub fn publish_working_set(store: &dyn SharedStore, prefix: &str, me: u32, journal: &[u8]) {
    store.overwrite(&working_set_key(prefix, me), journal);
}

/// Worker `peer`'s working-set journal if it is at most `ttl_ms` old (a worker that went away
/// publishes nothing new, and is not decoded every tick).
pub fn read_working_set_fresh(
    store: &dyn SharedStore,
    prefix: &str,
    peer: u32,
    now_ms: u64,
    ttl_ms: u64,
) -> Option<Vec<u8>> {
    read_journal_fresh(store, &working_set_key(prefix, peer), now_ms, ttl_ms)
}

/// The journal under `key` (stamped by the core: `published_ms u64` first) if it is at most
/// `ttl_ms` old.
pub(super) fn read_journal_fresh(
    store: &dyn SharedStore,
    key: &str,
    now_ms: u64,
    ttl_ms: u64,
) -> Option<Vec<u8>> {
    let (record, _) = store.get(key)?;
    let ts = u64::from_le_bytes(record.get(0..8)?.try_into().ok()?);
    (now_ms.saturating_sub(ts) <= ttl_ms).then_some(record)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::store::tests::{MemStore, NgxStore};

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
        let rec = WorkerLoad {
            totals: t.clone(),
            since: vec![t[1], t[0]],
            released: vec![t[0], t[0]],
            held: vec![t[0], t[1]],
        };
        let b = encode(99, &rec);
        assert_eq!(decode(&b, 2), Some((99, rec.clone())));
        assert_eq!(decode(&b, 3), None);
        let part = 8 + 2 * LoadTotals::LEN;
        let first = 8 + part;
        let third = 8 + 3 * part;
        for cut in (0..b.len()).filter(|&c| c != first && c != third) {
            assert_eq!(decode(&b[..cut], 2), None, "cut at {cut}");
        }
        // A record with the bookings alone (an older filter): nothing since the polls.
        let zeros = vec![LoadTotals::default(); 2];
        let old = WorkerLoad {
            totals: t.clone(),
            since: zeros.clone(),
            released: zeros.clone(),
            held: zeros.clone(),
        };
        assert_eq!(decode(&b[..first], 2), Some((99, old)));
        // One without the held part (the filter before `others`): holding nothing.
        let before = WorkerLoad { held: zeros, ..rec };
        assert_eq!(decode(&b[..third], 2), Some((99, before)));
    }

    fn totals(prefill: u64) -> Vec<LoadTotals> {
        vec![
            LoadTotals {
                prefill_tokens: prefill,
                decode_blocks: 2,
                active_requests: 1,
            },
            LoadTotals::default(),
        ]
    }

    #[test]
    fn workers_claim_distinct_numbers_and_read_each_others_fresh_records() {
        let s = MemStore::default();
        assert_eq!(worker_count(&s, "k"), 0);
        assert_eq!(claim_worker_id(&s, "k"), Some(0));
        assert_eq!(claim_worker_id(&s, "k"), Some(1));
        assert_eq!(claim_worker_id(&s, "other"), Some(0), "per prefix");
        assert_eq!(worker_count(&s, "k"), 2);
        let rec = WorkerLoad {
            totals: totals(7),
            since: totals(3),
            released: totals(1),
            held: totals(2),
        };
        publish(&s, "k", 0, 1_000, &rec);
        assert_eq!(read_fresh(&s, "k", 0, 2, 1_500, 500), Some(rec));
        assert_eq!(read_fresh(&s, "k", 0, 2, 1_501, 500), None, "too old");
        assert_eq!(
            read_fresh(&s, "k", 0, 3, 1_000, 500),
            None,
            "other replica count"
        );
        assert_eq!(
            read_fresh(&s, "k", 1, 2, 1_000, 500),
            None,
            "never published"
        );
    }

    #[test]
    fn records_are_republished_under_nginx_cas_rule() {
        // ngx_wasm_module writes a key without a token only once: every record a worker publishes
        // tick after tick must still show the newest.
        let s = NgxStore::default();
        assert_eq!(claim_worker_id(&s, "k"), Some(0));
        assert_eq!(claim_worker_id(&s, "k"), Some(1));
        for ts in [1_000, 2_000] {
            let rec = WorkerLoad {
                totals: totals(ts),
                since: totals(1),
                released: totals(1),
                held: totals(1),
            };
            publish(&s, "k", 1, ts, &rec);
            assert_eq!(read_fresh(&s, "k", 1, 2, ts, 0), Some(rec));
            let c = vec![HealthCounts {
                ok: ts as f64,
                err: 0.0,
            }];
            publish_records(&s, "k", 1, ts, &c);
            assert_eq!(read_records_fresh(&s, "k", 1, 1, ts, 0), Some((ts, c)));
            publish_working_set(&s, "k", 1, &ts.to_le_bytes());
            assert_eq!(
                s.get(&working_set_key("k", 1)).map(|(v, _)| v),
                Some(ts.to_le_bytes().to_vec())
            );
        }
    }

    #[test]
    fn health_records_round_trip_expire_and_refuse_garbage() {
        let s = MemStore::default();
        let c = vec![HealthCounts { ok: 1.0, err: 2.5 }, HealthCounts::default()];
        publish_records(&s, "k", 3, 1_000, &c);
        assert_eq!(s.get("k:health:3").map(|(v, _)| v.len()), Some(8 + 32));
        assert_eq!(
            read_records_fresh(&s, "k", 3, 2, 1_400, 500),
            Some((1_000, c.clone()))
        );
        assert_eq!(
            read_records_fresh::<HealthCounts>(&s, "k", 3, 2, 1_501, 500),
            None
        );
        assert_eq!(
            read_records_fresh::<HealthCounts>(&s, "k", 3, 3, 1_000, 500),
            None
        );
        // Another kind under another key: a worker's speeds are not its health.
        assert_eq!(
            read_records_fresh::<SpeedEstimate>(&s, "k", 3, 2, 1_000, 500),
            None
        );
        let mut b = 1_000u64.to_le_bytes().to_vec();
        b.extend_from_slice(&HealthCounts::encode_all(&c));
        for cut in 0..b.len() {
            assert_eq!(
                decode_records::<HealthCounts>(&b[..cut], 2),
                None,
                "cut {cut}"
            );
        }
        b[12] = 0xff; // a NaN / huge count
        b[13] = 0xff;
        b[14] = 0xff;
        b[15] = 0xff;
        assert_eq!(decode_records::<HealthCounts>(&b, 2), None);
    }

    #[test]
    fn one_probe_per_interval_for_the_whole_proxy() {
        let s = MemStore::default();
        assert_eq!(claim_probe(&s, "k", 2, 5_000, 1_000), Ok(()));
        assert_eq!(
            claim_probe(&s, "k", 2, 5_400, 1_000),
            Err(5_000),
            "another worker"
        );
        assert_eq!(claim_probe(&s, "k", 3, 5_400, 1_000), Ok(()), "per replica");
        assert_eq!(claim_probe(&s, "k", 2, 6_000, 1_000), Ok(()));
        // Garbage in the record reads as never probed.
        s.set(&probe_key("k", 4), b"xyz", None);
        assert_eq!(claim_probe(&s, "k", 4, 10_000, 1_000), Ok(()));
    }

    /// A store whose conditional writes lose the race a few times, as under concurrent workers.
    struct Contended {
        inner: MemStore,
        losses: std::cell::Cell<u32>,
    }

    impl SharedStore for Contended {
        fn get(&self, key: &str) -> Option<(Vec<u8>, u32)> {
            self.inner.get(key)
        }
        fn set(&self, key: &str, value: &[u8], cas: Option<u32>) -> bool {
            if cas.is_some() && self.losses.get() > 0 {
                self.losses.set(self.losses.get() - 1);
                return false;
            }
            self.inner.set(key, value, cas)
        }
    }

    #[test]
    fn claiming_retries_a_lost_race_and_gives_up_after_32() {
        let s = Contended {
            inner: MemStore::default(),
            losses: std::cell::Cell::new(0),
        };
        assert_eq!(claim_worker_id(&s, "k"), Some(0), "first write has no CAS");
        s.losses.set(5);
        assert_eq!(claim_worker_id(&s, "k"), Some(1), "lost 5 times, then won");
        s.losses.set(32);
        assert_eq!(claim_worker_id(&s, "k"), None);
        assert_eq!(worker_count(&s, "k"), 2);
    }
}
