//! The component build of the routing core (`kvsteer_component.wasm`, world `router-component` of
//! `wit/router.wit`) against the proxy-wasm filter (`kvsteer_filter.wasm`): given the same
//! configuration, the same replica feed payloads and the same requests and responses, both must make
//! the same decisions and keep the same token load.
//!
//! The filter runs in this crate's proxy-wasm host (one worker, Envoy mode); the component runs in
//! wasmtime's component model with bindings generated from the WIT file, so the test also checks that
//! the WIT package and the component agree. The replicas are scripted feeds (stores, removals, a
//! restart, a garbage payload, reported load that changes every poll), so every callout's payload is
//! known and handed to both routers byte for byte. Compared, request by request: the chosen replica and
//! the retry backup (the filter's destination header), the tier-weighted matched tokens on the chosen
//! replica and the prompt tokens (the filter's counters); after every tick: the tracked load per
//! replica (what the filter publishes to its peers in shared data) and each feed query's path.

mod common;

use common::{extend, module, tokens};
use kvsteer_core::block::BlockHasher;
use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedEvent, FeedQuery, ReplicaLoad, Tier};
use kvsteer_core::load::LoadTotals;
use kvsteer_core::record::Record;
use kvsteer_core::rng::SplitMix64;
use kvsteer_host_test::artifact::workspace_root;
use kvsteer_host_test::host::CLOCK_BASE_NS;
use kvsteer_host_test::openai::{SseWriter, completion_body, request_headers, sse_headers};
use kvsteer_host_test::{CallOutcome, HostMode, Proxy, ProxyOptions, WorkerVm, pairs};
use serde_json::{Value, json};
use std::collections::{BTreeMap, BTreeSet};
use std::path::PathBuf;
use std::sync::OnceLock;
use wasmtime::component::{Component, Linker, ResourceAny};
use wasmtime::{Config, Engine, Store};

wasmtime::component::bindgen!({
    path: "../wit",
    world: "router-component",
});

use kvsteer::router::types::{Decision, FeedError, FeedOutcome, Request};

const REPLICAS: usize = 4;
const BLOCK: usize = 16;
const DEST: &str = "x-gateway-destination-endpoint";

/// Environment variable naming the component explicitly.
const COMPONENT_ENV: &str = "KVSTEER_COMPONENT_WASM";

/// `$KVSTEER_COMPONENT_WASM`, else `<target dir>/wasm32-wasip2/release/kvsteer_component.wasm`. Like
/// the filter, it is never built here: cargo holds the build directory's lock while tests run, so a
/// nested `cargo build` would wait forever. `scripts/component` builds it.
fn component_path() -> PathBuf {
    if let Some(p) = std::env::var_os(COMPONENT_ENV) {
        return PathBuf::from(p);
    }
    let root = workspace_root();
    let target = std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|t| if t.is_relative() { root.join(t) } else { t })
        .unwrap_or_else(|| root.join("target"));
    let p = target.join("wasm32-wasip2/release/kvsteer_component.wasm");
    assert!(
        p.is_file(),
        "the component is not built: {} is missing. Build it with scripts/component (same \
         CARGO_TARGET_DIR), or point {COMPONENT_ENV} at a kvsteer_component.wasm",
        p.display()
    );
    p
}

struct Loaded {
    engine: Engine,
    component: Component,
}

fn loaded() -> &'static Loaded {
    static L: OnceLock<Loaded> = OnceLock::new();
    L.get_or_init(|| {
        let mut config = Config::new();
        config.wasm_component_model(true);
        let engine = Engine::new(&config).expect("engine");
        let path = component_path();
        let component = Component::from_file(&engine, &path)
            .unwrap_or_else(|e| panic!("load {}: {e:#}", path.display()));
        Loaded { engine, component }
    })
}

/// One router instance in the component.
struct ComponentRouter {
    store: Store<()>,
    bindings: RouterComponent,
    router: ResourceAny,
}

impl ComponentRouter {
    fn configure(config_json: &str, replicas: u32) -> Result<ComponentRouter, String> {
        let l = loaded();
        let mut linker = Linker::new(&l.engine);
        // The router needs nothing from its host. The wasm32-wasip2 standard library still links
        // WASI's stdio, environment and exit interfaces (used only to print a panic message); they
        // are stubbed to trap, so a router that reached for them would fail this test.
        linker
            .define_unknown_imports_as_traps(&l.component)
            .expect("stub imports");
        let mut store = Store::new(&l.engine, ());
        let bindings =
            RouterComponent::instantiate(&mut store, &l.component, &linker).expect("instantiate");
        let router = bindings
            .kvsteer_router_routing()
            .router()
            .call_configure(&mut store, config_json, replicas)
            .expect("configure call")
            .map_err(|e| format!("{}: {}", e.field, e.message))?;
        Ok(ComponentRouter {
            store,
            bindings,
            router,
        })
    }

    fn feed_path(&mut self, replica: u32, max_events: u32) -> String {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_feed_query(&mut self.store, r, replica, max_events)
            .unwrap()
            .path
    }

    fn apply_feed(&mut self, replica: u32, payload: &[u8]) -> Result<FeedOutcome, FeedError> {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_apply_feed(&mut self.store, r, replica, payload)
            .unwrap()
    }

    /// What the filter does with a request body: route it, or route it by load when unreadable.
    fn route(&mut self, id: u64, req: &Request, now_ms: u64) -> Decision {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        match b.call_route(&mut self.store, r, id, req, now_ms).unwrap() {
            Ok(d) => d,
            Err(_) => b
                .call_route_unread(&mut self.store, r, id, req.body.len() as u64, now_ms)
                .unwrap(),
        }
    }

    fn first_token(&mut self, id: u64) {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_first_token(&mut self.store, r, id).unwrap();
    }

    fn decode_progress(&mut self, id: u64, generated: u64) {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_decode_progress(&mut self.store, r, id, generated)
            .unwrap();
    }

    fn done(&mut self, id: u64) -> bool {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_done(&mut self.store, r, id).unwrap()
    }

    fn tracked(&mut self) -> Vec<LoadTotals> {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_load(&mut self.store, r)
            .unwrap()
            .iter()
            .map(|l| LoadTotals {
                prefill_tokens: l.tracked.prefill_tokens,
                decode_blocks: l.tracked.decode_blocks,
                active_requests: l.tracked.active_requests,
            })
            .collect()
    }

    fn stats(&mut self) -> kvsteer::router::types::RouterStats {
        let (b, r) = (self.bindings.kvsteer_router_routing().router(), self.router);
        b.call_stats(&mut self.store, r).unwrap()
    }
}

/// A scripted replica feed: a log of events with sequence numbers, an epoch, and the blocks it holds.
/// Answers a query as `docs/reference/feed.md` says a replica must: a snapshot when the epoch
/// differs or the cursor is outside the log, else the events after the cursor, at most
/// `max_events`.
struct ScriptedFeed {
    epoch: u64,
    log: Vec<FeedEvent>,
    held: BTreeMap<u64, Tier>,
    load: ReplicaLoad,
}

impl ScriptedFeed {
    fn new(epoch: u64) -> Self {
        ScriptedFeed {
            epoch,
            log: Vec::new(),
            held: BTreeMap::new(),
            load: ReplicaLoad {
                kv_total_blocks: 4096,
                block_size: BLOCK as u32,
                ..ReplicaLoad::default()
            },
        }
    }

    fn store(&mut self, tier: Tier, hashes: Vec<u64>) {
        for &h in &hashes {
            self.held.insert(h, tier);
        }
        self.log.push(FeedEvent::Stored { tier, hashes });
    }

    fn remove(&mut self, hashes: Vec<u64>) {
        for h in &hashes {
            self.held.remove(h);
        }
        self.log.push(FeedEvent::Removed {
            tier: Tier::Gpu,
            hashes,
        });
    }

    fn restart(&mut self) {
        self.epoch += 1;
        self.log.clear();
        self.held.clear();
    }

    fn answer(&self, q: &FeedQuery) -> FeedBatch {
        let next = self.log.len() as u64;
        if q.epoch != self.epoch || q.cursor > next {
            let mut events = vec![FeedEvent::Cleared];
            for tier in Tier::ALL {
                let hashes: Vec<u64> = self
                    .held
                    .iter()
                    .filter(|(_, t)| **t == tier)
                    .map(|(h, _)| *h)
                    .collect();
                if !hashes.is_empty() {
                    events.push(FeedEvent::Stored { tier, hashes });
                }
            }
            return FeedBatch {
                epoch: self.epoch,
                resync: true,
                more: false,
                first_seq: next,
                next_seq: next,
                load: self.load,
                events,
            };
        }
        let end = next.min(q.cursor + q.max_events.max(1) as u64);
        FeedBatch {
            epoch: self.epoch,
            resync: false,
            more: end < next,
            first_seq: q.cursor,
            next_seq: end,
            load: self.load,
            events: self.log[q.cursor as usize..end as usize].to_vec(),
        }
    }
}

/// A request in flight through both routers.
struct InFlight {
    stream: u32,
    sse: SseWriter,
    headers_sent: bool,
    generated: u64,
    length: u64,
}

fn plugin_config(routing: &Value) -> String {
    let replicas: Vec<Value> = (0..REPLICAS)
        .map(|i| {
            let endpoint = format!("127.0.0.1:{}", 18000 + i);
            json!({"name": format!("r{i}"), "endpoint": endpoint, "feed_cluster": format!("kvsteer_feed_r{i}"),
                   "feed_authority": endpoint, "cluster": format!("replica_r{i}")})
        })
        .collect();
    json!({
        "replicas": replicas, "routing": routing, "feed_period_ms": 100, "tick_ms": 50,
        "feed_max_events": 8, "session_header": "x-session-id", "output": "destination_header",
    })
    .to_string()
}

fn endpoint_index(e: &str) -> usize {
    let port: usize = e.rsplit(':').next().unwrap().parse().unwrap();
    port - 18000
}

fn counter(proxy: &Proxy, name: &str) -> u64 {
    proxy.metric(name).map_or(0, |m| m.value as u64)
}

/// Tracked load the filter published to its peers at its last tick.
fn filter_tracked(proxy: &Proxy) -> Vec<LoadTotals> {
    let (bytes, _) = proxy
        .shared_data(b"kvsteer:load:0")
        .expect("the filter publishes its load");
    // `published_ms`, then the bookings (a count-prefixed `LoadTotals::encode_all`), then the bookings
    // and releases since the last polls that `reported_load: merge` reads (filter/src/worker/share/mod.rs).
    LoadTotals::decode_front(&bytes[8..])
        .expect("load record")
        .0
}

/// Drives the filter and the component through the same scenario and compares them at every step.
/// Returns how many decisions were compared and on how many replicas they landed.
fn same_decisions(routing: Value, rounds: usize, seed: u64) -> (usize, BTreeSet<usize>) {
    let label = routing.to_string();
    let mut comp = ComponentRouter::configure(&routing.to_string(), REPLICAS as u32)
        .unwrap_or_else(|e| panic!("{label}: component refused the config: {e}"));
    let proxy = Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Envoy, plugin_config(&routing)),
    );
    let mut w: WorkerVm = proxy.start_worker().expect("worker");
    let mut rng = SplitMix64::new(seed);
    let hasher = BlockHasher::new(BLOCK).unwrap();
    let mut feeds: Vec<ScriptedFeed> = (0..REPLICAS)
        .map(|r| ScriptedFeed::new(100 * r as u64 + 1))
        .collect();
    // Shared prefixes (a system prompt each), so the index has something to match.
    let prefixes: Vec<Vec<u32>> = (0..5)
        .map(|p| tokens(seed * 10 + p, 256 + 64 * p as usize))
        .collect();
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut now_ns = 0u64;
    let mut compared = 0usize;
    let mut landed = BTreeSet::new();
    let mut garbage_sent = false;

    for round in 0..rounds {
        now_ns += 50_000_000;
        proxy.set_now_ns(now_ns);
        let now_ms = (CLOCK_BASE_NS + now_ns) / 1_000_000;
        // Replica-side changes between polls: reported load, an eviction now and then, one restart.
        for f in feeds.iter_mut() {
            f.load.running = rng.below(8) as u32;
            f.load.waiting = rng.below(3) as u32;
            f.load.prefill_tokens = rng.below(3000) as u64;
            f.load.decode_blocks = rng.below(300) as u64;
            f.load.kv_used_blocks = f.held.len() as u64;
            if rng.below(10) == 0 && !f.held.is_empty() {
                let victims: Vec<u64> = f.held.keys().rev().take(8).copied().collect();
                f.remove(victims);
            }
        }
        if round == rounds / 2 {
            feeds[1].restart();
        }

        w.tick().expect("tick");
        assert_eq!(
            filter_tracked(&proxy),
            comp.tracked(),
            "{label}: round {round}: tracked load after the tick"
        );
        // Answer every feed poll (a batch with MORE makes the filter poll again at once).
        loop {
            let calls = w.take_callouts();
            if calls.is_empty() {
                break;
            }
            for call in calls {
                let r = call
                    .upstream
                    .strip_prefix("kvsteer_feed_r")
                    .and_then(|s| s.parse::<usize>().ok())
                    .expect("a feed cluster");
                let path = call.header(":path").expect("path").to_string();
                let q = FeedQuery::parse(path.split_once('?').map_or("", |p| p.1)).unwrap();
                assert_eq!(
                    comp.feed_path(r as u32, q.max_events),
                    path,
                    "{label}: round {round}: feed query for r{r}"
                );
                let payload = if !garbage_sent && round == rounds / 3 && r == 2 {
                    garbage_sent = true;
                    b"KVSF\x01\x00garbage".to_vec()
                } else {
                    feeds[r].answer(&q).encode()
                };
                let outcome = comp.apply_feed(r as u32, &payload);
                if payload.len() < 80 {
                    assert!(
                        matches!(outcome, Err(FeedError::TooShort(_))),
                        "{outcome:?}"
                    );
                } else {
                    assert!(outcome.is_ok(), "{label}: {outcome:?}");
                }
                w.answer_callout(&call, CallOutcome::ok(200, FEED_CONTENT_TYPE, payload))
                    .expect("feed answer");
            }
        }

        // New requests: shared prefix + own suffix, sometimes a session, sometimes a bad body.
        for _ in 0..1 + rng.below(3) {
            let p = rng.below(prefixes.len());
            let prompt = extend(&prefixes[p], rng.next_u64(), 16 + rng.below(200));
            let session = (rng.below(3) > 0).then(|| format!("s{}", rng.below(6)));
            let bad = rng.below(25) == 0;
            let chat = !bad && rng.below(8) == 0;
            let (path, body) = if bad {
                ("/v1/completions", b"{\"prompt\": [1, 2,".to_vec())
            } else if chat {
                let text: String = prompt.iter().map(|t| format!("w{} ", t % 50)).collect();
                (
                    "/v1/chat/completions",
                    json!({"model": "m", "messages": [{"role": "user", "content": text}], "stream": true})
                        .to_string()
                        .into_bytes(),
                )
            } else {
                ("/v1/completions", completion_body(&prompt, 64))
            };
            let stream = w.new_stream().expect("stream");
            let id = stream as u64;
            let headers = request_headers(
                path,
                body.len(),
                session.as_deref().map(|s| ("x-session-id", s)),
                &[],
            );
            let matched_before = counter(&proxy, "kvsteer_matched_tokens");
            let prompt_before = counter(&proxy, "kvsteer_prompt_tokens");
            w.request_headers(stream, headers, false).expect("headers");
            w.request_body(stream, &body, true).expect("body");
            let st = w.stream(stream).expect("stream state");
            assert!(st.released, "{label}: the filter released the request");
            let dest = st.upstream_header(DEST).expect("destination").to_string();
            let mut hosts = dest.split(',').map(endpoint_index);
            let filter_replica = hosts.next().unwrap();
            let filter_backup = hosts.next();

            let req = Request {
                path: path.to_string(),
                body: body.clone(),
                session_key: session.clone(),
            };
            let d = comp.route(id, &req, now_ms);
            let what =
                format!("{label}: round {round}, request {id} ({path}, session {session:?})");
            assert_eq!(d.replica as usize, filter_replica, "{what}: replica; {d:?}");
            assert_eq!(
                d.backup.map(|b| b as usize),
                filter_backup,
                "{what}: backup"
            );
            let chosen_matched = d
                .matched_tokens
                .get(d.replica as usize)
                .copied()
                .unwrap_or(0);
            assert_eq!(
                counter(&proxy, "kvsteer_matched_tokens") - matched_before,
                chosen_matched,
                "{what}: matched tokens on the chosen replica"
            );
            assert_eq!(
                counter(&proxy, "kvsteer_prompt_tokens") - prompt_before,
                d.prompt_tokens,
                "{what}: prompt tokens"
            );
            compared += 1;
            landed.insert(filter_replica);
            // The replica caches what it prefills: token prompts become stored blocks in its feed
            // (a fifth of them in host memory, to exercise the tier credit).
            if !bad && !chat {
                let hashes = hasher
                    .sequence_hashes(&prompt)
                    .into_iter()
                    .map(|h| h.0)
                    .collect();
                let tier = if rng.below(5) == 0 {
                    Tier::Host
                } else {
                    Tier::Gpu
                };
                feeds[filter_replica].store(tier, hashes);
            }
            in_flight.push(InFlight {
                stream,
                sse: SseWriter::new(id, 0, 0),
                headers_sent: false,
                generated: 0,
                length: 1 + rng.below(40) as u64,
            });
        }

        // Responses: first token, decode progress (one token event per chunk, sometimes several),
        // completion; now and then an upstream error.
        let mut i = 0;
        while i < in_flight.len() {
            let f = &mut in_flight[i];
            let id = f.stream as u64;
            if !f.headers_sent {
                if rng.below(12) == 0 {
                    // The replica fails the request: the filter releases its load at once.
                    let h = pairs(&[(":status", "503"), ("content-type", "text/plain")]);
                    w.response_headers(f.stream, h, true)
                        .expect("error headers");
                    w.end_stream(f.stream).expect("end");
                    comp.done(id);
                    in_flight.swap_remove(i);
                    continue;
                }
                w.response_headers(f.stream, sse_headers(), false)
                    .expect("response headers");
                f.headers_sent = true;
            }
            let n = 1 + rng.below(6) as u64;
            let chunk = f.sse.tokens(&vec![500; n as usize]);
            let first = f.generated == 0;
            f.generated += n;
            w.response_body(f.stream, &chunk, false)
                .expect("response body");
            if first {
                comp.first_token(id);
            }
            comp.decode_progress(id, f.generated);
            if f.generated >= f.length {
                let end = f.sse.finish(&[], "length", 100, f.generated as u32, 0);
                w.response_body(f.stream, &end, true).expect("last chunk");
                w.end_stream(f.stream).expect("end");
                assert!(comp.done(id), "{label}: request {id} was tracked");
                in_flight.swap_remove(i);
                continue;
            }
            i += 1;
        }
    }
    assert!(w.notes().is_empty(), "{label}: ABI notes {:?}", w.notes());
    let stats = comp.stats();
    assert_eq!(stats.release_anomalies, 0, "{label}: {stats:?}");
    assert_eq!(
        stats.matched_tokens,
        counter(&proxy, "kvsteer_matched_tokens"),
        "{label}"
    );
    (compared, landed)
}

#[test]
fn the_component_decides_as_the_filter_does_under_every_policy() {
    let policies = [
        json!({"policy": "round_robin", "block_size": BLOCK}),
        json!({"policy": "least_load", "block_size": BLOCK}),
        json!({"policy": "session_hash", "block_size": BLOCK}),
        json!({"policy": "prefix_affinity", "block_size": BLOCK}),
        json!({"policy": "kv_affinity", "block_size": BLOCK}),
        json!({"policy": "kv_load", "block_size": BLOCK}),
        // Ray's "KV-balanced" variant, softmax sampling: the seeded generator must agree too.
        json!({"policy": "kv_load", "block_size": BLOCK, "seed": 7,
               "kv_load": {"overlap_credit": 0.5, "active_request_weight": 32.0, "temperature": 0.3}}),
    ];
    for (i, routing) in policies.into_iter().enumerate() {
        let label = routing.to_string();
        let (n, landed) = same_decisions(routing, 60, 11 + i as u64);
        assert!(n >= 100, "{label}: only {n} decisions compared");
        assert!(landed.len() >= 2, "{label}: every request on {landed:?}");
    }
}

#[test]
fn configuration_errors_come_back_as_a_result_naming_the_field() {
    let e = ComponentRouter::configure(r#"{"kv_load": {"temperature": -1}}"#, 4)
        .err()
        .expect("refused");
    assert!(e.starts_with("kv_load.temperature"), "{e}");
    let e = ComponentRouter::configure(r#"{"polcy": "kv_load"}"#, 4)
        .err()
        .expect("refused");
    assert!(e.contains("polcy"), "{e}");
    let e = ComponentRouter::configure("{}", 0).err().expect("refused");
    assert!(e.starts_with("replicas"), "{e}");
    assert!(ComponentRouter::configure("not json", 4).is_err());
    assert!(ComponentRouter::configure("{}", 4).is_ok());
}

#[test]
fn hostile_feed_payloads_and_bodies_are_typed_errors_not_traps() {
    let mut c = ComponentRouter::configure("{}", 2).unwrap();
    assert!(matches!(c.apply_feed(0, b""), Err(FeedError::TooShort(0))));
    let mut bad = FeedBatch {
        epoch: 1,
        resync: true,
        more: false,
        first_seq: 0,
        next_seq: 0,
        load: ReplicaLoad::default(),
        events: vec![FeedEvent::Stored {
            tier: Tier::Gpu,
            hashes: vec![1, 2, 3],
        }],
    }
    .encode();
    assert!(c.apply_feed(0, &bad).is_ok());
    assert!(matches!(c.apply_feed(7, &bad), Ok(FeedOutcome::BadReplica)));
    bad[80] = 9; // event kind
    assert!(
        matches!(c.apply_feed(0, &bad), Err(FeedError::BadEventKind(f)) if f.index == 0 && f.value == 9)
    );
    bad.truncate(90);
    assert!(c.apply_feed(0, &bad).is_err());
    // A body that is not JSON is a typed error; the router is still usable afterwards.
    let (b, r) = (c.bindings.kvsteer_router_routing().router(), c.router);
    let req = Request {
        path: "/v1/completions".into(),
        body: vec![0xff, 0xfe, b'{'],
        session_key: None,
    };
    let e = b.call_route(&mut c.store, r, 1, &req, 0).unwrap();
    assert!(e.is_err(), "{e:?}");
    let d = c.route(2, &req, 0);
    assert_eq!(
        d.fallback,
        Some(kvsteer::router::types::FallbackReason::BodyUnreadable)
    );
    assert!(c.done(2));
    assert!(!c.done(2), "a second release is refused");
    assert_eq!(c.stats().release_anomalies, 1);
}
