//! A smoke run of the fuzz campaign (`scripts/fuzz` runs the full count): the `fuzz` binary
//! pushes 20,000 mutated request bodies and feed answers (2,000 in a debug build) through the compiled
//! filter and must report no trap and no broken check, and the inputs must have reached the reader
//! and the feed decoder (the filter counted fallbacks for unreadable bodies and errors for malformed
//! feed answers).

use std::process::Command;

fn counter(out: &str, name: &str) -> u64 {
    out.lines()
        .find_map(|l| l.trim().strip_prefix(&format!("{name}: ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in the summary:\n{out}"))
}

#[test]
fn twenty_thousand_fuzz_inputs_never_trap_the_filter() {
    let count = if cfg!(debug_assertions) {
        2_000
    } else {
        20_000
    };
    let dir = std::env::temp_dir().join(format!("kvsteer-fuzz-smoke-{}", std::process::id()));
    let out = Command::new(env!("CARGO_BIN_EXE_fuzz"))
        .args([
            "--count",
            &count.to_string(),
            "--seed",
            "5",
            "--check-every",
            "200",
        ])
        .arg("--out")
        .arg(&dir)
        .output()
        .expect("the fuzz binary runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "fuzz failed ({}):\n{stdout}\n{stderr}",
        out.status
    );
    // The summary row: | seed | inputs | request bodies | feed answers | traps | violations | checks | ...
    let row: Vec<&str> = stdout
        .lines()
        .find(|l| l.starts_with("| 5 |"))
        .unwrap_or_else(|| panic!("no summary row:\n{stdout}"))
        .split('|')
        .map(str::trim)
        .collect();
    let n = |i: usize| row[i].parse::<u64>().unwrap();
    assert!(n(2) >= count, "inputs {}", n(2));
    assert!(n(3) > count / 3 && n(4) > count / 3, "kinds {row:?}");
    assert_eq!((n(5), n(6)), (0, 0), "traps, violations:\n{stdout}");
    assert!(n(7) >= count / 200 - 1, "plain checks {}", n(7));
    assert!(counter(&stdout, "kvsteer_fallbacks") > 0);
    assert!(counter(&stdout, "kvsteer_requests_routed") > 0);
    assert!(counter(&stdout, "kvsteer_feed_errors (all replicas)") > 0);
    assert!(counter(&stdout, "kvsteer_spoofed_headers_removed") > 0);
    assert!(
        !dir.exists(),
        "failure files were written to {}",
        dir.display()
    );
}
