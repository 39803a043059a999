//! The cells of each set: the training matrix, the five validation rounds and the coding-agent
//! validation samples, each written down and committed before any replay of it
//! (docs/reports/model-eval.md). Data, not logic: a round's function is its list of cells.

use super::{Cell, Set};
use crate::bench::scenario::{ARRIVAL_JITTER, Source, THINK_JITTER};
use kvsteer_workload::chat::ChatParams;
use kvsteer_workload::rl::RlParams;
use kvsteer_workload::weka;

fn cell(id: &str, set: Set, source: Source, replicas: usize, profile: &'static str) -> Cell {
    Cell {
        id: id.into(),
        set,
        source,
        replicas,
        profile,
        slowdowns: Vec::new(),
    }
}

const H100_8B: &str = "llama-3.1-8b-h100";

fn weka(concurrency: usize, copies: usize, max_sessions: Option<usize>) -> Source {
    weka_sample(weka::FILE, concurrency, copies, max_sessions)
}

/// [`weka`] on another coding-agent sample of the traces folder.
fn weka_sample(
    file: &'static str,
    concurrency: usize,
    copies: usize,
    max_sessions: Option<usize>,
) -> Source {
    Source::Weka {
        concurrency,
        copies,
        max_sessions,
        think_jitter: THINK_JITTER,
        file,
    }
}

fn rl(concurrency: usize) -> Source {
    Source::Rl(RlParams {
        concurrency,
        ..RlParams::default()
    })
}

/// The training matrix: docs/reports/results.md's cells (4 replicas of Llama-3.1-8B on H100s). `quick`
/// cuts the coding-agent trace to 16 sessions and the open traces to their first rows.
pub fn training(quick: bool) -> Vec<Cell> {
    let t = Set::Training;
    let (copies, max) = if quick { (1, Some(16)) } else { (2, None) };
    let mut v = vec![cell("rl", t, rl(16), 4, H100_8B)];
    for c in [8, 16, 24, 32, 40] {
        v.push(cell(
            &format!("weka-c{c}"),
            t,
            weka(c, copies, max),
            4,
            H100_8B,
        ));
    }
    for speed in [1.0, 2.0] {
        let src = Source::Mooncake {
            speed,
            max_requests: quick.then_some(600),
            arrival_jitter: ARRIVAL_JITTER,
        };
        v.push(cell(&format!("mooncake-x{speed}"), t, src, 4, H100_8B));
    }
    let az = Source::Azure {
        speed: 1.0,
        max_rows: quick.then_some(2000),
        arrival_jitter: ARRIVAL_JITTER,
    };
    v.push(cell("azure", t, az, 4, H100_8B));
    v
}

/// The validation set, as written in docs/reports/model-eval.md before any tuning against it: other fleet
/// sizes, two other engines, heterogeneous fleets and the shared-system-prompt chat workload.
pub fn validation() -> Vec<Cell> {
    let v = Set::Validation;
    let chat = |sessions_per_s: f64| {
        Source::Chat(ChatParams {
            sessions_per_s,
            ..ChatParams::default()
        })
    };
    let slow_half = |mut c: Cell| {
        c.slowdowns = (c.replicas / 2..c.replicas).map(|r| (r, 2.0, 0)).collect();
        c
    };
    let slow_mid = |mut c: Cell| {
        c.slowdowns = vec![(0, 2.0, 60_000_000)];
        c
    };
    vec![
        cell("v-chat-4", v, chat(4.0), 4, H100_8B),
        cell("v-chat-8", v, chat(8.0), 8, H100_8B),
        cell("v-rl-2", v, rl(8), 2, H100_8B),
        cell("v-rl-8", v, rl(32), 8, H100_8B),
        cell("v-weka-c32-8", v, weka(32, 1, Some(24)), 8, H100_8B),
        cell(
            "v-mooncake-x4-16",
            v,
            Source::Mooncake {
                speed: 4.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            16,
            H100_8B,
        ),
        cell(
            "v-70b-weka-c24",
            v,
            weka(24, 1, Some(16)),
            4,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("v-70b-rl", v, rl(16), 4, "llama-3.1-70b-h100-tp4"),
        cell(
            "v-a100-weka-c16",
            v,
            weka(16, 1, Some(16)),
            4,
            "llama-3.1-8b-a100-40gb",
        ),
        cell("v-a100-chat", v, chat(4.0), 4, "llama-3.1-8b-a100-40gb"),
        slow_half(cell(
            "v-half-slow-weka-c24",
            v,
            weka(24, 1, Some(16)),
            4,
            H100_8B,
        )),
        slow_half(cell("v-half-slow-rl", v, rl(16), 4, H100_8B)),
        slow_mid(cell("v-slows-mid-rl", v, rl(16), 4, H100_8B)),
    ]
}

/// The second validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// first round was looked into (its chat cells' TTFT tail), so it judges no change made after that.
/// Fleet sizes, engines, rates and slowdowns that neither the training set nor the first round has.
pub fn validation2() -> Vec<Cell> {
    let v = Set::Validation2;
    let chat = |sessions_per_s: f64, long_output_share: f64| {
        Source::Chat(ChatParams {
            sessions_per_s,
            long_output_share,
            ..ChatParams::default()
        })
    };
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "w-chat-6-70b",
            v,
            chat(3.0, 0.1),
            6,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("w-chat-12", v, chat(10.0, 0.2), 12, H100_8B),
        slow(
            cell(
                "w-chat-3-a100-slow",
                v,
                chat(3.0, 0.1),
                3,
                "llama-3.1-8b-a100-40gb",
            ),
            vec![(2, 1.5, 0)],
        ),
        cell("w-rl-6-a100", v, rl(24), 6, "llama-3.1-8b-a100-40gb"),
        cell(
            "w-weka-c20-6-70b",
            v,
            weka(20, 1, Some(16)),
            6,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell("w-weka-c24-slows-mid", v, weka(24, 1, Some(16)), 4, H100_8B),
            vec![(1, 3.0, 30_000_000)],
        ),
        cell(
            "w-mooncake-x3-8",
            v,
            Source::Mooncake {
                speed: 3.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            8,
            H100_8B,
        ),
        cell(
            "w-azure-x4-8",
            v,
            Source::Azure {
                speed: 4.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            8,
            H100_8B,
        ),
    ]
}

/// The third validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// second was looked into (its chat tail again), so it judges no change made after that. Fleet
/// sizes, rates, prompt shapes and slowdowns that neither the training set nor the first two rounds
/// have.
pub fn validation3() -> Vec<Cell> {
    let v = Set::Validation3;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "x-chat-16",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 12.0,
                long_output_share: 0.15,
                ..ChatParams::default()
            }),
            16,
            H100_8B,
        ),
        cell(
            "x-chat-5-a100-short-system",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 5.0,
                system_tokens: 2048,
                user_tokens_min: 128,
                user_tokens_max: 1024,
                ..ChatParams::default()
            }),
            5,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "x-chat-4-70b-long",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 2.0,
                long_output_share: 0.3,
                ..ChatParams::default()
            }),
            4,
            "llama-3.1-70b-h100-tp4",
        ),
        cell("x-rl-12", v, rl(48), 12, H100_8B),
        slow(
            cell("x-rl-4-70b-slows", v, rl(12), 4, "llama-3.1-70b-h100-tp4"),
            vec![(0, 2.5, 20_000_000)],
        ),
        cell("x-weka-c28-6", v, weka(28, 1, Some(20)), 6, H100_8B),
        cell(
            "x-weka-c12-3-a100",
            v,
            weka(12, 1, Some(12)),
            3,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "x-mooncake-x2-12",
            v,
            Source::Mooncake {
                speed: 2.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            12,
            H100_8B,
        ),
        cell(
            "x-azure-x6-12",
            v,
            Source::Azure {
                speed: 6.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            12,
            H100_8B,
        ),
    ]
}

/// The fourth validation round, fixed in docs/reports/model-eval.md before any replay of it: the
/// third was looked into (its chat tail), so it judges no change made after that. Fleet sizes (7 and
/// 10) no earlier set has, and combinations of engine, rate, prompt shape and slowdown none has.
pub fn validation4() -> Vec<Cell> {
    // Kept whole: a data list, one cell per line of the round as it was fixed in advance.
    let v = Set::Validation4;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    vec![
        cell(
            "y-chat-10",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 8.0,
                system_tokens: 3072,
                long_output_share: 0.12,
                ..ChatParams::default()
            }),
            10,
            H100_8B,
        ),
        cell(
            "y-chat-7-a100-long",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 4.0,
                long_output_share: 0.25,
                ..ChatParams::default()
            }),
            7,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "y-chat-3-70b-long-system",
            v,
            Source::Chat(ChatParams {
                sessions_per_s: 1.5,
                system_tokens: 6144,
                ..ChatParams::default()
            }),
            3,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell(
                "y-chat-6-slows",
                v,
                Source::Chat(ChatParams {
                    sessions_per_s: 6.0,
                    user_tokens_min: 256,
                    user_tokens_max: 2048,
                    ..ChatParams::default()
                }),
                6,
                H100_8B,
            ),
            vec![(2, 2.0, 15_000_000)],
        ),
        cell("y-rl-10", v, rl(40), 10, H100_8B),
        cell("y-rl-7-a100", v, rl(21), 7, "llama-3.1-8b-a100-40gb"),
        cell("y-weka-c36-10", v, weka(36, 1, Some(24)), 10, H100_8B),
        slow(
            cell(
                "y-weka-c16-4-70b-slows",
                v,
                weka(16, 1, Some(16)),
                4,
                "llama-3.1-70b-h100-tp4",
            ),
            vec![(3, 2.0, 10_000_000)],
        ),
        cell(
            "y-mooncake-x3-10",
            v,
            Source::Mooncake {
                speed: 3.0,
                max_requests: Some(2000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            10,
            H100_8B,
        ),
        cell(
            "y-azure-x5-7",
            v,
            Source::Azure {
                speed: 5.0,
                max_rows: Some(4000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            7,
            H100_8B,
        ),
    ]
}

/// The fifth validation round, as written in docs/reports/model-eval.md before any replay of it:
/// fleet sizes 5, 9 and 14, new combinations of workload, engine, rate and slowdown, and chat
/// cells of 900 sessions (about 3,100 requests, so a run's p99 is about its 31st slowest request,
/// not one of the fleet's first prefills of the shared prompt).
pub fn validation5() -> Vec<Cell> {
    // Kept whole: a data list, one cell per line of the round as it was fixed in advance.
    let v = Set::Validation5;
    let slow = |mut c: Cell, slowdowns: Vec<(usize, f64, u64)>| {
        c.slowdowns = slowdowns;
        c
    };
    let chat = |p: ChatParams| Source::Chat(ChatParams { sessions: 900, ..p });
    vec![
        cell(
            "z-chat-9",
            v,
            chat(ChatParams {
                sessions_per_s: 6.0,
                ..ChatParams::default()
            }),
            9,
            H100_8B,
        ),
        cell(
            "z-chat-14-long",
            v,
            chat(ChatParams {
                sessions_per_s: 10.0,
                long_output_share: 0.15,
                ..ChatParams::default()
            }),
            14,
            H100_8B,
        ),
        cell(
            "z-chat-5-70b",
            v,
            chat(ChatParams {
                sessions_per_s: 2.5,
                system_tokens: 5120,
                ..ChatParams::default()
            }),
            5,
            "llama-3.1-70b-h100-tp4",
        ),
        slow(
            cell(
                "z-chat-9-a100-slows",
                v,
                chat(ChatParams {
                    sessions_per_s: 5.0,
                    user_tokens_min: 128,
                    user_tokens_max: 768,
                    ..ChatParams::default()
                }),
                9,
                "llama-3.1-8b-a100-40gb",
            ),
            vec![(4, 1.5, 60_000_000)],
        ),
        cell("z-rl-9", v, rl(30), 9, H100_8B),
        cell("z-rl-14-a100", v, rl(56), 14, "llama-3.1-8b-a100-40gb"),
        cell("z-weka-c32-9", v, weka(32, 1, Some(24)), 9, H100_8B),
        cell(
            "z-weka-c20-5-a100",
            v,
            weka(20, 1, Some(16)),
            5,
            "llama-3.1-8b-a100-40gb",
        ),
        cell(
            "z-mooncake-x4-14",
            v,
            Source::Mooncake {
                speed: 4.0,
                max_requests: Some(3000),
                arrival_jitter: ARRIVAL_JITTER,
            },
            14,
            H100_8B,
        ),
        slow(
            cell(
                "z-azure-x3-9-slows",
                v,
                Source::Azure {
                    speed: 3.0,
                    max_rows: Some(4000),
                    arrival_jitter: ARRIVAL_JITTER,
                },
                9,
                H100_8B,
            ),
            vec![(1, 2.0, 20_000_000)],
        ),
    ]
}

/// The coding-agent samples [`weka_validation`] replays, by the name its cell ids carry: the
/// training sample and the three validation samples (`traces/README.md`).
pub const WEKA_SAMPLES: [(&str, &str); 4] = [
    ("train", weka::FILE),
    ("v1", weka::VALIDATION_FILES[0]),
    ("v2", weka::VALIDATION_FILES[1]),
    ("v3", weka::VALIDATION_FILES[2]),
];

/// Sessions in flight and fleet sizes of [`weka_validation`].
pub const WEKA_VALIDATION_LEVELS: [usize; 4] = [16, 24, 32, 40];
pub const WEKA_VALIDATION_FLEETS: [usize; 2] = [4, 9];

/// The sessions a `--quick` coding-agent validation cell keeps (the sample's first 16).
pub const WEKA_VALIDATION_QUICK_SESSIONS: usize = 16;

/// The coding-agent validation samples, as written in docs/reports/model-eval.md
/// before any replay of them: each sample ([`WEKA_SAMPLES`]) replayed whole, once (1 copy, think
/// times drawn per seed as the training cells draw them), at 16, 24, 32 and 40 sessions in flight
/// on 4 and on 9 replicas of Llama-3.1-8B on H100s. Ids `wv-<sample>-c<N>-<replicas>`. `quick`
/// keeps each sample's first 16 sessions (the same ids: keep its replays in another file).
/// Copies of each sample's sessions (each copy its own sessions, think times drawn apart): 2, as the
/// training cells at full size, so that 32 and 40 sessions in flight differ (one copy keeps at most
/// 32 sessions, and at 32 and 40 in flight the two cells replayed the same workload).
pub const WEKA_VALIDATION_COPIES: usize = 2;

pub fn weka_validation(quick: bool) -> Vec<Cell> {
    let max = quick.then_some(WEKA_VALIDATION_QUICK_SESSIONS);
    let mut v = Vec::new();
    for (name, file) in WEKA_SAMPLES {
        for replicas in WEKA_VALIDATION_FLEETS {
            for c in WEKA_VALIDATION_LEVELS {
                v.push(cell(
                    &format!("wv-{name}-c{c}-{replicas}"),
                    Set::WekaValidation,
                    weka_sample(file, c, WEKA_VALIDATION_COPIES, max),
                    replicas,
                    H100_8B,
                ));
            }
        }
    }
    v
}
