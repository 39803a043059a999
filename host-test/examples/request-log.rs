//! One replay of a bench scenario, written out request by request, for looking into *why* a policy
//! gets the figures it gets (which replica each turn of a session went to, what it found cached, how
//! long its first token took).
//!
//! `cargo run --release -p kvsteer-host-test --example request-log -- weka-c24 kv_load [seed] > log.tsv`
//!
//! Columns: request id, session, issue time (s), replica, prompt tokens, cached tokens, TTFT (ms),
//! whether the session's previous turn went to another replica.

use kvsteer_host_test::bench::run::config;
use kvsteer_host_test::bench::scenario::{Scale, matrix};
use kvsteer_host_test::{FilterModule, Harness, filter_wasm_path};
use kvsteer_workload::Driver;
use std::collections::HashMap;
use std::path::Path;

fn main() -> Result<(), String> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(id), Some(policy)) = (args.first(), args.get(1)) else {
        return Err("usage: request-log SCENARIO POLICY [SEED]".into());
    };
    let seed: u64 = args
        .get(2)
        .map_or(Ok(0), |s| s.parse())
        .map_err(|e| format!("seed: {e}"))?;
    let sc = matrix(Scale::Full)
        .into_iter()
        .find(|s| s.id == *id)
        .ok_or_else(|| format!("no scenario {id}"))?;
    let traces = Path::new(env!("CARGO_MANIFEST_DIR")).join("../traces");
    let (workload, mode) = sc.build(&traces, seed)?;
    let module = FilterModule::load_unmetered(&filter_wasm_path()?).map_err(|e| e.to_string())?;
    let cfg = config(policy, workload.block_size, seed, 2);
    let header = cfg.session_header.clone();
    let mut h = Harness::new(&module, cfg).map_err(|e| e.to_string())?;
    h.run_workload(Driver::new(workload, mode), |_, _| {})
        .map_err(|e| e.to_string())?;
    let mut records: Vec<_> = h.records().collect();
    records.sort_by_key(|r| (r.issued_us, r.id));
    let mut last: HashMap<String, usize> = HashMap::new();
    println!("id\tsession\tissued_s\treplica\tprompt\tcached\tttft_ms\tmoved");
    for r in records {
        let (Some(replica), Some(first)) = (r.replica, r.first_token_us) else {
            continue;
        };
        let session = r.upstream_header(&header).unwrap_or("-").to_string();
        let moved = last
            .insert(session.clone(), replica)
            .is_some_and(|p| p != replica);
        println!(
            "{}\t{}\t{:.3}\t{}\t{}\t{}\t{:.1}\t{}",
            r.id,
            session,
            r.issued_us as f64 / 1e6,
            replica,
            r.prompt_tokens,
            r.cached_tokens,
            (first - r.issued_us) as f64 / 1e3,
            u8::from(moved)
        );
    }
    Ok(())
}
