//! Hugging Face bundles against the reference: for each family (Llama 3.1, Qwen 2.5, DeepSeek V3,
//! Mistral Nemo) the chat template's text and the token ids of every case in the corpus of
//! `tokenizer/scripts/hf_reference.py`, which renders with transformers and tokenizes with the
//! `tokenizers` library. The bundles and reference ids are fetched at test time by
//! `tokenizer/scripts/hf-fetch` into target/tokenizers/ (or `KVSTEER_HF_DIR`), never vendored (the
//! files carry the models' licences). Without them the test fails under `CI=true` and otherwise skips,
//! saying so.
//!
//! Cases whose request defines `tools` are counted apart (and must be exact too): the core passes a
//! chat request's `tools` JSON to the template as transformers' `apply_chat_template(tools=...)` does.

use kvsteer_core::request::{ChatTurn, PromptTokenizer};
use kvsteer_tokenizer::{TextTokenizer, TokenizerConfig};
use serde_json::Value;
use std::path::PathBuf;

const FAMILIES: [&str; 4] = ["llama3_1", "qwen2_5", "deepseek_v3", "mistral_nemo"];

fn dir() -> PathBuf {
    match std::env::var_os("KVSTEER_HF_DIR") {
        Some(d) => PathBuf::from(d),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../target/tokenizers"),
    }
}

#[derive(Default, Debug)]
struct Counts {
    chat: usize,
    chat_exact: usize,
    rendered_same: usize,
    both_refuse: usize,
    text: usize,
    text_exact: usize,
    tools: usize,
    tools_exact: usize,
    failures: Vec<String>,
}

fn first_difference(a: &[u32], b: &[u32]) -> String {
    let at = a.iter().zip(b).take_while(|(x, y)| x == y).count();
    let lo = at.saturating_sub(3);
    format!(
        "lengths {} / {}, first difference at {at}: ours {:?} reference {:?}",
        a.len(),
        b.len(),
        &a[lo..(at + 4).min(a.len())],
        &b[lo..(at + 4).min(b.len())]
    )
}

fn parts(content: &Value) -> Vec<&str> {
    match content {
        Value::Array(list) => list.iter().filter_map(Value::as_str).collect(),
        other => vec![other.as_str().unwrap_or("")],
    }
}

fn chat_case(t: &mut TextTokenizer, case: &Value, c: &mut Counts) {
    let name = case["name"].as_str().unwrap_or("?");
    let turns: Vec<ChatTurn> = case["messages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| ChatTurn {
            role: m["role"].as_str(),
            parts: parts(&m["content"]),
            non_text: false,
            tool_calls: false,
        })
        .collect();
    // The text a client sent, key order kept (`case["tools"]` re-serialised would sort the keys).
    let tools_json = case["tools_json"].as_str();
    let tools = tools_json.is_some();
    let rendered = t.render_chat_tools(&turns, tools_json);
    let Some(want) = case["ids"].as_array() else {
        if tools {
            c.tools += 1;
        } else {
            c.chat += 1;
        }
        match rendered {
            Err(_) if tools => c.tools_exact += 1,
            Err(_) => {
                c.both_refuse += 1;
                c.chat_exact += 1;
            }
            Ok(_) => c.failures.push(format!(
                "{name}: the reference template refused, ours rendered"
            )),
        }
        return;
    };
    let want: Vec<u32> = want.iter().map(|v| v.as_u64().unwrap() as u32).collect();
    let got = t.tokenize_chat_tools(&turns, tools_json);
    let exact = got.as_deref() == Some(&want[..]);
    let same_text = rendered.as_deref().ok() == case["rendered"].as_str();
    if tools {
        c.tools += 1;
        c.tools_exact += usize::from(exact);
    } else {
        c.chat += 1;
        c.rendered_same += usize::from(same_text);
        c.chat_exact += usize::from(exact);
    }
    if exact {
    } else if !same_text {
        c.failures
            .push(format!("{name}: template text differs: {rendered:?}"));
    } else {
        let got = got.unwrap_or_default();
        c.failures.push(format!(
            "{name}: ids differ, {}",
            first_difference(&got, &want)
        ));
    }
}

fn text_case(t: &mut TextTokenizer, case: &Value, c: &mut Counts) {
    let name = case["name"].as_str().unwrap_or("?");
    let want: Vec<u32> = case["ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    c.text += 1;
    let got = t
        .tokenize_text(case["text"].as_str().unwrap())
        .unwrap_or_default();
    if got == want {
        c.text_exact += 1;
    } else {
        c.failures.push(format!(
            "{name}: ids differ, {}",
            first_difference(&got, &want)
        ));
    }
}

fn family(fam: &str) -> Option<Counts> {
    let d = dir().join(fam);
    let read = |f: &str| std::fs::read(d.join(f)).ok();
    let (Some(json), Some(config), Some(reference)) = (
        read("tokenizer.json"),
        read("tokenizer_config.json"),
        read("reference.json"),
    ) else {
        let msg = format!(
            "hf_conformance: {fam}: no bundle or reference in {} (run tokenizer/scripts/hf-fetch)",
            d.display()
        );
        assert!(std::env::var("CI").as_deref() != Ok("true"), "{msg}");
        println!("{msg}: skipped");
        return None;
    };
    let cfg = TokenizerConfig::default();
    let mut t = TextTokenizer::with_huggingface(&cfg, &json, Some(&config))
        .unwrap_or_else(|e| panic!("{fam}: {e}"));
    let reference: Value = serde_json::from_slice(&reference).unwrap();
    let mut c = Counts::default();
    for case in reference["cases"].as_array().unwrap() {
        match case["kind"].as_str() {
            Some("chat") => chat_case(&mut t, case, &mut c),
            _ => text_case(&mut t, case, &mut c),
        }
    }
    println!(
        "hf_conformance: {fam} (tokenizers {}, transformers {}): chat {}/{} exact (template text {}/{}, \
         refused by both {}), text {}/{} exact; requests with tool definitions {}/{} exact",
        reference["tokenizers"].as_str().unwrap_or("?"),
        reference["transformers"].as_str().unwrap_or("?"),
        c.chat_exact,
        c.chat,
        c.rendered_same,
        c.chat - c.both_refuse,
        c.both_refuse,
        c.text_exact,
        c.text,
        c.tools_exact,
        c.tools
    );
    for f in &c.failures {
        println!("  {fam}: {f}");
    }
    Some(c)
}

/// Long runs a client may send (one 100 KB word, 100 KB of spaces, of newlines, of punctuation, of
/// digits) encode in bounded time with every family's patterns: no regex blow-up, no fallback.
#[test]
fn long_runs_encode_in_bounded_time() {
    for fam in FAMILIES {
        let d = dir().join(fam);
        let Ok(json) = std::fs::read(d.join("tokenizer.json")) else {
            println!("long runs: {fam}: no bundle, skipped");
            continue;
        };
        let t = kvsteer_tokenizer::hf::HfTokenizer::from_bytes(&json, 64 << 20).unwrap();
        for (what, unit) in [
            ("word", "a"),
            ("spaces", " "),
            ("newlines", "\n"),
            ("punct", "=-"),
            ("digits", "7"),
            ("cjk", "語"),
        ] {
            let text = unit.repeat(100_000 / unit.len());
            let start = std::time::Instant::now();
            let ids = t.encode(&text, false);
            let ms = start.elapsed().as_secs_f64() * 1e3;
            println!(
                "long runs: {fam}: 100 KB of {what}: {} ids in {ms:.1} ms",
                ids.as_ref().map_or(0, Vec::len)
            );
            assert!(ids.is_some_and(|v| !v.is_empty()), "{fam} {what}");
        }
    }
}

#[test]
fn hugging_face_bundles_match_the_reference_exactly() {
    let mut failed = Vec::new();
    for fam in FAMILIES {
        if let Some(c) = family(fam)
            && !c.failures.is_empty()
        {
            failed.push(format!("{fam}: {} cases differ", c.failures.len()));
        }
    }
    assert!(failed.is_empty(), "{failed:?}");
}
