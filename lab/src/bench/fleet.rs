//! Routing quality by fleet size (docs/reports/fleet.md): the project's quality figures come from 4
//! replicas, so these cells replay the same four kinds of workload on fleets of 4 to 64 replicas
//! with the load growing in step with the fleet, to see whether a policy's gain holds when each
//! request has many more places to go.
//!
//! Per replica, every fleet size carries the same load: RL rollouts in flight ([`RL_PER_REPLICA`],
//! as `rl(16)` on 4 replicas), coding-agent sessions in flight ([`WEKA_PER_REPLICA`]), new chat
//! sessions a second behind one shared system prompt ([`CHAT_PER_REPLICA_S`]) and Mooncake's
//! arrival rate (its speed a quarter of the replica count: x1 on 4 replicas). The workloads are cut
//! (sessions, turns, trace rows) to a size that also grows with the fleet, so that every fleet
//! replays about the same virtual time and a 32-replica replay takes seconds on a shared 2-core
//! machine.
//!
//! Cells reuse [`model_eval::replay_shaped`] (the same filter configuration and engine profile as the
//! routing model's judge), with [`Trim`] cutting the built workload.

use super::model_eval::{self, Cell, Measured, Set};
use super::scenario::{ARRIVAL_JITTER, Source, THINK_JITTER};
use kvsteer_host_test::FilterModule;
use kvsteer_workload::Workload;
use kvsteer_workload::chat::ChatParams;
use kvsteer_workload::rl::RlParams;
use kvsteer_workload::weka;
use std::path::Path;

/// The fleet sizes `fleet-bench` runs by default. scripts/fleet-bench adds 64 in a run of its own,
/// after these, because one 64-replica replay takes 15-45 s on the shared 2-core machine and the
/// smaller fleets should be complete first.
pub const FLEETS: [usize; 4] = [4, 8, 16, 32];

/// The policies compared: the baselines and the two token-load policies.
pub const POLICIES: [&str; 5] = [
    "round_robin",
    "least_load",
    "session_hash",
    "kv_load",
    "kv_time",
];

/// The workloads, in report order.
pub const WORKLOADS: [&str; 4] = ["rl", "weka", "chat", "mooncake"];

/// RL rollouts in flight per replica: `rl(16)` on 4 replicas, today's matrix.
pub const RL_PER_REPLICA: usize = 4;
/// RL rollouts per step per replica (8 on 4 replicas, as the matrix), with every fourth rollout of a
/// step a straggler (2 of 8, as the matrix).
pub const RL_STEP_PER_REPLICA: usize = 2;
/// RL steps replayed (the matrix has 10): enough for the per-step prefix to be shared and for
/// stragglers to overlap, short enough for 32 replicas.
pub const RL_STEPS: usize = 3;
/// Coding-agent sessions in flight per replica (24 on 4 replicas, the matrix's middle level).
pub const WEKA_PER_REPLICA: usize = 6;
/// Coding-agent sessions replayed per session in flight: the closed loop starts a new one as one
/// ends, so the replay is not only the first wave.
pub const WEKA_SESSIONS_PER_SLOT: f64 = 1.5;
/// Coding-agent turns kept per session: the first ones, where the trace's prompts grow from the
/// shared tool and system prefix.
pub const WEKA_TURNS: usize = 6;
/// New chat sessions a second per replica.
pub const CHAT_PER_REPLICA_S: f64 = 2.0;
/// Chat sessions replayed per replica (10 s of arrivals at [`CHAT_PER_REPLICA_S`]).
pub const CHAT_SESSIONS_PER_REPLICA: usize = 20;
/// Mooncake trace rows replayed per 4 replicas (the speed grows with the fleet, so more rows keep
/// the same span of arrivals).
pub const MOONCAKE_ROWS_PER_4: usize = 150;

/// What is cut from a built workload: its first `sessions` sessions and their first `turns` turns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Trim {
    pub sessions: Option<usize>,
    pub turns: Option<usize>,
}

impl Trim {
    pub fn apply(&self, w: &mut Workload) {
        if let Some(n) = self.sessions {
            w.sessions.truncate(n);
        }
        if let Some(t) = self.turns {
            for s in &mut w.sessions {
                s.turns.truncate(t);
            }
        }
    }
}

/// One fleet-size cell: a model-eval [`Cell`] (its replicas, workload and engine) and its cut.
#[derive(Clone, Debug)]
pub struct FleetCell {
    pub cell: Cell,
    /// One of [`WORKLOADS`].
    pub workload: &'static str,
    pub trim: Trim,
}

const H100_8B: &str = "llama-3.1-8b-h100";

/// The four workloads on a fleet of `n` replicas, load and length per replica held fixed.
pub fn cells_for(n: usize) -> Vec<FleetCell> {
    let rollouts_per_step = RL_STEP_PER_REPLICA * n;
    let rl = Source::Rl(RlParams {
        concurrency: RL_PER_REPLICA * n,
        rollouts_per_step,
        steps: RL_STEPS,
        stragglers: (0..rollouts_per_step).step_by(4).collect(),
        ..RlParams::default()
    });
    let weka_c = WEKA_PER_REPLICA * n;
    let weka_sessions = (weka_c as f64 * WEKA_SESSIONS_PER_SLOT).ceil() as usize;
    // The trace keeps 28 sessions under the 128K cap; copies replay them as new users.
    let weka = Source::Weka {
        concurrency: weka_c,
        copies: weka_sessions.div_ceil(28),
        max_sessions: None,
        think_jitter: THINK_JITTER,
        file: weka::FILE,
    };
    let chat_sessions = CHAT_SESSIONS_PER_REPLICA * n;
    let chat = Source::Chat(ChatParams {
        sessions: chat_sessions,
        sessions_per_s: CHAT_PER_REPLICA_S * n as f64,
        ..ChatParams::default()
    });
    let mooncake = Source::Mooncake {
        speed: n as f64 / 4.0,
        max_requests: Some(MOONCAKE_ROWS_PER_4 * n / 4),
        arrival_jitter: ARRIVAL_JITTER,
    };
    let cell = |workload: &'static str, source: Source, trim: Trim| FleetCell {
        cell: Cell {
            id: format!("{workload}-n{n}"),
            set: Set::Fleet,
            source,
            replicas: n,
            profile: H100_8B,
            slowdowns: Vec::new(),
        },
        workload,
        trim,
    };
    vec![
        cell("rl", rl, Trim::default()),
        cell(
            "weka",
            weka,
            Trim {
                sessions: Some(weka_sessions),
                turns: Some(WEKA_TURNS),
            },
        ),
        cell("chat", chat, Trim::default()),
        cell("mooncake", mooncake, Trim::default()),
    ]
}

/// Every cell for the given fleet sizes, fleet by fleet.
pub fn fleet_scale(fleets: &[usize]) -> Vec<FleetCell> {
    fleets.iter().flat_map(|&n| cells_for(n)).collect()
}

/// Replays one cell under one policy spec for one seed.
pub fn replay(
    module: &FilterModule,
    traces: &Path,
    c: &FleetCell,
    spec: &str,
    seed: u64,
    keep_requests: bool,
) -> Result<Measured, String> {
    let trim = c.trim;
    model_eval::replay_shaped(module, traces, &c.cell, spec, seed, keep_requests, &|w| {
        trim.apply(w)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The load a cell puts on its fleet, per replica, and the requests it replays at most.
    fn per_replica(c: &FleetCell) -> (f64, usize) {
        let n = c.cell.replicas as f64;
        match &c.cell.source {
            Source::Rl(p) => (
                p.concurrency as f64 / n,
                p.steps * p.rollouts_per_step * p.turns,
            ),
            Source::Weka { concurrency, .. } => (
                *concurrency as f64 / n,
                c.trim.sessions.unwrap() * c.trim.turns.unwrap(),
            ),
            Source::Chat(p) => (p.sessions_per_s / n, p.sessions),
            Source::Mooncake {
                speed,
                max_requests,
                ..
            } => (speed / n, max_requests.unwrap()),
            _ => panic!("{}: unexpected source", c.cell.id),
        }
    }

    #[test]
    fn cells_are_unique_and_load_grows_with_the_fleet() {
        let fleets = [4, 8, 16, 32, 64, 128];
        let all = fleet_scale(&fleets);
        assert_eq!(all.len(), fleets.len() * WORKLOADS.len());
        let mut ids: Vec<&str> = all.iter().map(|c| c.cell.id.as_str()).collect();
        ids.sort();
        ids.dedup();
        assert_eq!(ids.len(), all.len());
        // Apart from the routing model's sets.
        let eval: Vec<String> = model_eval::training(false)
            .into_iter()
            .chain(model_eval::validation())
            .chain(model_eval::validation2())
            .map(|c| c.id)
            .collect();
        assert!(all.iter().all(|c| !eval.contains(&c.cell.id)));
        for w in WORKLOADS {
            let cells: Vec<&FleetCell> = all.iter().filter(|c| c.workload == w).collect();
            assert_eq!(cells.len(), fleets.len(), "{w}");
            let (load4, requests4) = per_replica(cells[0]);
            assert!(load4 > 0.0);
            for c in &cells {
                assert_eq!(c.cell.set, Set::Fleet);
                assert!(kvsteer_sim::Profile::named(c.cell.profile).is_some());
                let (load, requests) = per_replica(c);
                // The same load per replica, and the replay's length in proportion to the fleet.
                assert!((load - load4).abs() < 1e-9, "{}", c.cell.id);
                let k = c.cell.replicas / 4;
                assert!(
                    requests >= requests4 * k && requests <= requests4 * k + k,
                    "{}: {requests} against {requests4} on 4",
                    c.cell.id
                );
            }
        }
        // Coding-agent copies cover the sessions the cut keeps.
        for c in all.iter().filter(|c| c.workload == "weka") {
            let Source::Weka { copies, .. } = c.cell.source else {
                unreachable!()
            };
            assert!(copies * 28 >= c.trim.sessions.unwrap(), "{}", c.cell.id);
        }
        // A straggler every fourth rollout of a step, as 2 of the matrix's 8.
        for c in all.iter().filter(|c| c.workload == "rl") {
            let Source::Rl(p) = &c.cell.source else {
                unreachable!()
            };
            assert_eq!(p.stragglers.len() * 4, p.rollouts_per_step);
        }
    }

    #[test]
    fn trim_keeps_the_first_sessions_and_turns() {
        let mut w = kvsteer_workload::rl::generate(&RlParams::small()).unwrap();
        let n = w.sessions.len();
        Trim {
            sessions: Some(3),
            turns: Some(2),
        }
        .apply(&mut w);
        assert_eq!(w.sessions.len(), 3.min(n));
        assert!(w.sessions.iter().all(|s| s.turns.len() <= 2));
        let before = w.clone();
        Trim::default().apply(&mut w);
        assert_eq!(w.sessions.len(), before.sessions.len());
    }
}
