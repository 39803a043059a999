use super::*;
use crate::load::LoadTotals;
use crate::policy::{fit, load_only_input};

fn input<'a>(load: &'a [LoadTotals], overlap: &'a [f64], avoided: &'a [bool]) -> Input<'a> {
    Input {
        request_blocks: 256.0,
        overlap,
        identity_blocks: 256,
        ..load_only_input(load, avoided)
    }
}

fn busy(prefill_work: u64, running: u32, context_tokens: u64) -> LoadTotals {
    LoadTotals {
        prefill_tokens: prefill_work,
        decode_blocks: context_tokens / 16,
        active_requests: running,
    }
}

#[test]
fn an_idle_cold_replica_costs_exactly_its_prefill() {
    let p = EngineProfile::default();
    let load = [LoadTotals::default(), busy(50_000, 20, 200_000)];
    let t = terms(&input(&load, &[0.0, 256.0], &[false; 2]), &p);
    assert_eq!(
        t[0].cost(&KvTimeParams::default()),
        p.prefill_s(4096.0, 0.0)
    );
    assert_eq!(t[0].wait + t[0].decode + t[0].stall + t[0].evict, 0.0);
}

/// Issue-42's shape: three replicas hold a shared prefix and queue work; the fourth holds
/// nothing and is idle. When its prefill takes less time than the others' wait, it wins.
#[test]
fn a_replica_without_the_shared_prefix_wins_once_the_holders_queue_up() {
    let p = EngineProfile::default();
    let k = KvTimeParams::default();
    let overlap = [0.0, 250.0, 250.0, 250.0];
    let mut rng = SplitMix64::new(1);
    // Holders idle: the cached prefix wins.
    let idle = [LoadTotals::default(); 4];
    let (c, _) = choose(&input(&idle, &overlap, &[false; 4]), &k, &p, 0.0, &mut rng);
    assert_ne!(c.replica, 0);
    // Holders each with more queued prefill than the cold prefill takes: replica 0 wins.
    let cold = p.prefill_s(4096.0, 0.0);
    let queued = (cold / p.work_s(1.0) * 1.5) as u64;
    let load = [
        LoadTotals::default(),
        busy(queued, 0, 0),
        busy(queued, 0, 0),
        busy(queued, 0, 0),
    ];
    let (c, t) = choose(&input(&load, &overlap, &[false; 4]), &k, &p, 0.0, &mut rng);
    assert_eq!(c.replica, 0, "{t:?}");
}

/// At saturation a move's extra prefill is priced for the requests queued behind it: the
/// holder of the prompt's cache, busier than the rest, keeps the request once every replica
/// has a backlog of requests like it; with no record of what requests cost, or with an idle
/// fleet, the move is made as before.
#[test]
fn a_backlogged_fleet_prices_a_moves_extra_prefill_for_the_requests_behind() {
    let p = EngineProfile::default();
    let k = KvTimeParams {
        later_weight: 1.0,
        ..KvTimeParams::default()
    };
    let overlap = [250.0, 0.0, 0.0, 0.0];
    let cold = p.prefill_s(4096.0, 0.0);
    let queue = |waits: f64| (cold * waits / p.work_s(1.0)) as u64;
    let load = [
        busy(queue(2.0), 0, 0),
        busy(queue(0.5), 0, 0),
        busy(queue(0.5), 0, 0),
        busy(queue(0.5), 0, 0),
    ];
    let i = input(&load, &overlap, &[false; 4]);
    let mut rng = SplitMix64::new(1);
    let (moved, t) = choose(&i, &k, &p, 0.0, &mut rng);
    assert_ne!(moved.replica, 0, "{t:?}");
    assert!(t.iter().all(|t| t.later == 0.0));
    let (kept, t) = choose(&i, &k, &p, cold, &mut rng);
    assert_eq!(kept.replica, 0, "{t:?}");
    assert_eq!(t[0].later, 0.0, "the holder adds the least work");
    assert!(t[1].later > 0.5 * cold, "{t:?}");
    let off = KvTimeParams::default();
    assert_eq!(off.later_weight, 0.0, "off by default");
    let (c, t) = choose(&i, &off, &p, cold, &mut rng);
    assert_ne!(c.replica, 0);
    assert!(
        t.iter().all(|t| t.later == 0.0),
        "off: not priced, not shown"
    );
    // Idle: nobody is behind.
    let idle = [LoadTotals::default(); 4];
    let (_, t) = choose(&input(&idle, &overlap, &[false; 4]), &k, &p, cold, &mut rng);
    assert!(t.iter().all(|t| t.later == 0.0), "{t:?}");
}

/// The mean prefill the count of requests behind is taken in starts at the first request's
/// and moves a share of the way toward each next one, never by more than its difference.
#[test]
fn the_policy_learns_the_mean_prefill_of_what_it_places() {
    let p = EngineProfile::default();
    let mut kt = KvTime::new(KvTimeParams::default(), p.clone(), 2);
    let idle = [LoadTotals::default(); 2];
    let mut rng = SplitMix64::new(3);
    let first = input(&idle, &[0.0, 0.0], &[false; 2]);
    kt.choose(&first, &mut rng);
    let cold = p.prefill_s(4096.0, 0.0);
    assert!((kt.mean_prefill_s - cold).abs() < 1e-12);
    let hot = input(&idle, &[250.0, 250.0], &[false; 2]);
    kt.choose(&hot, &mut rng);
    let warm = p.prefill_s(96.0, 4000.0);
    assert!(kt.mean_prefill_s < cold && kt.mean_prefill_s > warm);
    let step = (cold - kt.mean_prefill_s) / (cold - warm);
    assert!((step - (1.0 - 0.5f64.powf(1.0 / PREFILL_MEMORY))).abs() < 1e-9);
}

#[test]
fn a_slower_replica_costs_more_for_the_same_work() {
    let p = EngineProfile::default();
    let load = [busy(1000, 4, 10_000); 2];
    let mut i = input(&load, &[0.0, 0.0], &[false; 2]);
    let speed = [2.0, 1.0];
    i.speed = &speed;
    let t = terms(&i, &p);
    assert!((t[0].ttft() - 2.0 * t[1].ttft()).abs() < 1e-12);
    assert!(t[0].cost(&KvTimeParams::default()) > t[1].cost(&KvTimeParams::default()));
}

/// The noise case: alike idle replicas whose learned factors differ by estimator noise
/// (1-6%) share fresh prompts; the same differences known exactly send every prompt to the
/// fastest.
#[test]
fn factors_apart_by_less_than_their_uncertainty_are_ties() {
    let p = EngineProfile::default();
    let k = KvTimeParams::default();
    let load = [LoadTotals::default(); 4];
    let speed = [1.0, 1.02, 1.04, 1.06];
    let mut rng = SplitMix64::new(7);
    let mut count = |spread: f64| {
        let spreads = [spread; 4];
        let mut i = input(&load, &[0.0; 4], &[false; 4]);
        i.speed = &speed;
        i.speed_spread = &spreads;
        let mut n = [0u32; 4];
        for _ in 0..400 {
            n[choose(&i, &k, &p, 0.0, &mut rng).0.replica] += 1;
        }
        n
    };
    let noisy = count(0.05);
    assert!(noisy.iter().all(|&c| c > 60), "{noisy:?}");
    assert_eq!(count(0.001), [400, 0, 0, 0]);
    assert_eq!(count(0.0), [400, 0, 0, 0]);
}

/// A stale replica learned slow is retried with a request it would serve as well at the
/// profile's speed (idle, no cache elsewhere), never with one that gives up a cache hit or a
/// shorter queue, and never when it is avoided.
#[test]
fn a_stale_replica_is_retried_only_where_it_costs_nothing_known() {
    let p = EngineProfile::default();
    let k = KvTimeParams::default();
    let load = [LoadTotals::default(); 3];
    let speed = [2.5, 1.0, 1.0];
    let mut rng = SplitMix64::new(3);
    let stale = [true, false, false];
    let mut i = input(&load, &[0.0; 3], &[false; 3]);
    i.speed = &speed;
    assert_ne!(
        choose(&i, &k, &p, 0.0, &mut rng).0.replica,
        0,
        "fresh: priced slow"
    );
    i.speed_stale = &stale;
    assert_eq!(
        choose(&i, &k, &p, 0.0, &mut rng).0.replica,
        0,
        "stale: retried"
    );
    // Replica 1 holds half the prompt: the retry would give that up.
    let overlap = [0.0, 128.0, 0.0];
    let mut cached = input(&load, &overlap, &[false; 3]);
    cached.speed = &speed;
    cached.speed_stale = &stale;
    assert_eq!(choose(&cached, &k, &p, 0.0, &mut rng).0.replica, 1);
    // Replica 0 queues work: the retry would wait behind it.
    let queued = [
        busy(4096, 0, 0),
        LoadTotals::default(),
        LoadTotals::default(),
    ];
    let mut waits = input(&queued, &[0.0; 3], &[false; 3]);
    waits.speed = &speed;
    waits.speed_stale = &stale;
    assert_ne!(choose(&waits, &k, &p, 0.0, &mut rng).0.replica, 0);
    // Avoided (unhealthy, draining): never.
    let mut avoided = input(&load, &[0.0; 3], &[true, false, false]);
    avoided.speed = &speed;
    avoided.speed_stale = &stale;
    assert_ne!(choose(&avoided, &k, &p, 0.0, &mut rng).0.replica, 0);
}

/// Among tied replicas what is known decides: the one holding the prompt's cache keeps it,
/// even where its learned factor is a little higher; an avoided replica never ties.
#[test]
fn among_ties_the_cost_at_the_profiles_speed_decides() {
    let p = EngineProfile::default();
    let k = KvTimeParams::default();
    let load = [LoadTotals::default(); 3];
    // Replica 1 holds an eighth of the prompt and looks 30% slow; the uncertainty covers that.
    let overlap = [0.0, 32.0, 0.0];
    let speed = [1.0, 1.3, 1.0];
    let spreads = [0.2; 3];
    let mut i = input(&load, &overlap, &[true, false, false]);
    i.speed = &speed;
    i.speed_spread = &spreads;
    let mut rng = SplitMix64::new(3);
    for _ in 0..50 {
        let (c, _) = choose(&i, &k, &p, 0.0, &mut rng);
        assert_eq!(c.replica, 1, "{:?}", c.costs);
    }
    // Known exactly, 30% slower outweighs an eighth of the prompt: replica 2 (0 avoided).
    i.speed_spread = &[];
    assert_eq!(choose(&i, &k, &p, 0.0, &mut rng).0.replica, 2);
}

#[test]
fn eviction_is_priced_only_past_the_cache_and_by_the_share_that_returns() {
    let p = EngineProfile::default();
    let load = [LoadTotals::default(); 2];
    let mut i = input(&load, &[0.0, 0.0], &[false; 2]);
    // Replica 0: 95 of 100 blocks, adds 10 (5 pushed out); replica 1: fits.
    let ws = [fit(95.0, 10.0, 100.0), fit(50.0, 10.0, 100.0)];
    i.working_set = &ws;
    i.reuse_share = 0.5;
    let t = terms(&i, &p);
    assert!((t[0].evict - 0.5 * p.work_s(5.0 * 16.0)).abs() < 1e-15);
    assert_eq!(t[1].evict, 0.0);
    i.reuse_share = 0.0;
    assert_eq!(terms(&i, &p)[0].evict, 0.0);
}

#[test]
fn running_decodes_delay_the_first_token_by_their_share_of_the_steps() {
    let p = EngineProfile::default();
    // 100 decodes over 200K tokens of KV: a memory-bound step of about 16 ms.
    let batch = busy(0, 100, 200_000);
    let t = terms(
        &input(&[batch, LoadTotals::default()], &[0.0; 2], &[false; 2]),
        &p,
    );
    assert_eq!(t[1].wait, 0.0, "nothing runs on replica 1");
    // A 4,096-token prefill: half the step in progress, then one step whose compute (4,196
    // tokens) outlasts the batch's read, so the batch adds its tokens and sampling only.
    let step = p.step_s(100.0, 200_000.0);
    let shared = (5.0 * 100.0 + 27.0 * 100.0) * 1e-6;
    assert!((t[0].wait - (0.5 * step + shared)).abs() < 1e-12, "{t:?}");
    // A 16-token prefill (the rest cached) is bound by the batch's read: about a whole step.
    let one = [batch];
    let t = terms(&input(&one, &[255.0], &[false]), &p);
    let own = p.prefill_s(16.0, 4080.0);
    assert!(t[0].wait > step, "{t:?}");
    assert!(t[0].ttft() > own + step, "{t:?}");
}

#[test]
fn a_replica_whose_cache_is_full_of_decodes_waits_for_room() {
    let p = EngineProfile::default();
    // Both idle in prefill; replica 0's running requests fill its cache, replica 1's half of it.
    let full = busy(0, 100, p.kv_cache_tokens as u64);
    let half = busy(0, 50, p.kv_cache_tokens as u64 / 2);
    let t = terms(&input(&[full, half], &[0.0, 0.0], &[false; 2]), &p);
    // Beyond what their running decodes add to the steps, only the full one waits for room.
    let batch = |n: f64, k: f64| batch_s(&p, n, k, 0.0, 4096.0);
    assert!(t[0].wait - batch(100.0, p.kv_cache_tokens) > 0.05, "{t:?}");
    assert_eq!(
        t[1].wait,
        batch(50.0, (p.kv_cache_tokens as u64 / 2) as f64)
    );
}

#[test]
fn a_replica_lacking_the_adapter_costs_the_load_time_more() {
    use crate::adapters::AdapterFit::{FreeSlot, Full, Held, Unknown};
    let p = EngineProfile::default();
    let k = KvTimeParams::default();
    let load = [busy(1000, 4, 10_000); 4];
    let mut i = input(&load, &[0.0; 4], &[false; 4]);
    let fits = [Held, FreeSlot, Full, Unknown];
    i.adapter = &fits;
    i.adapter_load_s = 0.3;
    let t = terms(&i, &p);
    for (r, extra) in [(1, 0.3), (3, 0.0)] {
        assert!((t[r].cost(&k) - t[0].cost(&k) - extra).abs() < 1e-12, "{r}");
        assert!((t[r].ttft() - t[0].ttft() - extra).abs() < 1e-12, "{r}");
    }
    // Every slot taken: the load, then about half an output of steps for a slot to free.
    let slot_wait = 256.0 / 2.0 * p.step_s(4.0, 10_000.0);
    assert!((t[2].adapter - 0.3 - slot_wait).abs() < 1e-12, "{t:?}");
    let mut rng = SplitMix64::new(5);
    assert_eq!(choose(&i, &k, &p, 0.0, &mut rng).0.replica, 0);
    i.adapter_load_s = f64::NAN;
    let t = terms(&i, &p);
    assert_eq!((t[0].adapter, t[1].adapter, t[3].adapter), (0.0, 0.0, 0.0));
}

#[test]
fn hostile_loads_give_finite_costs() {
    let p = EngineProfile::default();
    let load = [busy(u64::MAX, u32::MAX, u64::MAX), LoadTotals::default()];
    let mut i = input(&load, &[f64::MAX, -3.0], &[false; 2]);
    i.expected_output_tokens = f64::NAN;
    let mut rng = SplitMix64::new(3);
    let (c, t) = choose(&i, &KvTimeParams::default(), &p, 0.0, &mut rng);
    assert!(t.iter().all(|t| !t.cost(&KvTimeParams::default()).is_nan()));
    assert_eq!(c.replica, 1);
}

/// The router reports what became of each request placed ([`Policy::observe`]): the prediction
/// kept at admission is learned from at the first token, and a vacated slot's speed is forgotten.
#[test]
fn the_policy_learns_speeds_from_what_it_observes() {
    let p = EngineProfile::default();
    let mut kt = KvTime::new(KvTimeParams::default(), p, 2);
    let idle = [LoadTotals::default(); 2];
    let mut rng = SplitMix64::new(3);
    let c = kt.choose(&input(&idle, &[0.0, 0.0], &[false; 2]), &mut rng);
    let predicted_s = kt.last_terms()[c.replica].ttft();
    kt.observe(Observation::Admitted {
        request_id: 7,
        replica: c.replica,
        now_ms: 1_000,
    });
    assert_eq!(kt.learning().unwrap().pending(), 1);
    // Three times slower than predicted: the replica's factor rises above 1.
    let observed_ms = 1_000 + (3e3 * predicted_s) as u64;
    kt.observe(Observation::FirstToken {
        request_id: 7,
        now_ms: observed_ms,
    });
    let l = kt.learning().unwrap();
    assert_eq!(l.pending(), 0);
    assert!(l.factor(c.replica) > 1.0, "{}", l.factor(c.replica));
    kt.observe(Observation::Vacated { replica: c.replica });
    assert_eq!(kt.learning().unwrap().factor(c.replica), 1.0);
    // A release before the first token teaches nothing.
    kt.choose(&input(&idle, &[0.0, 0.0], &[false; 2]), &mut rng);
    kt.observe(Observation::Admitted {
        request_id: 8,
        replica: 0,
        now_ms: 2_000,
    });
    kt.observe(Observation::Released { request_id: 8 });
    assert_eq!(kt.learning().unwrap().pending(), 0);
}

/// The other policies learn nothing: they have no speeds to read and ignore what they observe.
#[test]
fn other_policies_have_no_learning() {
    use crate::config::{PolicyKind, RoutingConfig};
    for policy in [
        PolicyKind::KvLoad,
        PolicyKind::RoundRobin,
        PolicyKind::LeastLoad,
    ] {
        let cfg = RoutingConfig {
            policy,
            ..RoutingConfig::default()
        };
        let mut p = crate::policy::from_config(&cfg, 2);
        p.observe(Observation::Released { request_id: 1 });
        assert!(
            p.learning().is_none() && p.learning_mut().is_none(),
            "{policy:?}"
        );
    }
}

/// The head of a queue has computed since its prefill began: the wait counts only what is left of
/// it, never less than nothing of it, and a head past its predicted time is credited no more.
#[test]
fn the_heads_progress_comes_off_the_queue() {
    let p = EngineProfile::default();
    let head_work = 40_000.0;
    let load = [busy(100_000, 0, 0)];
    let wait = |elapsed_s: f64| {
        let head = [crate::load::HeadProgress {
            elapsed_s,
            work: head_work,
        }];
        let i = Input {
            prefill_head: &head,
            ..input(&load, &[0.0], &[false])
        };
        terms(&i, &p)[0].wait
    };
    let whole = terms(&input(&load, &[0.0], &[false]), &p)[0].wait;
    assert_eq!(wait(0.0), whole);
    let takes = p.work_s(head_work);
    // Half the head's predicted time gone: half its work off the queue.
    assert!((wait(takes / 2.0) - p.work_s(100_000.0 - head_work / 2.0)).abs() < 1e-9);
    // Past its time, the head counts as done, and no more than the head comes off.
    let done = p.work_s(100_000.0 - head_work);
    assert!((wait(takes) - done).abs() < 1e-9);
    assert!((wait(10.0 * takes) - done).abs() < 1e-9);
    // A slower replica has done less of the same head in the same time.
    let head = [crate::load::HeadProgress {
        elapsed_s: takes / 2.0,
        work: head_work,
    }];
    let slow = [2.0];
    let i = Input {
        prefill_head: &head,
        speed: &slow,
        ..input(&load, &[0.0], &[false])
    };
    let w = terms(&i, &p)[0].wait;
    assert!(
        (w - 2.0 * p.work_s(100_000.0 - head_work / 4.0)).abs() < 1e-9,
        "{w}"
    );
    // Hostile progress (not finite, negative, larger than the queue) gives a finite wait.
    for (elapsed_s, work) in [
        (f64::NAN, 1.0),
        (-1.0, 5e4),
        (1e9, 1e12),
        (f64::INFINITY, 1.0),
    ] {
        let head = [crate::load::HeadProgress { elapsed_s, work }];
        let i = Input {
            prefill_head: &head,
            ..input(&load, &[0.0], &[false])
        };
        let w = terms(&i, &p)[0].wait;
        assert!(w.is_finite() && w >= 0.0, "{elapsed_s} {work}: {w}");
    }
}

/// The head's progress is read only where it is switched on: off (the default) the router gathers
/// none and the queue counts whole.
#[test]
fn the_heads_progress_is_gathered_only_when_switched_on() {
    let p = EngineProfile::default();
    let off = KvTime::new(KvTimeParams::default(), p.clone(), 2);
    assert!(!off.needs().prefill_head, "off by default");
    let on = KvTime::new(
        KvTimeParams {
            head_progress: true,
            ..KvTimeParams::default()
        },
        p,
        2,
    );
    assert!(on.needs().prefill_head);
}
