//! README.md and the reports (docs/reports/*.md) call one policy "the default": the one
//! `RoutingConfig::default()` picks. When the default changes in the code, every sentence that still
//! names the old one as the default fails here, so the prose cannot go on describing an older build.
//!
//! A claim is a policy name (`` `kv_time` ``, `**kv_time**`, ``**`kv_time`**``) directly followed by
//! "(the default)", "(the default: ...", "(the default since ...", ", the default," or "is the
//! default" / "is kvsteer's default", or directly preceded by "the default, " or "kvsteer's default, ".
//! History says so ("the default then", "stays the default", "becomes the default") and is not a
//! claim.

use kvsteer_core::{PolicyKind, RoutingConfig};
use std::path::{Path, PathBuf};

fn policy_names() -> Vec<&'static str> {
    let mut names: Vec<&'static str> = PolicyKind::ALL.iter().map(|p| p.name()).collect();
    names.push(PolicyKind::AdapterAffinity.name());
    names
}

/// What may follow a name for the text to claim it is the default.
const AFTER: [&str; 7] = [
    " (the default)",
    " (the default:",
    " (the default,",
    " (the default since",
    ", the default,",
    " is the default",
    " is kvsteer's default",
];

/// What may come right before a name for the text to claim it is the default.
const BEFORE: [&str; 2] = ["the default, ", "kvsteer's default, "];

/// Words after "the default" that make it history rather than a claim about the code.
const HISTORY: [&str; 4] = [" then", " before", " until", " at the time"];

/// `(line, policy)` of every claim in `text`. Line breaks count as spaces, so a claim wrapped over
/// two lines is still found.
fn claims(text: &str) -> Vec<(usize, &'static str)> {
    let flat = text.replace('\n', " ");
    let line_of = |offset: usize| text[..offset].matches('\n').count() + 1;
    let mut found = Vec::new();
    for name in policy_names() {
        for form in [
            format!("`{name}`"),
            format!("**{name}**"),
            format!("**`{name}`**"),
        ] {
            for (at, _) in flat.match_indices(&form) {
                let rest = &flat[at + form.len()..];
                let before = &flat[..at];
                let after = AFTER
                    .iter()
                    .find(|a| rest.starts_with(*a))
                    .is_some_and(|a| {
                        !HISTORY
                            .iter()
                            .any(|h| rest[a.len()..].starts_with(h.trim_end()))
                    });
                if after || BEFORE.iter().any(|b| before.ends_with(b)) {
                    found.push((line_of(at), name));
                }
            }
        }
    }
    found.sort();
    found.dedup();
    found
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

fn documents() -> Vec<PathBuf> {
    let mut files = vec![root().join("README.md")];
    let reports = root().join("docs/reports");
    let mut md: Vec<PathBuf> = std::fs::read_dir(&reports)
        .expect("docs/reports")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "md"))
        .collect();
    md.sort();
    files.extend(md);
    files
}

#[test]
fn the_docs_call_the_codes_default_policy_the_default() {
    let default = RoutingConfig::default().policy.name();
    let mut wrong = Vec::new();
    let mut in_readme = 0;
    for path in documents() {
        let text = std::fs::read_to_string(&path).expect("readable");
        let shown = path
            .strip_prefix(root())
            .unwrap_or(&path)
            .display()
            .to_string();
        for (line, name) in claims(&text) {
            if name == default {
                in_readme += usize::from(shown == "README.md");
            } else {
                wrong.push(format!("{shown}:{line}: calls {name} the default"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "the code's default policy is {default}; fix these sentences (or say \"the default then\"):\n{}",
        wrong.join("\n")
    );
    assert!(
        in_readme > 0,
        "README.md no longer calls {default} the default in a form this test reads: update the test"
    );
}

#[test]
fn claims_are_told_from_history() {
    let text = "`kv_time` (the default) and **kv_load** (the default then); the default, `kv_time`,\n\
                `session_hash`, the default, and `round_robin` stays the default; `kv_time`, the\n\
                default, wraps; `least_load` is kvsteer's default.";
    assert_eq!(
        claims(text),
        vec![
            (1, "kv_time"),
            (2, "kv_time"),
            (2, "session_hash"),
            (3, "least_load"),
        ]
    );
}
