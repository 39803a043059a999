//! Hostile bodies: the request reader and the feed decoder never panic, whatever the bytes.

use kvsteer_core::feed::FeedBatch;
use kvsteer_core::request::read_request;
use proptest::prelude::*;

const SAMPLE: &str = r#"{"model":"m","stream":true,"max_tokens":5,"prompt":[1,2,3,4,5,6,7,8],"messages":[{"role":"user","content":[{"type":"text","text":"hi"}]}]}"#;

proptest! {
    #![proptest_config(ProptestConfig::with_cases(500))]

    #[test]
    fn random_bytes_never_panic(body in prop::collection::vec(any::<u8>(), 0..300)) {
        let _ = read_request("/v1/completions", &body, None, 16, 1 << 20);
        let _ = read_request("/v1/chat/completions", &body, Some("s"), 16, 1 << 20);
        let _ = FeedBatch::decode(&body);
        let _ = kvsteer_core::request::model_of(&body);
    }

    #[test]
    fn mutated_valid_bodies_never_panic(pos in 0usize..SAMPLE.len(), byte in any::<u8>(), cut in 0usize..=SAMPLE.len()) {
        let mut b = SAMPLE.as_bytes().to_vec();
        b[pos] = byte;
        b.truncate(cut.max(pos));
        let _ = read_request("/v1/completions", &b, None, 4, 1 << 20);
        let _ = read_request("/v1/chat/completions", &b, None, 4, 1 << 20);
        let _ = kvsteer_core::request::model_of(&b);
    }
}

proptest! {
    /// Token-id prompts read by the fast scanner equal the general parser's reading, whatever the
    /// spacing.
    #[test]
    fn token_prompts_read_exactly(tokens in prop::collection::vec(any::<u32>(), 0..100), sep in "[ \n\t]{0,2},[ \n\t]{0,2}") {
        use kvsteer_core::block::BlockHasher;
        use kvsteer_core::PromptIdentity;
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let body = format!("{{\"prompt\": [ {} ] }}", list.join(&sep));
        let r = read_request("/v1/completions", body.as_bytes(), None, 4, 1 << 20).unwrap();
        prop_assert_eq!(r.prompt_tokens, tokens.len() as u64);
        prop_assert_eq!(r.identity, PromptIdentity::Exact(BlockHasher::new(4).unwrap().sequence_hashes(&tokens)));
    }
}

fn oracle_tokens(body: &[u8]) -> Option<Result<Vec<u32>, ()>> {
    // None: not valid JSON. Some(Err): valid JSON but no flat u32 prompt.
    let v: serde_json::Value = serde_json::from_slice(body).ok()?;
    let arr = match v.get("prompt").and_then(|p| p.as_array()) {
        Some(a) => a,
        None => return Some(Err(())),
    };
    let t: Option<Vec<u32>> = arr
        .iter()
        .map(|x| x.as_u64().and_then(|n| u32::try_from(n).ok()))
        .collect();
    Some(t.ok_or(()))
}

const EXTRA: &[&str] = &[
    r#""model":"a\"b}{][,""#,
    r#""stream":true"#,
    r#""max_tokens":12"#,
    r#""logit_bias":{"1":[2,{"x":"]"}]}"#,
    r#""stop":["\\","\n"]"#,
    r#""user":null"#,
];

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The token-prompt fast path reads exactly what a general JSON parser sees, wherever the prompt sits
    /// among other fields, and refuses what the general parser refuses.
    #[test]
    fn fast_path_agrees_with_a_general_parser(
        tokens in prop::collection::vec(any::<u32>(), 0..40),
        extras in prop::collection::vec(0usize..EXTRA.len(), 0..4),
        at in 0usize..5,
        mutate in prop::option::of((any::<prop::sample::Index>(), any::<u8>())),
    ) {
        use kvsteer_core::block::BlockHasher;
        use kvsteer_core::PromptIdentity;
        let list: Vec<String> = tokens.iter().map(u32::to_string).collect();
        let mut fields: Vec<String> = extras.iter().map(|&i| EXTRA[i].to_string()).collect();
        fields.insert(at.min(fields.len()), format!("\"prompt\":[{}]", list.join(",")));
        let mut body = format!("{{{}}}", fields.join(",")).into_bytes();
        if let Some((ix, byte)) = mutate {
            let i = ix.index(body.len());
            body[i] = byte;
        }
        let got = read_request("/v1/completions", &body, None, 4, 1 << 20);
        let hasher = BlockHasher::new(4).unwrap();
        match oracle_tokens(&body) {
            None => prop_assert!(got.is_err(), "invalid JSON accepted: {:?}", String::from_utf8_lossy(&body)),
            Some(Ok(t)) => {
                // Duplicate keys (a mutation can make one) are refused by the reader, accepted by Value.
                if let Ok(r) = got {
                    prop_assert_eq!(r.identity, PromptIdentity::Exact(hasher.sequence_hashes(&t)));
                    prop_assert_eq!(r.prompt_tokens, t.len() as u64);
                }
            }
            // Other prompt shapes (text, lists) are covered by the reader's unit tests.
            Some(Err(())) => {}
        }
    }
}

// The one-pass reader against the general serde_json reader (`read_request_reference`), on random
// bodies built from the fields routing reads (in every type, right or wrong), unknown fields holding
// any JSON, strings with every kind of escape, and then the same bodies mutated and cut.

mod against_reference {
    use kvsteer_core::request::{
        ChatTurn, EarlyScan, PromptTokenizer, RequestError, RouteRequest, read_request_early,
        read_request_reference, read_request_with,
    };
    use proptest::prelude::*;

    /// A tokenizer that records what it is asked and declines some texts, so the exact and the
    /// fallback identities of text prompts are both exercised.
    #[derive(Default)]
    struct Recording {
        calls: Vec<String>,
    }

    impl PromptTokenizer for Recording {
        fn tokenize_text(&mut self, text: &str) -> Option<Vec<u32>> {
            self.calls.push(format!("text {text:?}"));
            (!text.contains('z')).then(|| text.bytes().map(u32::from).collect())
        }
        fn tokenize_chat(&mut self, turns: &[ChatTurn<'_>]) -> Option<Vec<u32>> {
            self.calls.push(format!("chat {turns:?}"));
            if turns.iter().any(|t| t.non_text || t.tool_calls) {
                return None;
            }
            Some(
                turns
                    .iter()
                    .flat_map(|t| {
                        t.role
                            .unwrap_or("")
                            .bytes()
                            .chain(t.parts.concat().into_bytes())
                    })
                    .map(u32::from)
                    .collect(),
            )
        }
        fn tokenize_chat_tools(
            &mut self,
            turns: &[ChatTurn<'_>],
            tools: Option<&str>,
        ) -> Option<Vec<u32>> {
            self.calls.push(format!("tools {tools:?}"));
            let mut ids = self.tokenize_chat(turns)?;
            ids.extend(tools.unwrap_or("").bytes().map(u32::from));
            Some(ids)
        }
    }

    fn same(
        a: &Result<RouteRequest, RequestError>,
        b: &Result<RouteRequest, RequestError>,
    ) -> bool {
        match (a, b) {
            (Ok(x), Ok(y)) => x == y,
            // Errors agree on their kind; serde_json words a `Json` error with its position.
            (Err(x), Err(y)) => std::mem::discriminant(x) == std::mem::discriminant(y),
            _ => false,
        }
    }

    /// Reads `body` after an early scan that saw it arrive `step` bytes at a time (not the last
    /// slice: the final read takes over from where the scan got to before it).
    fn read_early(
        path: &str,
        body: &[u8],
        block_size: usize,
        step: usize,
    ) -> Result<RouteRequest, RequestError> {
        let mut scan = EarlyScan::new(block_size);
        let mut n = 0;
        while n + step < body.len() {
            n += step;
            scan.advance(&body[..n]);
        }
        read_request_early(
            path,
            body,
            Some("s"),
            block_size,
            1 << 20,
            None,
            Some(scan),
            None,
        )
    }

    /// Reads `body` both ways on both endpoints, with and without a tokenizer, and compares.
    fn check(body: &[u8]) -> Result<(), TestCaseError> {
        for path in ["/v1/completions", "/v1/chat/completions"] {
            for block_size in [1, 4] {
                let fast = read_request_with(path, body, Some("s"), block_size, 1 << 20, None);
                let slow = read_request_reference(path, body, Some("s"), block_size, 1 << 20, None);
                prop_assert!(
                    same(&fast, &slow),
                    "{path} bs {block_size} {:?}: one-pass {fast:?} vs reference {slow:?}",
                    String::from_utf8_lossy(body)
                );
                for step in [1, 7, 64, 500] {
                    let early = read_early(path, body, block_size, step);
                    prop_assert!(
                        same(&early, &fast),
                        "{path} bs {block_size} step {step} {:?}: early {early:?} vs one-pass {fast:?}",
                        String::from_utf8_lossy(body)
                    );
                }
            }
            let (mut t1, mut t2) = (Recording::default(), Recording::default());
            let fast = read_request_with(path, body, None, 4, 1 << 20, Some(&mut t1));
            let slow = read_request_reference(path, body, None, 4, 1 << 20, Some(&mut t2));
            prop_assert!(
                same(&fast, &slow),
                "{path} with tokenizer {:?}: one-pass {fast:?} vs reference {slow:?}",
                String::from_utf8_lossy(body)
            );
            prop_assert_eq!(t1.calls, t2.calls);
        }
        Ok(())
    }

    fn ws() -> impl Strategy<Value = String> {
        prop_oneof![
            30 => Just(String::new()),
            10 => "[ \t\r\n]{1,3}",
            1 => "[\u{b}\u{c}]",
        ]
    }

    /// JSON string literals, escapes of every kind included (lone surrogates, bad escapes, raw
    /// control characters, non-ASCII), sometimes long enough for the word-wise scan.
    fn string() -> impl Strategy<Value = String> {
        let piece = prop_oneof![
            40 => "[a-z ]{0,12}",
            4 => Just("\\\"".to_string()),
            4 => Just("\\\\".to_string()),
            4 => Just("\\n\\t\\/\\b\\f\\r".to_string()),
            4 => Just("\\u00e9".to_string()),
            4 => Just("\\ud83e\\udd80".to_string()),
            4 => Just("é日🦀".to_string()),
            4 => Just("zz".to_string()),
            4 => Just("text".to_string()),
            1 => Just("\\ud83e".to_string()),
            1 => Just("\\udd80x".to_string()),
            1 => Just("\\uD83E\\u0041".to_string()),
            1 => Just("\\x".to_string()),
            1 => Just("\\u12g4".to_string()),
            1 => Just("\u{1}".to_string()),
        ];
        prop::collection::vec(piece, 0..6).prop_map(|p| format!("\"{}\"", p.concat()))
    }

    /// A token id as clients write it: every digit count a `u32` has.
    fn id() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => (0u64..200_000).prop_map(|n| n.to_string()),
            2 => (1_000_000u64..10_000_000).prop_map(|n| n.to_string()),
            2 => any::<u32>().prop_map(|n| n.to_string()),
            1 => (0u64..10).prop_map(|n| n.to_string()),
        ]
    }

    /// JSON numbers, mostly token ids and counts, with the forms an integer field refuses and a
    /// few that are not JSON at all.
    fn number() -> impl Strategy<Value = String> {
        prop_oneof![
            40 => id(),
            4 => any::<u64>().prop_map(|n| n.to_string()),
            2 => Just("1.5".to_string()),
            2 => Just("1e3".to_string()),
            2 => Just("-1".to_string()),
            2 => Just("2E-2".to_string()),
            1 => Just("4294967296".to_string()),
            1 => Just("18446744073709551616".to_string()),
            1 => Just("99999999999999999999999".to_string()),
            1 => Just("-0".to_string()),
            1 => Just("01".to_string()),
            1 => Just("1.".to_string()),
            1 => Just("-".to_string()),
            1 => Just("+1".to_string()),
        ]
    }

    /// Any JSON value (and a few near misses), nested a little.
    fn value() -> impl Strategy<Value = String> {
        let leaf = prop_oneof![
            10 => string(),
            10 => number(),
            3 => Just("true".to_string()),
            3 => Just("false".to_string()),
            3 => Just("null".to_string()),
            1 => Just("nul".to_string()),
            1 => Just("True".to_string()),
        ];
        leaf.prop_recursive(4, 24, 5, |inner| {
            prop_oneof![
                (prop::collection::vec(inner.clone(), 0..5), ws())
                    .prop_map(|(v, w)| format!("[{w}{}{w}]", v.join(&format!("{w},{w}")))),
                prop::collection::vec((string(), inner), 0..4).prop_map(|m| {
                    let m: Vec<String> = m.into_iter().map(|(k, v)| format!("{k}:{v}")).collect();
                    format!("{{{}}}", m.join(","))
                }),
            ]
        })
    }

    /// A token-id array, now and then with an element that is not a `u32`.
    fn ids(max: usize) -> impl Strategy<Value = String> {
        let element = prop_oneof![200 => id(), 1 => number(), 1 => string()];
        (
            prop::collection::vec(element, 0..max),
            prop::sample::select(vec![",", ", ", " , ", ",\n"]),
        )
            .prop_map(|(v, sep)| format!("[{}]", v.join(sep)))
    }

    fn prompt() -> impl Strategy<Value = String> {
        prop_oneof![
            4 => ids(70),
            2 => (0u32..1000, 0usize..80).prop_map(|(start, n)| {
                let v: Vec<String> = (start..start + n as u32).map(|t| (t * 7919).to_string()).collect();
                format!("[{}]", v.join(","))
            }),
            2 => string(),
            1 => prop::collection::vec(string(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            1 => prop::collection::vec(ids(10), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            1 => prop::sample::select(vec!["[1,\"a\"]", "[\"a\",[1]]", "[[1],2]", "[[[1]]]", "null", "[1.0]", "{}"])
                .prop_map(str::to_string),
            1 => value(),
        ]
    }

    fn part() -> impl Strategy<Value = String> {
        prop_oneof![
            3 => string().prop_map(|t| format!("{{\"type\":\"text\",\"text\":{t}}}")),
            2 => string().prop_map(|t| format!("{{\"text\":{t}}}")),
            1 => Just("{\"type\":\"image_url\",\"image_url\":{\"url\":\"x\"}}".to_string()),
            1 => Just("{\"type\":\"text\"}".to_string()),
            1 => Just("{\"type\":null,\"text\":null}".to_string()),
            1 => Just("{\"type\":\"text\",\"text\":\"a\",\"text\":\"b\"}".to_string()),
            1 => Just("[\"text\",\"a\"]".to_string()),
            1 => value(),
        ]
    }

    fn message() -> impl Strategy<Value = String> {
        let role = prop_oneof![
            Just("\"user\"".to_string()),
            Just("\"system\"".to_string()),
            Just("\"assistant\"".to_string()),
            Just("null".to_string()),
            string(),
            number(),
        ];
        let content = prop_oneof![
            3 => string(),
            2 => prop::collection::vec(part(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            1 => Just("null".to_string()),
            1 => value(),
        ];
        let field = prop_oneof![
            3 => role.prop_map(|r| format!("\"role\":{r}")),
            3 => content.prop_map(|c| format!("\"content\":{c}")),
            1 => value().prop_map(|v| format!("\"tool_calls\":{v}")),
            1 => value().prop_map(|v| format!("\"name\":{v}")),
        ];
        prop_oneof![
            8 => prop::collection::vec(field, 0..4).prop_map(|f| format!("{{{}}}", f.join(","))),
            1 => value(),
        ]
    }

    fn field() -> impl Strategy<Value = String> {
        let messages = prop_oneof![
            6 => prop::collection::vec(message(), 0..4).prop_map(|v| format!("[{}]", v.join(","))),
            1 => Just("null".to_string()),
            1 => value(),
        ];
        let known = prop_oneof![
            Just("model"),
            Just("stream"),
            Just("max_tokens"),
            Just("max_completion_tokens"),
            Just("cache_salt"),
            Just("tools"),
        ];
        prop_oneof![
            4 => prompt().prop_map(|p| format!("\"prompt\":{p}")),
            3 => messages.prop_map(|m| format!("\"messages\":{m}")),
            1 => value().prop_map(|v| format!("\"tools\":{v}")),
            1 => (known, value()).prop_map(|(k, v)| format!("\"{k}\":{v}")),
            1 => string().prop_map(|s| format!("\"model\":{s}")),
            1 => string().prop_map(|s| format!("\"cache_salt\":{s}")),
            1 => number().prop_map(|n| format!("\"max_tokens\":{n}")),
            2 => prop::sample::select(vec!["true", "false", "null", "1"]).prop_map(|b| format!("\"stream\":{b}")),
            2 => id().prop_map(|n| format!("\"max_completion_tokens\":{n}")),
            2 => (string(), value()).prop_map(|(k, v)| format!("{k}:{v}")),
            1 => value().prop_map(|v| format!("\"pr\\u006fmpt\":{v}")),
            1 => value().prop_map(|v| format!("\"x\":{v}")),
        ]
    }

    fn body() -> impl Strategy<Value = String> {
        let messages = prop::collection::vec(message(), 0..4)
            .prop_map(|v| format!("\"messages\":[{}]", v.join(",")));
        let object = (
            prop::collection::vec(field(), 0..4),
            prop::option::weighted(0.8, prompt().prop_map(|p| format!("\"prompt\":{p}"))),
            prop::option::weighted(0.6, messages),
            any::<prop::sample::Index>(),
            any::<prop::sample::Index>(),
            prop::collection::vec(ws(), 8),
        )
            .prop_map(|(mut f, p, m, at_p, at_m, w)| {
                if let Some(p) = p {
                    f.insert(at_p.index(f.len() + 1), p);
                }
                if let Some(m) = m {
                    f.insert(at_m.index(f.len() + 1), m);
                }
                let f: Vec<String> = f
                    .into_iter()
                    .enumerate()
                    .map(|(i, f)| format!("{}{f}{}", w[i % 8], w[(i + 3) % 8]))
                    .collect();
                format!("{}{{{}}}{}", w[6], f.join(","), w[7])
            });
        prop_oneof![
            20 => object,
            1 => value(),
            1 => prop::collection::vec(prompt(), 0..3).prop_map(|v| format!("[null,true,7,null,{}]", v.join(","))),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(4000))]

        #[test]
        fn random_bodies_read_as_the_reference_reads_them(b in body()) {
            check(b.as_bytes())?;
        }

        #[test]
        fn mutated_bodies_read_as_the_reference_reads_them(
            b in body(),
            edits in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..3),
            cut in any::<prop::sample::Index>(),
            truncate in any::<bool>(),
        ) {
            let mut b = b.into_bytes();
            for (at, byte) in edits {
                if !b.is_empty() {
                    let i = at.index(b.len());
                    b[i] = byte;
                }
            }
            if truncate && !b.is_empty() {
                b.truncate(cut.index(b.len()));
            }
            check(&b)?;
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(300))]

        /// Long token-id prompts (the bodies the early scan is for) arriving in slices of any size:
        /// the same result as reading the body whole, with a byte changed now and then.
        #[test]
        fn long_id_prompts_read_the_same_after_an_early_scan(
            ids in prop::collection::vec(prop_oneof![50 => 0u32..200_000, 1 => any::<u32>()], 0..3000),
            sep in prop::sample::select(vec![",", ", ", " , ", ",\n", ",\t "]),
            head in prop::sample::select(vec!["", "\"model\":\"m\",", "\"cache_salt\":\"s\",", "\"model\":\"m\",\"cache_salt\":null,"]),
            step in 1usize..5000,
            edit in prop::option::weighted(0.2, (any::<prop::sample::Index>(), any::<u8>())),
        ) {
            let list: Vec<String> = ids.iter().map(u32::to_string).collect();
            let mut body = format!("{{{head}\"prompt\": [{}], \"stream\": true}}", list.join(sep)).into_bytes();
            if let Some((at, byte)) = edit {
                let i = at.index(body.len());
                body[i] = byte;
            }
            for path in ["/v1/completions", "/v1/chat/completions"] {
                let whole = read_request_with(path, &body, Some("s"), 16, 1 << 24, None);
                let mut scan = EarlyScan::new(16);
                let mut n = 0;
                while n + step < body.len() {
                    n += step;
                    scan.advance(&body[..n]);
                }
                let early = read_request_early(path, &body, Some("s"), 16, 1 << 24, None, Some(scan), None);
                prop_assert!(same(&early, &whole), "{path} step {step}: early {early:?} vs whole {whole:?}");
            }
        }
    }

    /// The generator must reach the readers' success paths, not only their errors (else the
    /// comparison would hold with a one-pass reader that left every body to serde).
    #[test]
    fn random_bodies_are_mostly_readable() {
        use proptest::strategy::ValueTree;
        let mut runner = proptest::test_runner::TestRunner::deterministic();
        let (mut ok, mut exact, n) = (0, 0, 2000);
        for _ in 0..n {
            let b = body().new_tree(&mut runner).unwrap().current();
            for path in ["/v1/completions", "/v1/chat/completions"] {
                if let Ok(r) = read_request_reference(path, b.as_bytes(), None, 4, 1 << 20, None) {
                    ok += 1;
                    exact += matches!(r.identity, kvsteer_core::PromptIdentity::Exact(ref h) if h.len() > 2)
                        as usize;
                }
            }
        }
        assert!(ok > n / 10, "only {ok} of {} reads succeeded", 2 * n);
        assert!(
            exact > n / 20,
            "only {exact} reads had a token prompt of 3 blocks or more"
        );
    }

    /// Deep nesting, long numbers and the other extremes, each read both ways.
    #[test]
    fn extremes_read_as_the_reference_reads_them() {
        let deep = |n: usize| {
            format!(
                "{{\"x\":{}1{}, \"prompt\":[1]}}",
                "[".repeat(n),
                "]".repeat(n)
            )
        };
        let mut bodies: Vec<String> = (60..70).chain(120..132).map(deep).collect();
        bodies.push(format!("{{\"prompt\":{}}}", "[".repeat(10_000)));
        bodies.push(format!("{{\"prompt\":\"{}\"}}", "é".repeat(5000)));
        bodies.push(format!(
            "{{\"prompt\":[{}]}}",
            vec!["4294967295"; 3000].join(",")
        ));
        bodies.push(r#"{"cache_salt":"a","prompt":[1,2,3,4,5,6,7,8],"cache_salt":"b"}"#.into());
        bodies.push(r#"{"prompt":[1,2,3,4,5,6,7,8],"cache_salt":"b"}"#.into());
        bodies.push(r#"{"prompt":[[1,2,3,4,5],[6]],"cache_salt":"b"}"#.into());
        bodies.push(r#"{"prompt":[[1,2,3,4,5],[6]],"prompt":null}"#.into());
        bodies.push("{\"prompt\":[1,2]}\u{0}".into());
        bodies.push(" \n{ \"prompt\" : [ 1 , 2 ] } \n".into());
        for b in &bodies {
            check(b.as_bytes()).unwrap();
        }
        check(b"{\"prompt\":\"\xff\"}").unwrap();
        check(b"{\"x\":\"\xe6\x97\"}").unwrap();
        check(b"{\"x\":1}\xff").unwrap();
        // Surrogate escapes in strings the fast reader skips as well as in those it reads: a pair
        // is a character, anything else an error (found by the random bodies above).
        for s in [
            r"\ud83e",
            r"\ud83ex",
            r"\ud83e\u0041",
            r"\udd80",
            r"\ud83e\udd80",
            r"\ud83e\ud83e",
        ] {
            for b in [
                format!(r#"{{"messages":[{{"content":[{{"":"{s}"}}]}}]}}"#),
                format!(r#"{{"x":"{s}","prompt":[1,2]}}"#),
                format!(r#"{{"prompt":"{s}"}}"#),
                format!(r#"{{"messages":[{{"role":"user","content":"{s}"}}]}}"#),
            ] {
                check(b.as_bytes()).unwrap();
            }
        }
    }
}

/// A JSON value of a few levels with strings that hold brackets, quotes and escapes.
fn arb_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::Value;
    let leaf = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(Value::from),
        "[a-z{}\\[\\]\",:\\\\ é\n]{0,8}".prop_map(Value::String),
    ];
    leaf.prop_recursive(3, 24, 4, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
            prop::collection::btree_map("[a-z\"]{1,6}", inner, 0..4)
                .prop_map(|m| Value::Object(m.into_iter().collect())),
        ]
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(400))]

    /// The gateway's model scan (which pool reads the body) finds what a JSON parser finds at the
    /// top level, wherever `model` sits among other members, and nothing when it is absent.
    #[test]
    fn model_scan_equals_a_json_parser(
        members in prop::collection::btree_map("[a-z\"]{1,6}", arb_json(), 0..5),
        model in prop::option::of("[a-zA-Z0-9./:\"\\\\é-]{0,12}"),
        pretty in any::<bool>(),
        pad in prop::option::of((prop::sample::select(vec!["aaa", "pad"]), 0usize..9000)),
    ) {
        use kvsteer_core::request::{ModelField, model_of};
        let mut obj: serde_json::Map<String, serde_json::Value> = members.into_iter().collect();
        obj.remove("model");
        if let Some(m) = &model {
            obj.insert("model".into(), serde_json::Value::String(m.clone()));
        }
        // A long member before or after `model`, with quotes and backslashes at every distance,
        // so the read from the end meets its window's edge inside a string.
        if let Some((key, len)) = pad {
            let text: String = "ab\\\"c{]".chars().cycle().take(len).collect();
            obj.insert(key.into(), serde_json::Value::String(text));
        }
        let v = serde_json::Value::Object(obj);
        let body = if pretty { serde_json::to_vec_pretty(&v) } else { serde_json::to_vec(&v) }.unwrap();
        let expected = match &model {
            Some(m) => ModelField::Named(m.as_str().into()),
            None => ModelField::Absent,
        };
        prop_assert_eq!(model_of(&body), expected);
    }
}
