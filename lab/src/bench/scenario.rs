//! The benchmark matrix: which workloads, at which sizes, replayed how.
//!
//! A [`Scenario`] names one workload configuration (RL stragglers, the coding-agent trace at one
//! concurrency, Mooncake at one replay speed, Azure); the bench runs every policy on it for every seed.
//! Sizes come in three [`Scale`]s so the same code serves the published run, a try-out and the CI smoke
//! check.

use kvsteer_host_test::ProxySpread;
use kvsteer_sim::EngineConfig;
use kvsteer_workload::azure::{self, AzureParams};
use kvsteer_workload::mooncake::{self, MooncakeParams};
use kvsteer_workload::rl::{self, RlParams};
use kvsteer_workload::token_blocks::{block_key, sub_key, tokens};
use kvsteer_workload::weka::{self, WekaParams};
use kvsteer_workload::{Mode, Prompt, Workload};
use std::path::Path;

/// How much of the matrix to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scale {
    /// The report: every workload at its published size, several seeds.
    Full,
    /// Every workload, cut down, one seed: minutes.
    Quick,
    /// Tiny slices of every workload, one seed: seconds (the CI check).
    Smoke,
}

impl Scale {
    pub fn name(self) -> &'static str {
        match self {
            Scale::Full => "full",
            Scale::Quick => "quick",
            Scale::Smoke => "smoke",
        }
    }
}

/// Where a scenario's requests come from.
#[derive(Clone, Debug)]
pub enum Source {
    Rl(RlParams),
    /// Multi-turn chat behind one shared system prompt ([`kvsteer_workload::chat`]); the seed draws it.
    Chat(kvsteer_workload::chat::ChatParams),
    /// The Envoy slice: an RL workload with every prompt written out ([`flatten`]), so the harness
    /// and the Envoy run replay exactly the same requests.
    Slice(RlParams),
    Weka {
        concurrency: usize,
        copies: usize,
        max_sessions: Option<usize>,
        /// [`WekaParams::think_jitter`], drawn by the scenario's seed ([`THINK_JITTER`]
        /// everywhere but [`fixed_matrix`], which keeps the recorded timing).
        think_jitter: f64,
        /// The sample's file in the traces folder: [`weka::FILE`] (the training sample) everywhere
        /// but the coding-agent validation cells, which read one of [`weka::VALIDATION_FILES`].
        file: &'static str,
    },
    Mooncake {
        speed: f64,
        max_requests: Option<usize>,
        /// [`MooncakeParams::arrival_jitter`], drawn by the scenario's seed ([`ARRIVAL_JITTER`] in
        /// [`matrix`], 0 in [`fixed_matrix`]).
        arrival_jitter: f64,
    },
    Azure {
        speed: f64,
        max_rows: Option<usize>,
        /// [`AzureParams::arrival_jitter`], as for Mooncake.
        arrival_jitter: f64,
    },
}

/// One workload configuration of the matrix.
#[derive(Clone, Debug)]
pub struct Scenario {
    /// Short id used in file names and JSON (`rl`, `weka-c16`, `mooncake-x1`, ...).
    pub id: String,
    /// The report section it belongs to (`rl`, `weka`, `mooncake`, `azure`; `proxies` and
    /// `proxies-session` for [`proxy_matrix`]).
    pub group: &'static str,
    pub source: Source,
    /// Independent proxies in front of the replicas (1 everywhere but [`proxy_matrix`]).
    pub proxies: usize,
    /// How requests are spread across them.
    pub spread: ProxySpread,
    /// Engine endpoints (4 everywhere but [`dp_matrix`]).
    pub endpoints: usize,
    /// Data-parallel ranks behind each endpoint, each its own engine (1 everywhere but
    /// [`dp_matrix`]).
    pub dp_ranks: usize,
    /// Of `endpoints`, how many are prefill-role engines, the rest decode-role (0: not a P/D fleet;
    /// only [`pd_matrix`] sets it). A P/D scenario runs through `kvsteer_host_test::disaggregated_fleet`.
    pub pd_prefill: usize,
}

impl Scenario {
    /// The fleet in words, for the bench's banner and `harness.json`: `4 replicas`, `2 endpoints x 4
    /// DP ranks`, `2 prefill + 4 decode engines`.
    pub fn fleet(&self) -> String {
        if self.pd_prefill > 0 {
            format!(
                "{} prefill + {} decode engines",
                self.pd_prefill,
                self.endpoints.saturating_sub(self.pd_prefill)
            )
        } else if self.dp_ranks > 1 {
            format!("{} endpoints x {} DP ranks", self.endpoints, self.dp_ranks)
        } else {
            format!("{} replicas", self.endpoints)
        }
    }

    /// Builds the workload for one seed, and how to drive it.
    ///
    /// The seed reaches the RL generator (it changes every token, not the structure) and the
    /// coding-agent trace's think-time draw (when the scenario jitters them). Otherwise trace
    /// workloads have a fixed structure; their seed only reaches the engines and the router's
    /// tie-breaks (see [`crate::bench::run`]).
    pub fn build(&self, traces: &Path, seed: u64) -> Result<(Workload, Mode), String> {
        let err = |e: kvsteer_workload::WorkloadError| format!("{}: {e}", self.id);
        let w = match &self.source {
            Source::Rl(p) => rl::generate(&RlParams { seed, ..p.clone() }).map_err(err)?,
            Source::Chat(p) => {
                kvsteer_workload::chat::generate(&kvsteer_workload::chat::ChatParams {
                    seed,
                    ..p.clone()
                })
                .map_err(err)?
            }
            Source::Slice(p) => {
                flatten(&rl::generate(&RlParams { seed, ..p.clone() }).map_err(err)?)
            }
            Source::Weka {
                concurrency,
                copies,
                max_sessions,
                think_jitter,
                file,
            } => weka::read(&WekaParams {
                path: traces.join(file),
                concurrency: *concurrency,
                copies: *copies,
                max_sessions: *max_sessions,
                think_jitter: *think_jitter,
                jitter_seed: seed,
                ..Default::default()
            })
            .map_err(err)?,
            Source::Mooncake {
                speed,
                max_requests,
                arrival_jitter,
            } => mooncake::read(&MooncakeParams {
                path: traces.join(mooncake::FILE),
                speed: *speed,
                max_requests: *max_requests,
                arrival_jitter: *arrival_jitter,
                jitter_seed: seed,
                ..Default::default()
            })
            .map_err(err)?,
            Source::Azure {
                speed,
                max_rows,
                arrival_jitter,
            } => azure::read(&AzureParams {
                path: traces.join(azure::FILE),
                speed: *speed,
                max_rows: *max_rows,
                arrival_jitter: *arrival_jitter,
                jitter_seed: seed,
                ..Default::default()
            })
            .map_err(err)?,
        };
        let mode = w.default_mode;
        Ok((w, mode))
    }

    /// The simulated replica for a workload laid out in `block_size`-token blocks: the default
    /// Llama-3.1-8B on one H100, with the same KV memory cut into blocks of that size (so a 64-token
    /// block holds 4 of vLLM's default 16-token blocks and the cache holds the same number of tokens).
    /// The context limit is the model's 128K plus [`OUTPUT_ALLOWANCE`]: the coding-agent reader caps
    /// prompts at 128K, and a kept prompt near the cap plus its output would otherwise be refused by
    /// the engine under every policy alike (2 requests of the first 4 sessions were).
    pub fn engine(block_size: u32, seed: u64) -> EngineConfig {
        Scenario::engine_for(kvsteer_sim::Profile::default(), block_size, seed)
    }

    /// [`Scenario::engine`] for another engine `profile` (its KV memory and context limit).
    pub fn engine_for(profile: kvsteer_sim::Profile, block_size: u32, seed: u64) -> EngineConfig {
        let bs = block_size.max(1);
        EngineConfig {
            max_model_len: profile.max_model_len + OUTPUT_ALLOWANCE,
            block_size: bs as usize,
            kv_blocks: (profile.kv_blocks_16 as u64 * 16 / bs as u64).max(1) as u32,
            seed,
            profile,
            ..EngineConfig::default()
        }
    }
}

/// Writes every prompt out in full. An `Append` turn is the previous prompt, the previous output and
/// its own tokens; the previous output is the engine's, which a client outside the harness (the
/// Envoy slice's Python client) cannot know in advance, so a deterministic stand-in takes its place
/// (per session and turn). The engine never caches a stand-in, so a turn can hit its previous
/// prompt but not the previous output: the same for every policy and in both runs.
pub fn flatten(w: &Workload) -> Workload {
    let mut out = w.clone();
    for (si, s) in out.sessions.iter_mut().enumerate() {
        let mut prev: Vec<u32> = Vec::new();
        for (ti, t) in s.turns.iter_mut().enumerate() {
            let full = match &t.prompt {
                Prompt::Append(add) => {
                    let mut p = prev.clone();
                    p.extend_from_slice(add);
                    p
                }
                Prompt::Full(p) => p.clone(),
                Prompt::Blocks(b) => b.tokens(),
            };
            let standin = sub_key(block_key("bench:standin-output", si as u64), &[ti as u64]);
            prev = full.clone();
            prev.extend(tokens(standin, t.output_tokens as usize));
            t.prompt = Prompt::Full(full);
        }
    }
    out.name = format!("{}-flat", w.name);
    out
}

/// The Envoy slice: the RL structure (shared system and step prefixes, two stragglers a step) at a
/// size Envoy replays in about a minute per configuration with time-scaled replicas.
pub fn slice_params() -> RlParams {
    RlParams {
        steps: 2,
        turns: 4,
        ..RlParams::default()
    }
}

/// Tokens of output allowed beyond the 128K prompt cap.
pub const OUTPUT_ALLOWANCE: u32 = 32_768;

/// The coding-agent trace's concurrency levels (docs/design/design.md section 7).
pub const WEKA_LEVELS: [usize; 5] = [8, 16, 24, 32, 40];

/// Every scenario of a scale, in report order.
pub fn matrix(scale: Scale) -> Vec<Scenario> {
    // Kept whole: a data list, one scenario literal per row of the report, in its order.
    let mut v = Vec::new();
    let rl = match scale {
        Scale::Full | Scale::Quick => RlParams::default(),
        Scale::Smoke => RlParams::small(),
    };
    v.push(Scenario {
        id: "rl".into(),
        group: "rl",
        source: Source::Rl(rl),
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 4,
        dp_ranks: 1,
        pd_prefill: 0,
    });
    // Two copies of every session at every level: only 28 sessions survive the 128K cap, so levels 32
    // and 40 would otherwise be the same run; with copies the workload (56 sessions, 3,222 requests)
    // is the same at every level and only the concurrency changes.
    let (levels, copies, max_sessions): (&[usize], usize, Option<usize>) = match scale {
        Scale::Full => (&WEKA_LEVELS, 2, None),
        Scale::Quick => (&[8, 16], 1, Some(16)),
        Scale::Smoke => (&[1], 1, Some(1)),
    };
    // Each seed draws every think time anew (THINK_JITTER): with the recorded timing a seed changed
    // only tie-breaks, and kv_load replayed one run on every seed (see `fixed_matrix`).
    for &c in levels {
        v.push(Scenario {
            id: format!("weka-c{c}"),
            group: "weka",
            source: Source::Weka {
                concurrency: c,
                copies,
                max_sessions,
                think_jitter: THINK_JITTER,
                file: weka::FILE,
            },
            proxies: 1,
            spread: ProxySpread::PerRequest,
            endpoints: 4,
            dp_ranks: 1,
            pd_prefill: 0,
        });
    }
    let (mc_rows, az_rows) = match scale {
        Scale::Full => (None, None),
        Scale::Quick => (Some(600), Some(2000)),
        Scale::Smoke => (Some(60), Some(150)),
    };
    for speed in [1.0, 2.0] {
        v.push(Scenario {
            id: format!("mooncake-x{speed}"),
            group: "mooncake",
            source: Source::Mooncake {
                speed,
                max_requests: mc_rows,
                arrival_jitter: ARRIVAL_JITTER,
            },
            proxies: 1,
            spread: ProxySpread::PerRequest,
            endpoints: 4,
            dp_ranks: 1,
            pd_prefill: 0,
        });
    }
    v.push(Scenario {
        id: "slice-rl".into(),
        group: "slice",
        source: Source::Slice(match scale {
            Scale::Smoke => RlParams::small(),
            _ => slice_params(),
        }),
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 4,
        dp_ranks: 1,
        pd_prefill: 0,
    });
    v.push(Scenario {
        id: "azure".into(),
        group: "azure",
        source: Source::Azure {
            speed: 1.0,
            max_rows: az_rows,
            arrival_jitter: ARRIVAL_JITTER,
        },
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 4,
        dp_ranks: 1,
        pd_prefill: 0,
    });
    v
}

/// Think-time jitter of the coding-agent scenarios in [`matrix`]: each seed draws every think time
/// within 20% of the recorded one.
pub const THINK_JITTER: f64 = 0.2;

/// Arrival jitter of the open-loop traces (Mooncake, Azure) in [`matrix`]: each seed draws every gap
/// between consecutive arrivals within 20% of the recorded one, so that, as on the coding-agent
/// trace, every policy's seeds are independent draws (with the recorded times a seed changed only
/// tie-breaks, and kv_load replayed one run on every seed).
pub const ARRIVAL_JITTER: f64 = 0.2;

/// The trace scenarios of [`matrix`] on their recorded timing (no jitter): the coding-agent levels
/// (ids `weka-c<C>-fixed`, group `weka-fixed`), Mooncake and Azure (`mooncake-x<S>-fixed`,
/// `azure-fixed`; groups `mooncake-fixed`, `azure-fixed`). There a seed changes only the engines'
/// seeds and the routers' tie-breaks, so a policy that breaks few ties (kv_load's costs are rarely
/// equal) replays the same run on every seed while session_hash draws a new ring: the matrix up to
/// 2026-12-01 was built so, and these scenarios reproduce it. Not in [`matrix`]: only `--only`
/// selects them.
pub fn fixed_matrix(scale: Scale) -> Vec<Scenario> {
    matrix(scale)
        .into_iter()
        .filter_map(|mut s| {
            s.group = match &mut s.source {
                Source::Weka { think_jitter, .. } => {
                    *think_jitter = 0.0;
                    "weka-fixed"
                }
                Source::Mooncake { arrival_jitter, .. } => {
                    *arrival_jitter = 0.0;
                    "mooncake-fixed"
                }
                Source::Azure { arrival_jitter, .. } => {
                    *arrival_jitter = 0.0;
                    "azure-fixed"
                }
                _ => return None,
            };
            s.id = format!("{}-fixed", s.id);
            Some(s)
        })
        .collect()
}

/// The many-proxies scenarios (docs/reports/proxies.md): RL and the coding-agent trace at 16 and 32
/// in flight, through 1, 2 and 4 independent proxies. Ids `rl-p<N>`, `weka-c<C>-p<N>` (requests
/// spread across the proxies at random, group `proxies`) and the same ending in `s` (every session
/// through one proxy, group `proxies-session`). Not in [`matrix`]: the bench runs them only when
/// `--only` names them or their group. The coding-agent scenarios draw their think times per seed, as
/// [`matrix`]'s do: with the recorded timing a 1-proxy run replayed one draw on every seed while the
/// random spread across several proxies drew anew.
pub fn proxy_matrix(scale: Scale) -> Vec<Scenario> {
    let mut v = Vec::new();
    let rl = match scale {
        Scale::Full | Scale::Quick => RlParams::default(),
        Scale::Smoke => RlParams::small(),
    };
    let (levels, copies, max_sessions): (&[usize], usize, Option<usize>) = match scale {
        Scale::Full => (&[16, 32], 2, None),
        Scale::Quick => (&[16, 32], 1, Some(16)),
        Scale::Smoke => (&[2], 1, Some(2)),
    };
    for (spread, group, suffix) in [
        (ProxySpread::PerRequest, "proxies", ""),
        (ProxySpread::PerSession, "proxies-session", "s"),
    ] {
        for proxies in [1, 2, 4] {
            v.push(Scenario {
                id: format!("rl-p{proxies}{suffix}"),
                group,
                source: Source::Rl(rl.clone()),
                proxies,
                spread,
                endpoints: 4,
                dp_ranks: 1,
                pd_prefill: 0,
            });
            for &c in levels {
                v.push(Scenario {
                    id: format!("weka-c{c}-p{proxies}{suffix}"),
                    group,
                    source: Source::Weka {
                        concurrency: c,
                        copies,
                        max_sessions,
                        think_jitter: THINK_JITTER,
                        file: weka::FILE,
                    },
                    proxies,
                    spread,
                    endpoints: 4,
                    dp_ranks: 1,
                    pd_prefill: 0,
                });
            }
        }
    }
    v
}

/// The data-parallel fleet (docs/design/dp.md): 2 endpoints x 4 DP ranks, each rank an engine of
/// its own (the same simulated Llama-3.1-8B/H100 as everywhere), on the RL workload with twice the
/// rollouts in flight of the 4-replica matrix (8 engines) and on the coding-agent trace at 32 and 48
/// sessions in flight (4 and 6 per engine, as 16 and 24 are on 4 replicas). Ids `dp-rl`,
/// `dp-weka-c<C>`, group `dp`. Not in [`matrix`]: only `--only dp` (or an id) runs them; the policy
/// spec suffix `@rank_blind` ([`crate::bench::run::is_rank_blind`]) gives the rank-blind baseline.
/// The coding-agent scenarios draw their think times per seed, as [`matrix`]'s do.
pub fn dp_matrix(scale: Scale) -> Vec<Scenario> {
    let mut v = Vec::new();
    let rl = match scale {
        Scale::Full | Scale::Quick => RlParams {
            concurrency: RlParams::default().concurrency * 2,
            rollouts_per_step: RlParams::default().rollouts_per_step * 2,
            ..RlParams::default()
        },
        Scale::Smoke => RlParams::small(),
    };
    let dp = |id: String, source: Source| Scenario {
        id,
        group: "dp",
        source,
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 2,
        dp_ranks: 4,
        pd_prefill: 0,
    };
    v.push(dp("dp-rl".into(), Source::Rl(rl)));
    let (levels, copies, max_sessions): (&[usize], usize, Option<usize>) = match scale {
        Scale::Full => (&[32, 48], 2, None),
        Scale::Quick => (&[32], 1, Some(32)),
        Scale::Smoke => (&[2], 1, Some(2)),
    };
    for &c in levels {
        v.push(dp(
            format!("dp-weka-c{c}"),
            Source::Weka {
                concurrency: c,
                copies,
                max_sessions,
                think_jitter: THINK_JITTER,
                file: weka::FILE,
            },
        ));
    }
    v
}

/// The P/D fleet (docs/design/pd.md): 2 prefill-role + 4 decode-role engines (the same simulated
/// Llama-3.1-8B/H100 as everywhere), on the RL workload with 1.5x the rollouts per step and in flight
/// of the 4-replica matrix (6 engines) and on the coding-agent trace at 12 and 24 sessions in flight
/// (2 and 4 per engine; 24 saturates the two prefill engines). Ids `pd-rl`, `pd-weka-c<C>`, group
/// `pd`. Not in [`matrix`]: only
/// `--only pd` (or an id) runs them. The coding-agent scenarios draw their think times per seed, as
/// [`matrix`]'s do.
pub fn pd_matrix(scale: Scale) -> Vec<Scenario> {
    let mut v = Vec::new();
    let rl = match scale {
        Scale::Full | Scale::Quick => RlParams {
            concurrency: RlParams::default().concurrency * 3 / 2,
            rollouts_per_step: RlParams::default().rollouts_per_step * 3 / 2,
            ..RlParams::default()
        },
        Scale::Smoke => RlParams::small(),
    };
    let pd = |id: String, source: Source| Scenario {
        id,
        group: "pd",
        source,
        proxies: 1,
        spread: ProxySpread::PerRequest,
        endpoints: 6,
        dp_ranks: 1,
        pd_prefill: 2,
    };
    v.push(pd("pd-rl".into(), Source::Rl(rl)));
    let (levels, copies, max_sessions): (&[usize], usize, Option<usize>) = match scale {
        Scale::Full => (&[12, 24], 2, None),
        Scale::Quick => (&[24], 1, Some(24)),
        Scale::Smoke => (&[2], 1, Some(2)),
    };
    for &c in levels {
        v.push(pd(
            format!("pd-weka-c{c}"),
            Source::Weka {
                concurrency: c,
                copies,
                max_sessions,
                think_jitter: THINK_JITTER,
                file: weka::FILE,
            },
        ));
    }
    // The same 6 engines split 3 + 3, at the level that saturates 2 prefill engines: group
    // `pd-shape`, so `--only pd` stays the 2 + 4 fleet the issue names.
    let top = levels.last().copied().unwrap_or(2);
    v.push(Scenario {
        id: format!("pd-weka-c{top}-3p3d"),
        group: "pd-shape",
        pd_prefill: 3,
        ..pd(
            String::new(),
            Source::Weka {
                concurrency: top,
                copies,
                max_sessions,
                think_jitter: THINK_JITTER,
                file: weka::FILE,
            },
        )
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn engines_keep_the_same_kv_memory_at_every_block_size() {
        let e16 = Scenario::engine(16, 1);
        let e64 = Scenario::engine(64, 1);
        let e512 = Scenario::engine(512, 1);
        assert_eq!(e16.kv_blocks as u64 * 16, e64.kv_blocks as u64 * 64);
        assert_eq!(e16.kv_blocks as u64 * 16, e512.kv_blocks as u64 * 512);
        assert_eq!(e64.block_size, 64);
    }

    #[test]
    fn flattened_prompts_extend_the_previous_prompt_and_output() {
        let w = rl::generate(&RlParams::small()).unwrap();
        let f = flatten(&w);
        assert_eq!(f.total_requests(), w.total_requests());
        for s in &f.sessions {
            for pair in s.turns.windows(2) {
                let (Prompt::Full(a), Prompt::Full(b)) = (&pair[0].prompt, &pair[1].prompt) else {
                    panic!("not flattened");
                };
                assert!(b.starts_with(a));
                assert!(b.len() > a.len() + pair[0].output_tokens as usize);
            }
        }
        let (a, b) = (
            &f.sessions[0].turns[0].prompt,
            &f.sessions[1].turns[0].prompt,
        );
        let (Prompt::Full(a), Prompt::Full(b)) = (a, b) else {
            panic!("not flattened")
        };
        assert_eq!(a[..256], b[..256], "the shared system prompt survives");
    }

    #[test]
    fn fixed_scenarios_mirror_the_jittered_trace_scenarios_apart_from_the_matrix() {
        for scale in [Scale::Full, Scale::Quick, Scale::Smoke] {
            let m = matrix(scale);
            let j = fixed_matrix(scale);
            let traces: Vec<&Scenario> = m
                .iter()
                .filter(|s| matches!(s.group, "weka" | "mooncake" | "azure"))
                .collect();
            assert_eq!(j.len(), traces.len(), "{scale:?}");
            for (s, w) in j.iter().zip(traces) {
                assert_eq!(s.id, format!("{}-fixed", w.id));
                assert_eq!(s.group, format!("{}-fixed", w.group));
                assert!(!m.iter().any(|x| x.id == s.id || x.group == s.group));
                match (&s.source, &w.source) {
                    (
                        Source::Weka {
                            concurrency: a,
                            think_jitter: ja,
                            ..
                        },
                        Source::Weka {
                            concurrency: b,
                            think_jitter: jb,
                            ..
                        },
                    ) => assert_eq!((a, *ja, *jb), (b, 0.0, THINK_JITTER)),
                    (
                        Source::Mooncake {
                            speed: a,
                            arrival_jitter: ja,
                            ..
                        },
                        Source::Mooncake {
                            speed: b,
                            arrival_jitter: jb,
                            ..
                        },
                    ) => assert_eq!((a, *ja, *jb), (b, 0.0, ARRIVAL_JITTER)),
                    (
                        Source::Azure {
                            arrival_jitter: ja, ..
                        },
                        Source::Azure {
                            arrival_jitter: jb, ..
                        },
                    ) => assert_eq!((*ja, *jb), (0.0, ARRIVAL_JITTER)),
                    _ => panic!("{} does not mirror {}", s.id, w.id),
                }
            }
        }
    }

    #[test]
    fn proxy_scenarios_are_apart_from_the_matrix_and_named_by_count() {
        for scale in [Scale::Full, Scale::Quick, Scale::Smoke] {
            let m = matrix(scale);
            assert!(m.iter().all(|s| s.proxies == 1), "the matrix has one proxy");
            let p = proxy_matrix(scale);
            // Two spreads x 3 proxy counts x (RL + the coding-agent levels: 2, or 1 for smoke).
            let levels = if scale == Scale::Smoke { 1 } else { 2 };
            assert_eq!(p.len(), 2 * 3 * (1 + levels), "{scale:?}");
            for s in &p {
                assert!(!m.iter().any(|x| x.id == s.id || x.group == s.group));
                let n: usize =
                    s.id.rsplit("-p")
                        .next()
                        .unwrap()
                        .trim_end_matches('s')
                        .parse()
                        .unwrap();
                assert_eq!(n, s.proxies, "{}", s.id);
                assert_eq!(s.id.ends_with('s'), s.spread == ProxySpread::PerSession);
            }
            let mut ids: Vec<&str> = p.iter().map(|s| s.id.as_str()).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), p.len());
        }
        assert!(
            proxy_matrix(Scale::Full)
                .iter()
                .any(|s| s.id == "weka-c32-p4")
        );
    }

    #[test]
    fn dp_scenarios_are_apart_from_the_matrix_with_eight_engines() {
        for scale in [Scale::Full, Scale::Quick, Scale::Smoke] {
            let m = matrix(scale);
            assert!(m.iter().all(|s| s.dp_ranks == 1 && s.endpoints == 4));
            let d = dp_matrix(scale);
            assert!(d.len() >= 2);
            for s in &d {
                assert_eq!((s.endpoints, s.dp_ranks, s.group), (2, 4, "dp"));
                assert!(!m.iter().any(|x| x.id == s.id));
            }
        }
    }

    #[test]
    fn pd_scenarios_are_apart_from_the_matrix_with_two_prefill_and_four_decode() {
        for scale in [Scale::Full, Scale::Quick, Scale::Smoke] {
            let m = matrix(scale);
            assert!(m.iter().all(|s| s.pd_prefill == 0));
            assert!(dp_matrix(scale).iter().all(|s| s.pd_prefill == 0));
            let p = pd_matrix(scale);
            assert!(p.len() >= 2 && p[0].id == "pd-rl");
            for s in p.iter().filter(|s| s.group == "pd") {
                assert_eq!((s.endpoints, s.pd_prefill, s.dp_ranks), (6, 2, 1));
                assert!(!m.iter().any(|x| x.id == s.id));
            }
            for s in p.iter().filter(|s| s.group != "pd") {
                assert_eq!((s.endpoints, s.pd_prefill, s.group), (6, 3, "pd-shape"));
                assert!(!m.iter().any(|x| x.id == s.id));
            }
        }
    }

    #[test]
    fn each_fleet_names_itself() {
        let fleets = |v: Vec<Scenario>| v.iter().map(Scenario::fleet).collect::<Vec<_>>();
        assert!(
            fleets(matrix(Scale::Smoke))
                .iter()
                .all(|f| f == "4 replicas")
        );
        assert!(
            fleets(dp_matrix(Scale::Smoke))
                .iter()
                .all(|f| f == "2 endpoints x 4 DP ranks")
        );
        let pd = fleets(pd_matrix(Scale::Full));
        assert!(
            pd.contains(&"2 prefill + 4 decode engines".to_string()),
            "{pd:?}"
        );
        assert!(
            pd.contains(&"3 prefill + 3 decode engines".to_string()),
            "{pd:?}"
        );
    }

    #[test]
    fn ids_are_unique_and_every_group_is_present() {
        for scale in [Scale::Full, Scale::Quick, Scale::Smoke] {
            let m = matrix(scale);
            let mut ids: Vec<&str> = m.iter().map(|s| s.id.as_str()).collect();
            ids.sort();
            ids.dedup();
            assert_eq!(ids.len(), m.len());
            for g in ["rl", "weka", "mooncake", "azure", "slice"] {
                assert!(m.iter().any(|s| s.group == g), "{g} missing at {scale:?}");
            }
        }
    }
}
