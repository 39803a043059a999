use super::*;

/// kvsteer's earlier accounting: prompt blocks from the first token, no sharing.
const FIRST_TOKEN: Accounting = Accounting {
    prompt_blocks_at_admission: false,
    assume_kv_reuse: false,
    use_output_hint: false,
    prefill_in_time: None,
};

#[test]
fn prefill_work_weighs_each_uncached_token_by_its_context() {
    // Short prompts cost about their tokens; a cold 100K-token prompt three times its tokens
    // (its tokens attend to 50K of context on average); the same tokens at the end of a cached
    // 100K context cost more again.
    assert_eq!(prefill_work(1_000, 1_000, 25_000), 1_020);
    assert_eq!(prefill_work(100_000, 100_000, 25_000), 300_000);
    assert_eq!(prefill_work(200_000, 100_000, 25_000), 700_000);
    assert_eq!(prefill_work(5_000, 0, 25_000), 0);
    // Hostile sizes saturate instead of overflowing; a zero scale books plain tokens.
    assert!(prefill_work(u64::MAX, u64::MAX, 1) >= u64::MAX / 8);
    assert_eq!(prefill_work(100_000, 100_000, 0), 100_000);
}

#[test]
fn prefill_in_time_books_and_releases_work() {
    let mut t = LoadTable::new(
        1,
        16,
        Accounting {
            prefill_in_time: Some(25_000),
            ..FIRST_TOKEN
        },
    );
    t.admit(1, 0, 100_000, 100_000, None, []);
    assert_eq!(t.totals()[0].prefill_tokens, 300_000);
    t.first_token(1);
    assert_eq!(t.totals()[0].prefill_tokens, 0);
}

#[test]
fn life_cycle_moves_load_and_releases_all() {
    let mut t = LoadTable::new(2, 16, FIRST_TOKEN);
    assert!(t.admit(1, 1, 100, 60, None, []));
    assert_eq!(
        t.totals()[1],
        LoadTotals {
            prefill_tokens: 60,
            decode_blocks: 0,
            active_requests: 1
        }
    );
    t.first_token(1);
    assert_eq!(t.totals()[1].prefill_tokens, 0);
    assert_eq!(t.totals()[1].decode_blocks, 7); // ceil(100/16)
    t.decode_progress(1, 15);
    assert_eq!(t.totals()[1].decode_blocks, 7);
    t.decode_progress(1, 16);
    assert_eq!(t.totals()[1].decode_blocks, 8);
    t.decode_progress(1, 40);
    assert_eq!(t.totals()[1].decode_blocks, 9);
    assert!(t.release(1));
    assert_eq!(t.totals()[1], LoadTotals::default());
    assert!(!t.release(1), "double release is harmless");
    assert_eq!(t.release_anomalies(), 1);
    assert!(!t.admit(2, 5, 10, 10, None, []), "bad replica");
}

#[test]
fn output_hint_weights_decode_blocks() {
    let mut t = LoadTable::new(
        1,
        16,
        Accounting {
            use_output_hint: true,
            ..FIRST_TOKEN
        },
    );
    t.admit(1, 0, 160, 160, Some(160), []);
    t.first_token(1);
    assert_eq!(t.totals()[0].decode_blocks, 10);
    t.decode_progress(1, 80); // 15 blocks, half done
    assert_eq!(t.totals()[0].decode_blocks, 8);
    t.decode_progress(1, 160);
    assert_eq!(t.totals()[0].decode_blocks, 0);
    t.release(1);
    assert_eq!(t.totals()[0], LoadTotals::default());
}

#[test]
fn release_before_first_token_removes_prefill() {
    let mut t = LoadTable::new(1, 16, FIRST_TOKEN);
    t.admit(1, 0, 100, 100, None, []);
    t.admit(2, 0, 50, 20, None, []);
    t.release(1);
    assert_eq!(t.totals()[0].prefill_tokens, 20);
    assert_eq!(t.totals()[0].active_requests, 1);
    t.decode_progress(9, 3);
    assert_eq!(t.release_anomalies(), 1);
}

#[test]
fn dynamo_accounting_books_at_admission_and_counts_shared_blocks_once() {
    let mut t = LoadTable::new(2, 16, Accounting::default());
    // 100 tokens: 6 full blocks (hashed) + a partial one.
    let a = [1, 2, 3, 4, 5, 6];
    assert!(t.admit(1, 0, 100, 100, None, a));
    assert_eq!(t.totals()[0].decode_blocks, 7, "booked from admission");
    assert_eq!(t.totals()[0].prefill_tokens, 100);
    // A second request sharing the first 4 blocks adds only its own 2 + partial.
    let b = [1, 2, 3, 4, 9, 10];
    assert_eq!(t.active_prefix(0, &b), 4);
    assert_eq!(t.active_prefix(1, &b), 0, "other replica");
    t.admit(2, 0, 100, 36, None, b);
    assert_eq!(t.totals()[0].decode_blocks, 7 + 3);
    t.first_token(1);
    assert_eq!(t.totals()[0].prefill_tokens, 36);
    assert_eq!(
        t.totals()[0].decode_blocks,
        10,
        "first token changes no blocks"
    );
    t.decode_progress(1, 32);
    assert_eq!(t.totals()[0].decode_blocks, 12);
    // Releasing the first keeps the shared prefix booked for the second.
    t.release(1);
    assert_eq!(t.totals()[0].decode_blocks, 7);
    assert_eq!(t.active_prefix(0, &a), 4);
    t.release(2);
    assert_eq!(t.totals()[0], LoadTotals::default());
    assert_eq!(t.active_prefix(0, &a), 0);
}

#[test]
fn shared_blocks_are_capped_by_the_prompt_and_hint_weights_only_own_blocks() {
    let mut t = LoadTable::new(
        1,
        16,
        Accounting {
            use_output_hint: true,
            ..Accounting::default()
        },
    );
    // More identity chunks than token blocks (a text identity): at most 2 shared blocks booked.
    t.admit(1, 0, 32, 32, Some(32), [7, 8, 9, 10]);
    assert_eq!(t.totals()[0].decode_blocks, 2);
    // Half-way through its output: 2 shared + ceil(1 own block * 0.5).
    t.decode_progress(1, 16);
    assert_eq!(t.totals()[0].decode_blocks, 3);
    t.decode_progress(1, 32);
    assert_eq!(
        t.totals()[0].decode_blocks,
        2,
        "own blocks weigh 0 when done"
    );
    t.release(1);
    assert_eq!(t.totals()[0], LoadTotals::default());
}

/// Idle blocks kept after release (and swept when many) give exactly what removing them gave:
/// checked against a set that removes each block with its last holder, over requests that
/// share prefixes, overlap, and release in a scrambled order, across several sweeps.
#[test]
fn idle_blocks_count_as_removed_ones() {
    let mut t = LoadTable::new(1, 16, Accounting::default());
    let mut model: HashMap<u64, u32> = HashMap::new();
    let mut held: Vec<(u64, Vec<u64>)> = Vec::new();
    let mut seed = 7u64;
    let mut next = || {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        seed >> 33
    };
    let chain =
        |root: u64, len: u64| -> Vec<u64> { (0..len).map(|i| root * 1_000_003 + i).collect() };
    let mut swept = 0;
    for id in 0..3000u64 {
        // Roots repeat, so prefixes are shared; many roots and long chains, so the idle blocks
        // pass the floor and get swept.
        let blocks = chain(next() % 40, 1 + next() % 900);
        let probe = match held.last() {
            Some((_, b)) if next() % 2 == 0 => chain(b[0] / 1_000_003, 1 + next() % 900),
            _ => chain(next() % 40, 1 + next() % 900),
        };
        let want = probe.iter().take_while(|h| model.contains_key(*h)).count();
        assert_eq!(t.active_prefix(0, &probe), want);
        t.admit(
            id,
            0,
            blocks.len() as u64 * 16,
            0,
            None,
            blocks.iter().copied(),
        );
        for h in &blocks {
            *model.entry(*h).or_insert(0) += 1;
        }
        held.push((id, blocks));
        if held.len() > 3 || next() % 3 == 0 {
            let (rid, gone) = held.swap_remove((next() % held.len() as u64) as usize);
            let before = t.active_blocks[0].counts.len();
            t.release(rid);
            swept += (t.active_blocks[0].counts.len() < before) as u32;
            for h in &gone {
                let n = model.get_mut(h).unwrap();
                *n -= 1;
                if *n == 0 {
                    model.remove(h);
                }
            }
        }
        // Each prompt is whole blocks, all shared: the decode load is the distinct blocks.
        assert_eq!(t.totals()[0].decode_blocks, model.len() as u64);
        assert_eq!(t.active_blocks[0].live, model.len());
    }
    assert!(swept > 2, "the test reached the sweep ({swept})");
}

#[test]
fn totals_encoding_round_trips_and_refuses_garbage() {
    let v = vec![
        LoadTotals {
            prefill_tokens: 1,
            decode_blocks: u64::MAX,
            active_requests: 7,
        },
        LoadTotals::default(),
    ];
    let b = LoadTotals::encode_all(&v);
    assert_eq!(LoadTotals::decode_all(&b).unwrap(), v);
    for cut in 0..b.len() {
        assert!(LoadTotals::decode_all(&b[..cut]).is_err());
    }
    let mut bad = b.clone();
    bad[0] = b'x';
    assert_eq!(
        LoadTotals::decode_all(&bad),
        Err(crate::record::RecordError::BadMagic)
    );
}

#[test]
fn the_head_is_the_oldest_request_in_prefill_and_starts_at_the_last_first_token() {
    let mut t = LoadTable::new(2, 16, FIRST_TOKEN).with_prefill_heads();
    assert_eq!(t.prefill_heads(), vec![PrefillHead::default(); 2]);
    t.admit_at(1, 0, 1_000, 1_000, None, [], 100);
    t.admit_at(2, 0, 2_000, 2_000, None, [], 200);
    t.admit_at(3, 0, 500, 500, None, [], 300);
    t.admit_at(4, 1, 100, 0, None, [], 300); // fully cached: nothing in prefill
    let h = t.prefill_heads();
    assert_eq!(
        (h[0].admitted_ms, h[0].work, h[0].last_first_token_ms),
        (100, 1_000, 0)
    );
    assert_eq!(h[1].admitted_ms, PrefillHead::NONE);
    // The head returns its first token: the next one starts then.
    t.first_token_at(1, 500);
    let h = t.prefill_heads()[0];
    assert_eq!(
        (h.admitted_ms, h.work, h.last_first_token_ms),
        (200, 2_000, 500)
    );
    assert_eq!(h.running(800).elapsed_s, 0.3);
    // A request behind the head returning first does not restart the head's clock.
    t.first_token_at(3, 600);
    assert_eq!(t.prefill_heads()[0].last_first_token_ms, 500);
    assert_eq!(t.prefill_heads()[0].admitted_ms, 200);
    // Released while in prefill (an abort): gone from the queue, and nothing is left in it.
    t.release(2);
    assert_eq!(t.prefill_heads()[0].admitted_ms, PrefillHead::NONE);
    // An unknown request's first token is counted, not applied.
    let before = t.release_anomalies();
    t.first_token_at(99, 700);
    assert_eq!(t.release_anomalies(), before + 1);
}

#[test]
fn a_head_that_never_leaves_does_not_keep_what_left_behind_it() {
    let mut t = LoadTable::new(1, 16, FIRST_TOKEN).with_prefill_heads();
    t.admit_at(0, 0, 100, 100, None, [], 0); // never answered, never released
    for id in 1..20_000u64 {
        t.admit_at(id, 0, 100, 100, None, [], id);
        t.first_token_at(id, id);
        t.release(id);
    }
    assert!(
        t.in_prefill[0].len() <= 2 * t.active() + 1024 + 1,
        "{}",
        t.in_prefill[0].len()
    );
    assert_eq!(t.prefill_heads()[0].admitted_ms, 0);
}

#[test]
fn without_prefill_heads_nothing_is_kept_and_every_head_reads_as_none() {
    let mut t = LoadTable::new(1, 16, FIRST_TOKEN);
    t.admit_at(1, 0, 1_000, 1_000, None, [], 100);
    t.first_token_at(1, 200);
    t.admit_at(2, 0, 1_000, 1_000, None, [], 300);
    assert!(t.in_prefill[0].is_empty());
    assert_eq!(t.prefill_heads(), vec![PrefillHead::default()]);
    assert_eq!(
        t.totals()[0].prefill_tokens,
        1_000,
        "the bookings are the same"
    );
}
