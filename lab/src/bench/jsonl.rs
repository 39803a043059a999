//! Replays that append one JSON line each to a file as they finish, so that a run of many minutes
//! can be read while it goes and resumed where it stopped (`model-eval`, `fleet-bench`).

use std::collections::HashSet;
use std::io::Write;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A replay's identity in the output: `(cell, policy, seed)`.
pub type Key = (String, String, u64);

/// The replays already in `out` (none when it does not exist), so a resumed run skips them.
pub fn done(out: &Path) -> HashSet<Key> {
    std::fs::read_to_string(out)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            Some((
                v["cell"].as_str()?.to_string(),
                v["policy"].as_str()?.to_string(),
                v["seed"].as_u64()?,
            ))
        })
        .collect()
}

/// The replays still to run, `(cell index, policy, seed)`, seed-major (a run cut short has every
/// cell at its first seeds): every cell of `ids` under every policy for seeds `0..seeds`, less those
/// already in `out`.
pub fn pending(
    ids: &[&str],
    policies: &[String],
    seeds: u64,
    out: &Path,
) -> Vec<(usize, String, u64)> {
    let done = done(out);
    let mut work = Vec::new();
    for seed in 0..seeds {
        for (i, id) in ids.iter().enumerate() {
            for p in policies {
                if !done.contains(&(id.to_string(), p.clone(), seed)) {
                    work.push((i, p.clone(), seed));
                }
            }
        }
    }
    work
}

/// Runs `work` on `jobs` threads, after a line `NAME: WHAT: N replays to run` on stderr; each
/// item's `run` returns its JSON line and a progress message, printed on stderr as `[i/total]
/// message (seconds)`, and the line gets the replay's wall time as `wall_s`; failures are printed
/// the same way. Returns how many failed, or the error opening `out`.
pub fn run_all<T: Sync>(
    name: &str,
    what: &str,
    out: &Path,
    jobs: u64,
    work: &[T],
    run: impl Fn(&T) -> Result<(serde_json::Value, String), String> + Sync,
) -> Result<usize, String> {
    eprintln!("{name}: {what}: {} replays to run", work.len());
    if let Some(dir) = out.parent() {
        let _ = std::fs::create_dir_all(dir);
    }
    let file = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(out)
        .map_err(|e| format!("{}: {e}", out.display()))?;
    let file = Mutex::new(file);
    let total = work.len();
    let next = AtomicUsize::new(0);
    let failed = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..jobs.max(1) {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = work.get(i) else {
                        break;
                    };
                    let started = std::time::Instant::now();
                    match run(item) {
                        Ok((mut v, msg)) => {
                            let wall_s = started.elapsed().as_secs_f64();
                            v["wall_s"] = serde_json::json!((wall_s * 100.0).round() / 100.0);
                            if let Ok(mut f) = file.lock() {
                                let _ = f.write_all(format!("{v}\n").as_bytes());
                            }
                            eprintln!("[{}/{total}] {msg} ({wall_s:.1} s)", i + 1);
                        }
                        Err(e) => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            eprintln!("[{}/{total}] {e}", i + 1);
                        }
                    }
                }
            });
        }
    });
    Ok(failed.into_inner())
}

/// Writes one replay's request rows to `DIR/<cell>.<policy>.<seed>.jsonl`; a failure is reported
/// and the replay's figures kept.
pub fn write_requests(dir: &Path, cell: &str, policy: &str, seed: u64, rows: &[serde_json::Value]) {
    let path = dir.join(format!(
        "{cell}.{}.{seed}.jsonl",
        policy.replace(['/', '@', '#', '='], "_")
    ));
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    if let Err(e) = std::fs::create_dir_all(dir).and_then(|_| std::fs::write(&path, text)) {
        eprintln!("{}: {e}", path.display());
    }
}
