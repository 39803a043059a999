//! Engine behaviour the router can see: prefix-cache hits, eviction in the feed, preemption, latency
//! shape, reproducibility, restarts and aborts.

use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::{FeedCursor, FeedEvent, FeedQuery, Tier};
use kvsteer_sim::{Engine, EngineConfig, EngineEvent, EngineRequest, FinishReason, OutputLen};

fn req(id: u64, prompt: Vec<u32>, max_tokens: u32) -> EngineRequest {
    EngineRequest {
        id,
        prompt,
        max_tokens,
        ignore_eos: true,
        min_tokens: 0,
    }
}

fn prompt(tag: u32, len: usize) -> Vec<u32> {
    (0..len as u32).map(|i| tag * 1_000_000 + i).collect()
}

/// Runs until idle, returning every event.
fn drain(e: &mut Engine) -> Vec<EngineEvent> {
    let mut out = Vec::new();
    while let Some(t) = e.next_event_time() {
        e.advance(t, &mut out);
    }
    e.advance(e.now_us(), &mut out);
    out
}

fn finished(events: &[EngineEvent], id: u64) -> (u32, u32, u32, FinishReason, u64) {
    events
        .iter()
        .find_map(|e| match *e {
            EngineEvent::Finished {
                id: i,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                t_us,
            } if i == id => Some((
                prompt_tokens,
                cached_tokens,
                completion_tokens,
                reason,
                t_us,
            )),
            _ => None,
        })
        .expect("request finished")
}

fn first_token_time(events: &[EngineEvent], id: u64) -> u64 {
    events
        .iter()
        .find_map(|e| match *e {
            EngineEvent::FirstToken { id: i, t_us, .. } if i == id => Some(t_us),
            _ => None,
        })
        .expect("first token")
}

#[test]
fn same_prefix_reports_shared_full_blocks_as_cached() {
    let mut e = Engine::new(EngineConfig::default());
    let shared = prompt(1, 1000); // 62 full blocks + 8 tokens
    let mut a = shared.clone();
    a.extend(prompt(2, 100));
    let mut b = shared.clone();
    b.extend(prompt(3, 100));
    e.submit(0, req(1, a, 4)).unwrap();
    let ev = drain(&mut e);
    assert_eq!(finished(&ev, 1).1, 0);
    let t = e.now_us();
    e.submit(t, req(2, b, 4)).unwrap();
    let ev = drain(&mut e);
    let (prompt_tokens, cached, completion, reason, _) = finished(&ev, 2);
    assert_eq!(prompt_tokens, 1100);
    assert_eq!(cached, 62 * 16, "only the shared full blocks hit");
    assert_eq!(completion, 4);
    assert_eq!(reason, FinishReason::Length);
    let hits = e.stats().prefix_cache_hits;
    assert_eq!(hits, 62 * 16);
}

#[test]
fn identical_prompt_keeps_one_token_to_compute() {
    let mut e = Engine::new(EngineConfig::default());
    let p = prompt(1, 64);
    e.submit(0, req(1, p.clone(), 2)).unwrap();
    drain(&mut e);
    e.submit(e.now_us(), req(2, p, 2)).unwrap();
    let ev = drain(&mut e);
    assert_eq!(
        finished(&ev, 2).1,
        48,
        "the last full block is recomputed to sample"
    );
}

#[test]
fn eviction_under_pressure_shows_up_in_the_feed_as_removals() {
    let cfg = EngineConfig {
        kv_blocks: 64,
        ..Default::default()
    };
    let mut e = Engine::new(cfg);
    let mut cursor = FeedCursor::default();
    let snap = e.feed(&cursor.query(4096));
    cursor.accept(&snap);
    let first = prompt(1, 40 * 16);
    let first_hashes: Vec<u64> = BlockHasher::new(16)
        .unwrap()
        .sequence_hashes(&first)
        .iter()
        .map(|h| h.0)
        .collect();
    e.submit(0, req(1, first, 1)).unwrap();
    drain(&mut e);
    e.submit(e.now_us(), req(2, prompt(2, 40 * 16), 1)).unwrap();
    drain(&mut e);
    let batch = e.feed(&cursor.query(4096));
    assert_eq!(
        cursor.accept(&batch),
        kvsteer_core::feed::CursorVerdict::Apply
    );
    let mut stored: Vec<u64> = Vec::new();
    let mut removed: Vec<u64> = Vec::new();
    for ev in &batch.events {
        match ev {
            FeedEvent::Stored { tier, hashes } => {
                assert_eq!(*tier, Tier::Gpu);
                stored.extend(hashes)
            }
            FeedEvent::Removed { hashes, .. } => removed.extend(hashes),
            FeedEvent::Cleared => panic!("no clear without a restart"),
        }
    }
    assert_eq!(stored.len(), 80, "both prompts' full blocks were stored");
    assert!(
        !removed.is_empty(),
        "the second prompt evicted some of the first"
    );
    for h in &removed {
        assert!(first_hashes.contains(h));
        assert!(!e.is_cached(kvsteer_core::block::SeqHash(*h)));
    }
    assert_eq!(batch.load.kv_total_blocks, 64);
}

#[test]
fn preemption_happens_when_the_cache_is_full() {
    let cfg = EngineConfig {
        kv_blocks: 40,
        ..Default::default()
    };
    let mut e = Engine::new(cfg);
    // Four requests of 8 blocks of prompt that each grow by 8 blocks: 64 blocks wanted, 40 exist.
    for id in 0..4 {
        e.submit(0, req(id, prompt(id as u32 + 1, 128), 128))
            .unwrap();
    }
    let ev = drain(&mut e);
    assert!(e.stats().preemptions > 0);
    for id in 0..4 {
        let (_, _, completion, reason, _) = finished(&ev, id);
        assert_eq!((completion, reason), (128, FinishReason::Length));
    }
    // Token positions stay in order and complete despite recompute.
    let toks: Vec<u32> = ev
        .iter()
        .filter_map(|x| match x {
            EngineEvent::FirstToken { id: 3, token, .. }
            | EngineEvent::Token { id: 3, token, .. } => Some(*token),
            _ => None,
        })
        .collect();
    let want: Vec<u32> = (0..128).map(|p| e.output_token(3, p)).collect();
    assert_eq!(toks, want);
}

#[test]
fn ttft_grows_with_uncached_prompt_length() {
    let mut ttft = Vec::new();
    for len in [256usize, 2048, 8192, 32768] {
        let mut e = Engine::new(EngineConfig::default());
        e.submit(0, req(1, prompt(1, len), 1)).unwrap();
        let ev = drain(&mut e);
        ttft.push(first_token_time(&ev, 1));
    }
    assert!(ttft.windows(2).all(|w| w[1] > w[0]), "{ttft:?}");
    // A cached prefix cuts TTFT.
    let mut e = Engine::new(EngineConfig::default());
    let p = prompt(1, 32768);
    e.submit(0, req(1, p.clone(), 1)).unwrap();
    drain(&mut e);
    let mut q = p;
    q.extend(prompt(9, 256));
    let t0 = e.now_us();
    e.submit(t0, req(2, q, 1)).unwrap();
    let ev = drain(&mut e);
    assert!(first_token_time(&ev, 2) - t0 < ttft[3] / 10);
}

#[test]
fn inter_token_latency_grows_with_batch_size() {
    let mut itl = Vec::new();
    for batch in [1u64, 16, 64, 256] {
        let mut e = Engine::new(EngineConfig::default());
        for id in 0..batch {
            e.submit(0, req(id, prompt(id as u32 + 1, 1024), 64))
                .unwrap();
        }
        let ev = drain(&mut e);
        let first = first_token_time(&ev, 0);
        let last = finished(&ev, 0).4;
        // Every request decodes together after the prefill steps.
        itl.push((last - first) / 63);
    }
    assert!(itl.windows(2).all(|w| w[1] > w[0]), "{itl:?}");
    assert!((6000..8000).contains(&itl[0]), "batch-1 ITL {}", itl[0]);
}

#[test]
fn virtual_runs_are_reproducible_for_a_seed() {
    let run = |seed: u64| {
        let cfg = EngineConfig {
            kv_blocks: 300,
            seed,
            output_len: OutputLen::Exponential { mean: 40.0 },
            ..Default::default()
        };
        let mut e = Engine::new(cfg);
        let mut all = Vec::new();
        for id in 0..40u64 {
            let t = id * 7_000;
            e.advance(t, &mut all);
            let mut p = prompt((id % 5) as u32, 300);
            p.extend(prompt(100 + id as u32, 50 + (id as usize * 13) % 200));
            let r = EngineRequest {
                id,
                prompt: p,
                max_tokens: 200,
                ignore_eos: false,
                min_tokens: 3,
            };
            e.submit(t, r).unwrap();
        }
        all.extend(drain(&mut e));
        let feed = e.feed(&FeedQuery::resync(4096));
        (all, feed)
    };
    let a = run(7);
    assert_eq!(a, run(7));
    assert_ne!(a.0, run(8).0);
    let lens: Vec<u32> = (0..40).map(|id| finished(&a.0, id).2).collect();
    assert!(lens.iter().all(|&l| (3..=200).contains(&l)));
    assert!(lens.iter().any(|&l| l < 200), "natural lengths vary");
}

#[test]
fn restart_aborts_in_flight_and_changes_epoch() {
    let mut e = Engine::new(EngineConfig::default());
    e.submit(0, req(1, prompt(1, 4000), 1000)).unwrap();
    e.submit(0, req(2, prompt(2, 4000), 1000)).unwrap();
    let mut out = Vec::new();
    e.advance(1_000_000, &mut out);
    let epoch = e.epoch();
    let mut cursor = FeedCursor::default();
    cursor.accept(&e.feed(&cursor.query(100)));
    e.restart(1_000_000);
    assert_ne!(e.epoch(), epoch);
    assert_eq!(e.next_event_time(), None);
    let mut out = Vec::new();
    e.advance(1_000_001, &mut out);
    let aborted: Vec<u64> = out
        .iter()
        .filter_map(|x| match x {
            EngineEvent::Finished {
                id,
                reason: FinishReason::Abort,
                ..
            } => Some(*id),
            _ => None,
        })
        .collect();
    assert_eq!(aborted.len(), 2);
    let b = e.feed(&cursor.query(100));
    assert!(b.resync);
    assert_eq!(b.events, vec![FeedEvent::Cleared]);
    assert_eq!(b.load.kv_used_blocks, 0);
}

#[test]
fn abort_frees_blocks_and_reports_once() {
    let mut e = Engine::new(EngineConfig::default());
    e.submit(0, req(1, prompt(1, 100), 1000)).unwrap();
    let mut out = Vec::new();
    e.advance(100_000, &mut out);
    assert!(e.decode_blocks() > 0);
    assert!(e.abort(100_000, 1));
    assert!(!e.abort(100_000, 1));
    let ev = drain(&mut e);
    assert_eq!(finished(&ev, 1).3, FinishReason::Abort);
    assert_eq!(e.decode_blocks(), 0);
    assert_eq!(e.in_flight(), 0);
    assert_eq!(e.load().running, 0);
}

#[test]
fn bad_requests_are_refused() {
    use kvsteer_sim::SubmitError;
    let mut e = Engine::new(EngineConfig {
        kv_blocks: 10,
        max_model_len: 1000,
        ..Default::default()
    });
    assert_eq!(
        e.submit(0, req(1, vec![], 1)),
        Err(SubmitError::EmptyPrompt)
    );
    assert_eq!(
        e.submit(0, req(1, vec![1], 0)),
        Err(SubmitError::ZeroMaxTokens)
    );
    assert!(matches!(
        e.submit(0, req(1, prompt(1, 990), 20)),
        Err(SubmitError::TooLong { tokens: 1010, .. })
    ));
    assert!(matches!(
        e.submit(0, req(1, prompt(1, 200), 1)),
        Err(SubmitError::ExceedsKvCapacity { .. })
    ));
    e.submit(0, req(1, vec![1], 1)).unwrap();
    assert_eq!(
        e.submit(0, req(1, vec![1], 1)),
        Err(SubmitError::DuplicateId(1))
    );
}

#[test]
fn host_tier_brings_evicted_blocks_back_cheaper() {
    let cfg = EngineConfig {
        kv_blocks: 70,
        host_blocks: 200,
        ..Default::default()
    };
    let mut e = Engine::new(cfg);
    let a = prompt(1, 64 * 16);
    e.submit(0, req(1, a.clone(), 1)).unwrap();
    let ev = drain(&mut e);
    let cold = first_token_time(&ev, 1);
    let t = e.now_us();
    e.submit(t, req(2, prompt(2, 64 * 16), 1)).unwrap();
    drain(&mut e);
    let b = e.feed(&FeedQuery::resync(10));
    assert!(b.events.iter().any(|x| matches!(
        x,
        FeedEvent::Stored {
            tier: Tier::Host,
            ..
        }
    )));
    let t = e.now_us();
    e.submit(t, req(3, a, 1)).unwrap();
    let ev = drain(&mut e);
    let (_, cached, ..) = finished(&ev, 3);
    assert!(
        cached >= 63 * 16 - 16,
        "host hits count as cached: {cached}"
    );
    assert!(first_token_time(&ev, 3) - t < cold / 2);
}

#[test]
fn reported_prefill_counts_only_what_a_waiting_request_will_compute() {
    let mut e = Engine::new(EngineConfig {
        max_running: 1,
        ..Default::default()
    });
    // Cache a 640-token prompt (40 blocks of 16).
    let p = prompt(1, 640);
    e.submit(0, req(1, p.clone(), 1)).unwrap();
    drain(&mut e);
    // One long request takes the only running slot; the next turn of the first prompt waits.
    e.submit(e.now_us(), req(2, prompt(2, 32), 1000)).unwrap();
    let mut out = Vec::new();
    let t = e.next_event_time().unwrap();
    e.advance(t, &mut out);
    let mut next = p.clone();
    next.extend(prompt(3, 100));
    e.submit(e.now_us(), req(3, next, 1)).unwrap();
    let load = e.load();
    assert_eq!((load.running, load.waiting), (1, 1));
    // Request 2 has its prompt computed; request 3 will compute its 100 new tokens only.
    assert_eq!(load.prefill_tokens, 100, "{load:?}");
    // Without the cached prefix the whole prompt counts.
    e.submit(e.now_us(), req(4, prompt(4, 300), 1)).unwrap();
    assert_eq!(e.load().prefill_tokens, 100 + 300);
}

#[test]
fn a_fork_runs_ahead_exactly_as_the_engine_would_and_leaves_it_alone() {
    let cfg = EngineConfig {
        kv_blocks: 200,
        seed: 3,
        output_len: OutputLen::Exponential { mean: 30.0 },
        ..Default::default()
    };
    let mut e = Engine::new(cfg);
    let mut seen = Vec::new();
    for id in 0..6u64 {
        e.advance(id * 5_000, &mut seen);
        let r = EngineRequest {
            id,
            prompt: prompt(id as u32 % 2, 400),
            max_tokens: 100,
            ignore_eos: false,
            min_tokens: 1,
        };
        e.submit(id * 5_000, r).unwrap();
    }
    // Mid-run: some requests decode, some wait. The views carry every one, with its true remaining
    // output (natural lengths: the engine drew them, a router cannot know them).
    let views = e.sequences();
    assert_eq!(views.len(), e.in_flight());
    assert!(views.iter().any(|v| v.running) && views.iter().all(|v| v.remaining >= 1));
    let before = views.clone();
    let mut fork = e.fork();
    let ahead = drain(&mut fork);
    // The original has not moved.
    assert_eq!(e.sequences(), before);
    let rest = drain(&mut e);
    assert_eq!(ahead, rest, "the fork produced exactly the engine's future");
    for v in &before {
        let (_, _, completion, _, _) = finished(&rest, v.id);
        assert_eq!(completion, v.generated + v.remaining, "request {}", v.id);
    }
    // The prefix lookup counts what admission would: a cached prompt's full blocks but its last.
    let p = prompt(0, 400);
    let hashes = e.prompt_hashes(&p);
    assert_eq!(hashes.len(), 25);
    assert_eq!(e.cached_prefix_tokens(&hashes, p.len()), 384);
    let other = prompt(9, 400);
    assert_eq!(
        e.cached_prefix_tokens(&e.prompt_hashes(&other), other.len()),
        0
    );
}

/// LoRA: a request whose adapter is not resident waits for its load before its first token; one
/// whose adapter is resident does not; with every slot taken by a running adapter, a request for
/// another waits for one to finish; the feed's report names the running and waiting adapters.
#[test]
fn an_adapter_not_resident_costs_its_load_before_the_first_token() {
    let load_us = 300_000;
    let cfg = EngineConfig {
        lora: kvsteer_sim::lora::LoraConfig { slots: 1, load_us },
        ..EngineConfig::default()
    };
    let ttft = |adapters: &[Option<&str>]| {
        let mut e = Engine::new(cfg.clone());
        let mut times = Vec::new();
        for (i, a) in adapters.iter().enumerate() {
            e.submit_with_adapter(e.now_us(), req(i as u64, prompt(i as u32, 256), 2), *a)
                .unwrap();
            let t0 = e.now_us();
            let events = drain(&mut e);
            times.push(first_token_time(&events, i as u64) - t0);
        }
        (times, e.adapter_loads())
    };
    let (base, loads) = ttft(&[None, None]);
    assert_eq!(loads, 0);
    let (cold_then_warm, loads) = ttft(&[Some("a"), Some("a")]);
    assert_eq!(loads, 1);
    assert_eq!(cold_then_warm[0], base[0] + load_us);
    assert_eq!(cold_then_warm[1], base[1]);
    // One slot: b replaces a, and a comes back at the price of another load.
    let (_, loads) = ttft(&[Some("a"), Some("b"), Some("a")]);
    assert_eq!(loads, 3);

    // Both submitted at once with one slot: b waits for a's request to finish.
    let mut e = Engine::new(cfg.clone());
    e.submit_with_adapter(0, req(1, prompt(1, 256), 50), Some("a"))
        .unwrap();
    e.submit_with_adapter(0, req(2, prompt(2, 256), 2), Some("b"))
        .unwrap();
    let mut out = Vec::new();
    e.advance(1, &mut out);
    let r = e.adapter_report().unwrap();
    assert_eq!(
        (r.slots, r.running, r.waiting),
        (1, vec!["a".into()], vec!["b".into()])
    );
    let events = drain(&mut e);
    assert!(first_token_time(&events, 2) > finished(&events, 1).4);
    assert_eq!(e.resident_adapters(), vec!["b"]);
    // LoRA off: no report, and a named adapter is ignored.
    let mut off = Engine::new(EngineConfig::default());
    off.submit_with_adapter(0, req(1, prompt(1, 64), 1), Some("a"))
        .unwrap();
    assert_eq!(off.adapter_report(), None);
}

/// An adapter's blocks are its own: the same prompt under another adapter, or the base model, finds
/// nothing cached; under the same adapter it finds the prefix.
#[test]
fn adapters_do_not_share_cached_blocks() {
    let cfg = EngineConfig {
        lora: kvsteer_sim::lora::LoraConfig {
            slots: 4,
            load_us: 1,
        },
        ..EngineConfig::default()
    };
    let mut e = Engine::new(cfg);
    let p = prompt(3, 512);
    e.submit_with_adapter(0, req(1, p.clone(), 1), Some("a"))
        .unwrap();
    drain(&mut e);
    let mut cached = |id: u64, adapter: Option<&str>| {
        e.submit_with_adapter(e.now_us(), req(id, p.clone(), 1), adapter)
            .unwrap();
        finished(&drain(&mut e), id).1
    };
    assert_eq!(cached(2, None), 0);
    assert_eq!(cached(3, Some("b")), 0);
    assert!(cached(4, Some("a")) >= 496);
}

/// A second-long stall about every 2 s of engine time, and when the first one starts and ends for
/// the default seed.
fn first_stall() -> (kvsteer_sim::stall::StallConfig, u64, u64) {
    let cfg = kvsteer_sim::stall::StallConfig {
        mean_gap_us: 2_000_000,
        len_us: 1_000_000,
        seed: 0,
    };
    let seed = EngineConfig::default().seed;
    let (start, end) = kvsteer_sim::stall::Stalls::new(cfg, seed)
        .window()
        .expect("stalls on");
    (cfg, start, end)
}

/// An engine with `stall` that got one request at `at_us` and ran until its first token, and the
/// events it gave so far.
fn run_to_first_token(
    stall: kvsteer_sim::stall::StallConfig,
    at_us: u64,
) -> (Engine, Vec<EngineEvent>) {
    let mut e = Engine::new(EngineConfig {
        stall,
        ..EngineConfig::default()
    });
    e.submit(at_us, req(1, prompt(1, 2000), 4)).unwrap();
    let mut ev = Vec::new();
    while e.stats().generation_tokens == 0 {
        let t = e.next_event_time().expect("busy");
        e.advance(t, &mut ev);
    }
    (e, ev)
}

/// Submits one request at `at_us` and runs until its first token: (first token's time, stalls
/// that held a step up, engine time they held it).
fn first_token_at(stall: kvsteer_sim::stall::StallConfig, at_us: u64) -> (u64, u64, u64) {
    let (e, ev) = run_to_first_token(stall, at_us);
    let s = e.stats();
    (first_token_time(&ev, 1) - at_us, s.stalls, s.stalled_us)
}

#[test]
fn a_stall_holds_the_first_token_back_by_its_length() {
    let (stall, start, end) = first_stall();
    assert_eq!(end - start, 1_000_000);
    // Arriving as the stall starts, the request waits all of it before its prefill.
    let (calm, calm_stalls, _) = first_token_at(Default::default(), start);
    assert_eq!(calm_stalls, 0);
    let (stalled, stalls, held_us) = first_token_at(stall, start);
    assert_eq!((stalled, stalls, held_us), (calm + 1_000_000, 1, 1_000_000));
    // Half way through it, half of it; once it is over (the engine idle through it), nothing.
    let (half, _, _) = first_token_at(stall, start + 500_000);
    assert_eq!(half, calm + 500_000);
    assert_eq!(first_token_at(stall, end), (calm, 0, 0));
}

#[test]
fn the_engine_lists_the_stalls_that_held_it_up() {
    let (stall, start, end) = first_stall();
    let fresh = Engine::new(EngineConfig {
        stall,
        ..EngineConfig::default()
    });
    assert_eq!(fresh.held_stalls().count(), 0);
    let (e, _) = run_to_first_token(stall, start + 250_000);
    // Held from the request's arrival (the engine was idle before) to the stall's end.
    assert_eq!(e.held_stalls().next(), Some((start + 250_000, end)));
}

/// The longest time between two tokens of one request (the first token's from its arrival).
fn longest_gap(events: &[EngineEvent], arrivals: &[u64]) -> u64 {
    let mut last = arrivals.to_vec();
    let mut gap = 0;
    for e in events {
        if let EngineEvent::FirstToken { id, t_us, .. } | EngineEvent::Token { id, t_us, .. } = *e {
            gap = gap.max(t_us - last[id as usize]);
            last[id as usize] = t_us;
        }
    }
    gap
}

#[test]
fn stalls_off_change_nothing_and_on_they_stretch_a_busy_run() {
    let run = |stall| {
        let mut e = Engine::new(EngineConfig {
            stall,
            ..EngineConfig::default()
        });
        let mut ev = Vec::new();
        for id in 0..40u64 {
            let t = id * 500_000;
            e.advance(t, &mut ev);
            e.submit(t, req(id, prompt(id as u32, 1500), 200)).unwrap();
        }
        ev.extend(drain(&mut e));
        (ev, e.stats().stalls)
    };
    let arrivals: Vec<u64> = (0..40).map(|id| id * 500_000).collect();
    let (base, _) = run(EngineConfig::default().stall);
    assert!(longest_gap(&base, &arrivals) < 500_000);
    let off = kvsteer_sim::stall::StallConfig {
        mean_gap_us: 0,
        len_us: 1_000_000,
        seed: 0,
    };
    assert_eq!(run(off).0, base, "0 between stalls is off");
    // A second-long stall every ~3 s of engine time over a ~20 s busy run: several hold it up.
    let on = kvsteer_sim::stall::StallConfig {
        mean_gap_us: 3_000_000,
        len_us: 1_000_000,
        seed: 0,
    };
    let (ev, stalls) = run(on);
    assert!(stalls >= 2, "{stalls} stalls");
    assert!(longest_gap(&ev, &arrivals) >= 900_000);
    // Every request still finishes, with all its tokens.
    for id in 0..40u64 {
        assert_eq!(finished(&ev, id).2, 200);
    }
    assert_eq!(run(on).0, ev, "reproducible for a seed");
}

#[test]
fn stalls_are_counted_in_metrics() {
    let (stall, start, _) = first_stall();
    let mut e = Engine::new(EngineConfig {
        stall,
        ..EngineConfig::default()
    });
    let line = "kvsteer_sim:stalls_total{model_name=\"m\"} ";
    let text = kvsteer_sim::metrics::render(&e, "m");
    assert!(text.contains(&format!("{line}0\n")), "{text}");
    e.submit(start, req(1, prompt(1, 100), 2)).unwrap();
    drain(&mut e);
    let text = kvsteer_sim::metrics::render(&e, "m");
    assert!(text.contains(&format!("{line}1\n")), "{text}");
    // The time held, in whole engine milliseconds: a stall holds a step for the configured length
    // at most (it may have begun before the request came).
    let held = e.stats().stalled_us / 1000;
    assert!(held > 0, "the stall held the step");
    let line = format!("kvsteer_sim:stalled_ms_total{{model_name=\"m\"}} {held}\n");
    assert!(text.contains(&line), "{text}");
}
