//! The running adapter: the ZMQ subscriber (with replay after gaps), the engine /metrics scraper, and
//! the HTTP server for the feed, its own /metrics and /health.

use crate::config::{Args, offset_endpoint, sub_endpoint};
use crate::engine_metrics;
use crate::obs::{IoStats, Metrics};
use crate::state::{AdapterState, ResetReason, SeqVerdict, StateConfig, next_epoch};
use crate::wire::Limits;
use axum::Router;
use axum::extract::{RawQuery, State};
use axum::http::{StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use http_body_util::{BodyExt, Empty, Limited};
use hyper::Uri;
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FEED_PATH, FeedQuery};
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tokio::task::JoinHandle;
use tracing::{debug, info, warn};
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Fresh entropy for epochs: the clock, the process id and a counter, so an adapter restart and every
/// reset get an epoch of their own.
pub fn entropy() -> u64 {
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(0);
    nanos ^ ((std::process::id() as u64) << 32) ^ COUNTER.fetch_add(1, Ordering::Relaxed)
}

/// Everything the tasks share.
pub struct Shared {
    pub state: Mutex<AdapterState>,
    pub io: Mutex<IoStats>,
    pub metrics: Metrics,
    /// When the engine's /metrics last answered.
    pub last_scrape_ok: Mutex<Option<Instant>>,
    pub stale_after: Option<Duration>,
}

/// Locks, recovering from a poisoned lock (a panic elsewhere must not take the feed down).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Shared {
    fn io(&self, f: impl FnOnce(&mut IoStats)) {
        f(&mut lock(&self.io));
    }

    /// Whether the feed should answer 503: the engine's /metrics answered once and then stopped.
    fn engine_stale(&self) -> bool {
        match (self.stale_after, *lock(&self.last_scrape_ok)) {
            (Some(after), Some(t)) => t.elapsed() > after,
            _ => false,
        }
    }
}

/// A started adapter; dropping it stops its tasks.
pub struct Running {
    pub http_addr: SocketAddr,
    /// The endpoint the SUB socket bound (port resolved), when it binds (rank 0's with DP ranks).
    pub zmq_bound: Option<String>,
    /// The engine's view (rank 0's with DP ranks).
    pub shared: Arc<Shared>,
    /// One view per data-parallel rank (`--dp-ranks`), in rank order; `ranks[0]` is `shared`.
    pub ranks: Vec<Arc<Shared>>,
    tasks: Vec<JoinHandle<()>>,
}

/// What the HTTP handlers serve from: every rank's view.
struct Served {
    ranks: Vec<Arc<Shared>>,
    /// The tokenizer bundle (`--model-dir`), framed once at start.
    bundle: Option<crate::bundle::ServedBundle>,
}

impl Served {
    /// The view a query asks for: with one engine, no rank (or rank 0); with DP ranks, `rank=R`
    /// is required (each rank is its own cache; a rank-blind answer would merge them). An error
    /// names the problem.
    fn pick(&self, query: &str) -> Result<&Arc<Shared>, String> {
        let n = self.ranks.len();
        match kvsteer_core::feed::query_rank(query)? {
            None if n == 1 => Ok(&self.ranks[0]),
            None => Err(format!(
                "this adapter serves {n} data-parallel ranks: ask with rank=0..{}",
                n - 1
            )),
            Some(r) => self
                .ranks
                .get(r as usize)
                .ok_or_else(|| format!("no data-parallel rank {r} here ({n} rank(s))")),
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        for t in &self.tasks {
            t.abort();
        }
    }
}

fn state_config(a: &Args, dp_rank: Option<u32>) -> StateConfig {
    StateConfig {
        dp_rank,
        block_size: a.block_size,
        max_blocks: a.max_blocks,
        log_hashes: a.log_hashes,
        group_idx: a.group_idx,
        limits: Limits {
            max_payload_bytes: a.max_payload_bytes,
            max_events: a.max_batch_events,
            ..Limits::default()
        },
    }
}

/// The runtime both binaries run on: `worker_threads` threads (the adapter's work is small and
/// bursty; a few threads keep it off the engine's cores). `None`, logged, when it cannot start.
pub fn runtime(worker_threads: usize) -> Option<tokio::runtime::Runtime> {
    match tokio::runtime::Builder::new_multi_thread()
        .worker_threads(worker_threads)
        .enable_all()
        .build()
    {
        Ok(rt) => Some(rt),
        Err(e) => {
            tracing::error!(error = %e, "cannot start the runtime");
            None
        }
    }
}

/// Starts every task. Errors: the HTTP address or the ZMQ endpoint cannot be bound, a URL is invalid.
pub async fn start(args: Args) -> Result<Running, String> {
    let n = args.dp_ranks.max(1);
    let ranks: Vec<Arc<Shared>> = (0..n)
        .map(|r| {
            Arc::new(Shared {
                state: Mutex::new(AdapterState::new(
                    state_config(&args, (n > 1).then_some(r)),
                    next_epoch(0, entropy()),
                )),
                io: Mutex::new(IoStats::default()),
                metrics: Metrics::new(),
                last_scrape_ok: Mutex::new(None),
                stale_after: (args.stale_after_s > 0 && args.metrics_url.is_some())
                    .then(|| Duration::from_secs(args.stale_after_s)),
            })
        })
        .collect();
    let shared = ranks[0].clone();
    let epoch = lock(&shared.state).epoch();
    let mut tasks = Vec::new();

    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let http_addr = listener
        .local_addr()
        .map_err(|e| format!("listener address: {e}"))?;
    let bundle = crate::bundle::from_args(&args)?;
    let app = router(Arc::new(Served {
        ranks: ranks.clone(),
        bundle,
    }));
    tasks.push(tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            warn!(error = %e, "http server stopped");
        }
    }));

    let mut zmq_bound = None;
    let mut bind = false;
    for (r, sh) in ranks.iter().enumerate() {
        let r = r as u32;
        let (bound, b) = start_rank(&args, r, sh.clone(), &mut tasks).await?;
        bind = b;
        if r == 0 {
            zmq_bound = bound;
        }
        if let Some(url) = &args.metrics_url {
            let uri: Uri = url
                .parse()
                .map_err(|e| format!("--metrics-url {url:?}: {e}"))?;
            if uri.scheme_str() != Some("http") {
                return Err(format!("--metrics-url {url:?}: only http:// is supported"));
            }
            let every = Duration::from_millis(args.scrape_interval_ms.max(10));
            // With DP ranks each view reads its own engine's samples (vLLM's `engine` label).
            let engine = (n > 1).then(|| r.to_string());
            tasks.push(tokio::spawn(scraper(sh.clone(), uri, every, engine)));
        }
    }

    info!(
        http = %http_addr,
        epoch,
        zmq = %args.zmq_endpoint,
        bind,
        dp_ranks = n,
        "kvsteer-feed started"
    );
    Ok(Running {
        http_addr,
        zmq_bound,
        shared,
        ranks,
        tasks,
    })
}

/// Subscribes rank `rank`'s view to its engine's events (rank 0: the endpoint as given; rank R: the
/// port plus R, as vLLM offsets it). Returns the bound endpoint (when binding) and whether it binds.
async fn start_rank(
    args: &Args,
    rank: u32,
    shared: Arc<Shared>,
    tasks: &mut Vec<JoinHandle<()>>,
) -> Result<(Option<String>, bool), String> {
    let endpoint = offset_endpoint(&args.zmq_endpoint, rank)?;
    let (ep, bind) = sub_endpoint(&endpoint, args.zmq_mode);
    let mut sub = SubSocket::new();
    sub.subscribe(&args.topic)
        .await
        .map_err(|e| format!("subscribe: {e}"))?;
    let zmq_bound = if bind {
        let bound = sub
            .bind(&ep)
            .await
            .map_err(|e| format!("cannot bind the SUB socket on {ep}: {e}"))?;
        info!(endpoint = %bound, "SUB socket bound; the engine connects here");
        Some(bound.to_string())
    } else {
        None
    };
    let replay = match &args.replay_endpoint {
        Some(r) => Some(Replay {
            endpoint: offset_endpoint(r, rank)?.replace('*', "127.0.0.1"),
            timeout: Duration::from_millis(args.replay_timeout_ms.max(1)),
        }),
        None => None,
    };
    let sh = shared.clone();
    let topic = args.topic.clone();
    tasks.push(tokio::spawn(async move {
        if !bind {
            connect_until_up(&mut sub, &ep, &sh).await;
        }
        subscriber(sub, sh, replay, topic).await;
    }));
    Ok((zmq_bound, bind))
}

async fn connect_until_up(sub: &mut SubSocket, ep: &str, sh: &Shared) {
    let mut wait = Duration::from_millis(200);
    loop {
        match sub.connect(ep).await {
            Ok(()) => {
                info!(endpoint = ep, "SUB socket connected to the engine");
                return;
            }
            Err(e) => {
                sh.io(|io| io.zmq_errors += 1);
                warn!(endpoint = ep, error = %e, "cannot connect to the engine's PUB socket yet");
                tokio::time::sleep(wait).await;
                wait = (wait * 2).min(Duration::from_secs(5));
            }
        }
    }
}

#[derive(Clone)]
struct Replay {
    endpoint: String,
    timeout: Duration,
}

async fn subscriber(mut sub: SubSocket, sh: Arc<Shared>, replay: Option<Replay>, topic: String) {
    loop {
        let msg = match sub.recv().await {
            Ok(m) => m,
            Err(e) => {
                sh.io(|io| io.zmq_errors += 1);
                warn!(error = %e, "ZMQ receive failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        on_message(&sh, replay.as_ref(), &topic, msg.into_vec()).await;
    }
}

/// Checks the three frames (topic, 8-byte big-endian sequence, payload).
fn split_frames<'a>(sh: &Shared, topic: &str, frames: &'a [Bytes]) -> Option<(u64, &'a Bytes)> {
    let mut st = lock(&sh.state);
    if frames.len() != 3 {
        st.count_bad_payload("frames");
        warn!(frames = frames.len(), "engine message without 3 frames");
        return None;
    }
    if !topic.is_empty() && frames[0].as_ref() != topic.as_bytes() {
        st.count_bad_payload("topic");
        debug!("engine message for another topic");
        return None;
    }
    let Ok(seq) = <[u8; 8]>::try_from(frames[1].as_ref()) else {
        st.count_bad_payload("seq");
        warn!(len = frames[1].len(), "sequence frame is not 8 bytes");
        return None;
    };
    Some((u64::from_be_bytes(seq), &frames[2]))
}

fn apply(sh: &Shared, seq: u64, payload: &[u8]) {
    let mut st = lock(&sh.state);
    if let Err(e) = st.apply_payload(payload, entropy()) {
        warn!(seq, error = %e, epoch = st.epoch(), "engine payload refused; view reset");
    }
    st.set_applied_seq(seq);
}

async fn on_message(sh: &Shared, replay: Option<&Replay>, topic: &str, frames: Vec<Bytes>) {
    let Some((seq, payload)) = split_frames(sh, topic, &frames) else {
        return;
    };
    let verdict = lock(&sh.state).check_seq(seq);
    match verdict {
        SeqVerdict::InOrder => {}
        SeqVerdict::First => {
            info!(seq, "first engine batch");
            if seq > 0
                && let Some(r) = replay
            {
                // Learn what the engine cached before the adapter started, as far as its buffer goes.
                sh.io(|io| io.replay_requests += 1);
                match fetch_replay(r, 0, seq).await {
                    Ok(batches) => {
                        info!(batches = batches.len(), "history replayed");
                        apply_replayed(sh, &batches);
                    }
                    Err(e) => {
                        sh.io(|io| io.replay_failed += 1);
                        info!(error = %e, "no history from the replay endpoint");
                    }
                }
            }
        }
        SeqVerdict::Restart => {
            let mut st = lock(&sh.state);
            st.reset(ResetReason::EngineRestart, entropy());
            warn!(
                seq,
                epoch = st.epoch(),
                "engine sequence went back: engine restart, new epoch"
            );
        }
        SeqVerdict::Gap { from, to } => on_gap(sh, replay, seq, from, to).await,
    }
    apply(sh, seq, payload);
}

/// Batches `from..to` were lost before batch `seq`: read them again from the engine's replay
/// endpoint when it has them all, else reset the view (a new epoch); either way `seq` comes next.
async fn on_gap(sh: &Shared, replay: Option<&Replay>, seq: u64, from: u64, to: u64) {
    {
        let mut st = lock(&sh.state);
        let s = st.stats_mut();
        s.gaps += 1;
        s.gap_batches += to - from;
    }
    let recovered = match replay {
        Some(r) => {
            sh.io(|io| io.replay_requests += 1);
            match fetch_replay(r, from, to).await {
                Ok(b) if b.len() as u64 == to - from => Some(b),
                Ok(b) => {
                    sh.io(|io| io.replay_failed += 1);
                    warn!(from, to, got = b.len(), "replay did not cover the gap");
                    None
                }
                Err(e) => {
                    sh.io(|io| io.replay_failed += 1);
                    warn!(from, to, error = %e, "replay failed");
                    None
                }
            }
        }
        None => None,
    };
    match recovered {
        Some(b) => {
            apply_replayed(sh, &b);
            lock(&sh.state).stats_mut().gaps_recovered += 1;
            info!(from, to, "gap recovered by replay");
        }
        None => {
            let mut st = lock(&sh.state);
            st.reset(ResetReason::Gap, entropy());
            warn!(
                from,
                to,
                epoch = st.epoch(),
                "batches lost: view reset, new epoch"
            );
        }
    }
    lock(&sh.state).set_expected_seq(seq.wrapping_add(1));
}

fn apply_replayed(sh: &Shared, batches: &[(u64, Bytes)]) {
    for (seq, payload) in batches {
        apply(sh, *seq, payload);
        lock(&sh.state).stats_mut().replayed_batches += 1;
    }
}

/// Asks the engine's ROUTER for batches `from..to`: sends the start as 8 big-endian bytes, reads
/// `(seq, payload)` replies until the end marker (sequence -1). Returns the batches in `from..to`, in
/// order and without holes (stops at the first hole).
///
/// A reply is `[empty delimiter,] [topic,] seq, payload`: vLLM 0.32 sends the topic (its end marker
/// an empty one), SGLang and older vLLM releases do not.
async fn fetch_replay(r: &Replay, from: u64, to: u64) -> Result<Vec<(u64, Bytes)>, String> {
    let work = async {
        let mut d = DealerSocket::new();
        d.connect(&r.endpoint)
            .await
            .map_err(|e| format!("connect {}: {e}", r.endpoint))?;
        let mut req = ZmqMessage::from(Bytes::new());
        req.push_back(Bytes::copy_from_slice(&from.to_be_bytes()));
        d.send(req).await.map_err(|e| format!("send: {e}"))?;
        let mut out: Vec<(u64, Bytes)> = Vec::new();
        loop {
            let mut frames = d.recv().await.map_err(|e| format!("recv: {e}"))?.into_vec();
            if frames.len() == 4 && frames[0].is_empty() {
                frames.remove(0);
            }
            if frames.len() == 3 {
                // The delimiter (no topic), or the topic.
                frames.remove(0);
            }
            if frames.len() != 2 {
                return Err(format!("replay reply with {} frames", frames.len()));
            }
            let seq = <[u8; 8]>::try_from(frames[0].as_ref())
                .map_err(|_| "replay sequence frame is not 8 bytes".to_string())?;
            let seq = i64::from_be_bytes(seq);
            if seq == -1 {
                break;
            }
            let seq = seq as u64;
            if seq >= from && seq < to && seq == from + out.len() as u64 {
                out.push((seq, frames.swap_remove(1)));
            }
        }
        Ok(out)
    };
    tokio::time::timeout(r.timeout, work)
        .await
        .map_err(|_| format!("no end of replay within {:?}", r.timeout))?
}

/// GET over HTTP/1.1 with hyper; bodies over 16 MiB are refused.
pub async fn http_get(uri: &Uri, timeout: Duration) -> Result<Bytes, String> {
    let work = async {
        let host = uri.host().ok_or("no host in URL")?.to_string();
        let port = uri.port_u16().unwrap_or(80);
        let stream = tokio::net::TcpStream::connect((host.as_str(), port))
            .await
            .map_err(|e| format!("connect {host}:{port}: {e}"))?;
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .map_err(|e| format!("handshake: {e}"))?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
        let authority = uri.authority().map(|a| a.as_str()).unwrap_or(&host);
        let req = hyper::Request::get(path)
            .header(hyper::header::HOST, authority)
            .body(Empty::<Bytes>::new())
            .map_err(|e| format!("request: {e}"))?;
        let resp = sender
            .send_request(req)
            .await
            .map_err(|e| format!("send: {e}"))?;
        let status = resp.status();
        let body = Limited::new(resp.into_body(), 16 << 20)
            .collect()
            .await
            .map_err(|e| format!("body: {e}"))?
            .to_bytes();
        if !status.is_success() {
            return Err(format!("status {status}"));
        }
        Ok(body)
    };
    tokio::time::timeout(timeout, work)
        .await
        .map_err(|_| format!("no answer within {timeout:?}"))?
}

async fn scraper(sh: Arc<Shared>, uri: Uri, every: Duration, engine: Option<String>) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut failing = false;
    loop {
        tick.tick().await;
        match http_get(&uri, Duration::from_secs(5).max(every)).await {
            Ok(body) => {
                let text = String::from_utf8_lossy(&body);
                let (load, bad) = engine_metrics::parse_engine(&text, engine.as_deref());
                {
                    let mut st = lock(&sh.state);
                    let epoch = st.epoch();
                    st.set_engine_load(load, entropy());
                    if st.epoch() != epoch {
                        warn!(
                            epoch = st.epoch(),
                            "engine process restarted: view reset, new epoch"
                        );
                    }
                }
                *lock(&sh.last_scrape_ok) = Some(Instant::now());
                sh.io(|io| {
                    io.scrapes_ok += 1;
                    io.metrics_lines_bad += bad as u64;
                });
                if failing {
                    info!("engine /metrics answers again");
                    failing = false;
                }
            }
            Err(e) => {
                sh.io(|io| io.scrapes_failed += 1);
                if !failing {
                    warn!(url = %uri, error = %e, "engine /metrics scrape failed");
                    failing = true;
                }
            }
        }
    }
}

fn router(sh: Arc<Served>) -> Router {
    Router::new()
        .route(FEED_PATH, get(feed))
        .route("/metrics", get(own_metrics))
        .route("/health", get(health))
        .route(kvsteer_core::bundle::BUNDLE_PATH, get(tokenizer_bundle))
        .with_state(sh)
}

async fn tokenizer_bundle(State(sv): State<Arc<Served>>) -> Response {
    crate::bundle::answer(sv.bundle.as_ref())
}

async fn feed(State(sv): State<Arc<Served>>, RawQuery(q): RawQuery) -> Response {
    let query = q.as_deref().unwrap_or("");
    let sh = match sv.pick(query) {
        Ok(sh) => sh,
        Err(e) => {
            sv.ranks[0].io(|io| io.feed_bad_query += 1);
            return (StatusCode::BAD_REQUEST, e).into_response();
        }
    };
    let q = match FeedQuery::parse(query) {
        Ok(q) => q,
        Err(e) => {
            sh.io(|io| io.feed_bad_query += 1);
            return (StatusCode::BAD_REQUEST, e).into_response();
        }
    };
    if sh.engine_stale() {
        sh.io(|io| io.feed_unavailable += 1);
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            "engine /metrics not answering",
        )
            .into_response();
    }
    let adapters = kvsteer_core::feed::query_adapters(query);
    let body = lock(&sh.state).answer_bytes_for(&q, adapters);
    ([(header::CONTENT_TYPE, FEED_CONTENT_TYPE)], body).into_response()
}

/// The adapter's own metrics; with DP ranks, one rank's (`?rank=R`, default 0).
async fn own_metrics(State(sv): State<Arc<Served>>, RawQuery(q): RawQuery) -> Response {
    let sh = pick_or_first(&sv, q.as_deref());
    let io = lock(&sh.io).clone();
    let text = {
        let st = lock(&sh.state);
        sh.metrics.render(&st, &io)
    };
    ([(header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response()
}

/// A view named by `?rank=R`, else rank 0's (the adapter's own pages, not the feed).
fn pick_or_first<'a>(sv: &'a Served, q: Option<&str>) -> &'a Arc<Shared> {
    match q.map(kvsteer_core::feed::query_rank) {
        Some(Ok(Some(r))) => sv.ranks.get(r as usize).unwrap_or(&sv.ranks[0]),
        _ => &sv.ranks[0],
    }
}

async fn health(State(sv): State<Arc<Served>>, RawQuery(q): RawQuery) -> Response {
    let sh = pick_or_first(&sv, q.as_deref());
    let st = lock(&sh.state);
    let body = format!(
        "{{\"epoch\":{},\"blocks\":{},\"block_size\":{},\"expected_seq\":{},\"applied_seq\":{},\"engine_stale\":{}}}\n",
        st.epoch(),
        st.blocks(),
        st.block_size().unwrap_or(0),
        st.expected_seq()
            .map(|s| s.to_string())
            .unwrap_or_else(|| "null".into()),
        st.applied_seq()
            .map(|s| s.to_string())
            .unwrap_or_else(|| "null".into()),
        sh.engine_stale()
    );
    ([(header::CONTENT_TYPE, "application/json")], body).into_response()
}
