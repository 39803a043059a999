//! The tokenizer through the core's request reader: exact identity for text prompts, the per-segment
//! cache giving the same ids as a whole-text encode, and every bad input falling back with its reason.

use kvsteer_core::block::BlockHasher;
use kvsteer_core::request::{PromptIdentity, read_request_with};
use kvsteer_tokenizer::{FallbackReason, TextTokenizer, TokenizerConfig};

fn tok(template: &str, cache_tokens: usize) -> TextTokenizer {
    TextTokenizer::new(&TokenizerConfig {
        chat_template: template.into(),
        cache_tokens,
        ..TokenizerConfig::default()
    })
    .unwrap()
}

fn chat(msgs: &[(&str, &str)]) -> String {
    let m: Vec<_> = msgs
        .iter()
        .map(|(r, c)| serde_json::json!({"role": r, "content": c}))
        .collect();
    serde_json::json!({"model": "gpt-oss", "messages": m}).to_string()
}

fn read(t: &mut TextTokenizer, path: &str, body: &str) -> kvsteer_core::RouteRequest {
    read_request_with(path, body.as_bytes(), None, 16, 8 << 20, Some(t)).unwrap()
}

/// Varied text: words, numbers, punctuation, whitespace runs, non-ASCII.
fn prose(seed: u64, words: usize) -> String {
    const W: [&str; 12] = [
        "routing",
        "the",
        "KV-cache",
        "42",
        "réplica",
        " ",
        "\n\n",
        "tokens;",
        "日本語",
        "(x)",
        "don't",
        "  indent",
    ];
    let mut s = String::new();
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push_str(W[(x % W.len() as u64) as usize]);
        s.push(' ');
    }
    s
}

#[test]
fn chat_prompts_get_the_exact_identity_of_the_rendered_template() {
    let mut t = tok("harmony", 1 << 20);
    let sys = prose(1, 400);
    let body = chat(&[("system", &sys), ("user", "What is routing?")]);
    let r = read(&mut t, "/v1/chat/completions", &body);
    let rendered = t
        .render_chat(&[
            kvsteer_core::ChatTurn {
                role: Some("system"),
                parts: vec![&sys],
                non_text: false,
                tool_calls: false,
            },
            kvsteer_core::ChatTurn {
                role: Some("user"),
                parts: vec!["What is routing?"],
                non_text: false,
                tool_calls: false,
            },
        ])
        .unwrap();
    // Reference: the whole rendered text through tiktoken itself, specials allowed.
    let bpe = tiktoken_rs::o200k_harmony_singleton();
    let ids = bpe.encode_with_special_tokens(&rendered);
    assert_eq!(r.prompt_tokens, ids.len() as u64);
    let h = BlockHasher::new(16).unwrap();
    assert_eq!(r.identity, PromptIdentity::Exact(h.sequence_hashes(&ids)));
    assert_eq!(t.stats().exact, 1);
}

#[test]
fn follow_up_turns_reuse_cached_messages_and_match_an_uncached_encode() {
    let mut cached = tok("harmony", 1 << 20);
    let mut plain = tok("harmony", 0);
    let mut convo: Vec<(String, String)> = vec![("system".into(), prose(7, 300))];
    for turn in 0..6u64 {
        convo.push(("user".into(), prose(100 + turn, 200)));
        let msgs: Vec<(&str, &str)> = convo
            .iter()
            .map(|(r, c)| (r.as_str(), c.as_str()))
            .collect();
        let body = chat(&msgs);
        let a = read(&mut cached, "/v1/chat/completions", &body);
        let b = read(&mut plain, "/v1/chat/completions", &body);
        assert_eq!(a, b, "turn {turn}");
        convo.push(("assistant".into(), prose(200 + turn, 150)));
    }
    let s = cached.stats();
    // Each turn misses only on its new messages (the user turn; the assistant reply from turn 2 on).
    assert_eq!(s.cache_misses, 1 + 6 + 5, "{s:?}");
    assert!(s.cache_hits >= 5 * 2, "{s:?}");
    assert_eq!(plain.stats().cache_hits, 0);
}

#[test]
fn completions_text_is_exact_and_specials_are_recognised() {
    let mut t = tok("harmony", 1 << 20);
    let r = read(
        &mut t,
        "/v1/completions",
        r#"{"prompt":"<|start|>user<|message|>hello world<|end|>"}"#,
    );
    let ids = [200006u32, 1428, 200008, 24912, 2375, 200007];
    let h = BlockHasher::new(16).unwrap();
    assert_eq!(r.prompt_tokens, 6);
    assert_eq!(r.identity, PromptIdentity::Exact(h.sequence_hashes(&ids)));
}

#[test]
fn bad_input_falls_back_with_a_counted_reason() {
    let mut t = TextTokenizer::new(&TokenizerConfig {
        max_prompt_bytes: 10_000,
        ..TokenizerConfig::default()
    })
    .unwrap();
    let approx =
        |r: &kvsteer_core::RouteRequest| matches!(r.identity, PromptIdentity::Approximate(_));
    let cases: [(&str, FallbackReason); 6] = [
        (
            r#"{"messages":[{"role":"wizard","content":"hi"}]}"#,
            FallbackReason::UnknownRole,
        ),
        (
            r#"{"messages":[{"content":"no role"}]}"#,
            FallbackReason::UnknownRole,
        ),
        (
            r#"{"messages":[{"role":"user","content":[{"type":"text","text":"see"},{"type":"image_url","image_url":{"url":"x"}}]}]}"#,
            FallbackReason::NonText,
        ),
        (
            r#"{"messages":[{"role":"assistant","content":null,"tool_calls":[{"id":"1"}]}]}"#,
            FallbackReason::ToolCalls,
        ),
        // harmony does not render tool results.
        (
            r#"{"messages":[{"role":"tool","content":"42"}]}"#,
            FallbackReason::Template,
        ),
        (
            &chat(&[("user", &"x".repeat(20_000))]),
            FallbackReason::TooLarge,
        ),
    ];
    for (i, (body, why)) in cases.iter().enumerate() {
        let before = t.stats().fallbacks[*why as usize];
        let r = read(&mut t, "/v1/chat/completions", body);
        assert!(approx(&r), "case {i}: {r:?}");
        assert_eq!(t.stats().fallbacks[*why as usize], before + 1, "case {i}");
    }
    let big = format!("{{\"prompt\":\"{}\"}}", "y".repeat(20_000));
    assert!(approx(&read(&mut t, "/v1/completions", &big)));
    // Invalid UTF-8 never reaches the tokenizer: the reader refuses the body (the filter then routes
    // by load alone and counts it).
    assert!(
        read_request_with(
            "/v1/chat/completions",
            b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\"}]}",
            None,
            16,
            1 << 20,
            Some(&mut t)
        )
        .is_err()
    );
    assert_eq!(t.stats().exact, 0);
}

#[test]
fn a_failing_custom_template_falls_back() {
    let custom = |src: &str| {
        TextTokenizer::new(&TokenizerConfig {
            chat_template: "custom".into(),
            chat_template_jinja: Some(src.into()),
            ..TokenizerConfig::default()
        })
        .unwrap()
    };
    // A method neither Python's str nor pycompat has: a render error, counted.
    let mut t = custom("{{ messages[0].content.frobnicate() }}");
    let r = read(&mut t, "/v1/chat/completions", &chat(&[("user", " hi ")]));
    assert!(matches!(r.identity, PromptIdentity::Approximate(_)));
    let s = t.stats();
    assert_eq!(s.fallbacks[FallbackReason::Template as usize], 1);
    assert!(s.last_error.is_some());
    // Python's `.strip()` renders (it used to fail): "hi" is one token.
    let mut t = custom("{{ messages[0].content.strip() }}");
    let r = read(&mut t, "/v1/chat/completions", &chat(&[("user", " hi ")]));
    assert!(matches!(r.identity, PromptIdentity::Exact(_)));
    assert_eq!(r.prompt_tokens, 1);
}

#[test]
fn long_runs_without_spaces_stay_fast_and_exact() {
    // One huge BPE piece (tiktoken switches to its heap-based merge past 100 bytes).
    let mut t = tok("harmony", 0);
    let s = "ab".repeat(50_000);
    let ids = t.encode(&s).unwrap();
    assert_eq!(
        ids,
        tiktoken_rs::o200k_harmony_singleton().encode_ordinary(&s)
    );
}
