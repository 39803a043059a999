//! `kv_time`'s learned speeds cannot lock a replica out. A cold engine (a warm-up
//! compile, an empty page cache) answers its first requests 20x slowly, then runs at its profile's
//! speed. The first version learned those requests as the speed bound and then never chose the
//! replica again while the others could take the load; now the prior keeps a few requests from
//! moving the factor far and costs within the estimates' uncertainty are ties, so the replica is
//! tried again and wins back its share (with the defaults: fading evidence off). And alike
//! replicas whose learned factors differ by noise share fresh prompts.

mod common;

use kvsteer_lab::bench::model_eval::{self, Cell, Set};
use kvsteer_lab::bench::scenario::Source;
use kvsteer_workload::rl::RlParams;
use std::path::Path;

/// Replica 0 runs 20x slow for its first `heal_s` seconds.
const HEAL_S: f64 = 5.0;
/// Requests issued within this many seconds after it heals are judged.
const WINDOW_S: f64 = 30.0;

/// Two clients in a closed loop, each request a fresh 2K-token prompt (one-turn rollouts sharing
/// nothing), 64 output tokens.
fn cell() -> Cell {
    Cell {
        id: "cold-replica".into(),
        set: Set::Validation,
        source: Source::Rl(RlParams {
            steps: 60,
            turns: 1,
            system_tokens: 0,
            step_tokens: 0,
            rollout_tokens: 2048,
            output_tokens: 64,
            straggler_output_tokens: 64,
            stragglers: Vec::new(),
            concurrency: 2,
            ..RlParams::default()
        }),
        replicas: 4,
        profile: "llama-3.1-8b-h100",
        slowdowns: vec![(0, 20.0, 0), (0, 1.0, (HEAL_S * 1e6) as u64)],
    }
}

/// Per seed: replica 0's share of the requests issued in the window after it healed, how many
/// requests that window held, and how many replica 0 took while slow.
fn share_after_healing(seed: u64) -> (f64, usize, usize) {
    let m = model_eval::replay(
        common::module(),
        Path::new("traces"),
        &cell(),
        "kv_time",
        seed,
        true,
    )
    .unwrap_or_else(|e| panic!("{e}"));
    let in_window: Vec<u64> = m
        .requests
        .iter()
        .filter(|r| {
            let t = r["issued_ms"].as_f64().unwrap_or(0.0) / 1e3;
            (HEAL_S..HEAL_S + WINDOW_S).contains(&t)
        })
        .filter_map(|r| r["replica"].as_u64())
        .collect();
    let on_0 = in_window.iter().filter(|&&r| r == 0).count();
    let while_slow = m
        .requests
        .iter()
        .filter(|r| r["issued_ms"].as_f64().unwrap_or(0.0) / 1e3 < HEAL_S)
        .filter(|r| r["replica"].as_u64() == Some(0))
        .count();
    (
        on_0 as f64 / in_window.len().max(1) as f64,
        in_window.len(),
        while_slow,
    )
}

/// At least a quarter of a fair share (1/16 of the requests on 4 replicas) within 30 s of healing,
/// on every draw.
#[test]
fn a_replica_slow_on_its_first_requests_wins_back_its_share() {
    for seed in 0..3 {
        let (share, n, while_slow) = share_after_healing(seed);
        eprintln!(
            "seed {seed}: replica 0 took {while_slow} requests while slow, then {share:.3} of {n} \
             in the window"
        );
        assert!(
            while_slow >= 1,
            "seed {seed}: replica 0 was never tried while slow"
        );
        assert!(n >= 40, "seed {seed}: only {n} requests in the window");
        assert!(share >= 0.25 / 4.0, "seed {seed}: share {share:.3} of {n}");
    }
}

/// The noise case: four alike replicas whose speeds, while the first `NOISY_S` seconds last, are
/// redrawn every half second within 6% of the profile's (so the learned factors differ by noise,
/// with a spread), then all run at the profile's speed. One client sends fresh prompts one by
/// one: afterwards every replica gets at least a quarter of a fair share and none more than half.
/// The first version sent every fresh prompt to the replica whose factor happened to be lowest
/// (40 of 40 through Envoy, factors 1-6% apart).
#[test]
fn alike_replicas_share_fresh_prompts_whatever_their_factors_noise() {
    const NOISY_S: f64 = 10.0;
    const REPLICAS: usize = 4;
    for seed in 0..3u64 {
        let mut draw = kvsteer_core::rng::SplitMix64::new(seed + 17);
        let mut slowdowns = Vec::new();
        for step in 0..(NOISY_S * 2.0) as u64 {
            for r in 0..REPLICAS {
                let factor = 0.94 + 0.12 * draw.next_f64();
                slowdowns.push((r, factor, step * 500_000));
            }
        }
        for r in 0..REPLICAS {
            slowdowns.push((r, 1.0, (NOISY_S * 1e6) as u64));
        }
        let mut c = cell();
        c.id = "noisy-factors".into();
        c.slowdowns = slowdowns;
        if let Source::Rl(p) = &mut c.source {
            p.concurrency = 1;
        }
        let m = model_eval::replay(
            common::module(),
            Path::new("traces"),
            &c,
            "kv_time",
            seed,
            true,
        )
        .unwrap_or_else(|e| panic!("{e}"));
        let mut per = [0usize; REPLICAS];
        for r in &m.requests {
            let t = r["issued_ms"].as_f64().unwrap_or(0.0) / 1e3;
            if let Some(k) = r["replica"].as_u64().filter(|_| t >= NOISY_S) {
                per[k as usize] += 1;
            }
        }
        let n: usize = per.iter().sum();
        eprintln!("seed {seed}: fresh prompts after the noisy phase per replica {per:?}");
        assert!(
            n >= 40,
            "seed {seed}: only {n} requests after the noisy phase"
        );
        for (k, &got) in per.iter().enumerate() {
            assert!(
                got as f64 >= 0.25 * n as f64 / REPLICAS as f64,
                "seed {seed}: replica {k} got {got} of {n}: {per:?}"
            );
            assert!(
                got * 2 <= n,
                "seed {seed}: replica {k} got {got} of {n}: {per:?}"
            );
        }
    }
}
