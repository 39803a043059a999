use super::*;
use crate::load::Accounting;

fn table() -> LoadTable {
    LoadTable::new(
        2,
        16,
        Accounting {
            prompt_blocks_at_admission: false,
            assume_kv_reuse: false,
            use_output_hint: false,
            prefill_in_time: None,
        },
    )
}

fn report(prefill_tokens: u64, decode_blocks: u64, running: u32) -> ReplicaLoad {
    ReplicaLoad {
        running,
        prefill_tokens,
        decode_blocks,
        ..ReplicaLoad::default()
    }
}

fn totals(prefill_tokens: u64, decode_blocks: u64, active_requests: u32) -> LoadTotals {
    LoadTotals {
        prefill_tokens,
        decode_blocks,
        active_requests,
    }
}

/// Admits `id` on `replica` at `at_ms` with `uncached` prompt tokens to prefill.
fn admit(load: &mut LoadTable, id: u64, replica: usize, uncached: u64, at_ms: u64) {
    load.admit_at(id, replica, uncached, uncached, None, [], at_ms);
}

#[test]
fn ignore_and_max_read_the_report_as_told() {
    let mut load = table();
    admit(&mut load, 1, 0, 100, 0);
    let mut ignore = Reported::new(2, ReportedLoad::Ignore, 16);
    ignore.accept(0, report(500, 4, 3), 10, &load);
    assert_eq!(ignore.effective(&load), load.totals().to_vec());

    let mut max = Reported::new(2, ReportedLoad::Max, 16);
    // A report in another engine block size is read in the router's: 4 blocks of 32 are 8 of 16.
    let in_32 = ReplicaLoad {
        block_size: 32,
        ..report(50, 4, 3)
    };
    max.accept(0, in_32, 10, &load);
    assert_eq!(max.effective(&load)[0], totals(100, 8, 3));
    // A stale replica's report is not read.
    assert!(max.set_stale(0, true));
    assert_eq!(max.effective(&load)[0], totals(100, 0, 1));
    assert!(!max.set_stale(2, true));
    assert!(!max.is_stale(2));
}

#[test]
fn merge_adds_bookings_since_the_poll_and_takes_off_releases() {
    let mut load = table();
    admit(&mut load, 1, 0, 100, 0);
    let mut m = Reported::new(2, ReportedLoad::Merge, 16);
    assert_eq!(m.polled_ms(0), None);
    // The report, polled at 10, holds request 1; request 2 comes after it.
    m.accept(0, report(1_000, 0, 5), 10, &load);
    assert_eq!(m.polled_ms(0), Some(10));
    admit(&mut load, 2, 0, 30, 20);
    assert_eq!(m.effective(&load)[0], totals(1_030, 0, 6));
    assert_eq!(m.local_since(&load)[0], totals(30, 0, 1));
    // Request 1's release is taken off the report; request 2's goes with the bookings.
    let gone = load.release_entry(1).unwrap();
    m.released(&gone);
    assert_eq!(m.local_released_since()[0], totals(100, 0, 1));
    assert_eq!(m.effective(&load)[0], totals(930, 0, 5));
    let gone = load.release_entry(2).unwrap();
    m.released(&gone);
    assert_eq!(m.effective(&load)[0], totals(900, 0, 4));
    // A peer's bookings since and releases count as this worker's.
    m.set_peer_since(
        7,
        &[totals(10, 0, 1)],
        &[totals(0, 0, 1), totals(1, 1, 1), totals(9, 9, 9)],
    );
    assert_eq!(m.effective(&load)[0], totals(910, 0, 4));
    m.clear_peer(7);
    assert_eq!(m.effective(&load)[0], totals(900, 0, 4));
    // A new report starts again from its poll.
    m.accept(0, report(200, 0, 1), 40, &load);
    assert_eq!(m.effective(&load)[0], totals(200, 0, 1));
    // Replica 1 has not reported: its tracked totals and its peers'.
    m.set_peer_load(3, &[totals(0, 0, 0), totals(5, 0, 1)]);
    assert_eq!(m.effective(&load)[1], totals(5, 0, 1));
}

#[test]
fn others_counts_own_requests_once_and_the_rest_of_the_report() {
    let mut load = table();
    admit(&mut load, 1, 0, 100, 0);
    let mut o = Reported::new(2, ReportedLoad::Others, 16);
    // The report holds request 1 (as it stood when accepted) and 400 tokens of other proxies'.
    o.accept(0, report(500, 0, 2), 10, &load);
    assert_eq!(o.local_held()[0], totals(100, 0, 1));
    assert_eq!(o.effective(&load)[0], totals(500, 0, 2));
    // A peer worker's requests the report holds are the proxy's too.
    o.set_peer_held(2, &[totals(50, 0, 1)]);
    o.set_peer_load(2, &[totals(50, 0, 1)]);
    assert_eq!(o.effective(&load)[0], totals(500, 0, 2));
}

#[test]
fn a_report_in_plain_tokens_meets_bookings_in_time_in_one_unit() {
    // kv_time books prefill in time: each of a request's uncached tokens also attends to its
    // context (here 1,000 tokens of context per token's worth of work).
    let mut load = LoadTable::new(
        2,
        16,
        Accounting {
            prefill_in_time: Some(1_000),
            ..Accounting::default()
        },
    );
    // 1,000 uncached tokens after 1,500 cached: each attends to 2,000 on average, 3x a token.
    load.admit_at(1, 0, 2_500, 1_000, None, [], 0);
    assert_eq!(load.totals()[0].prefill_tokens, 3_000);
    assert_eq!(load.work_per_token(), 3.0);
    let mut o = Reported::new(2, ReportedLoad::Others, 16);
    // The replica reports its queue in plain tokens: this proxy's 1,000 and 400 of another's.
    o.accept(0, report(1_400, 0, 2), 10, &load);
    assert_eq!(o.local_held()[0].prefill_tokens, 1_000);
    // The other proxy's 400 tokens are priced like this proxy's, 3x: before, the 3,000 booked
    // were taken off the 1,400 reported and the other proxy's queue read as nothing.
    assert_eq!(o.effective(&load)[0].prefill_tokens, 3_000 + 1_200);
    // `max` and `merge` read the report in the same unit.
    let mut max = Reported::new(2, ReportedLoad::Max, 16);
    max.accept(1, report(1_400, 0, 2), 10, &load);
    assert_eq!(max.effective(&load)[1].prefill_tokens, 4_200);
    let mut merge = Reported::new(2, ReportedLoad::Merge, 16);
    merge.accept(0, report(1_400, 0, 2), 10, &load);
    load.admit_at(2, 0, 100, 100, None, [], 20);
    // 1,400 reported + 100 booked since, in plain tokens, then converted by the table's ratio
    // over both bookings: (3,000 + 105) / 1,100.
    let per_token = load.work_per_token();
    assert!(per_token > 2.8 && per_token < 3.0, "{per_token}");
    let merged = merge.effective(&load)[0].prefill_tokens;
    assert_eq!(merged, (1_500.0 * per_token) as u64);
}

#[test]
fn a_forgotten_slot_keeps_nothing_of_its_member() {
    let mut load = table();
    let mut m = Reported::new(2, ReportedLoad::Max, 16);
    m.accept(
        1,
        ReplicaLoad {
            kv_total_blocks: 64,
            ..report(500, 0, 2)
        },
        10,
        &load,
    );
    m.set_stale(1, true);
    m.set_peer_load(4, &[totals(1, 0, 1), totals(7, 0, 1)]);
    assert_eq!(m.report(1).map(|r| r.kv_total_blocks), Some(64));
    m.forget(1);
    assert_eq!(m.report(1), None);
    assert_eq!(m.polled_ms(1), None);
    assert!(!m.is_stale(1));
    assert_eq!(m.effective(&load), vec![totals(1, 0, 1), totals(0, 0, 0)]);
    admit(&mut load, 1, 1, 10, 20);
    assert_eq!(m.effective(&load)[1], totals(10, 0, 1));
}
