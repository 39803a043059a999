//! Reading OpenAI request bodies (completions, chat completions, and the tokenizer and renderer
//! endpoints built on them) into what the engine runs, with vLLM-style 400s naming the parameter.

use super::api::ApiError;
use crate::output::VOCAB;
use crate::tokenize::tokenize;
use serde_json::{Map, Value};

/// Which OpenAI API a request speaks.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Api {
    Completions,
    Chat,
}

/// A generation request, as the engine and the answer need it.
pub(super) struct GenParams {
    pub model: String,
    pub prompt: Vec<u32>,
    pub max_tokens: Option<u32>,
    pub ignore_eos: bool,
    pub min_tokens: u32,
    pub stream: bool,
    pub return_token_ids: bool,
    /// `kv_transfer_params.do_remote_decode`: a P/D prefill leg (docs/design/pd.md); its answer
    /// carries `kv_transfer_params` for the decode leg.
    pub remote_decode: bool,
    /// `kv_transfer_params.do_remote_prefill`: a P/D decode leg; the prompt's KV is read over the
    /// modelled link ([`crate::Engine::submit_remote`]) instead of computed.
    pub remote_prefill: bool,
}

/// The request body as a JSON object, or an OpenAI-style error.
pub(super) fn body_object(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad("body", format!("malformed JSON: {e}")))?;
    match v {
        Value::Object(o) => Ok(o),
        _ => Err(ApiError::bad(
            "body",
            "the request body must be a JSON object",
        )),
    }
}

/// The prompt's token ids as generation would compute them: `prompt` (completions) or `messages`
/// (chat, with the server's framing).
pub(super) fn request_prompt(o: &Map<String, Value>, api: Api) -> Result<Vec<u32>, ApiError> {
    match api {
        Api::Completions => completion_prompt(o.get("prompt")),
        Api::Chat => chat_prompt(o.get("messages"), o.get("tools")),
    }
}

/// The P/D flags of a request's `kv_transfer_params` (absent or null: neither). vLLM takes any JSON
/// object there; a value that is not an object, or flags that are not booleans, are refused here.
fn kv_transfer_flags(o: &Map<String, Value>) -> Result<(bool, bool), ApiError> {
    const K: &str = "kv_transfer_params";
    match o.get(K) {
        None | Some(Value::Null) => Ok((false, false)),
        Some(Value::Object(kv)) => {
            let flag = |k: &str| match kv.get(k) {
                None | Some(Value::Null) => Ok(false),
                Some(Value::Bool(b)) => Ok(*b),
                Some(_) => Err(ApiError::bad(K, format!("{K}.{k} must be a boolean"))),
            };
            Ok((flag("do_remote_decode")?, flag("do_remote_prefill")?))
        }
        Some(_) => Err(ApiError::bad(K, format!("{K} must be an object"))),
    }
}

/// A boolean field; absent or null is false, anything but a boolean is a 400 naming it.
pub(super) fn get_bool(o: &Map<String, Value>, k: &'static str) -> Result<bool, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(false),
        Some(Value::Bool(b)) => Ok(*b),
        Some(_) => Err(ApiError::bad(k, format!("{k} must be a boolean"))),
    }
}

/// A count field; absent or null is `None`, anything but an integer in `u32` is a 400 naming it.
pub(super) fn get_u32(o: &Map<String, Value>, k: &'static str) -> Result<Option<u32>, ApiError> {
    match o.get(k) {
        None | Some(Value::Null) => Ok(None),
        Some(v) => v
            .as_u64()
            .and_then(|n| u32::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| ApiError::bad(k, format!("{k} must be a non-negative integer"))),
    }
}

/// Token ids, if every one is an integer inside the vocabulary.
fn token_ids(a: &[Value]) -> Option<Vec<u32>> {
    a.iter()
        .map(|v| v.as_u64().filter(|&n| n < VOCAB as u64).map(|n| n as u32))
        .collect()
}

/// `prompt`: a string, a list of token ids, or a list of one of those (vLLM's accepted forms,
/// batches aside).
fn completion_prompt(v: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::bad("prompt", m.to_string());
    match v {
        None | Some(Value::Null) => Err(bad("prompt is required")),
        Some(Value::String(s)) => Ok(tokenize(s)),
        Some(Value::Array(a)) if a.is_empty() => Err(bad("prompt must not be empty")),
        Some(Value::Array(a)) if a[0].is_number() => {
            token_ids(a).ok_or_else(|| bad(&format!("token ids must be integers below {VOCAB}")))
        }
        Some(Value::Array(a)) if a.len() == 1 => match &a[0] {
            Value::String(s) => Ok(tokenize(s)),
            Value::Array(ids) => token_ids(ids)
                .ok_or_else(|| bad(&format!("token ids must be integers below {VOCAB}"))),
            _ => Err(bad(
                "prompt must be a string, a list of token ids, or a list of one of those",
            )),
        },
        Some(Value::Array(_)) => Err(bad(
            "batched prompts are not supported: send one prompt a request",
        )),
        Some(_) => Err(bad("prompt must be a string or a list of token ids")),
    }
}

/// Renders chat messages with a fixed template and tokenizes them with the stand-in; with a Hugging
/// Face bundle, with the bundle's own template when it renders them ([`hf_chat_prompt`]).
fn chat_prompt(v: Option<&Value>, tools: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: String| ApiError::bad("messages", m);
    let Some(Value::Array(msgs)) = v else {
        return Err(bad("messages must be a list of messages".into()));
    };
    if msgs.is_empty() {
        return Err(bad("messages must not be empty".into()));
    }
    if let Some(ids) = hf_chat_prompt(msgs, tools) {
        return Ok(ids);
    }
    let mut text = String::new();
    for (i, m) in msgs.iter().enumerate() {
        let Some(role) = m.get("role").and_then(Value::as_str) else {
            return Err(bad(format!("messages[{i}].role must be a string")));
        };
        text.push_str("<|start|>");
        text.push_str(role);
        text.push('\n');
        match m.get("content") {
            None | Some(Value::Null) => {}
            Some(Value::String(s)) => text.push_str(s),
            Some(Value::Array(parts)) => {
                for p in parts {
                    match p.get("text").and_then(Value::as_str) {
                        Some(t) => text.push_str(t),
                        None => {
                            return Err(bad(format!(
                                "messages[{i}].content parts must be text parts"
                            )));
                        }
                    }
                }
            }
            Some(_) => {
                return Err(bad(format!(
                    "messages[{i}].content must be a string or a list of parts"
                )));
            }
        }
        text.push_str("<|end|>\n");
    }
    text.push_str("<|start|>assistant\n");
    Ok(tokenize(&text))
}

/// A chat through the Hugging Face bundle's template (none without `--huggingface`, or when the
/// template refuses it): text parts joined with newlines, as vLLM does for string templates.
fn hf_chat_prompt(msgs: &[Value], tools: Option<&Value>) -> Option<Vec<u32>> {
    if !crate::tokenize::huggingface() {
        return None;
    }
    let turns: Vec<kvsteer_core::request::ChatTurn> = msgs
        .iter()
        .map(|m| kvsteer_core::request::ChatTurn {
            role: m.get("role").and_then(Value::as_str),
            parts: match m.get("content") {
                Some(Value::String(s)) => vec![s.as_str()],
                Some(Value::Array(ps)) => ps
                    .iter()
                    .filter_map(|p| p.get("text").and_then(Value::as_str))
                    .collect(),
                _ => Vec::new(),
            },
            non_text: false,
            tool_calls: m.get("tool_calls").is_some(),
        })
        .collect();
    let tools = tools.filter(|t| !t.is_null()).map(Value::to_string);
    crate::tokenize::hf_chat(&turns, tools.as_deref())
}

/// A completions or chat completions body. Sampling fields the simulator has no use for
/// (`temperature`, `top_p`, `stop`, ...) are accepted and ignored.
pub(super) fn parse_params(body: &[u8], api: Api) -> Result<GenParams, ApiError> {
    let o = &body_object(body)?;
    let model = match o.get("model") {
        None | Some(Value::Null) => String::new(),
        Some(Value::String(s)) => s.clone(),
        Some(_) => return Err(ApiError::bad("model", "model must be a string")),
    };
    let prompt = request_prompt(o, api)?;
    let mut max_tokens = get_u32(o, "max_tokens")?;
    if api == Api::Chat {
        max_tokens = get_u32(o, "max_completion_tokens")?.or(max_tokens);
    }
    if max_tokens == Some(0) {
        return Err(ApiError::bad("max_tokens", "max_tokens must be at least 1"));
    }
    let (remote_decode, remote_prefill) = kv_transfer_flags(o)?;
    Ok(GenParams {
        model,
        prompt,
        max_tokens,
        ignore_eos: get_bool(o, "ignore_eos")?,
        min_tokens: get_u32(o, "min_tokens")?.unwrap_or(0),
        stream: get_bool(o, "stream")?,
        return_token_ids: get_bool(o, "return_token_ids")?,
        remote_decode,
        remote_prefill,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(api: Api, body: &str) -> Result<GenParams, ApiError> {
        parse_params(body.as_bytes(), api)
    }

    #[test]
    fn prompts_in_every_accepted_form() {
        let ids = |b: &str| params(Api::Completions, b).map(|p| p.prompt);
        assert_eq!(ids(r#"{"prompt": [1, 2, 3]}"#).unwrap(), vec![1, 2, 3]);
        assert_eq!(ids(r#"{"prompt": [[4, 5]]}"#).unwrap(), vec![4, 5]);
        assert_eq!(ids(r#"{"prompt": ["abcd"]}"#).unwrap(), tokenize("abcd"));
        assert_eq!(ids(r#"{"prompt": "abcd"}"#).unwrap(), tokenize("abcd"));
        for bad in [
            r#"{}"#,
            r#"{"prompt": []}"#,
            r#"{"prompt": [[1], [2]]}"#,
            r#"{"prompt": [1, -2]}"#,
            r#"{"prompt": 7}"#,
        ] {
            let e = ids(bad).expect_err(bad);
            assert_eq!((e.status, e.param), (400, Some("prompt")), "{bad}");
        }
    }

    #[test]
    fn chat_messages_are_framed_then_tokenized() {
        let p = params(
            Api::Chat,
            r#"{"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
                "max_completion_tokens": 3, "max_tokens": 9}"#,
        )
        .unwrap();
        assert_eq!(
            p.prompt,
            tokenize("<|start|>user\nhi<|end|>\n<|start|>assistant\n")
        );
        assert_eq!(p.max_tokens, Some(3), "max_completion_tokens wins in chat");
        let e = params(Api::Chat, r#"{"messages": [{"content": "x"}]}"#)
            .err()
            .unwrap();
        assert_eq!(e.param, Some("messages"));
        assert!(e.message.contains("messages[0].role"), "{}", e.message);
    }

    #[test]
    fn fields_of_the_wrong_type_are_named() {
        for (body, param) in [
            (r#"{"prompt": "x", "max_tokens": "many"}"#, "max_tokens"),
            (r#"{"prompt": "x", "max_tokens": 0}"#, "max_tokens"),
            (r#"{"prompt": "x", "stream": 1}"#, "stream"),
            (r#"{"prompt": "x", "model": 3}"#, "model"),
            (
                r#"{"prompt": "x", "kv_transfer_params": []}"#,
                "kv_transfer_params",
            ),
            (
                r#"{"prompt": "x", "kv_transfer_params": {"do_remote_decode": 1}}"#,
                "kv_transfer_params",
            ),
            ("[1, 2]", "body"),
            ("{nope", "body"),
        ] {
            let e = params(Api::Completions, body).err().expect(body);
            assert_eq!((e.status, e.param), (400, Some(param)), "{body}");
        }
    }

    #[test]
    fn kv_transfer_flags_mark_the_pd_legs() {
        let p = params(
            Api::Completions,
            r#"{"prompt": "x", "kv_transfer_params": {"do_remote_decode": true}}"#,
        )
        .unwrap();
        assert!(p.remote_decode && !p.remote_prefill);
        let p = params(
            Api::Completions,
            r#"{"prompt": "x", "kv_transfer_params": {"do_remote_prefill": true}}"#,
        )
        .unwrap();
        assert!(!p.remote_decode && p.remote_prefill);
        let p = params(
            Api::Completions,
            r#"{"prompt": "x", "kv_transfer_params": null}"#,
        )
        .unwrap();
        assert!(!p.remote_decode && !p.remote_prefill);
    }
}
