//! Fuzz campaign of the request reader and the feed decoder through the real `kvsteer_filter.wasm`.
//! Structured random inputs, not coverage-guided: every input is a valid body or feed
//! batch with random mutations, driven by a seeded generator, so a run is reproducible from
//! `(SEED, COUNT)`.
//!
//! - **Request inputs**: `/v1/completions` and `/v1/chat/completions` bodies (token-id prompts, text
//!   prompts, batched prompts, chat messages, content parts), mutated (byte flips, inserts, deletes,
//!   truncation, splices, huge and odd numbers, deep nesting, wrong types, duplicated keys, invalid
//!   UTF-8, escapes, junk inside token-id arrays, whitespace floods), sent in random chunkings with
//!   random headers (spoofed destination and cluster headers, wrong content-length and content-type,
//!   session headers, other methods and paths), sometimes with trailers, sometimes aborted mid-body.
//! - **Feed inputs**: answers to the filter's own feed polls: valid batches for its query (incremental
//!   or resync, random events, tiers and loads) mutated the same way at the byte level plus header
//!   fields (version, flags, counts, block size) set to odd values, with random status codes, content
//!   types and lying content-lengths, some resets and timeouts, sizes up to a little over the
//!   configured `feed_max_bytes`.
//!
//! One worker VM (fuel-metered, so a runaway loop is a trap too) serves every input; it is recreated
//! only after a trap. Every `--check-every` inputs a plain valid request must still be routed to a
//! configured replica. Checked after each request input: no trap, a request that ended was released
//! (or answered locally, counted), and the destination header the upstream sees names only configured
//! replicas. A trap or a violated check is a failure: the seed, index and input are written under
//! `--out` (default `target/fuzz-failures`) and the run goes on with a fresh VM.
//!
//! Usage: `fuzz [--count N] [--seed S] [--check-every N] [--out DIR] [--feed-share PERCENT]
//! [--from INDEX]` (`--help` says what each means). `--feed-share` (default 50) is the percentage
//! of inputs that are feed answers; the kind of each input follows from the counts so far, its
//! content from `(SEED, index)` alone, so
//! `--from INDEX --count 1` with `--feed-share 0` (a request) or `100` (a feed round) regenerates a
//! failure's input exactly on a fresh VM (whose state then differs from the original run's; the
//! written file holds the input itself too).

use clap::Parser;
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    CallOutcome, Callout, FilterModule, HostError, HostMode, Proxy, ProxyOptions, WorkerVm,
    filter_wasm_path, header_value,
};
use serde_json::json;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::PathBuf;
use std::time::Instant;

mod feeds;
mod requests;

use feeds::feed_input;
use requests::{RequestInput, request_input};

const REPLICAS: usize = 4;
const FEED_MAX_BYTES: usize = 256 * 1024;
const FEED_MAX_EVENTS: u32 = 64;
const DEST: &str = "x-gateway-destination-endpoint";
const CLUSTER: &str = "x-kvsteer-cluster";

fn endpoint(r: usize) -> String {
    format!("10.0.0.{}:8000", r + 1)
}

/// splitmix64: small, fast, and good enough to drive mutations.
struct Rng(u64);

impl Rng {
    fn for_input(seed: u64, index: u64) -> Rng {
        let mut r = Rng(seed ^ index.wrapping_mul(0x9e37_79b9_7f4a_7c15));
        r.next();
        r
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in `0..n` (`n > 0`).
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn chance(&mut self, percent: u64) -> bool {
        self.next() % 100 < percent
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

struct Args {
    count: u64,
    seed: u64,
    check_every: u64,
    out: PathBuf,
    feed_share: u64,
    from: u64,
}

#[derive(Parser, Debug)]
#[command(
    name = "fuzz",
    about = "Fuzz campaign of the request reader and the feed decoder through kvsteer_filter.wasm; \
             reproducible from (SEED, COUNT).",
    args_override_self = true
)]
struct Cli {
    /// Inputs to run (`_` separators allowed: 1_000_000).
    #[arg(long, value_name = "N", default_value = "100_000", value_parser = number)]
    count: u64,
    /// Seed of the input generator; an input's content follows from (SEED, index) alone.
    #[arg(long, value_name = "S", default_value_t = 17, value_parser = number)]
    seed: u64,
    /// Inputs between two checks that a plain valid request is still routed (at least 1).
    #[arg(long, value_name = "N", default_value = "1000", value_parser = number)]
    check_every: u64,
    /// Where failures are written (default: $CARGO_TARGET_DIR/fuzz-failures, else
    /// target/fuzz-failures).
    #[arg(long, value_name = "DIR")]
    out: Option<PathBuf>,
    /// Percentage of inputs that are feed answers, 0 to 100 (larger values count as 100).
    #[arg(long, value_name = "PERCENT", default_value_t = 50, value_parser = number)]
    feed_share: u64,
    /// Index of the first input (with `--count 1` regenerates one failure's input).
    #[arg(long, value_name = "INDEX", default_value_t = 0, value_parser = number)]
    from: u64,
}

/// A count with optional `_` separators.
fn number(s: &str) -> Result<u64, String> {
    s.replace('_', "")
        .parse()
        .map_err(|_| format!("{s:?} is not a number"))
}

fn parse_args() -> Args {
    let cli = Cli::parse();
    let out = cli.out.unwrap_or_else(|| {
        std::env::var_os("CARGO_TARGET_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("target"))
            .join("fuzz-failures")
    });
    Args {
        count: cli.count,
        seed: cli.seed,
        check_every: cli.check_every.max(1),
        out,
        feed_share: cli.feed_share.min(100),
        from: cli.from,
    }
}

struct Vm {
    proxy: Proxy,
    worker: WorkerVm,
    now_us: u64,
}

fn plugin_config() -> serde_json::Value {
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|i| json!({"name": format!("r{i}"), "endpoint": endpoint(i), "feed_cluster": format!("feed_r{i}")}))
        .collect();
    json!({
        "replicas": replicas,
        "routing": {"policy": "kv_load", "block_size": 16, "index_capacity_blocks": 200_000},
        "feed_period_ms": 1,
        "tick_ms": 1,
        "feed_max_bytes": FEED_MAX_BYTES,
        "feed_max_events": FEED_MAX_EVENTS,
    })
}

fn new_vm(module: &FilterModule) -> Result<Vm, String> {
    let mut opts = ProxyOptions::new(HostMode::Envoy, plugin_config().to_string());
    opts.log_level = kvsteer_host_test::LogLevel::Warn;
    opts.echo_logs = false;
    let proxy = Proxy::new(module, opts);
    let worker = proxy.start_worker().map_err(|e| e.to_string())?;
    Ok(Vm {
        proxy,
        worker,
        now_us: 0,
    })
}

#[derive(Default)]
struct Totals {
    requests: u64,
    feeds: u64,
    traps: u64,
    violations: u64,
    released: u64,
    local: u64,
    aborted: u64,
    checks: u64,
    mutations: BTreeMap<&'static str, u64>,
    feed_status: BTreeMap<u16, u64>,
    metrics: BTreeMap<String, u64>,
    vms: u64,
}

enum Failure {
    Trap(HostError),
    Violation(String),
}

impl From<HostError> for Failure {
    fn from(e: HostError) -> Self {
        Failure::Trap(e)
    }
}

fn destination_ok(value: Option<&str>) -> Result<(), String> {
    let Some(v) = value else {
        return Ok(());
    };
    for e in v.split(',') {
        let e = e.trim();
        if !(0..REPLICAS).any(|r| endpoint(r) == e) {
            return Err(format!(
                "upstream destination {v:?} names no configured replica"
            ));
        }
    }
    Ok(())
}

fn run_request(vm: &mut Vm, inp: &RequestInput, t: &mut Totals) -> Result<(), Failure> {
    let w = &mut vm.worker;
    let id = w.new_stream()?;
    let mut ended = inp.body.is_empty() && !inp.trailers;
    let mut last = w.request_headers(id, inp.headers.clone(), ended)?;
    let mut off = 0;
    let mut aborted = false;
    if !inp.body.is_empty() || inp.trailers {
        for (k, &c) in inp.chunks.iter().enumerate() {
            if inp.abort_after == Some(k) {
                aborted = true;
                break;
            }
            let eos = k + 1 == inp.chunks.len() && !inp.trailers;
            if let Some(a) = w.request_body(id, &inp.body[off..off + c], eos)? {
                last = a;
            }
            off += c;
        }
        if !aborted && inp.trailers {
            last = w.request_trailers(id, vec![(b"x-t".to_vec(), b"1".to_vec())])?;
        }
        ended = !aborted;
    }
    let _ = last;
    let s = w
        .stream(id)
        .ok_or_else(|| Failure::Violation("stream vanished".into()))?;
    let check = if ended {
        if s.local_response.is_some() {
            t.local += 1;
            Ok(())
        } else if !s.released {
            Err(format!("a complete request was never released ({last:?})"))
        } else {
            t.released += 1;
            let up = s.upstream_headers.as_ref().unwrap_or(&s.request_headers);
            destination_ok(header_value(up, DEST))
        }
    } else {
        t.aborted += 1;
        Ok(())
    };
    w.end_stream(id)?;
    check.map_err(Failure::Violation)
}

/// One round of feed polls: advance the clock a tick, tick, answer every callout with a fuzzed
/// answer. Returns the answers delivered.
fn run_feed_round(
    vm: &mut Vm,
    rng: &mut Rng,
    t: &mut Totals,
    last_input: &mut Vec<(Callout, CallOutcome, Vec<&'static str>)>,
) -> Result<u64, Failure> {
    vm.now_us += 1000;
    vm.proxy.set_now_ns(vm.now_us * 1000);
    vm.worker.tick()?;
    let calls = vm.worker.take_callouts();
    let mut n = 0;
    for call in &calls {
        let r = call
            .upstream
            .strip_prefix("feed_r")
            .and_then(|x| x.parse::<u64>().ok())
            .unwrap_or(0);
        let inp = feed_input(rng, call, 100 + r);
        for m in &inp.mutations {
            *t.mutations.entry(m).or_insert(0) += 1;
        }
        if let CallOutcome::Response { headers, .. } = &inp.outcome {
            let st = header_value(headers, ":status")
                .and_then(|s| s.parse().ok())
                .unwrap_or(0);
            *t.feed_status.entry(st).or_insert(0) += 1;
        }
        last_input.push((call.clone(), inp.outcome.clone(), inp.mutations.clone()));
        vm.worker.answer_callout(call, inp.outcome)?;
        n += 1;
    }
    Ok(n)
}

fn describe_feed(answers: &[(Callout, CallOutcome, Vec<&'static str>)]) -> String {
    let mut out = String::new();
    for (call, outcome, mutations) in answers {
        match outcome {
            CallOutcome::Response { headers, body, .. } => {
                let _ = writeln!(
                    out,
                    "feed answer to {} ({}): mutations {:?}, {} body bytes\nheaders {:?}\nbody (hex) {}",
                    call.upstream,
                    call.header(":path").unwrap_or(""),
                    mutations,
                    body.len(),
                    headers
                        .iter()
                        .map(|(k, v)| (
                            String::from_utf8_lossy(k).to_string(),
                            String::from_utf8_lossy(v).to_string()
                        ))
                        .collect::<Vec<_>>(),
                    hex(body)
                );
            }
            CallOutcome::Reset => {
                let _ = writeln!(out, "feed answer to {}: reset", call.upstream);
            }
        }
    }
    out
}

fn hex(b: &[u8]) -> String {
    let mut s = String::with_capacity(b.len() * 2);
    for x in b {
        let _ = write!(s, "{x:02x}");
    }
    s
}

fn plain_check(vm: &mut Vm) -> Result<(), Failure> {
    let body =
        br#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,16,17],"max_tokens":8}"#;
    let w = &mut vm.worker;
    let id = w.new_stream()?;
    let headers = request_headers("/v1/completions", body.len(), None, &[]);
    w.request_headers(id, headers, false)?;
    w.request_body(id, body, true)?;
    let s = w
        .stream(id)
        .ok_or_else(|| Failure::Violation("stream vanished".into()))?;
    let up = s.upstream_headers.clone();
    let released = s.released;
    w.end_stream(id)?;
    if !released {
        return Err(Failure::Violation(
            "the plain request was not released".into(),
        ));
    }
    let dest = up.as_ref().and_then(|h| header_value(h, DEST));
    if dest.is_none() {
        return Err(Failure::Violation(
            "the plain request has no destination".into(),
        ));
    }
    destination_ok(dest).map_err(Failure::Violation)?;
    if !vm.worker.notes().is_empty() {
        return Err(Failure::Violation(format!(
            "ABI misuse: {:?}",
            vm.worker.notes()
        )));
    }
    Ok(())
}

fn add_metrics(vm: &Vm, t: &mut Totals) {
    for m in vm.proxy.metrics() {
        let key = if m.name.starts_with("kvsteer_feed_errors_") {
            "kvsteer_feed_errors (all replicas)".to_string()
        } else if m.name.starts_with("kvsteer_feed_oversized_") {
            "kvsteer_feed_oversized (all replicas)".to_string()
        } else if m.name.starts_with("kvsteer_feed_timeouts_") {
            "kvsteer_feed_timeouts (all replicas)".to_string()
        } else if [
            "kvsteer_fallbacks",
            "kvsteer_requests_routed",
            "kvsteer_spoofed_headers_removed",
            "kvsteer_feed_resets",
            "kvsteer_release_anomalies",
            "kvsteer_early_scan_bodies",
            "kvsteer_early_scan_declined",
        ]
        .contains(&m.name.as_str())
        {
            m.name.clone()
        } else {
            continue;
        };
        *t.metrics.entry(key).or_insert(0) += m.value.max(0) as u64;
    }
}

fn write_failure(
    args: &Args,
    index: u64,
    what: &str,
    input: &str,
    body: Option<&[u8]>,
) -> Result<PathBuf, String> {
    std::fs::create_dir_all(&args.out).map_err(|e| e.to_string())?;
    let base = args.out.join(format!("seed{}-input{index}", args.seed));
    let txt = base.with_extension("txt");
    std::fs::write(
        &txt,
        format!(
            "seed {} index {index}\nreplay: fuzz --seed {} --from {index} --count 1\n{what}\n\n{input}\n",
            args.seed, args.seed
        ),
    )
    .map_err(|e| e.to_string())?;
    if let Some(b) = body {
        std::fs::write(base.with_extension("body"), b).map_err(|e| e.to_string())?;
    }
    Ok(txt)
}

fn describe_request(inp: &RequestInput) -> String {
    format!(
        "request {} mutations {:?} chunks {:?} trailers {} abort_after {:?}\nheaders {:?}",
        inp.path,
        inp.mutations,
        inp.chunks,
        inp.trailers,
        inp.abort_after,
        inp.headers
            .iter()
            .map(|(k, v)| (
                String::from_utf8_lossy(k).to_string(),
                String::from_utf8_lossy(v).to_string()
            ))
            .collect::<Vec<_>>()
    )
}

fn main() {
    match run() {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("fuzz: {e}");
            std::process::exit(2);
        }
    }
}

fn run() -> Result<bool, String> {
    let args = parse_args();
    let path = filter_wasm_path()?;
    let module = FilterModule::load(&path).map_err(|e| e.to_string())?;
    println!(
        "fuzz: {} ({:.0} KB), seed {}, {} inputs from index {}, {}% feed answers, check every {}",
        path.display(),
        module.size() as f64 / 1024.0,
        args.seed,
        args.count,
        args.from,
        args.feed_share,
        args.check_every
    );
    let mut vm = new_vm(&module)?;
    let mut t = Totals {
        vms: 1,
        ..Default::default()
    };
    let start = Instant::now();
    let mut last_report = Instant::now();
    let mut failures: Vec<String> = Vec::new();
    let mut index = args.from;
    let end = args.from + args.count;
    let mut next_check = args.from + args.check_every;
    while index < end {
        let before = index;
        let (input, mut result) = next_input(&mut vm, &args, &mut t, &mut index);
        let mut note = "";
        if result.is_ok() && index >= next_check {
            next_check = index + args.check_every;
            t.checks += 1;
            result = plain_check(&mut vm);
            if result.is_err() {
                note = "(the plain-request check after this input failed)\n";
            }
        }
        if let Err(f) = result {
            let line = record_failure(&args, before, f, note, &input, &mut t)?;
            println!("{line}");
            failures.push(line);
            add_metrics(&vm, &mut t);
            vm = new_vm(&module)?;
            t.vms += 1;
        }
        if last_report.elapsed().as_secs() >= 10 {
            last_report = Instant::now();
            let done = index - args.from;
            println!(
                "  {done} inputs ({} requests, {} feed answers), {} traps, {} violations, {:.0} inputs/s",
                t.requests,
                t.feeds,
                t.traps,
                t.violations,
                done as f64 / start.elapsed().as_secs_f64()
            );
        }
    }
    // A last check, then the filter's own counters.
    if let Err(f) = plain_check(&mut vm) {
        let what = match f {
            Failure::Trap(e) => format!("TRAP in the final check: {e}"),
            Failure::Violation(v) => format!("VIOLATION in the final check: {v}"),
        };
        println!("{what}");
        failures.push(what);
        t.violations += 1;
    }
    add_metrics(&vm, &mut t);
    print_totals(&args, &t, start.elapsed().as_secs_f64(), &failures);
    Ok(failures.is_empty())
}

/// One input as it was run, kept to describe it if it failed: a request, or a feed round's answers.
struct Input {
    request: Option<RequestInput>,
    answers: Vec<(Callout, CallOutcome, Vec<&'static str>)>,
}

/// Runs the input at `index`, a feed round or a request body, and moves `index` past it.
fn next_input(
    vm: &mut Vm,
    args: &Args,
    t: &mut Totals,
    index: &mut u64,
) -> (Input, Result<(), Failure>) {
    let mut rng = Rng::for_input(args.seed, *index);
    // Keep the kinds at `feed_share` percent of the inputs (a feed round answers every replica
    // the filter polled, usually all four).
    let feed =
        t.feeds * (100 - args.feed_share) < t.requests * args.feed_share || args.feed_share == 100;
    let mut input = Input {
        request: None,
        answers: Vec::new(),
    };
    let result = if feed {
        let result = run_feed_round(vm, &mut rng, t, &mut input.answers);
        let n = *result.as_ref().unwrap_or(&1);
        t.feeds += n;
        *index += n.max(1);
        result.map(|_| ())
    } else {
        let inp = request_input(&mut rng);
        for m in &inp.mutations {
            *t.mutations.entry(m).or_insert(0) += 1;
        }
        let result = run_request(vm, &inp, t);
        input.request = Some(inp);
        t.requests += 1;
        *index += 1;
        result
    };
    (input, result)
}

/// Counts a failure and writes its input under `--out`; returns the line that names it.
fn record_failure(
    args: &Args,
    index: u64,
    f: Failure,
    note: &str,
    input: &Input,
    t: &mut Totals,
) -> Result<String, String> {
    let (what, trap) = match &f {
        Failure::Trap(e) => (format!("TRAP: {e}"), true),
        Failure::Violation(v) => (format!("VIOLATION: {v}"), false),
    };
    if trap {
        t.traps += 1;
    } else {
        t.violations += 1;
    }
    let descr = match &input.request {
        Some(r) => format!(
            "kind: request body (replay with --feed-share 0)\n{}",
            describe_request(r)
        ),
        None => format!(
            "kind: feed round (replay with --feed-share 100; the cause may be an earlier \
             round's answer, still being applied)\n{}",
            describe_feed(&input.answers)
        ),
    };
    let file = write_failure(
        args,
        index,
        &what,
        &format!("{note}{descr}"),
        input.request.as_ref().map(|r| r.body.as_slice()),
    )?;
    Ok(format!(
        "input {index} (seed {}): {} -> {}",
        args.seed,
        what.lines().next().unwrap_or(""),
        file.display()
    ))
}

/// The run's table, what the requests and feed answers did, and the failures.
fn print_totals(args: &Args, t: &Totals, secs: f64, failures: &[String]) {
    let total = t.requests + t.feeds;
    println!();
    println!(
        "| seed | inputs | request bodies | feed answers | traps | violations | plain checks | VMs | wall s | inputs/s |"
    );
    println!("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|");
    println!(
        "| {} | {total} | {} | {} | {} | {} | {} | {} | {secs:.0} | {:.0} |",
        args.seed,
        t.requests,
        t.feeds,
        t.traps,
        t.violations,
        t.checks,
        t.vms,
        total as f64 / secs
    );
    println!();
    println!(
        "requests that ended: {} released, {} answered locally; {} aborted mid-body",
        t.released, t.local, t.aborted
    );
    println!("feed answers by status: {:?}", t.feed_status);
    println!("the filter's counters (summed over the VMs):");
    for (k, v) in &t.metrics {
        println!("  {k}: {v}");
    }
    println!("mutations applied:");
    for (k, v) in &t.mutations {
        println!("  {k}: {v}");
    }
    if !failures.is_empty() {
        println!("{} failures:", failures.len());
        for f in failures {
            println!("  {f}");
        }
    }
}
