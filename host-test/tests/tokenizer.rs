//! Exact routing for chat prompts in the real `.wasm` (docs/design/tokenizer.md): a filter
//! configured with the o200k_harmony tokenizer and the simulator's chat template computes the same
//! token ids as the simulator (`kvsteer_sim::tokenize` with the same BPE), so a multi-turn
//! conversation is matched against the replica's KV feed and routed to the replica holding its
//! prefix; without the tokenizer the same conversation has only the approximate identity, which the
//! feed cannot match. Bad input never traps: it falls back with a counted reason.

mod common;

use kvsteer_core::feed::{FEED_CONTENT_TYPE, FeedBatch, FeedEvent, ReplicaLoad, Tier};
use kvsteer_host_test::openai::request_headers;
use kvsteer_host_test::{
    Action, CallOutcome, FilterModule, HostMode, Proxy, ProxyOptions, WorkerVm, filter_wasm_path,
};
use kvsteer_sim::tokenize::{TokenizerKind, select, tokenize};
use serde_json::{Value, json};
use std::sync::OnceLock;

const REPLICAS: usize = 4;
const HOLDER: usize = 2;

fn module() -> &'static FilterModule {
    static M: OnceLock<FilterModule> = OnceLock::new();
    M.get_or_init(|| {
        select(TokenizerKind::Bpe(kvsteer_tokenizer_vocab())).unwrap();
        let path = filter_wasm_path().unwrap_or_else(|e| panic!("{e}"));
        // Unmetered: parsing the 200K-entry vocabulary in on_configure is more work than the fuel the
        // metered host gives one callback (a proxy has no such budget).
        FilterModule::load_unmetered(&path).unwrap_or_else(|e| panic!("{e}"))
    })
}

fn kvsteer_tokenizer_vocab() -> kvsteer_sim::tokenize::Vocabulary {
    kvsteer_sim::tokenize::Vocabulary::O200kHarmony
}

/// Token ids as the simulator's engine computes them (the real BPE, chosen before first use).
fn engine_tokens(text: &str) -> Vec<u32> {
    module();
    tokenize(text)
}

/// The simulator's chat framing (sim/src/server/openai.rs), which its engine tokenizes.
fn sim_render(messages: &[(&str, String)]) -> String {
    let mut t = String::new();
    for (role, content) in messages {
        t.push_str(&format!("<|start|>{role}\n{content}<|end|>\n"));
    }
    t.push_str("<|start|>assistant\n");
    t
}

fn prose(seed: u64, words: usize) -> String {
    const W: [&str; 10] = [
        "routing", "tokens", "cache", "replica", "prefill", "decode", "block", "hash,", "agent.",
        "tool",
    ];
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut s = format!("[{seed}]");
    for _ in 0..words {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.push(' ');
        s.push_str(W[(x % 10) as usize]);
    }
    s
}

fn start(tokenizer: Option<Value>) -> (Proxy, WorkerVm) {
    let replicas: Vec<_> = (0..REPLICAS)
        .map(|i| {
            json!({"name": format!("r{i}"), "endpoint": format!("10.0.0.{}:8000", i + 1),
                        "feed_cluster": format!("feed_r{i}")})
        })
        .collect();
    let mut cfg = json!({"replicas": replicas, "routing": {"policy": "kv_load", "block_size": 16},
                         "feed_period_ms": 3_600_000, "tick_ms": 100});
    if let Some(t) = tokenizer {
        cfg["tokenizer"] = t;
    }
    let proxy = Proxy::new(
        module(),
        ProxyOptions::new(HostMode::Envoy, cfg.to_string()),
    );
    let worker = proxy.start_worker().unwrap();
    (proxy, worker)
}

/// Answers the first polls with snapshots: `held` blocks on [`HOLDER`], nothing elsewhere.
fn feed(proxy: &Proxy, w: &mut WorkerVm, held: &[u64]) {
    let mut answered = [false; REPLICAS];
    let mut now_ms = 0;
    for _ in 0..50 {
        now_ms += 100;
        proxy.set_now_ns(now_ms * 1_000_000);
        w.tick().unwrap();
        for call in w.take_callouts() {
            let r: usize = call
                .upstream
                .strip_prefix("feed_r")
                .unwrap()
                .parse()
                .unwrap();
            // Every poll gets the same snapshot (a resync), whatever its cursor.
            assert!(call.header(":path").is_some_and(|p| p.contains('?')));
            let hashes = if r == HOLDER {
                held.to_vec()
            } else {
                Vec::new()
            };
            let batch = FeedBatch {
                epoch: 7 + r as u64,
                resync: true,
                more: false,
                first_seq: 1,
                next_seq: 1,
                load: ReplicaLoad {
                    block_size: 16,
                    kv_total_blocks: 1 << 16,
                    ..Default::default()
                },
                events: vec![
                    FeedEvent::Cleared,
                    FeedEvent::Stored {
                        tier: Tier::Gpu,
                        hashes,
                    },
                ],
            };
            answered[r] = true;
            w.answer_callout(
                &call,
                CallOutcome::ok(200, FEED_CONTENT_TYPE, batch.encode()),
            )
            .unwrap();
        }
        if answered.iter().all(|a| *a) {
            return;
        }
    }
    panic!("not every replica was polled");
}

/// Sends a chat body; returns the destination header's first endpoint.
fn route(w: &mut WorkerVm, body: &[u8]) -> String {
    let headers = request_headers("/v1/chat/completions", body.len(), None, &[]);
    let id = w.new_stream().unwrap();
    let mut last = w.request_headers(id, headers, false).unwrap();
    if let Some(a) = w.request_body(id, body, true).unwrap() {
        last = a;
    }
    assert_eq!(last, Action::Continue);
    let dest = w
        .stream(id)
        .and_then(|s| s.upstream_header("x-gateway-destination-endpoint"))
        .unwrap_or("")
        .split(',')
        .next()
        .unwrap()
        .to_string();
    w.end_stream(id).unwrap();
    dest
}

fn body(messages: &[(&str, String)]) -> Vec<u8> {
    let m: Vec<_> = messages
        .iter()
        .map(|(r, c)| json!({"role": r, "content": c}))
        .collect();
    json!({"model": "sim", "max_tokens": 8, "messages": m})
        .to_string()
        .into_bytes()
}

fn metric(p: &Proxy, name: &str) -> i64 {
    p.metric(name).map_or(0, |m| m.value)
}

#[test]
fn a_multi_turn_chat_is_routed_to_the_replica_holding_its_tokens() {
    let tok = json!({"vocabulary": "o200k_harmony", "chat_template": "kvsteer_sim"});
    let holder = format!("10.0.0.{}:8000", HOLDER + 1);
    let mut convo = vec![("system", prose(1, 1500)), ("user", prose(2, 100))];
    // The engine holds everything turn 1 computed: the prompt the simulator tokenized.
    let ids = engine_tokens(&sim_render(&convo));
    assert!(ids.len() > 1500, "{}", ids.len());
    let held = common::hf::held_blocks(&ids);
    for turn in 2..6u64 {
        convo.push(("assistant", prose(10 * turn, 60)));
        convo.push(("user", prose(10 * turn + 1, 80)));
        let b = body(&convo);
        let expect_tokens = engine_tokens(&sim_render(&convo)).len() as i64;

        let (p, mut w) = start(Some(tok.clone()));
        feed(&p, &mut w, &held);
        let before = metric(&p, "kvsteer_prompt_tokens");
        assert_eq!(route(&mut w, &b), holder, "turn {turn}");
        assert_eq!(
            metric(&p, "kvsteer_prompt_tokens") - before,
            expect_tokens,
            "the filter counts the engine's tokens"
        );
        w.tick().unwrap();
        assert_eq!(metric(&p, "kvsteer_tokenizer_exact"), 1);
        assert!(!w.is_dead() && w.notes().is_empty(), "{:?}", w.notes());

        // Without a tokenizer the feed's blocks cannot be matched: the decision is by load alone,
        // which spreads identical idle choices (here: never all four turns on the holder by cache).
        let (p, mut w) = start(None);
        feed(&p, &mut w, &held);
        route(&mut w, &b);
        assert_eq!(metric(&p, "kvsteer_matched_tokens"), 0);
    }
}

#[test]
fn follow_up_turns_hit_the_per_message_cache() {
    let (p, mut w) = start(Some(
        json!({"vocabulary": "o200k_harmony", "chat_template": "harmony"}),
    ));
    feed(&p, &mut w, &[]);
    let mut convo = vec![("system", prose(3, 2000))];
    for turn in 0..5u64 {
        convo.push(("user", prose(100 + turn, 200)));
        route(&mut w, &body(&convo));
        convo.push(("assistant", prose(200 + turn, 200)));
    }
    w.tick().unwrap();
    // Misses: the system prompt and each turn's new messages; hits: everything else.
    assert_eq!(metric(&p, "kvsteer_tokenizer_cache_misses"), 1 + 5 + 4);
    assert_eq!(metric(&p, "kvsteer_tokenizer_cache_hits"), 2 + 4 + 6 + 8);
    assert!(metric(&p, "kvsteer_tokenizer_cache_tokens") > 2000);
}

#[test]
fn bad_chat_input_never_traps_and_is_counted() {
    let (p, mut w) = start(Some(
        json!({"chat_template": "harmony", "max_prompt_bytes": 100000}),
    ));
    feed(&p, &mut w, &[]);
    let bodies: Vec<Vec<u8>> = vec![
        br#"{"messages":[{"role":"wizard","content":"hi"}]}"#.to_vec(),
        br#"{"messages":[{"role":"tool","content":"42"}]}"#.to_vec(),
        br#"{"messages":[{"role":"user","content":[{"type":"image_url","image_url":{"url":"x"}}]}]}"#
            .to_vec(),
        body(&[("user", "z".repeat(200_000))]),
        b"{\"messages\":[{\"role\":\"user\",\"content\":\"\xff\xfe\"}]}".to_vec(),
        body(&[("user", "<|start|><|end|><|message|>".repeat(1000))]),
        body(&[("user", " ".repeat(50_000))]),
    ];
    for b in &bodies {
        let d = route(&mut w, b);
        assert!(d.starts_with("10.0.0."), "{d}");
    }
    w.tick().unwrap();
    assert!(!w.is_dead() && w.notes().is_empty(), "{:?}", w.notes());
    assert_eq!(metric(&p, "kvsteer_tokenizer_fallback_unknown_role"), 1);
    assert_eq!(metric(&p, "kvsteer_tokenizer_fallback_template"), 1);
    assert_eq!(metric(&p, "kvsteer_tokenizer_fallback_non_text"), 1);
    assert_eq!(metric(&p, "kvsteer_tokenizer_fallback_too_large"), 1);
    // Special-token look-alikes and whitespace runs are tokenized, not refused.
    assert_eq!(metric(&p, "kvsteer_tokenizer_exact"), 2);
}

/// A model's own template in the style of Llama 3.x (written for this test): Python string methods,
/// `strftime_now`, `tojson` and the `tools`/`date_string` checks, all evaluated inside the `.wasm`.
const LLAMA_STYLE: &str = r#"{{- bos_token }}
{%- if not date_string is defined %}{%- set date_string = strftime_now("%d %b %Y") %}{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}{{- "Environment: ipython\n" }}{%- endif %}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'].strip() }}{%- endif %}
{{- "<|eot_id|>" }}
{%- for m in messages if m.role != 'system' %}
    {{- "<|start_header_id|>" + m.role + "<|end_header_id|>\n\n" + m.content | trim + "<|eot_id|>" }}
    {%- if loop.last and m.content.endswith('?') %}{{- {"q": m.content.title()} | tojson }}{%- endif %}
{%- endfor %}
{{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
"#;

#[test]
fn model_templates_with_python_methods_and_strftime_now_render_inside_the_wasm() {
    let convo = [
        ("system", " Be brief. ".to_string()),
        ("user", "  what is a kv cache?".to_string()),
    ];
    let rendered = concat!(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
        "Today Date: 26 Jul 2024\n\nBe brief.<|eot_id|>",
        "<|start_header_id|>user<|end_header_id|>\n\nwhat is a kv cache?<|eot_id|>",
        "{\"q\": \"  What Is A Kv Cache?\"}",
        "<|start_header_id|>assistant<|end_header_id|>\n\n",
    );
    let cfg = json!({"chat_template": "llama_style", "chat_template_jinja": LLAMA_STYLE,
                     "current_date": "2024-07-26", "bos_token": "<|begin_of_text|>"});
    let (p, mut w) = start(Some(cfg.clone()));
    feed(&p, &mut w, &[]);
    let before = metric(&p, "kvsteer_prompt_tokens");
    route(&mut w, &body(&convo));
    w.tick().unwrap();
    assert_eq!(metric(&p, "kvsteer_tokenizer_exact"), 1);
    assert_eq!(
        metric(&p, "kvsteer_prompt_tokens") - before,
        engine_tokens(rendered).len() as i64,
        "the filter tokenizes exactly the hand-derived rendering"
    );
    assert!(!w.is_dead() && w.notes().is_empty(), "{:?}", w.notes());

    // No configured date: strftime_now refuses, the request falls back (counted), nothing traps.
    let mut no_date = cfg;
    no_date["current_date"] = Value::Null;
    let (p, mut w) = start(Some(no_date));
    feed(&p, &mut w, &[]);
    assert!(route(&mut w, &body(&convo)).starts_with("10.0.0."));
    w.tick().unwrap();
    assert_eq!(metric(&p, "kvsteer_tokenizer_exact"), 0);
    assert_eq!(metric(&p, "kvsteer_tokenizer_fallback_template"), 1);
    assert!(!w.is_dead() && w.notes().is_empty(), "{:?}", w.notes());
}

/// Where the lean build (`--no-default-features`, no vocabulary) is, when the test script built it.
const LEAN_WASM_ENV: &str = "KVSTEER_FILTER_LEAN_WASM";

#[test]
fn the_lean_build_refuses_a_tokenizer_section_at_configure_time() {
    let Some(path) = std::env::var_os(LEAN_WASM_ENV) else {
        eprintln!(
            "skipped: set {LEAN_WASM_ENV} to a build of `cargo build -p kvsteer-filter --target \
             wasm32-wasip1 --release --no-default-features`"
        );
        return;
    };
    let lean = FilterModule::load(std::path::Path::new(&path)).unwrap_or_else(|e| panic!("{e}"));
    // No vocabulary inside: the vocabulary alone is about 6 MB of the full build's 7.5, the
    // lean build's code about 1.2 MB.
    assert!(lean.size() < 2 << 20, "{} bytes", lean.size());
    let cfg = |tokenizer: Option<Value>| {
        let mut c = json!({"replicas": [{"name": "r0", "endpoint": "10.0.0.1:8000",
                                          "feed_cluster": "feed_r0"}]});
        if let Some(t) = tokenizer {
            c["tokenizer"] = t;
        }
        Proxy::new(&lean, ProxyOptions::new(HostMode::Envoy, c.to_string()))
    };
    match cfg(Some(json!({"chat_template": "harmony"}))).start_worker() {
        Err(kvsteer_host_test::HostError::Refused { callback, .. }) => {
            assert_eq!(callback, "proxy_on_configure")
        }
        Err(e) => panic!("expected a refusal, got {e}"),
        Ok(_) => panic!("the lean build accepted a tokenizer section"),
    }
    // Without the section it configures and routes a text prompt (approximate identity).
    let mut w = cfg(None).start_worker().unwrap();
    let b = body(&[("user", "hello".to_string())]);
    assert_eq!(route(&mut w, &b), "10.0.0.1:8000");
    assert!(!w.is_dead());
}

/// A Hugging Face bundle in the real `.wasm`: Llama 3.1's files given inline in the configuration,
/// the reference corpus' multi-turn chat (ids from the `tokenizers` library, written by
/// tokenizer/scripts/hf_reference.py) is routed to the replica whose feed holds exactly those ids'
/// blocks, and the filter counts the reference's number of tokens. Skipped, saying so, without the
/// files of tokenizer/scripts/hf-fetch (failing under `CI=true`).
#[test]
fn a_hugging_face_bundle_routes_by_the_reference_ids() {
    let Some(bundle) = common::hf::llama_bundle() else {
        return;
    };
    let held = common::hf::held_blocks(&bundle.ids);
    let text = |b: &[u8]| String::from_utf8(b.to_vec()).unwrap();
    let (json, config) = (
        text(&bundle.tokenizer_json),
        text(&bundle.tokenizer_config_json),
    );
    let tok = json!({"huggingface": {"tokenizer_json": json, "tokenizer_config_json": config}});
    let (p, mut w) = start(Some(tok));
    feed(&p, &mut w, &held);
    let b = json!({"model": "llama", "max_tokens": 8, "messages": bundle.messages}).to_string();
    let before = metric(&p, "kvsteer_prompt_tokens");
    assert_eq!(
        route(&mut w, b.as_bytes()),
        format!("10.0.0.{}:8000", HOLDER + 1)
    );
    assert_eq!(
        metric(&p, "kvsteer_prompt_tokens") - before,
        bundle.ids.len() as i64
    );
    w.tick().unwrap();
    assert_eq!(metric(&p, "kvsteer_tokenizer_exact"), 1);
    assert!(!w.is_dead() && w.notes().is_empty(), "{:?}", w.notes());
}
