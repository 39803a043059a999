//! The oracle: the limit the benchmark measures kvsteer's policies against.
//!
//! The policies rank against each other in docs/reports/results.md; nothing there says how far the
//! best of them is from what routing could achieve at all. The oracle is that reference point. It
//! lives in the harness, never in the filter, because it cheats twice over:
//!
//! - it knows every request's **true output length** (the harness sends the workload's length as
//!   `max_tokens` with `ignore_eos`, and the engine draws the length of every request it holds at
//!   submission; a router sees only a cap);
//! - it reads the simulated engines' **exact state** at decision time: their running and waiting
//!   requests with their true remaining tokens, and their KV cache contents (no feed, no delay, no
//!   approximation).
//!
//! No deployable router can know either, so the oracle row of a table is a reference point to measure
//! the distance to, not a policy to ship. It is also only *greedy*: it places each request as it
//! arrives, best for that moment, and knows nothing of requests still to come. A greedy oracle can be
//! beaten on a metric it does not optimise, or by a policy that happens to keep room for later
//! arrivals (measured: `kv_load` keeps better TTFT and TPOT tails on Mooncake and a better RL rollout
//! p99; docs/design/harness.md, "The oracle"), and the report says so where it happens.
//!
//! **How it decides.** For every replica that is not down (the harness passes which are usable), it
//! predicts, in microseconds of engine time, what placing the request there costs, and picks the
//! cheapest (the lowest index on a tie):
//!
//! 1. **its own time to first token**, exactly as the simulator would produce it with no further
//!    arrivals: the replica's engine is forked ([`Engine::fork`]: same requests, cache, clock and step
//!    in progress), the request is submitted to the fork, and the fork runs until the request's first
//!    token. Queueing, chunked prefill, prefix hits, memory waits (which end when the requests ahead
//!    finish: their true lengths) and preemptions are all the engine's own, not a model of them;
//! 2. **plus the stall its prefill puts on the others**: each chunk of its prefill lengthens a step
//!    that every request running beside it waits for, so its uncached prefill work (the profile's
//!    linear-layer and attention cost of the tokens it must compute) counts once per request running
//!    there when it gets its first token ([`Weights::stall`], 1);
//! 3. optionally (**[`Weights::decode`], 0 by default**) **the decode interaction**: for as long as
//!    both decode, every step on that replica reads its KV and the other's, so each request `j` still
//!    generating there adds `min(remaining_j, output) * (kv_read * (context_j + context +
//!    min(remaining_j, output)) + 2 * per_seq)`, true remaining lengths on both sides (two long
//!    stragglers on one replica cost what they will really cost). Measured on one seed
//!    (docs/design/harness.md, "The oracle"), weight 1 lowers RL's rollout p99 and TPOT p99 but
//!    raises TTFT p99 by half and costs cache hits on the coding-agent trace, where TTFT p50 gets
//!    worse than `kv_load`'s: the term prices latency summed over requests, not the TTFT the tables
//!    lead with, so the default leaves it out (`oracle@decode=1` in the bench puts it back).
//!
//! Term 1 is a lower bound of the total, so a replica whose fork has already run past the best total
//! found is abandoned early: candidates are tried in order of queued plus uncached prefill tokens,
//! which usually finds a good bound first.

use kvsteer_sim::profile::attn_pairs;
use kvsteer_sim::{Engine, EngineEvent, EngineRequest, Profile, SeqView};

/// The name the bench gives the oracle in its policy list (`--policies kv_load,oracle`).
pub const ORACLE: &str = "oracle";

/// How the report labels the oracle: the limit, not a policy.
pub const ORACLE_NOTE: &str = "limit: knows true output lengths and engine state; not deployable";

/// The weights of the cost terms (module doc); [`Weights::default`] is the bench's `oracle`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Weights {
    /// Term 2: the stall its prefill puts on the requests running beside it.
    pub stall: f64,
    /// Term 3: the decode interaction with the requests still generating there.
    pub decode: f64,
}

impl Default for Weights {
    fn default() -> Self {
        Weights {
            stall: 1.0,
            decode: 0.0,
        }
    }
}

impl Weights {
    /// The weights of a bench policy spec: `oracle` (the defaults) or `oracle@decode=1@stall=0.5`;
    /// `None` for a spec that is not the oracle's, an error for a malformed one.
    pub fn from_spec(spec: &str) -> Option<Result<Weights, String>> {
        let mut parts = spec.split('@');
        if parts.next() != Some(ORACLE) {
            return None;
        }
        let mut w = Weights::default();
        for kv in parts {
            let parsed = kv.split_once('=').and_then(|(k, v)| {
                let v: f64 = v
                    .parse()
                    .ok()
                    .filter(|v: &f64| v.is_finite() && *v >= 0.0)?;
                Some((k, v))
            });
            match parsed {
                Some(("stall", v)) => w.stall = v,
                Some(("decode", v)) => w.decode = v,
                _ => {
                    return Some(Err(format!(
                        "policy spec {spec:?}: {kv:?} is not stall=N or decode=N (N >= 0)"
                    )));
                }
            }
        }
        Some(Ok(w))
    }
}

/// The request to place, as the oracle sees it.
#[derive(Clone, Copy, Debug)]
pub struct OracleRequest<'a> {
    pub id: u64,
    pub prompt: &'a [u32],
    /// The true output length (the engine generates exactly this many tokens).
    pub output_tokens: u32,
}

/// What the oracle predicted for one replica, in microseconds of engine time.
#[derive(Clone, Debug, PartialEq)]
pub struct Estimate {
    pub replica: usize,
    /// Prompt tokens the replica holds in its cache (what it would not compute).
    pub cached_tokens: usize,
    /// Time to first token from the forked engine; a lower bound when `complete` is false.
    pub ttft_us: f64,
    /// Term 2 of the module doc: the stall its prefill adds to the requests running beside it.
    pub prefill_stall_us: f64,
    /// Term 3: the decode interaction with the requests still generating there.
    pub decode_us: f64,
    /// The sum; a lower bound when `complete` is false.
    pub cost_us: f64,
    /// False when the fork was abandoned because it already cost more than the best replica.
    pub complete: bool,
}

/// The oracle's decision.
#[derive(Clone, Debug, PartialEq)]
pub struct Choice {
    pub replica: usize,
    /// One estimate per usable replica the engine accepted, in the order they were tried.
    pub estimates: Vec<Estimate>,
}

/// Picks the replica for `req` arriving at `now_us` among `engines` (replica `i` is `engines[i]`),
/// pricing with `weights`,
/// never one whose `usable[i]` is false. `None` when no usable engine would accept the request (it is
/// too long for every one, or none is usable): the caller keeps whatever it would otherwise do.
pub fn choose(
    now_us: u64,
    engines: &[&Engine],
    usable: &[bool],
    req: &OracleRequest,
    weights: Weights,
) -> Option<Choice> {
    let mut candidates: Vec<(u64, usize, usize)> = Vec::new(); // (queued + uncached, replica, cached)
    let mut hashes: Option<(usize, Vec<u64>)> = None; // (block size, hashes)
    for (i, e) in engines.iter().enumerate() {
        if !usable.get(i).copied().unwrap_or(false) {
            continue;
        }
        let bs = e.config().block_size;
        if hashes.as_ref().is_none_or(|(b, _)| *b != bs) {
            hashes = Some((bs, e.prompt_hashes(req.prompt)));
        }
        let h = &hashes.as_ref().expect("computed above").1;
        let cached = e.cached_prefix_tokens(h, req.prompt.len());
        let uncached = (req.prompt.len() - cached) as u64;
        candidates.push((e.load().prefill_tokens + uncached, i, cached));
    }
    candidates.sort_unstable();
    let mut best: Option<(f64, usize)> = None;
    let mut estimates = Vec::new();
    for (_, i, cached) in candidates {
        let bound = best.map_or(f64::INFINITY, |(c, _)| c);
        if let Some(est) = estimate(now_us, engines[i], i, cached, req, weights, bound) {
            if est.complete && best.is_none_or(|(c, _)| est.cost_us < c) {
                best = Some((est.cost_us, i));
            }
            estimates.push(est);
        }
    }
    best.map(|(_, replica)| Choice { replica, estimates })
}

/// The cost of placing `req` on `engine` (module doc), or `None` when the engine refuses it. Stops
/// early, with `complete: false`, once the time to first token alone exceeds `bound`.
fn estimate(
    now_us: u64,
    engine: &Engine,
    replica: usize,
    cached: usize,
    req: &OracleRequest,
    weights: Weights,
    bound: f64,
) -> Option<Estimate> {
    let mut fork = engine.fork();
    let start = now_us.max(engine.now_us());
    fork.submit(
        start,
        EngineRequest {
            id: req.id,
            prompt: req.prompt.to_vec(),
            max_tokens: req.output_tokens,
            ignore_eos: true,
            min_tokens: 0,
        },
    )
    .ok()?;
    let t_first = match first_token(&mut fork, now_us, req.id, bound) {
        Ok(t) => t,
        Err(ttft_us) => {
            return Some(Estimate {
                replica,
                cached_tokens: cached,
                ttft_us,
                prefill_stall_us: 0.0,
                decode_us: 0.0,
                cost_us: ttft_us,
                complete: false,
            });
        }
    };
    let ttft_us = t_first.saturating_sub(now_us) as f64;
    let p = &engine.config().profile;
    let uncached = (req.prompt.len() - cached) as u64;
    let prefill_work_us = p.compute_us_per_token * uncached as f64
        + p.attn_us_per_pair * attn_pairs(cached as u64, uncached) as f64;
    let others = fork.sequences();
    let beside = others
        .iter()
        .filter(|s| s.running && s.id != req.id)
        .count();
    let prefill_stall_us = weights.stall * prefill_work_us * beside as f64;
    let decode_us = if weights.decode > 0.0 {
        weights.decode * decode_pairs_us(p, &others, req)
    } else {
        0.0
    };
    Some(Estimate {
        replica,
        cached_tokens: cached,
        ttft_us,
        prefill_stall_us,
        decode_us,
        cost_us: ttft_us + prefill_stall_us + decode_us,
        complete: true,
    })
}

/// Runs `fork` until request `id`'s first token: its time, or, when it gives up past `bound` (or
/// the fork runs dry), the time to first token it reached, for a partial estimate.
fn first_token(fork: &mut Engine, now_us: u64, id: u64, bound: f64) -> Result<u64, f64> {
    let mut events = Vec::new();
    loop {
        let Some(t) = fork.next_event_time() else {
            // Cannot happen with the request in flight; treated as never served.
            return Err(fork.now_us().saturating_sub(now_us) as f64);
        };
        if t.saturating_sub(now_us) as f64 > bound {
            return Err(bound);
        }
        fork.advance(t, &mut events);
        let first = events.iter().find_map(|e| match e {
            EngineEvent::FirstToken { id: i, t_us, .. } if *i == id => Some(*t_us),
            _ => None,
        });
        if let Some(t) = first {
            return Ok(t);
        }
        events.clear();
    }
}

/// The decode time `req` and each other sequence on the engine cost each other while both run:
/// over the tokens they decode side by side, each step reads both contexts and pays both
/// sequences' fixed cost.
fn decode_pairs_us(p: &Profile, others: &[SeqView], req: &OracleRequest) -> f64 {
    let output = req.output_tokens as f64;
    let context = req.prompt.len() as f64;
    others
        .iter()
        .filter(|s| s.id != req.id)
        .map(|s| {
            let overlap = (s.remaining as f64).min(output);
            overlap
                * (p.kv_read_us_per_token * (s.context_tokens as f64 + context + overlap)
                    + 2.0 * p.per_seq_us)
        })
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvsteer_sim::EngineConfig;

    fn engine(i: usize) -> Engine {
        Engine::new(
            EngineConfig {
                kv_blocks: 4096,
                ..EngineConfig::default()
            }
            .for_replica(i),
        )
    }

    fn prompt(tag: u32, len: usize) -> Vec<u32> {
        (0..len as u32).map(|i| tag * 1_000_000 + i).collect()
    }

    fn submit(e: &mut Engine, id: u64, prompt: Vec<u32>, max_tokens: u32) {
        let now = e.now_us();
        e.submit(
            now,
            EngineRequest {
                id,
                prompt,
                max_tokens,
                ignore_eos: true,
                min_tokens: 0,
            },
        )
        .unwrap();
    }

    fn run_until_idle(e: &mut Engine) {
        let mut out = Vec::new();
        while let Some(t) = e.next_event_time() {
            e.advance(t, &mut out);
        }
    }

    fn pick(engines: &[Engine], usable: &[bool], prompt: &[u32], output: u32) -> Option<Choice> {
        pick_with(engines, usable, prompt, output, Weights::default())
    }

    fn pick_with(
        engines: &[Engine],
        usable: &[bool],
        prompt: &[u32],
        output: u32,
        weights: Weights,
    ) -> Option<Choice> {
        let now = engines.iter().map(Engine::now_us).max().unwrap_or(0);
        let refs: Vec<&Engine> = engines.iter().collect();
        let req = OracleRequest {
            id: 999,
            prompt,
            output_tokens: output,
        };
        choose(now, &refs, usable, &req, weights)
    }

    #[test]
    fn an_idle_replica_holding_the_prefix_beats_idle_and_busy_ones_without_it() {
        let shared = prompt(1, 8_000);
        let mut es: Vec<Engine> = (0..3).map(engine).collect();
        // Replica 1 has served the prefix and is idle again; replica 2 is busy with other work.
        submit(&mut es[1], 1, shared.clone(), 4);
        run_until_idle(&mut es[1]);
        for id in 10..14 {
            submit(&mut es[2], id, prompt(id as u32, 6_000), 500);
        }
        let mut p = shared.clone();
        p.extend(prompt(7, 200));
        let c = pick(&es, &[true; 3], &p, 100).unwrap();
        assert_eq!(c.replica, 1, "{c:?}");
        let holder = c.estimates.iter().find(|e| e.replica == 1).unwrap();
        assert_eq!(holder.cached_tokens, 8_000);
        // The others were tried after it (more prefill to do) and abandoned once their forks ran
        // past its cost.
        assert_eq!(c.estimates[0].replica, 1, "{c:?}");
        for e in &c.estimates[1..] {
            assert!(!e.complete && e.cost_us >= holder.cost_us, "{c:?}");
        }
        // Without the bound, the cold replica's own prefill shows.
        let req = OracleRequest {
            id: 999,
            prompt: &p,
            output_tokens: 100,
        };
        let now = es.iter().map(Engine::now_us).max().unwrap();
        let cold = estimate(now, &es[0], 0, 0, &req, Weights::default(), f64::INFINITY).unwrap();
        assert!(
            cold.complete && cold.ttft_us > holder.ttft_us + 100_000.0,
            "{cold:?}"
        );
        // The prediction is the engine's own future: placed there, the request's first token comes
        // exactly when the fork said.
        let mut real = es.swap_remove(1);
        real.advance(now, &mut Vec::new());
        submit(&mut real, 999, p.clone(), 100);
        let mut out = Vec::new();
        let first = loop {
            let t = real.next_event_time().expect("the request is in flight");
            real.advance(t, &mut out);
            if let Some(t) = out.iter().find_map(|e| match e {
                EngineEvent::FirstToken { id: 999, t_us, .. } => Some(*t_us),
                _ => None,
            }) {
                break t;
            }
        };
        assert_eq!((first - now) as f64, holder.ttft_us);
    }

    #[test]
    fn a_long_queue_outweighs_the_cache_it_holds() {
        let shared = prompt(1, 2_000);
        let mut es: Vec<Engine> = (0..2).map(engine).collect();
        submit(&mut es[0], 1, shared.clone(), 4);
        run_until_idle(&mut es[0]);
        // The holder now has a long queue of uncached prefill ahead of anything new.
        for id in 10..16 {
            submit(&mut es[0], id, prompt(id as u32, 8_000), 200);
        }
        let mut p = shared.clone();
        p.extend(prompt(7, 100));
        let c = pick(&es, &[true; 2], &p, 100).unwrap();
        assert_eq!(c.replica, 1, "{c:?}");
    }

    #[test]
    fn with_the_decode_term_true_lengths_keep_a_long_decode_off_the_straggler() {
        // Both replicas decode one request with the same context; replica 0's has 4,000 tokens left,
        // replica 1's a handful. A router sees two equal replicas; the oracle knows which frees up.
        let mut es: Vec<Engine> = (0..2).map(engine).collect();
        submit(&mut es[0], 1, prompt(1, 4_000), 4_010);
        submit(&mut es[1], 2, prompt(2, 4_000), 30);
        let mut out = Vec::new();
        for e in es.iter_mut() {
            for _ in 0..20 {
                if let Some(t) = e.next_event_time() {
                    e.advance(t, &mut out);
                }
            }
        }
        let now = es.iter().map(Engine::now_us).max().unwrap();
        for e in es.iter_mut() {
            e.advance(now, &mut out);
        }
        let views: Vec<_> = es.iter().map(|e| e.sequences()[0]).collect();
        assert!(
            views[0].remaining > 3_000 && views[1].remaining < 30,
            "{views:?}"
        );
        let decode = Weights {
            decode: 1.0,
            ..Weights::default()
        };
        let c = pick_with(&es, &[true; 2], &prompt(3, 1_000), 2_000, decode).unwrap();
        assert_eq!(c.replica, 1, "{c:?}");
        let d: Vec<f64> = c.estimates.iter().map(|e| e.decode_us).collect();
        assert!(d[0] > 10.0 * d[1] && d[1] > 0.0, "{c:?}");
        // A one-token answer barely overlaps anything: the two replicas cost nearly the same.
        let short = pick_with(&es, &[true; 2], &prompt(3, 1_000), 1, decode).unwrap();
        let d: Vec<f64> = short.estimates.iter().map(|e| e.decode_us).collect();
        assert!(d.len() == 2 && (d[0] - d[1]).abs() < 10.0, "{short:?}");
        // The default oracle leaves the decode term out.
        let plain = pick(&es, &[true; 2], &prompt(3, 1_000), 2_000).unwrap();
        assert!(plain.estimates.iter().all(|e| e.decode_us == 0.0));
    }

    #[test]
    fn specs_name_the_weights() {
        assert_eq!(Weights::from_spec("oracle"), Some(Ok(Weights::default())));
        assert_eq!(
            Weights::from_spec("oracle@decode=1@stall=0.5"),
            Some(Ok(Weights {
                stall: 0.5,
                decode: 1.0
            }))
        );
        assert_eq!(Weights::from_spec("kv_load"), None);
        assert_eq!(Weights::from_spec("oracles"), None);
        for bad in [
            "oracle@decode",
            "oracle@decode=-1",
            "oracle@x=1",
            "oracle@stall=nan",
        ] {
            assert!(matches!(Weights::from_spec(bad), Some(Err(_))), "{bad}");
        }
    }

    #[test]
    fn a_down_replica_is_never_chosen() {
        let shared = prompt(1, 4_000);
        let mut es: Vec<Engine> = (0..3).map(engine).collect();
        submit(&mut es[2], 1, shared.clone(), 4);
        run_until_idle(&mut es[2]);
        // Replica 2 holds the prefix and would win; it is down.
        let c = pick(&es, &[true, true, false], &shared, 50).unwrap();
        assert_ne!(c.replica, 2);
        assert!(c.estimates.iter().all(|e| e.replica != 2));
        assert_eq!(pick(&es, &[true; 3], &shared, 50).unwrap().replica, 2);
        assert_eq!(pick(&es, &[false; 3], &shared, 50), None);
        // A request no engine accepts gets no choice.
        assert_eq!(pick(&es, &[true; 3], &prompt(4, 200_000), 50), None);
    }

    #[test]
    fn choosing_leaves_the_engines_untouched() {
        let mut es: Vec<Engine> = (0..2).map(engine).collect();
        submit(&mut es[0], 1, prompt(1, 3_000), 100);
        let before: Vec<_> = es.iter().map(|e| (e.sequences(), e.now_us())).collect();
        let c = pick(&es, &[true; 2], &prompt(2, 3_000), 100).unwrap();
        assert_eq!(c.replica, 1);
        let after: Vec<_> = es.iter().map(|e| (e.sequences(), e.now_us())).collect();
        assert_eq!(before, after);
    }
}
