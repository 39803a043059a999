//! Server mode: one engine per replica behind an OpenAI-compatible HTTP API, the feed, `/metrics`
//! and fault knobs, in real time (optionally scaled).
//!
//! Each replica has a *driver* thread that owns the clock: it advances the engine to "now" (virtual
//! microseconds = wall microseconds x time scale), hands each request's events to the handler waiting
//! for them, and sleeps until the next step ends or a new request arrives. HTTP is hyper's, routed by
//! axum on one tokio runtime shared by the process's replicas; handlers parse, submit, then answer or
//! stream what the driver sends them. A client that goes away drops its handler (or its stream), and
//! its request is aborted at once so nothing leaks.
//!
//! The files: [`conn`] accepts connections and holds the HTTP limits, [`api`] routes and answers
//! everything but generation, [`openai`] reads OpenAI request bodies, [`generate`] runs a generation
//! request, [`stream`] frames a streamed one as server-sent events, [`admin`] sets the fault knobs.

mod admin;
mod api;
mod conn;
mod generate;
mod openai;
mod stream;

pub use admin::Faults;
pub use api::ApiError;
pub use conn::{IDLE_TIMEOUT, MAX_BODY, MAX_CONNECTIONS, MAX_HEAD};

use crate::engine::{Engine, EngineConfig, EngineEvent};
use crate::output::mix64;
use hashbrown::HashMap;
use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Notify;
use tokio::sync::mpsc::UnboundedSender;

/// Header naming the replica on every response.
pub const REPLICA_HEADER: &str = "x-kvsteer-replica";

/// The header vLLM's OpenAI server reads to pin a request to a DP rank (lower-cased, as HTTP
/// header names are compared).
pub const RANK_HEADER: &str = kvsteer_core::dp::DEFAULT_RANK_HEADER;

/// One replica's settings.
#[derive(Clone, Debug)]
pub struct ReplicaConfig {
    pub name: String,
    pub host: String,
    /// 0 picks a free port.
    pub port: u16,
    /// Virtual seconds per wall second (10 runs the simulated GPU ten times faster than real).
    pub time_scale: f64,
    /// Served model name (requests may name any model; it is echoed back).
    pub model: String,
    pub engine: EngineConfig,
    /// Data-parallel ranks behind this endpoint (1: one engine). Each rank is its own engine (own
    /// cache and queue, seeds derived from the rank); a request's rank comes from the
    /// `x-data-parallel-rank` header, else from vLLM's internal balancer
    /// ([`crate::dp::DpBalancer`]). docs/design/dp.md.
    pub dp_ranks: usize,
}

/// What the driver and the handlers share under one lock.
struct Core {
    /// One engine per DP rank (one without ranks).
    engines: Vec<Engine>,
    /// The rank each request in flight runs on.
    rank_of: HashMap<u64, usize>,
    balancer: crate::dp::DpBalancer,
    /// The endpoint's rank-blind feed (polls without `rank` when there are several ranks).
    union: crate::dp::UnionFeed,
    /// Where each request in flight wants its events.
    subs: HashMap<u64, UnboundedSender<EngineEvent>>,
    next_id: u64,
    faults: Faults,
    fault_draws: u64,
}

struct Clock {
    start: Instant,
    /// `start` on the Unix clock, in microseconds: lets a client place engine times on its own
    /// wall clock (`GET /admin/stalls`).
    start_unix_us: u64,
    scale: f64,
}

impl Clock {
    fn now_us(&self) -> u64 {
        (self.start.elapsed().as_secs_f64() * 1e6 * self.scale) as u64
    }

    /// Wall time until virtual time `t_us`, at most a second (the driver wakes and re-reads the clock).
    fn real_until(&self, now_us: u64, t_us: u64) -> Duration {
        let secs = t_us.saturating_sub(now_us) as f64 / 1e6 / self.scale;
        Duration::try_from_secs_f64(secs.min(1.0)).unwrap_or(Duration::from_secs(1))
    }
}

impl Core {
    /// The rank a request runs on: the rank header's when it names one of ours (vLLM ignores a
    /// value that is not an integer), else vLLM's internal balancer.
    fn rank_for(&mut self, now_us: u64, rank_header: Option<&str>) -> usize {
        let n = self.engines.len();
        let named = rank_header
            .and_then(|v| v.trim().parse::<usize>().ok())
            .filter(|&r| r < n);
        match named {
            Some(r) => r,
            None if n == 1 => 0,
            None => {
                let engines = &self.engines;
                self.balancer.choose(now_us, |r| {
                    let l = engines[r].load();
                    (l.waiting, l.running)
                })
            }
        }
    }
}

/// One replica's state, shared by its driver thread, its accept loop and its handlers.
struct Shared {
    name: String,
    model: String,
    core: Mutex<Core>,
    /// Wakes the driver: a request arrived, left, or the replica shuts down.
    cv: Condvar,
    clock: Clock,
    shutdown: AtomicBool,
    /// Wakes the accept loop on shutdown.
    stop: Notify,
    connections: AtomicUsize,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Core> {
        // A panicking handler must not take the replica down with a poisoned lock.
        self.core.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Aborts request `id` if it is still in flight (its client left), at once rather than at its
    /// next token: it may still be queued.
    fn abandon(&self, id: u64) {
        let mut g = self.lock();
        if g.subs.remove(&id).is_some() {
            let now = self.clock.now_us();
            let r = g.rank_of.remove(&id).unwrap_or(0);
            if let Some(e) = g.engines.get_mut(r) {
                e.abort(now, id);
            }
            self.cv.notify_all();
        }
    }
}

/// A running replica.
pub struct Replica {
    shared: Arc<Shared>,
    addr: SocketAddr,
}

impl Replica {
    /// Binds, starts the driver and the accept loop, and returns once listening.
    pub fn start(cfg: ReplicaConfig) -> io::Result<Replica> {
        // Bound here, not on the runtime, so a bind error reaches the caller and the port is known.
        let listener = std::net::TcpListener::bind((cfg.host.as_str(), cfg.port))?;
        let addr = listener.local_addr()?;
        let scale = if cfg.time_scale.is_finite() && cfg.time_scale > 0.0 {
            cfg.time_scale
        } else {
            1.0
        };
        let ranks = cfg.dp_ranks.max(1);
        let shared = Arc::new(Shared {
            name: cfg.name,
            model: cfg.model,
            core: Mutex::new(Core {
                engines: (0..ranks)
                    .map(|r| {
                        let mut e = cfg.engine.clone();
                        if r > 0 {
                            e.seed = mix64(e.seed ^ (r as u64).rotate_left(24));
                            e.epoch = mix64(e.epoch ^ r as u64) | 1;
                        }
                        Engine::new(e)
                    })
                    .collect(),
                rank_of: HashMap::new(),
                balancer: crate::dp::DpBalancer::new(ranks),
                union: crate::dp::UnionFeed::new(
                    ranks,
                    mix64(cfg.engine.epoch ^ 0xD9),
                    cfg.engine.feed_log_hashes,
                ),
                subs: HashMap::new(),
                next_id: 1,
                faults: Faults::default(),
                fault_draws: 0,
            }),
            cv: Condvar::new(),
            clock: Clock {
                start: Instant::now(),
                start_unix_us: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map(|d| d.as_micros() as u64)
                    .unwrap_or(0),
                scale,
            },
            shutdown: AtomicBool::new(false),
            stop: Notify::new(),
            connections: AtomicUsize::new(0),
        });
        let s = shared.clone();
        thread::Builder::new()
            .name(format!("{}-driver", shared.name))
            .spawn(move || drive(s))?;
        conn::listen(shared.clone(), listener)?;
        Ok(Replica { shared, addr })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    pub fn name(&self) -> &str {
        &self.shared.name
    }

    /// Stops accepting and driving. Connections in progress end when their client does.
    pub fn shutdown(&self) {
        self.shared.shutdown.store(true, Ordering::SeqCst);
        self.shared.cv.notify_all();
        self.shared.stop.notify_one();
    }
}

impl Drop for Replica {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// The driver thread: advances the engines to the wall clock's virtual time, delivers their events,
/// and aborts the requests whose receiver is gone.
fn drive(shared: Arc<Shared>) {
    let mut events = Vec::new();
    let mut g = shared.lock();
    while !shared.shutdown.load(Ordering::SeqCst) {
        let now = shared.clock.now_us();
        for e in g.engines.iter_mut() {
            e.advance(now, &mut events);
        }
        let mut dead = Vec::new();
        for ev in events.drain(..) {
            let id = ev.id();
            let fin = matches!(ev, EngineEvent::Finished { .. });
            if let Some(tx) = g.subs.get(&id)
                && tx.send(ev).is_err()
            {
                dead.push(id);
            }
            if fin {
                g.subs.remove(&id);
                g.rank_of.remove(&id);
            }
        }
        if !dead.is_empty() {
            for id in dead {
                g.subs.remove(&id);
                let r = g.rank_of.remove(&id).unwrap_or(0);
                if let Some(e) = g.engines.get_mut(r) {
                    e.abort(now, id);
                }
            }
            continue;
        }
        let wait = match g.engines.iter().filter_map(Engine::next_event_time).min() {
            Some(t) => shared.clock.real_until(now, t),
            None => Duration::from_millis(500),
        };
        g = shared
            .cv
            .wait_timeout(g, wait)
            .unwrap_or_else(|e| e.into_inner())
            .0;
    }
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

/// Starts `n` replicas named `<prefix><i>` on consecutive ports from `base.port` (0: any free ports).
pub fn start_replicas(base: &ReplicaConfig, n: usize, prefix: &str) -> io::Result<Vec<Replica>> {
    let mut out = Vec::with_capacity(n);
    for i in 0..n {
        let mut cfg = base.clone();
        cfg.name = format!("{prefix}{i}");
        cfg.port = if base.port == 0 {
            0
        } else {
            base.port
                .checked_add(i as u16)
                .ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "port overflow"))?
        };
        cfg.engine.seed = mix64(base.engine.seed ^ i as u64);
        if cfg.engine.epoch == 0 {
            let nanos = SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0);
            cfg.engine.epoch = mix64(nanos ^ (i as u64).rotate_left(40)) | 1;
        }
        out.push(Replica::start(cfg)?);
    }
    Ok(out)
}
