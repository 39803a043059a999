//! `kvsteer-check`: judges a plugin configuration with the filter's own configure path before it is
//! deployed. The filter refuses a bad configuration in `on_configure`, and Envoy then refuses the
//! whole bootstrap whatever the wasm `failure_policy` says (an ECDS or Istio push is rejected
//! instead): finding out at deploy time is too late, so this runs the same code natively.
//!
//! Exit codes: 0 every configuration found is accepted, 1 one is refused, 2 the input cannot be
//! read or holds no plugin configuration.

mod extract;

use clap::Parser;
use extract::{Format, Found};
use kvsteer_filter::WorkerState;
use kvsteer_filter::config::GatewayConfig;
use serde_json::json;
use std::io::Read;
use std::process::ExitCode;

/// Check a kvsteer plugin configuration with the filter's own parser (what `on_configure` runs).
#[derive(Parser, Debug)]
#[command(name = "kvsteer-check", version)]
struct Args {
    /// The file to read; `-` or none: standard input.
    file: Option<String>,
    /// What the input is. auto: a YAML/JSON document with Envoy bootstrap or Kubernetes keys is a
    /// manifest, a file with a `proxy_wasm` directive is nginx.conf, anything else is the plugin
    /// configuration itself.
    #[arg(long, value_enum, default_value = "auto")]
    from: Format,
    /// One JSON object on standard output instead of lines.
    #[arg(long)]
    json: bool,
}

/// The filter's verdict on one configuration.
enum Verdict {
    Ok {
        /// Static routing units (`replicas`, DP ranks expanded).
        replicas: usize,
        /// Slots for members read at run time (`discovery.max_members`; 0 without discovery).
        slots: usize,
        policy: &'static str,
        warnings: Vec<String>,
        /// With `pools`: each pool's name, models, static units, slots and policy.
        pools: Vec<PoolReport>,
    },
    Refused(String),
}

/// One pool of a configuration with `pools`, as the verdict lists it.
struct PoolReport {
    name: String,
    models: Vec<String>,
    replicas: usize,
    slots: usize,
    policy: &'static str,
}

/// Exactly the steps of `on_configure` that can refuse (the rest are host calls that cannot): the
/// parser with its validation, then the router state, which also refuses routing and tokenizer
/// settings the parser lets through. Where the bootstrap's clusters are known (`clusters`), a
/// configuration that names a cluster the bootstrap lacks is refused too: the filter accepts it,
/// but every callout to that cluster fails, so a feed, a tokenizer bundle or a peer never arrives
/// and the filter routes without it, which nothing at deploy time would show.
fn judge(bytes: &[u8], clusters: Option<&[String]>) -> Verdict {
    let gateway = match GatewayConfig::from_json(bytes) {
        Ok(g) => g,
        Err(e) => return Verdict::Refused(e.to_string()),
    };
    let mut states = Vec::new();
    for p in &gateway.pools {
        match WorkerState::new(p.cfg.clone()) {
            Ok(s) => states.push(s),
            Err(e) => {
                return Verdict::Refused(match &p.name {
                    Some(n) => format!("pool {n}: {e}"),
                    None => e.to_string(),
                });
            }
        }
    }
    if let Some(known) = clusters {
        let mut named = Vec::new();
        if let Ok(v) = serde_json::from_slice::<serde_json::Value>(bytes) {
            cluster_references(&v, "", &mut named);
        }
        let missing: Vec<String> = named
            .into_iter()
            .filter(|(_, c)| !known.contains(c))
            .map(|(at, c)| format!("{at} names cluster {c:?}"))
            .collect();
        if !missing.is_empty() {
            return Verdict::Refused(format!(
                "{}, which the bootstrap does not define: callouts to it would fail",
                missing.join("; ")
            ));
        }
    }
    let report = |s: &WorkerState| {
        (
            s.config().static_units(),
            s.replicas() - s.config().static_units(),
            s.config().routing.policy.name(),
        )
    };
    let pools = if gateway.pooled() {
        gateway
            .pools
            .iter()
            .zip(&states)
            .map(|(p, s)| {
                let (replicas, slots, policy) = report(s);
                PoolReport {
                    name: p.name.clone().unwrap_or_default(),
                    models: p.models.clone(),
                    replicas,
                    slots,
                    policy,
                }
            })
            .collect()
    } else {
        Vec::new()
    };
    let (_, _, policy) = report(&states[0]);
    Verdict::Ok {
        replicas: states.iter().map(|s| report(s).0).sum(),
        slots: states.iter().map(|s| report(s).1).sum(),
        policy,
        warnings: gateway.warnings(),
        pools,
    }
}

/// Every cluster the configuration names, with where: the values of the keys `cluster` and
/// `*_cluster` (a replica's `feed_cluster`, P/D's `prefill_cluster`, discovery's, a peer's, the
/// tokenizer bundle's `cluster`). `cluster_header` is a header's name, not a cluster.
fn cluster_references(v: &serde_json::Value, at: &str, out: &mut Vec<(String, String)>) {
    match v {
        serde_json::Value::Object(m) => {
            for (k, child) in m {
                let here = if at.is_empty() {
                    k.clone()
                } else {
                    format!("{at}.{k}")
                };
                match child {
                    serde_json::Value::String(s) if k == "cluster" || k.ends_with("_cluster") => {
                        out.push((here, s.clone()))
                    }
                    _ => cluster_references(child, &here, out),
                }
            }
        }
        serde_json::Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                cluster_references(child, &format!("{at}[{i}]"), out);
            }
        }
        _ => {}
    }
}

fn read(file: Option<&str>) -> Result<Vec<u8>, String> {
    match file {
        None | Some("-") => {
            let mut bytes = Vec::new();
            std::io::stdin()
                .read_to_end(&mut bytes)
                .map_err(|e| format!("standard input: {e}"))?;
            Ok(bytes)
        }
        Some(path) => std::fs::read(path).map_err(|e| e.to_string()),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let name = args.file.as_deref().unwrap_or("-");
    let found = match read(args.file.as_deref()).and_then(|b| extract::extract(&b, args.from)) {
        Ok(f) => f,
        Err(e) => {
            if args.json {
                println!("{}", json!({"ok": false, "unreadable": e}));
            } else {
                eprintln!("kvsteer-check: {name}: {e}");
            }
            return ExitCode::from(2);
        }
    };
    let mut all_ok = true;
    let mut reports = Vec::new();
    for Found {
        place,
        bytes,
        clusters,
    } in found
    {
        let verdict = judge(&bytes, clusters.as_deref());
        all_ok &= matches!(verdict, Verdict::Ok { .. });
        if args.json {
            reports.push(match verdict {
                Verdict::Ok {
                    replicas,
                    slots,
                    policy,
                    warnings,
                    pools,
                } => {
                    let mut r = json!({"place": place, "ok": true, "replicas": replicas,
                            "discovery_slots": slots, "policy": policy,
                            "warnings": warnings});
                    if !pools.is_empty() {
                        r["pools"] = pools
                            .iter()
                            .map(|p| {
                                json!({"name": p.name, "models": p.models,
                                "replicas": p.replicas, "discovery_slots": p.slots,
                                "policy": p.policy})
                            })
                            .collect();
                    }
                    r
                }
                Verdict::Refused(e) => json!({"place": place, "ok": false, "error": e}),
            });
            continue;
        }
        let prefix = place.map(|p| format!("{p}: ")).unwrap_or_default();
        print_verdict(&prefix, verdict);
    }
    if args.json {
        println!("{}", json!({"ok": all_ok, "configs": reports}));
    }
    if all_ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::from(1)
    }
}

/// The verdict on one configuration as lines, each starting with `prefix` (where it was found).
fn print_verdict(prefix: &str, verdict: Verdict) {
    match verdict {
        Verdict::Ok {
            replicas,
            slots,
            policy,
            warnings,
            pools,
        } => {
            if !pools.is_empty() {
                println!(
                    "{prefix}ok: {} pools, {replicas} replicas and {slots} discovery slots in all",
                    pools.len()
                );
                for p in &pools {
                    println!(
                        "{prefix}pool {}: models {}; {} replicas, {} discovery slots, policy {}",
                        p.name,
                        if p.models.is_empty() {
                            "(default only)".to_string()
                        } else {
                            p.models.join(", ")
                        },
                        p.replicas,
                        p.slots,
                        p.policy
                    );
                }
            } else if slots == 0 {
                println!("{prefix}ok: {replicas} replicas, policy {policy}");
            } else {
                println!(
                    "{prefix}ok: {replicas} replicas and {slots} discovery slots, policy {policy}"
                );
            }
            for w in warnings {
                println!("{prefix}warning: {w}");
            }
        }
        Verdict::Refused(e) => println!("{prefix}refused: {e}"),
    }
}
