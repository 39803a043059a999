//! One feed poll per replica per period for the whole proxy, not one per worker.
//!
//! Every Envoy worker keeps its own block index (VMs share no memory), so every worker needs every feed
//! batch, but the replicas should not be polled by every worker. A worker takes a *lease* on a replica's
//! feed in shared data (CAS, renewed on each poll, expiring after a few periods so a dead worker is
//! replaced), polls it, applies the answer and *relays* the raw batch into a small ring in shared data.
//! The other workers read the ring every tick and apply what they have not seen, in order.
//!
//! A follower whose cursor falls out of step (it missed more batches than the ring holds, or it just
//! started) asks for a snapshot itself: resync polls bypass the lease, because only the worker that needs
//! the snapshot can use it. Batches that overlap what a follower already applied are trimmed to the part
//! past its cursor, so a follower that resynced on its own rejoins the relay without another snapshot.
//!
//! Keys: `<prefix>:lease:<replica>` = `worker u32 | expires_ms u64`;
//! `<prefix>:relay:<replica>` = newest relay number `u64`; `<prefix>:relay:<replica>:<n % RING>` =
//! `n u64 | polled_ms u64 | batch bytes` (the feed wire format; `polled_ms`: when the holder sent the
//! poll, which `reported_load` `merge` needs to know which bookings the batch's load already holds).

use crate::host::store::SharedStore;

/// Relayed batches kept per replica.
pub const RING: u64 = 8;

pub fn lease_key(prefix: &str, replica: usize) -> String {
    format!("{prefix}:lease:{replica}")
}

fn head_key(prefix: &str, replica: usize) -> String {
    format!("{prefix}:relay:{replica}")
}

fn slot_key(prefix: &str, replica: usize, n: u64) -> String {
    format!("{prefix}:relay:{replica}:{}", n % RING)
}

fn u64_at(b: &[u8], at: usize) -> Option<u64> {
    Some(u64::from_le_bytes(b.get(at..at + 8)?.try_into().ok()?))
}

/// Takes or renews the lease on a replica's feed; `true` when this worker may poll it now.
///
/// `routing`: whether this VM routes requests. A VM that does not (Envoy's main thread runs one of
/// the plugin: ticks and callouts, never a stream; an idle worker is another) takes a lease from a
/// routing holder at once, and a routing VM takes a lease only once it has expired. So where the
/// proxy has such a VM, the feed polls (the callouts, their answers handed into the VM, the
/// relaying) run there, off the threads that serve requests, which then only apply the relayed
/// batches; where it has none, the routing workers poll as before. A non-routing VM never takes a
/// lease from another non-routing holder, so the lease stays put once there.
pub fn try_lease(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    me: u32,
    now_ms: u64,
    hold_ms: u64,
    routing: bool,
) -> bool {
    let key = lease_key(prefix, replica);
    let current = store.get(&key);
    let cas = match &current {
        Some((v, cas)) => {
            let holder = v
                .get(0..4)
                .and_then(|b| b.try_into().ok())
                .map(u32::from_le_bytes);
            let expires = u64_at(v, 4).unwrap_or(0);
            // A value without the flag (written by an older filter) counts as not routing: never
            // taken before it expires.
            let holder_routing = v.get(12).is_some_and(|&b| b == 1);
            let preempt = !routing && holder_routing;
            if holder != Some(me) && expires > now_ms && !preempt {
                return false;
            }
            Some(*cas)
        }
        None => None,
    };
    let mut value = me.to_le_bytes().to_vec();
    value.extend_from_slice(&now_ms.saturating_add(hold_ms).to_le_bytes());
    value.push(routing as u8);
    // Without a CAS token (absent entry) two workers may both write; the later one wins the lease and
    // both poll once: harmless.
    store.set(&key, &value, cas)
}

/// Appends a batch the lease holder received to the replica's ring, with the time its poll was sent;
/// returns its relay number.
pub fn publish(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    batch: &[u8],
    polled_ms: u64,
) -> u64 {
    let hk = head_key(prefix, replica);
    let (head, cas) = match store.get(&hk) {
        Some((v, cas)) => (u64_at(&v, 0).unwrap_or(0), Some(cas)),
        None => (0, None),
    };
    let n = head + 1;
    let mut slot = n.to_le_bytes().to_vec();
    slot.extend_from_slice(&polled_ms.to_le_bytes());
    slot.extend_from_slice(batch);
    // Slot first, head second: a reader that sees the new head finds the slot already written.
    store.overwrite(&slot_key(prefix, replica, n), &slot);
    store.set(&hk, &n.to_le_bytes(), cas);
    n
}

/// Relayed batches a follower has not seen yet, oldest first, and the relay number to remember.
/// Batches that fell out of the ring are skipped; the cursor check then finds the gap.
pub fn unseen(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    mut seen: u64,
) -> (Vec<Vec<u8>>, u64) {
    let mut out = Vec::new();
    while let (Some((b, _)), n) = next_unseen(store, prefix, replica, seen) {
        out.push(b);
        seen = n;
    }
    let (_, seen) = next_unseen(store, prefix, replica, seen);
    (out, seen)
}

/// The oldest relayed batch a follower has not seen (with its poll time), and the relay number to
/// remember: a follower
/// still applying an earlier batch reads the next one only when it is done. Batches that fell out of
/// the ring are skipped (the cursor check then finds the gap); with none left, the newest number.
pub fn next_unseen(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    seen: u64,
) -> (Option<(Vec<u8>, u64)>, u64) {
    let Some(head) = store
        .get(&head_key(prefix, replica))
        .and_then(|(v, _)| u64_at(&v, 0))
    else {
        return (None, seen);
    };
    if head <= seen {
        return (None, seen);
    }
    let from = (seen + 1).max(head.saturating_sub(RING - 1));
    for n in from..=head {
        if let Some((v, _)) = store.get(&slot_key(prefix, replica, n))
            && u64_at(&v, 0) == Some(n)
            && let Some(polled_ms) = u64_at(&v, 8)
        {
            return (Some((v[16..].to_vec(), polled_ms)), n);
        }
    }
    (None, head)
}

fn health_key(prefix: &str, replica: usize) -> String {
    format!("{prefix}:down:{replica}")
}

/// The lease holder's verdict on whether a replica is reachable: `down u8 | at_ms u64`.
pub fn publish_health(
    store: &dyn SharedStore,
    prefix: &str,
    replica: usize,
    down: bool,
    now_ms: u64,
) {
    let mut v = vec![down as u8];
    v.extend_from_slice(&now_ms.to_le_bytes());
    store.overwrite(&health_key(prefix, replica), &v);
}

/// The last published verdict, if any.
pub fn health(store: &dyn SharedStore, prefix: &str, replica: usize) -> Option<bool> {
    let (v, _) = store.get(&health_key(prefix, replica))?;
    match v.first()? {
        0 => Some(false),
        1 => Some(true),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::host::store::tests::{MemStore, NgxStore};

    #[test]
    fn one_holder_at_a_time_and_expiry_hands_over() {
        for routing in [false, true] {
            let s = MemStore::default();
            let r = routing;
            assert!(try_lease(&s, "k", 0, 1, 0, 600, r));
            assert!(!try_lease(&s, "k", 0, 2, 100, 600, r), "held by worker 1");
            assert!(try_lease(&s, "k", 0, 1, 200, 600, r), "holder renews");
            assert!(
                try_lease(&s, "k", 1, 2, 200, 600, r),
                "leases are per replica"
            );
            assert!(!try_lease(&s, "k", 0, 2, 799, 600, r));
            assert!(try_lease(&s, "k", 0, 2, 801, 600, r), "expired: taken over");
            assert!(!try_lease(&s, "k", 0, 1, 900, 600, r));
        }
    }

    #[test]
    fn a_vm_that_routes_nothing_takes_the_lease_from_one_that_routes() {
        let s = MemStore::default();
        assert!(
            try_lease(&s, "k", 0, 1, 0, 600, true),
            "a routing worker takes a free lease"
        );
        assert!(
            !try_lease(&s, "k", 0, 3, 100, 600, true),
            "another routing worker waits"
        );
        assert!(
            try_lease(&s, "k", 0, 2, 100, 600, false),
            "a VM routing nothing takes it"
        );
        assert!(
            !try_lease(&s, "k", 0, 1, 200, 600, true),
            "and keeps it from the routing one"
        );
        assert!(
            !try_lease(&s, "k", 0, 4, 200, 600, false),
            "and from another idle VM"
        );
        assert!(try_lease(&s, "k", 0, 2, 300, 600, false), "renewing it");
        // Once the holder routes, the next idle VM takes it over.
        assert!(try_lease(&s, "k", 0, 2, 400, 600, true));
        assert!(try_lease(&s, "k", 0, 4, 500, 600, false));
        // A value from an older filter (no flag) is never taken before it expires.
        s.set(
            &lease_key("k", 1),
            &[1, 0, 0, 0, 0x58, 2, 0, 0, 0, 0, 0, 0],
            None,
        );
        assert!(!try_lease(&s, "k", 1, 2, 100, 600, false));
        assert!(try_lease(&s, "k", 1, 2, 601, 600, false));
    }

    #[test]
    fn ring_keeps_order_and_drops_the_oldest() {
        // Envoy's CAS rule and ngx_wasm_module's (no token writes only a new key): the ring's slots
        // are written over and over, so the second rule must not freeze them at their first batch.
        let (envoy, ngx) = (MemStore::default(), NgxStore::default());
        for s in [&envoy as &dyn SharedStore, &ngx] {
            ring_on(s);
        }
    }

    fn ring_on(s: &dyn SharedStore) {
        for i in 0..3u8 {
            publish(s, "k", 0, &[i], i as u64);
        }
        let (b, seen) = unseen(s, "k", 0, 0);
        assert_eq!(b, vec![vec![0], vec![1], vec![2]]);
        assert_eq!(seen, 3);
        assert_eq!(
            next_unseen(s, "k", 0, 1).0,
            Some((vec![1], 1)),
            "with its poll time"
        );
        assert!(unseen(s, "k", 0, seen).0.is_empty());
        for i in 3..20u8 {
            publish(s, "k", 0, &[i], i as u64);
        }
        let (b, seen) = unseen(s, "k", 0, 3);
        assert_eq!(b.len() as u64, RING);
        assert_eq!(b.last(), Some(&vec![19]));
        assert_eq!(b.first(), Some(&vec![12]));
        assert_eq!(seen, 20);
        assert!(unseen(s, "k", 1, 0).0.is_empty(), "other replica untouched");
    }

    #[test]
    fn verdicts_change_under_both_cas_rules() {
        let (envoy, ngx) = (MemStore::default(), NgxStore::default());
        for s in [&envoy as &dyn SharedStore, &ngx] {
            assert_eq!(health(s, "k", 2), None);
            publish_health(s, "k", 2, true, 10);
            assert_eq!(health(s, "k", 2), Some(true));
            publish_health(s, "k", 2, false, 20);
            assert_eq!(health(s, "k", 2), Some(false), "back up");
        }
    }
}
