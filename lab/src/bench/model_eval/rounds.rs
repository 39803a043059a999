//! The cells of each set: the training matrix, the five validation rounds and the coding-agent
//! validation samples, each written down and committed before any replay of it
//! (docs/reports/model-eval.md). The five validation rounds are data files, `lab/rounds/*.json`, one
//! cell a line, read here; the training matrix and the coding-agent samples, regular grids, are
//! generated.

use super::{Cell, Set};
use crate::bench::scenario::{ARRIVAL_JITTER, Source, THINK_JITTER};
use kvsteer_workload::chat::ChatParams;
use kvsteer_workload::rl::RlParams;
use kvsteer_workload::weka;
use serde::Deserialize;

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

/// A round file of `lab/rounds/`, compiled in.
macro_rules! round_file {
    ($name:literal) => {
        include_str!(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/rounds/",
            $name,
            ".json"
        ))
    };
}

/// The first validation round (`lab/rounds/validation.json`).
pub fn validation() -> Vec<Cell> {
    round(Set::Validation, round_file!("validation"))
}

/// The second validation round (`lab/rounds/validation2.json`).
pub fn validation2() -> Vec<Cell> {
    round(Set::Validation2, round_file!("validation2"))
}

/// The third validation round (`lab/rounds/validation3.json`).
pub fn validation3() -> Vec<Cell> {
    round(Set::Validation3, round_file!("validation3"))
}

/// The fourth validation round (`lab/rounds/validation4.json`).
pub fn validation4() -> Vec<Cell> {
    round(Set::Validation4, round_file!("validation4"))
}

/// The fifth validation round (`lab/rounds/validation5.json`).
pub fn validation5() -> Vec<Cell> {
    round(Set::Validation5, round_file!("validation5"))
}

/// A validation round's file: its set, what it is for (`about`, as written down with it) and its
/// cells, one a line.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RoundFile<'a> {
    set: Set,
    #[serde(rename = "about")]
    _about: String,
    #[serde(borrow)]
    cells: Vec<CellSpec<'a>>,
}

/// One cell of a round file: `{"id", "replicas", "profile", "source": {KIND: {...}}, "slowdowns":
/// [[replica, factor, from_us], ...]}` (`slowdowns` optional; see [`Cell`]).
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CellSpec<'a> {
    id: String,
    replicas: usize,
    profile: &'a str,
    source: SourceSpec,
    #[serde(default)]
    slowdowns: Vec<(usize, f64, u64)>,
}

/// A round cell's workload. Jitter is the matrix's ([`THINK_JITTER`], [`ARRIVAL_JITTER`]); a
/// coding-agent cell reads the training sample ([`weka::FILE`]); a chat cell's fields left out keep
/// [`ChatParams::default`], an RL cell's all but its concurrency keep [`RlParams::default`].
#[derive(Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
enum SourceSpec {
    Chat(ChatSpec),
    Rl {
        concurrency: usize,
    },
    Weka {
        concurrency: usize,
        copies: usize,
        max_sessions: Option<usize>,
    },
    Mooncake {
        speed: f64,
        max_requests: Option<usize>,
    },
    Azure {
        speed: f64,
        max_rows: Option<usize>,
    },
}

/// The [`ChatParams`] fields a round sets.
#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct ChatSpec {
    sessions: Option<usize>,
    sessions_per_s: Option<f64>,
    system_tokens: Option<usize>,
    user_tokens_min: Option<usize>,
    user_tokens_max: Option<usize>,
    long_output_share: Option<f64>,
}

impl SourceSpec {
    fn source(self) -> Source {
        match self {
            SourceSpec::Chat(c) => {
                let d = ChatParams::default();
                Source::Chat(ChatParams {
                    sessions: c.sessions.unwrap_or(d.sessions),
                    sessions_per_s: c.sessions_per_s.unwrap_or(d.sessions_per_s),
                    system_tokens: c.system_tokens.unwrap_or(d.system_tokens),
                    user_tokens_min: c.user_tokens_min.unwrap_or(d.user_tokens_min),
                    user_tokens_max: c.user_tokens_max.unwrap_or(d.user_tokens_max),
                    long_output_share: c.long_output_share.unwrap_or(d.long_output_share),
                    ..d
                })
            }
            SourceSpec::Rl { concurrency } => rl(concurrency),
            SourceSpec::Weka {
                concurrency,
                copies,
                max_sessions,
            } => weka(concurrency, copies, max_sessions),
            SourceSpec::Mooncake {
                speed,
                max_requests,
            } => Source::Mooncake {
                speed,
                max_requests,
                arrival_jitter: ARRIVAL_JITTER,
            },
            SourceSpec::Azure { speed, max_rows } => Source::Azure {
                speed,
                max_rows,
                arrival_jitter: ARRIVAL_JITTER,
            },
        }
    }
}

/// The cells of a round file (compiled in: a round never changes once written down). Panics on a
/// malformed file or one of another set; the unit tests read every round.
fn round(set: Set, text: &'static str) -> Vec<Cell> {
    let file: RoundFile<'static> =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("round file of {set:?}: {e}"));
    assert_eq!(file.set, set, "a round file of another set");
    file.cells
        .into_iter()
        .map(|c| Cell {
            slowdowns: c.slowdowns,
            ..cell(&c.id, set, c.source.source(), c.replicas, c.profile)
        })
        .collect()
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
