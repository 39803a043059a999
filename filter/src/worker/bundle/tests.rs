use super::*;
use crate::config::FilterConfig;
use kvsteer_tokenizer::fetch::sha256_hex;

const TOKENIZER_JSON: &str = r#"{"model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "ab": 2},
    "merges": ["a b"]}, "pre_tokenizer": {"type": "ByteLevel", "use_regex": true}}"#;

fn body(model: Option<&str>) -> Vec<u8> {
    kvsteer_core::bundle::encode(model, TOKENIZER_JSON.as_bytes(), None)
}

fn config(fetch: serde_json::Value) -> Result<WorkerState, String> {
    let cfg = serde_json::json!({
        "replicas": [{"name": "r0", "endpoint": "127.0.0.1:8000", "feed_cluster": "f0"}],
        "tokenizer": {"huggingface": {"fetch": fetch},
            "chat_template_jinja": "{{ messages[0].content }}"}
    });
    let cfg = FilterConfig::from_json(cfg.to_string().as_bytes()).map_err(|e| e.to_string())?;
    WorkerState::new(cfg).map_err(|e| e.to_string())
}

fn state(sha: &str, model: Option<&str>) -> WorkerState {
    config(serde_json::json!({"cluster": "tok", "sha256": sha, "model": model})).unwrap()
}

/// A fetch goes out on the first tick, the checked bundle loads and text prompts get the exact
/// identity from then on; nothing more is fetched.
#[test]
fn a_good_bundle_is_fetched_once_and_loaded() {
    let b = body(Some("m"));
    let mut s = state(&sha256_hex(&b), Some("m"));
    assert!(!s.tokenizer_ready());
    let req = s.plan_bundle_fetch(0).unwrap();
    assert_eq!(
        (
            req.upstream.as_str(),
            req.authority.as_str(),
            req.path.as_str()
        ),
        ("tok", "tok", "/kvsteer/tokenizer")
    );
    s.bundle_fetch_started(7, 0);
    assert!(s.is_bundle_fetch(7) && !s.is_bundle_fetch(8));
    assert_eq!(s.plan_bundle_fetch(100), None);
    let out = s.on_bundle_answer(Some(200), b.len(), Some(&b), 150);
    assert!(
        matches!(&out, BundleOutcome::Loaded { model: Some(m), .. } if m == "m"),
        "{out:?}"
    );
    assert!(s.tokenizer_ready());
    assert!(!s.is_bundle_fetch(7));
    assert_eq!(s.plan_bundle_fetch(1_000_000), None);
    assert_eq!(s.bundle_fetch_counts(), Some((1, 0, 0)));
}

/// Oversized, wrong digest, another model, files that do not load: each is refused naming why, the
/// tokenizer stays unloaded, and the next fetch waits 80-120% of a wait that doubles up to the cap.
#[test]
fn bad_bundles_are_refused_and_retried_with_backoff() {
    let b = body(Some("m"));
    let bad_files = kvsteer_core::bundle::encode(None, b"{\"model\": 1}", None);
    let cases: [(WorkerState, Option<&[u8]>, usize, &str); 4] = [
        (
            state(&sha256_hex(&b), None),
            None,
            64 << 20,
            "over fetch.max_bytes",
        ),
        (
            state(&"0".repeat(64), None),
            Some(&b),
            b.len(),
            "digest mismatch",
        ),
        (
            state(&sha256_hex(&b), Some("n")),
            Some(&b),
            b.len(),
            "model mismatch",
        ),
        (
            state(&sha256_hex(&bad_files), None),
            Some(&bad_files),
            bad_files.len(),
            "do not load",
        ),
    ];
    for (mut s, answer, size, why) in cases {
        let mut now = 0;
        let mut waits = Vec::new();
        for _ in 0..9 {
            let Some(_) = s.plan_bundle_fetch(now) else {
                panic!("{why}: no fetch due at {now}")
            };
            s.bundle_fetch_started(1, now);
            match s.on_bundle_answer(Some(200), size, answer, now) {
                BundleOutcome::Refused {
                    why: w,
                    retry_in_ms,
                } => {
                    assert!(w.contains(why), "{w}");
                    assert_eq!(s.plan_bundle_fetch(now + retry_in_ms - 1), None);
                    waits.push(retry_in_ms);
                    now += retry_in_ms;
                }
                other => panic!("{why}: {other:?}"),
            }
            assert!(!s.tokenizer_ready());
        }
        // 1 s doubling to the 60 s cap, each jittered within 80-120%.
        let base = [1, 2, 4, 8, 16, 32, 60, 60, 60];
        for (w, b) in waits.iter().zip(base) {
            assert!((b * 800..=b * 1200).contains(w), "{why}: {waits:?}");
        }
        assert_eq!(s.bundle_fetch_counts(), Some((9, 9, 0)));
    }
}

/// No answer, an error status, a fetch the proxy would not send, a callout never answered: failures,
/// not refusals, retried the same way.
#[test]
fn fetches_that_get_no_bundle_are_failures() {
    let mut s = state(&"a".repeat(64), None);
    s.plan_bundle_fetch(0).unwrap();
    s.bundle_fetch_started(1, 0);
    let out = s.on_bundle_answer(Some(503), 10, Some(b"0123456789"), 10);
    assert!(matches!(out, BundleOutcome::Failed { ref why, .. } if why.contains("503")));
    let out = s.bundle_fetch_not_started("BadArgument", 5_000);
    assert!(matches!(out, BundleOutcome::Failed { ref why, .. } if why.contains("BadArgument")));
    s.plan_bundle_fetch(60_000).unwrap();
    s.bundle_fetch_started(2, 60_000);
    // Never answered: given up after twice the 10 s timeout.
    assert_eq!(s.plan_bundle_fetch(79_999), None);
    assert!(s.is_bundle_fetch(2));
    assert_eq!(s.plan_bundle_fetch(80_000), None);
    assert!(!s.is_bundle_fetch(2));
    assert_eq!(s.bundle_fetch_counts(), Some((3, 0, 3)));
}

/// The section is checked when the configuration is given, not when the bundle arrives.
#[test]
fn a_bad_fetch_section_refuses_the_configuration_by_name() {
    let e = config(serde_json::json!({"cluster": "tok", "sha256": "abc"}))
        .err()
        .unwrap();
    assert!(e.starts_with("tokenizer.huggingface.fetch.sha256"), "{e}");
    let e = config(serde_json::json!({"sha256": "a".repeat(64)}))
        .err()
        .unwrap();
    assert!(e.contains("cluster"), "{e}");
    let e = config(serde_json::json!({"cluster": "", "sha256": "a".repeat(64)}))
        .err()
        .unwrap();
    assert!(e.starts_with("tokenizer.huggingface.fetch.cluster"), "{e}");
    // Inline files and a fetch together are refused.
    let cfg = serde_json::json!({
        "replicas": [{"name": "r0", "endpoint": "127.0.0.1:8000", "feed_cluster": "f0"}],
        "tokenizer": {"huggingface": {"tokenizer_json": TOKENIZER_JSON,
            "fetch": {"cluster": "tok", "sha256": "a".repeat(64)}}}
    });
    let cfg = FilterConfig::from_json(cfg.to_string().as_bytes()).unwrap();
    let e = WorkerState::new(cfg).err().unwrap().to_string();
    assert!(e.contains("inline or fetch"), "{e}");
}
