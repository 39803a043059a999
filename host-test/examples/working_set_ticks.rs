//! What the working-set term costs two workers that share it (docs/reports/notebook/envoy-latency.md:
//! the Envoy p99 it adds): two worker VMs of one proxy in wasmtime, fresh random 8,192-id prompts (every request
//! adds to the working set, the worst case; `scripts/envoy-latency` sends the same), 3.3 ms apart
//! in virtual time, requests alternating between the workers, each worker ticking every 100 ms.
//! Prints the request path's and the ticks' wall times (p50, p99, max) and the slowest requests'
//! places.
//!
//! `cargo run --release -p kvsteer-host-test --example working_set_ticks -- [overflow_weight] [requests] [gap_us] [one]`
//! (defaults 0.3, 6000 and 3300; 0 turns the term off for comparison). With `one`, every request
//! goes to worker 0, as `scripts/envoy-latency --inflight 1` does (one keep-alive connection: one
//! Envoy worker admits everything, the other applies all of it on its ticks); ticks are then also
//! printed per worker.
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    Action, CallOutcome, FilterModule, HostMode, Proxy, ProxyOptions, WorkerVm, filter_wasm_path,
};
use serde_json::json;
use std::time::Instant;

fn lcg(s: &mut u64) -> u64 {
    *s = s
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *s >> 33
}

fn pct(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[((v.len() as f64 - 1.0) * p) as usize]
}

/// What the working-set term costs two worker VMs that share it: the request path's and the
/// ticks' wall times.
#[derive(clap::Parser)]
#[command(name = "working_set_ticks")]
struct Args {
    /// `kv_load.overflow_weight`, the working-set term's weight (0 turns the term off).
    #[arg(value_name = "OVERFLOW_WEIGHT", default_value_t = 0.3)]
    overflow_weight: f64,
    /// Requests sent, each a fresh random 8,192-id prompt (at least 1).
    #[arg(
        value_name = "REQUESTS",
        default_value_t = 6000,
        value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..)
    )]
    requests: usize,
    /// Virtual time between requests, in microseconds.
    #[arg(value_name = "GAP_US", default_value_t = 3300)]
    gap_us: u64,
    /// `one`: every request goes to worker 0 (one keep-alive connection), ticks printed per worker.
    #[arg(value_name = "one", value_parser = ["one"])]
    one: Option<String>,
}

fn main() {
    let args: Args = clap::Parser::parse();
    let (ow, n, gap_us) = (args.overflow_weight, args.requests, args.gap_us);
    let one = args.one.is_some();
    let module = FilterModule::load_unmetered(&filter_wasm_path().unwrap()).unwrap();
    let replicas: Vec<_> = (0..4)
        .map(|i| json!({"name": format!("r{i}"), "endpoint": format!("10.0.0.{}:8000", i + 1), "feed_cluster": format!("feed_r{i}")}))
        .collect();
    let cfg = json!({"replicas": replicas, "routing": {"policy": "kv_load", "block_size": 16, "kv_load": {"overflow_weight": ow}},
                     "feed_period_ms": 200, "tick_ms": 100});
    let proxy = Proxy::new(&module, ProxyOptions::new(HostMode::Envoy, cfg.to_string()));
    let mut ws = [proxy.start_worker().unwrap(), proxy.start_worker().unwrap()];
    let mut req_us = Vec::new();
    let mut tick_us = Vec::new();
    let mut worker_tick_us = [Vec::new(), Vec::new()];
    let mut next_tick = 0u64;
    let mut seed = 7u64;
    for i in 0..n {
        let now_us = proxy.now_ns() / 1000 + gap_us;
        proxy.set_now_ns(now_us * 1000);
        if now_us >= next_tick {
            for (k, w) in ws.iter_mut().enumerate() {
                let us = tick(w);
                tick_us.push(us);
                worker_tick_us[k].push(us);
            }
            next_tick = now_us + 100_000;
        }
        let w = &mut ws[if one { 0 } else { i % 2 }];
        req_us.push(request(w, &mut seed));
    }
    report(ow, &req_us, &tick_us, one.then_some(&mut worker_tick_us));
}

/// One tick of a worker, its feed polls answered with timeouts; its wall time (us).
fn tick(w: &mut WorkerVm) -> f64 {
    let t = Instant::now();
    w.tick().unwrap();
    let us = t.elapsed().as_secs_f64() * 1e6;
    for call in w.take_callouts() {
        w.answer_callout(&call, CallOutcome::timeout()).unwrap();
    }
    us
}

/// A request with a fresh random 8,192-id prompt through `w`, in 16 KiB chunks; its wall time (us).
fn request(w: &mut WorkerVm, seed: &mut u64) -> f64 {
    let ids: Vec<String> = (0..8192)
        .map(|_| (lcg(seed) % 128_000).to_string())
        .collect();
    let body = format!(
        "{{\"model\":\"m\",\"prompt\":[{}],\"max_tokens\":4,\"stream\":true}}",
        ids.join(",")
    );
    let body = body.into_bytes();
    let headers = request_headers("/v1/completions", body.len(), None, &[]);
    let t = Instant::now();
    let id = w.new_stream().unwrap();
    let mut last = w.request_headers(id, headers, false).unwrap();
    let mut chunks = body.chunks(16 * 1024).peekable();
    while let Some(c) = chunks.next() {
        if let Some(x) = w.request_body(id, c, chunks.peek().is_none()).unwrap() {
            last = x;
        }
    }
    assert_eq!(last, Action::Continue);
    w.end_stream(id).unwrap();
    t.elapsed().as_secs_f64() * 1e6
}

/// The request path's and the ticks' wall times, per worker too when given, and the slowest
/// requests' places.
fn report(ow: f64, req_us: &[f64], tick_us: &[f64], per_worker: Option<&mut [Vec<f64>; 2]>) {
    let mut r = req_us.to_vec();
    let mut tk = tick_us.to_vec();
    println!(
        "ow {ow}: requests {} p50 {:.1} p99 {:.1} max {:.1} us; ticks {} p50 {:.1} p99 {:.1} max {:.1} us; tick total {:.1} ms, request total {:.1} ms",
        r.len(),
        pct(&mut r, 0.5),
        pct(&mut r, 0.99),
        pct(&mut r, 1.0),
        tk.len(),
        pct(&mut tk, 0.5),
        pct(&mut tk, 0.99),
        pct(&mut tk, 1.0),
        tick_us.iter().sum::<f64>() / 1e3,
        req_us.iter().sum::<f64>() / 1e3
    );
    for (k, t) in per_worker
        .into_iter()
        .flat_map(|w| w.iter_mut().enumerate())
    {
        let total = t.iter().sum::<f64>() / 1e3;
        println!(
            "worker {k} ticks: p50 {:.1} p99 {:.1} max {:.1} us, total {total:.1} ms",
            pct(t, 0.5),
            pct(t, 0.99),
            pct(t, 1.0)
        );
    }
    // The slowest requests: where in the run.
    let mut idx: Vec<usize> = (0..req_us.len()).collect();
    idx.sort_by(|&a, &b| req_us[b].partial_cmp(&req_us[a]).unwrap());
    let top: Vec<(usize, u64)> = idx
        .iter()
        .take(15)
        .map(|&i| (i, req_us[i] as u64))
        .collect();
    println!("slowest requests (index, us): {top:?}");
}
