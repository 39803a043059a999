//! The two legs of a prefill/decode (P/D) request, as the filter carries them out
//! (docs/design/pd.md): the bodies it sends and how it reads the prefill replica's answer. Free of
//! host calls, so every way a client or a replica can get these bytes wrong is tested natively.
//!
//! vLLM's protocol: the **prefill leg** is the client's request with `stream` off, a 1-token limit and
//! `kv_transfer_params` asking for remote decode; the prefill engine computes the prompt and answers
//! `kv_transfer_params` naming where its KV is. The **decode leg** is the client's own request with
//! that object in `kv_transfer_params`, sent to a decode replica, whose answer goes to the client.

use serde_json::{Map, Value, json};

pub const KV_TRANSFER_PARAMS: &str = "kv_transfer_params";

/// The client's body as a JSON object (`None`: not one).
pub fn client_request(body: &[u8]) -> Option<Map<String, Value>> {
    match serde_json::from_slice::<Value>(body) {
        Ok(Value::Object(m)) => Some(m),
        _ => None,
    }
}

/// What the prefill leg asks for: vLLM's `do_remote_decode` request (its toy P/D proxy's fields).
pub fn remote_decode_params() -> Value {
    json!({"do_remote_decode": true, "do_remote_prefill": false, "remote_engine_id": null,
        "remote_block_ids": null, "remote_host": null, "remote_port": null})
}

/// The prefill leg's body: the client's fields with `stream` false, `max_tokens` 1 (and
/// `max_completion_tokens` 1 when the client gave it: a chat request may cap with either), no
/// `stream_options` (refused without `stream`), no `min_tokens` / `min_completion_tokens` (a minimum
/// above 1 would contradict the cap; the decode leg keeps them), and `kv_transfer_params` asking for
/// remote decode whatever the client sent there.
pub fn prefill_body(client: &Map<String, Value>) -> Vec<u8> {
    let mut m = client.clone();
    m.insert("stream".into(), Value::Bool(false));
    m.insert("max_tokens".into(), json!(1));
    if m.contains_key("max_completion_tokens") {
        m.insert("max_completion_tokens".into(), json!(1));
    }
    for k in ["stream_options", "min_tokens", "min_completion_tokens"] {
        m.remove(k);
    }
    m.insert(KV_TRANSFER_PARAMS.into(), remote_decode_params());
    serde_json::to_vec(&m).unwrap_or_default()
}

/// The decode leg's body: the client's fields as sent, with `kv_transfer_params` replaced by the
/// prefill answer's object verbatim, or removed when there is none (the decode replica then computes
/// the prompt itself). A client's own `kv_transfer_params` never reaches the decode replica: it
/// could name a producer to read KV from.
pub fn decode_body(mut client: Map<String, Value>, params: Option<Value>) -> Vec<u8> {
    match params {
        Some(p) => {
            client.insert(KV_TRANSFER_PARAMS.into(), p);
        }
        None => {
            client.remove(KV_TRANSFER_PARAMS);
        }
    }
    serde_json::to_vec(&client).unwrap_or_default()
}

/// What a usable prefill answer carries.
#[derive(Clone, Debug, PartialEq)]
pub enum PrefillAnswer {
    /// Its `kv_transfer_params` object, for the decode leg.
    Params(Value),
    /// A 2xx JSON answer without an object `kv_transfer_params` (a prefill engine without a KV
    /// connector, or one that did not stop at the length cap): the decode leg goes as a plain
    /// request and the decode replica computes the prompt, as vLLM's proxy does.
    Plain,
}

/// Why a prefill leg failed (the client gets a 502 naming it).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum LegFailure {
    /// The callout could not be sent (unknown cluster, ...).
    NotSent(String),
    /// No answer: connection refused or reset, or the callout timed out.
    NoAnswer,
    Status(u16),
    /// The answer's body is over `pd.max_prefill_response_bytes`.
    Oversized(usize),
    /// The answer's body is not a JSON object.
    NotJson,
}

impl core::fmt::Display for LegFailure {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            LegFailure::NotSent(why) => write!(f, "could not be sent ({why})"),
            LegFailure::NoAnswer => f.write_str("got no answer (refused, reset or timed out)"),
            LegFailure::Status(s) => write!(f, "was answered with status {s}"),
            LegFailure::Oversized(n) => write!(f, "was answered with {n} bytes, over the limit"),
            LegFailure::NotJson => {
                f.write_str("was answered with a body that is not a JSON object")
            }
        }
    }
}

/// Reads a prefill answer: `status` None when the callout got no response headers (Envoy: reset or
/// timeout); `body` is only asked for once the status and size are acceptable, so an oversized body
/// is never copied into the VM.
pub fn read_prefill_answer(
    status: Option<u16>,
    body_size: usize,
    max_bytes: usize,
    body: impl FnOnce() -> Option<Vec<u8>>,
) -> Result<PrefillAnswer, LegFailure> {
    let status = status.ok_or(LegFailure::NoAnswer)?;
    if !(200..300).contains(&status) {
        return Err(LegFailure::Status(status));
    }
    if body_size > max_bytes {
        return Err(LegFailure::Oversized(body_size));
    }
    let bytes = if body_size == 0 {
        Vec::new()
    } else {
        body().unwrap_or_default()
    };
    let Some(mut answer) = client_request(&bytes) else {
        return Err(LegFailure::NotJson);
    };
    Ok(match answer.remove(KV_TRANSFER_PARAMS) {
        Some(p @ Value::Object(_)) => PrefillAnswer::Params(p),
        _ => PrefillAnswer::Plain,
    })
}

/// The body of the error answered to the client when a P/D request cannot be served: OpenAI's
/// error shape, naming the leg and the replica.
pub fn error_body(status: u16, leg: &str, replica: &str, message: &str) -> Vec<u8> {
    serde_json::to_vec(&json!({"error": {
        "message": format!("kvsteer: the {leg} leg on {replica} {message}"),
        "type": if status == 503 { "service_unavailable" } else { "bad_gateway" },
        "code": status,
        "leg": leg,
        "replica": replica,
    }}))
    .unwrap_or_default()
}

/// The `x-request-id` both legs carry (vLLM's producer and consumer match a transfer by it, so it
/// must be unique among the requests in flight at a prefill replica): the VM's random `nonce` and its
/// own counter. The filter makes its own rather than trusting a client's header.
pub fn request_id(nonce: u64, n: u64) -> String {
    format!("kvsteer-{nonce:016x}-{n:x}")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn client(v: Value) -> Map<String, Value> {
        match v {
            Value::Object(m) => m,
            _ => unreachable!(),
        }
    }

    fn parsed(bytes: &[u8]) -> Value {
        serde_json::from_slice(bytes).unwrap()
    }

    #[test]
    fn the_prefill_leg_asks_one_token_and_remote_decode() {
        let c = client(json!({"model": "m", "prompt": [1, 2, 3], "stream": true,
            "stream_options": {"include_usage": true}, "max_tokens": 300, "min_tokens": 20,
            "temperature": 0.7, "kv_transfer_params": {"do_remote_prefill": true,
            "remote_host": "10.9.9.9"}}));
        let p = parsed(&prefill_body(&c));
        assert_eq!(p["stream"], json!(false));
        assert_eq!(p["max_tokens"], json!(1));
        assert!(p.get("max_completion_tokens").is_none());
        assert!(p.get("stream_options").is_none() && p.get("min_tokens").is_none());
        assert_eq!(p["kv_transfer_params"], remote_decode_params());
        assert_eq!(p["prompt"], json!([1, 2, 3]));
        assert_eq!(p["temperature"], json!(0.7));
        let chat = client(json!({"messages": [], "max_completion_tokens": 50,
            "min_completion_tokens": 5}));
        let p = parsed(&prefill_body(&chat));
        assert_eq!(p["max_completion_tokens"], json!(1));
        assert_eq!(p["max_tokens"], json!(1));
        assert!(p.get("min_completion_tokens").is_none());
    }

    #[test]
    fn the_decode_leg_is_the_clients_request_with_the_answers_params() {
        let c = client(
            json!({"prompt": "hi", "stream": true, "max_tokens": 300, "min_tokens": 20,
            "kv_transfer_params": {"remote_host": "evil"}}),
        );
        let params = json!({"do_remote_prefill": true, "remote_block_ids": [0, 1],
            "remote_engine_id": "p0", "extra": {"nested": [1]}});
        let d = parsed(&decode_body(c.clone(), Some(params.clone())));
        assert_eq!(d["kv_transfer_params"], params);
        assert_eq!(d["stream"], json!(true));
        assert_eq!(d["max_tokens"], json!(300));
        assert_eq!(d["min_tokens"], json!(20));
        // Without params the client's own are dropped, not passed on.
        let d = parsed(&decode_body(c, None));
        assert!(d.get("kv_transfer_params").is_none());
        assert_eq!(d["prompt"], json!("hi"));
    }

    #[test]
    fn hostile_prefill_answers_are_failures_or_plain_never_panics() {
        let ok = |b: &[u8]| {
            let b = b.to_vec();
            read_prefill_answer(Some(200), b.len(), 1024, || Some(b))
        };
        assert_eq!(
            ok(br#"{"kv_transfer_params": {"do_remote_prefill": true}}"#),
            Ok(PrefillAnswer::Params(json!({"do_remote_prefill": true})))
        );
        assert_eq!(ok(br#"{"choices": []}"#), Ok(PrefillAnswer::Plain));
        assert_eq!(
            ok(br#"{"kv_transfer_params": null}"#),
            Ok(PrefillAnswer::Plain)
        );
        assert_eq!(
            ok(br#"{"kv_transfer_params": [1]}"#),
            Ok(PrefillAnswer::Plain)
        );
        assert_eq!(
            ok(br#"{"kv_transfer_params": "x"}"#),
            Ok(PrefillAnswer::Plain)
        );
        for bad in [
            &b"not json"[..],
            b"[1,2]",
            b"",
            b"\xff\xfe",
            b"{\"a\":",
            b"null",
        ] {
            assert_eq!(ok(bad), Err(LegFailure::NotJson), "{bad:?}");
        }
        // A body the host will not give is a body that is not JSON.
        assert_eq!(
            read_prefill_answer(Some(200), 10, 1024, || None),
            Err(LegFailure::NotJson)
        );
        assert_eq!(
            read_prefill_answer(None, 0, 1024, || unreachable!()),
            Err(LegFailure::NoAnswer)
        );
        assert_eq!(
            read_prefill_answer(Some(500), 10, 1024, || unreachable!()),
            Err(LegFailure::Status(500))
        );
        // Oversized: refused before the body is read.
        assert_eq!(
            read_prefill_answer(Some(200), 5000, 1024, || unreachable!()),
            Err(LegFailure::Oversized(5000))
        );
        // Deep nesting is serde_json's recursion limit, an error, not a stack overflow.
        let deep = format!("{{\"a\":{}{}}}", "[".repeat(100_000), "]".repeat(100_000));
        assert_eq!(
            read_prefill_answer(Some(200), deep.len(), 1 << 20, || Some(deep.into_bytes())),
            Err(LegFailure::NotJson)
        );
    }

    #[test]
    fn errors_name_the_leg_and_ids_differ() {
        let e = parsed(&error_body(
            502,
            "prefill",
            "p0",
            &LegFailure::Status(500).to_string(),
        ));
        assert_eq!(e["error"]["leg"], json!("prefill"));
        assert_eq!(e["error"]["code"], json!(502));
        assert!(
            e["error"]["message"]
                .as_str()
                .unwrap()
                .contains("status 500")
        );
        assert_ne!(request_id(7, 1), request_id(7, 2));
        assert_ne!(request_id(7, 1), request_id(8, 1));
    }
}
