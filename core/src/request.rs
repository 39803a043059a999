//! Reading an OpenAI-style request body into what routing needs: the prompt's block identity, its size,
//! the output-length hint, the session key. Every byte comes from a client: anything malformed,
//! truncated, non-UTF-8 or oversized is a typed [`RequestError`], never a panic.
//!
//! Prompt identity: token-id prompts get the exact (Dynamo) identity and can be matched against the
//! engines' KV feed; text prompts get the approximate text identity until a tokenizer lands. For
//! `/v1/completions` with a batch of prompts, the identity is the first prompt's and the token count is
//! the sum over all of them. For `/v1/chat/completions` the text is each message's role and text parts,
//! framed so that the same conversation prefix gives the same chunks; non-text parts are skipped.

use serde::Deserialize;

use crate::block::{BlockHasher, SeqHash, TextHash, TextHasher};

/// Which endpoint a request is for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Completions,
    ChatCompletions,
}

/// The prompt's identity for matching.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PromptIdentity {
    /// Token ids: exact sequence hashes of full blocks.
    Exact(Vec<SeqHash>),
    /// Text: approximate chunk hashes.
    Approximate(Vec<TextHash>),
}

impl PromptIdentity {
    pub fn blocks(&self) -> usize {
        match self {
            PromptIdentity::Exact(v) => v.len(),
            PromptIdentity::Approximate(v) => v.len(),
        }
    }
}

/// What the router needs from one request.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RouteRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub stream: bool,
    /// `max_completion_tokens`, else `max_tokens`: the output-length hint.
    pub output_hint: Option<u64>,
    pub session_key: Option<String>,
    /// Prompt tokens (approximate for text: 4 characters a token).
    pub prompt_tokens: u64,
    pub identity: PromptIdentity,
}

/// Why a body could not be read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RequestError {
    TooLarge {
        len: usize,
        max: usize,
    },
    UnsupportedPath(String),
    NotUtf8,
    /// Not JSON of the expected shape; the message is serde_json's (with line and column).
    Json(String),
    /// Neither `prompt` (completions) nor `messages` (chat) is present.
    MissingPrompt,
    /// A prompt list mixing kinds, or an empty one.
    BadPrompt(&'static str),
}

impl core::fmt::Display for RequestError {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        match self {
            RequestError::TooLarge { len, max } => {
                write!(
                    f,
                    "request body of {len} bytes exceeds max_body_bytes {max}"
                )
            }
            RequestError::UnsupportedPath(p) => write!(f, "unsupported path {p:?}"),
            RequestError::NotUtf8 => write!(f, "request body is not UTF-8"),
            RequestError::Json(m) => write!(f, "request body: {m}"),
            RequestError::MissingPrompt => write!(f, "request has no prompt or messages"),
            RequestError::BadPrompt(m) => write!(f, "bad prompt: {m}"),
        }
    }
}

impl std::error::Error for RequestError {}

/// The `prompt` field in its four OpenAI shapes.
enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

/// One element of a prompt list: a token id, a text, or a list of token ids.
enum PromptItem {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

// Hand-written visitors instead of `#[serde(untagged)]`: untagged enums buffer the whole value into
// serde's generic `Content` first, which made an 8K-token-id body five times slower to read.
impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = PromptItem;
            fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
                f.write_str("a token id (u32), a string, or a list of token ids")
            }
            fn visit_u64<E: serde::de::Error>(self, v: u64) -> Result<PromptItem, E> {
                u32::try_from(v)
                    .map(PromptItem::Token)
                    .map_err(|_| E::custom(format!("token id {v} out of range")))
            }
            fn visit_i64<E: serde::de::Error>(self, v: i64) -> Result<PromptItem, E> {
                Err(E::custom(format!("token id {v} out of range")))
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut a: A,
            ) -> Result<PromptItem, A::Error> {
                let mut v = Vec::with_capacity(a.size_hint().unwrap_or(0).min(1 << 16));
                while let Some(t) = a.next_element::<u32>()? {
                    v.push(t);
                }
                Ok(PromptItem::Tokens(v))
            }
        }
        d.deserialize_any(V)
    }
}

impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct V;
        impl<'de> serde::de::Visitor<'de> for V {
            type Value = Prompt;
            fn expecting(&self, f: &mut core::fmt::Formatter) -> core::fmt::Result {
                f.write_str("a string, a list of token ids, a list of strings, or a list of lists")
            }
            fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Prompt, E> {
                Ok(Prompt::Text(v.to_string()))
            }
            fn visit_string<E: serde::de::Error>(self, v: String) -> Result<Prompt, E> {
                Ok(Prompt::Text(v))
            }
            fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut a: A) -> Result<Prompt, A::Error> {
                use serde::de::Error;
                let mixed = || A::Error::custom("prompt list mixes token ids, strings and lists");
                let Some(first) = a.next_element::<PromptItem>()? else {
                    return Ok(Prompt::Tokens(Vec::new()));
                };
                let hint = a.size_hint().unwrap_or(0).min(1 << 16);
                Ok(match first {
                    PromptItem::Token(t) => {
                        let mut v = Vec::with_capacity(hint + 1);
                        v.push(t);
                        while let Some(t) = a.next_element::<u32>()? {
                            v.push(t);
                        }
                        Prompt::Tokens(v)
                    }
                    PromptItem::Text(s) => {
                        let mut v = vec![s];
                        while let Some(item) = a.next_element::<PromptItem>()? {
                            match item {
                                PromptItem::Text(s) => v.push(s),
                                _ => return Err(mixed()),
                            }
                        }
                        Prompt::Texts(v)
                    }
                    PromptItem::Tokens(t) => {
                        let mut v = vec![t];
                        while let Some(item) = a.next_element::<PromptItem>()? {
                            match item {
                                PromptItem::Tokens(t) => v.push(t),
                                _ => return Err(mixed()),
                            }
                        }
                        Prompt::TokenLists(v)
                    }
                })
            }
        }
        d.deserialize_any(V)
    }
}

#[derive(Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Deserialize)]
struct Part {
    #[serde(rename = "type", default)]
    kind: Option<String>,
    #[serde(default)]
    text: Option<String>,
}

#[derive(Deserialize)]
struct Message {
    #[serde(default)]
    role: Option<String>,
    #[serde(default)]
    content: Option<Content>,
}

/// The fields read; everything else in the body is ignored (clients send many more).
#[derive(Deserialize)]
struct Body {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    #[serde(default)]
    prompt: Option<Prompt>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    /// vLLM's per-request cache salt: blocks under another salt are never shared.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Endpoint for a `:path` (query string allowed).
pub fn endpoint(path: &str) -> Result<Endpoint, RequestError> {
    let p = path.split(['?', '#']).next().unwrap_or("");
    match p.trim_end_matches('/') {
        "/v1/completions" => Ok(Endpoint::Completions),
        "/v1/chat/completions" => Ok(Endpoint::ChatCompletions),
        _ => Err(RequestError::UnsupportedPath(
            path.chars().take(200).collect(),
        )),
    }
}

/// Reads a request body. `block_size` must be valid (the router checked it at configuration).
pub fn read_request(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
) -> Result<RouteRequest, RequestError> {
    if body.len() > max_body_bytes {
        return Err(RequestError::TooLarge {
            len: body.len(),
            max: max_body_bytes,
        });
    }
    let endpoint = endpoint(path)?;
    let text = core::str::from_utf8(body).map_err(|_| RequestError::NotUtf8)?;
    let b: Body = serde_json::from_str(text).map_err(|e| RequestError::Json(e.to_string()))?;
    let bad_size = |_| RequestError::BadPrompt("invalid block size");
    let (prompt_tokens, identity) = match (endpoint, b.prompt, b.messages) {
        (Endpoint::Completions, Some(p), _) => {
            let hasher = BlockHasher::new(block_size)
                .map_err(bad_size)?
                .namespaced(None, b.cache_salt.as_deref());
            let texter = TextHasher::new(block_size).map_err(bad_size)?;
            match p {
                Prompt::Text(s) => text_identity(&texter, &[s.as_str()]),
                Prompt::Texts(v) => {
                    let first = v
                        .first()
                        .ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    let (_, id) = text_identity(&texter, &[first.as_str()]);
                    let chars: usize = v.iter().map(|s| s.chars().count()).sum();
                    (TextHasher::approx_tokens(chars) as u64, id)
                }
                Prompt::Tokens(t) => (
                    t.len() as u64,
                    PromptIdentity::Exact(hasher.sequence_hashes(&t)),
                ),
                Prompt::TokenLists(v) => {
                    let first = v
                        .first()
                        .ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    let total: usize = v.iter().map(Vec::len).sum();
                    (
                        total as u64,
                        PromptIdentity::Exact(hasher.sequence_hashes(first)),
                    )
                }
            }
        }
        (Endpoint::ChatCompletions, _, Some(msgs)) => {
            let texter = TextHasher::new(block_size).map_err(bad_size)?;
            let mut parts: Vec<&str> = Vec::with_capacity(msgs.len() * 4);
            for m in &msgs {
                parts.push("<|");
                parts.push(m.role.as_deref().unwrap_or(""));
                parts.push("|>");
                match &m.content {
                    Some(Content::Text(s)) => parts.push(s),
                    Some(Content::Parts(ps)) => {
                        for p in ps {
                            if p.kind.as_deref().is_none_or(|k| k == "text")
                                && let Some(t) = &p.text
                            {
                                parts.push(t);
                            }
                        }
                    }
                    None => {}
                }
                parts.push("\n");
            }
            text_identity(&texter, &parts)
        }
        _ => return Err(RequestError::MissingPrompt),
    };
    Ok(RouteRequest {
        endpoint,
        model: b.model,
        stream: b.stream.unwrap_or(false),
        output_hint: b.max_completion_tokens.or(b.max_tokens),
        session_key: session_key.map(str::to_string),
        prompt_tokens,
        identity,
    })
}

/// Approximate identity of the concatenation of `parts` (without building it when it is one part).
fn text_identity(texter: &TextHasher, parts: &[&str]) -> (u64, PromptIdentity) {
    let joined;
    let text: &str = if parts.len() == 1 {
        parts[0]
    } else {
        joined = parts.concat();
        &joined
    };
    let mut out = Vec::new();
    let chars = texter.extend(None, text, &mut out);
    (
        TextHasher::approx_tokens(chars) as u64,
        PromptIdentity::Approximate(out),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(path: &str, body: &str) -> Result<RouteRequest, RequestError> {
        read_request(path, body.as_bytes(), Some("s1"), 4, 1 << 20)
    }

    #[test]
    fn token_prompt_is_exact() {
        let r = read(
            "/v1/completions?x=1",
            r#"{"model":"m","prompt":[1,2,3,4,5,6,7,8,9],"max_tokens":7,"stream":true,"extra":{"a":[1]}}"#,
        )
        .unwrap();
        assert_eq!(r.prompt_tokens, 9);
        assert_eq!(r.output_hint, Some(7));
        assert!(r.stream);
        assert_eq!(r.model.as_deref(), Some("m"));
        assert_eq!(r.session_key.as_deref(), Some("s1"));
        let h = BlockHasher::new(4).unwrap();
        assert_eq!(
            r.identity,
            PromptIdentity::Exact(h.sequence_hashes(&[1, 2, 3, 4, 5, 6, 7, 8]))
        );
    }

    #[test]
    fn prompt_lists_and_text() {
        let r = read("/v1/completions", r#"{"prompt":[[1,2,3,4],[5,6]]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 6);
        assert_eq!(r.identity.blocks(), 1);
        let r = read("/v1/completions", r#"{"prompt":"abcdefghijklmnopq"}"#).unwrap();
        assert_eq!(r.prompt_tokens, 5);
        assert!(matches!(r.identity, PromptIdentity::Approximate(ref v) if v.len() == 1));
        let r = read("/v1/completions", r#"{"prompt":["abcd","ef"]}"#).unwrap();
        assert_eq!(r.prompt_tokens, 2);
        // cache_salt changes the exact identity.
        let a = read("/v1/completions", r#"{"prompt":[1,2,3,4]}"#).unwrap();
        let b = read(
            "/v1/completions",
            r#"{"prompt":[1,2,3,4],"cache_salt":"x"}"#,
        )
        .unwrap();
        assert_ne!(a.identity, b.identity);
    }

    #[test]
    fn chat_messages_share_prefixes() {
        let a = read(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"system","content":"You are a helpful assistant, always."},
                {"role":"user","content":[{"type":"text","text":"hello"},{"type":"image_url","image_url":{"url":"x"}}]}],
                "max_completion_tokens":5,"max_tokens":9}"#,
        )
        .unwrap();
        let b = read(
            "/v1/chat/completions",
            r#"{"messages":[{"role":"system","content":"You are a helpful assistant, always."},
                {"role":"user","content":"something else entirely"}]}"#,
        )
        .unwrap();
        assert_eq!(a.output_hint, Some(5));
        let (PromptIdentity::Approximate(x), PromptIdentity::Approximate(y)) =
            (&a.identity, &b.identity)
        else {
            panic!("text prompts are approximate")
        };
        assert!(x.len() >= 2 && y.len() >= 2);
        assert_eq!(x[0], y[0]);
    }

    #[test]
    fn bad_bodies_are_typed_errors() {
        assert!(matches!(
            read_request("/v1/completions", &[b'{'; 100], None, 4, 10),
            Err(RequestError::TooLarge { len: 100, max: 10 })
        ));
        assert!(matches!(
            read("/v1/embeddings", "{}"),
            Err(RequestError::UnsupportedPath(_))
        ));
        assert!(matches!(
            read_request("/v1/completions", b"{\"prompt\":\"\xff\"}", None, 4, 100),
            Err(RequestError::NotUtf8)
        ));
        assert!(matches!(
            read("/v1/completions", "{\"prompt\":[1,2"),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", "{}"),
            Err(RequestError::MissingPrompt)
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[]}"#),
            Ok(RouteRequest {
                prompt_tokens: 0,
                ..
            })
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[1,"a"]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":["a",[1]]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[-1]}"#),
            Err(RequestError::Json(_))
        ));
        assert!(matches!(
            read("/v1/completions", r#"{"prompt":[4294967296]}"#),
            Err(RequestError::Json(_))
        ));
        let deep = "[".repeat(10_000);
        assert!(read("/v1/completions", &format!("{{\"prompt\":{deep}")).is_err());
        assert!(matches!(
            read("/v1/chat/completions", r#"{"prompt":"x"}"#),
            Err(RequestError::MissingPrompt)
        ));
    }
}
