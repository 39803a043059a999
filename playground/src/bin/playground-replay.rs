//! The playground's replay, natively: the same code the page runs (`kvsteer_playground::replay`),
//! for checking the page's numbers (`scripts/test-playground`) and for trying a configuration from a
//! terminal.
//!
//! `playground-replay REQUEST.json [TRACE_FILE]` prints the result as JSON. REQUEST.json holds one
//! `ReplayRequest` or a list of them (one per policy); the output is then a list of results.

use clap::Parser;
use kvsteer_playground::replay::{ReplayRequest, run};
use serde_json::Value;
use std::path::PathBuf;

#[derive(Parser, Debug)]
#[command(
    name = "playground-replay",
    about = "The browser playground's replay run natively; prints the result as JSON."
)]
struct Cli {
    /// One `ReplayRequest` as JSON, or a list of them (one per policy; the output is then a list).
    #[arg(value_name = "REQUEST.json")]
    request: PathBuf,
    /// The trace text the trace-based workloads (coding-agent, Mooncake slices) read (default: none).
    #[arg(value_name = "TRACE_FILE")]
    trace: Option<PathBuf>,
}

fn main() {
    if let Err(e) = real_main() {
        eprintln!("playground-replay: {e}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<(), String> {
    let cli = Cli::parse();
    let req_path = cli.request.display();
    let text = std::fs::read_to_string(&cli.request).map_err(|e| format!("{req_path}: {e}"))?;
    let trace = match &cli.trace {
        Some(p) => std::fs::read_to_string(p).map_err(|e| format!("{}: {e}", p.display()))?,
        None => String::new(),
    };
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{req_path}: {e}"))?;
    let out = match v {
        Value::Array(items) => {
            let mut results = Vec::new();
            for item in items {
                let req: ReplayRequest = serde_json::from_value(item).map_err(|e| e.to_string())?;
                results.push(serde_json::to_value(run(&req, &trace)?).map_err(|e| e.to_string())?);
            }
            Value::Array(results)
        }
        item => {
            let req: ReplayRequest = serde_json::from_value(item).map_err(|e| e.to_string())?;
            serde_json::to_value(run(&req, &trace)?).map_err(|e| e.to_string())?
        }
    };
    println!("{out}");
    Ok(())
}
