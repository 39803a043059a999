//! Reading an OpenAI-style request body into what routing needs: the prompt's block identity, its size,
//! the output-length hint, the session key. Every byte comes from a client: anything malformed,
//! truncated, non-UTF-8 or oversized is a typed [`RequestError`], never a panic.
//!
//! Prompt identity: token-id prompts get the exact (Dynamo) identity and can be matched against the
//! engines' KV feed. Text prompts get the exact identity too when a [`PromptTokenizer`] is given (the
//! `kvsteer-tokenizer` crate renders the chat template and tokenizes as the engine does); without one,
//! or when it declines a prompt, they get the approximate text identity. For
//! `/v1/completions` with a batch of prompts, the identity is the first prompt's and the token count is
//! the sum over all of them. For `/v1/chat/completions` the text is each message's role and text parts,
//! framed so that the same conversation prefix gives the same chunks; non-text parts are skipped.
//!
//! Two readers share this module's types and its identity step (`identify`): the one-pass reader
//! (`one_pass`), which reads the bodies clients send in a single pass over the bytes, parsing token
//! ids and hashing each block as its ids go by, and the general serde_json reader (`general`), which
//! reads whatever the one-pass reader leaves to it (any shape it does not read itself, and every
//! error). Both give the same result for every body; the property tests in `core/tests` hold the
//! one-pass reader to the general one ([`read_request_reference`]).

mod early;
mod general;
mod model;
mod one_pass;

pub use early::EarlyScan;
pub use model::{ModelField, model_of};

use crate::adapters::AdapterParams;
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

    /// The `i`-th block hash as a plain integer, for the token-load table's per-replica set of active
    /// blocks (which only needs equality within one identity kind); 0 past the end (callers stay below
    /// `blocks()`; the routing path must not panic).
    pub fn key(&self, i: usize) -> u64 {
        match self {
            PromptIdentity::Exact(v) => v.get(i).map_or(0, |h| h.0),
            PromptIdentity::Approximate(v) => v.get(i).map_or(0, |h| h.0),
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

/// One chat message as a [`PromptTokenizer`] sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ChatTurn<'a> {
    pub role: Option<&'a str>,
    /// The text (a string content is one part; text parts of a list in order).
    pub parts: Vec<&'a str>,
    /// The content had parts that are not text (images, audio): the engine's tokens for them are unknown.
    pub non_text: bool,
    /// The message carries `tool_calls`.
    pub tool_calls: bool,
}

/// Turns text prompts into the engine's token ids. Returning None means "cannot do it exactly": the
/// request then gets the approximate identity (the implementation counts why).
pub trait PromptTokenizer {
    /// A `/v1/completions` text prompt.
    fn tokenize_text(&mut self, text: &str) -> Option<Vec<u32>>;
    /// A `/v1/chat/completions` conversation, chat template included.
    fn tokenize_chat(&mut self, turns: &[ChatTurn<'_>]) -> Option<Vec<u32>>;
    /// A conversation with the request's `tools`: the raw JSON text of its `tools` value (None when
    /// absent or `null`), for templates that render tool definitions as transformers'
    /// `apply_chat_template(tools=...)` does. The default ignores them (the tokenizers written before
    /// tools were carried).
    fn tokenize_chat_tools(
        &mut self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
    ) -> Option<Vec<u32>> {
        let _ = tools;
        self.tokenize_chat(turns)
    }
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
    read_request_with(path, body, session_key, block_size, max_body_bytes, None)
}

/// [`read_request`] with a tokenizer for text prompts.
pub fn read_request_with(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
    tokenizer: Option<&mut dyn PromptTokenizer>,
) -> Result<RouteRequest, RequestError> {
    read_request_early(
        path,
        body,
        session_key,
        block_size,
        max_body_bytes,
        tokenizer,
        None,
        None,
    )
}

/// [`read_request_with`] for a body an [`EarlyScan`] followed as it arrived (`body` begins with every
/// byte the scan was given): the same result, with the prompt's ids the scan read not read again.
/// With the router's LoRA adapters (`routing.adapters`), a request whose `model` names an adapter
/// has its prompt hashed in that adapter's namespace, as vLLM hashes an adapter's blocks and the
/// feed adapter reports them ([`crate::block::namespace_seed`]); `None`, or a base model: the plain
/// namespace.
#[allow(clippy::too_many_arguments)]
pub fn read_request_early(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
    mut tokenizer: Option<&mut dyn PromptTokenizer>,
    early: Option<EarlyScan>,
    adapters: Option<&AdapterParams>,
) -> Result<RouteRequest, RequestError> {
    let endpoint = check(path, body, max_body_bytes)?;
    let resume = early
        .and_then(EarlyScan::into_resume)
        .filter(|r| r.block_size == block_size);
    if let Some(r) = one_pass::read(
        endpoint,
        body,
        session_key,
        block_size,
        tokenizer
            .as_mut()
            .map(|t| &mut **t as &mut dyn PromptTokenizer),
        resume,
        adapters,
    ) {
        return r;
    }
    general::read(endpoint, body, session_key, block_size, tokenizer, adapters)
}

/// [`read_request_with`] through the general serde_json reader alone: the reference the one-pass
/// reader is tested against (the same result for every body, errors included up to their wording).
pub fn read_request_reference(
    path: &str,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    max_body_bytes: usize,
    tokenizer: Option<&mut dyn PromptTokenizer>,
) -> Result<RouteRequest, RequestError> {
    let endpoint = check(path, body, max_body_bytes)?;
    general::read(endpoint, body, session_key, block_size, tokenizer, None)
}

/// What is checked before any byte of the body is read: its size, then the path.
fn check(path: &str, body: &[u8], max_body_bytes: usize) -> Result<Endpoint, RequestError> {
    if body.len() > max_body_bytes {
        return Err(RequestError::TooLarge {
            len: body.len(),
            max: max_body_bytes,
        });
    }
    endpoint(path)
}

/// The `prompt` as a reader found it, in the form [`identify`] needs: token ids already hashed under
/// the request's namespace (`cache_salt`), texts as text.
enum PromptRead<'a> {
    Text(&'a str),
    /// A batch of texts: the first (None: an empty batch) and the characters of the others.
    Texts {
        first: Option<&'a str>,
        rest_chars: usize,
    },
    Tokens {
        count: u64,
        hashes: Vec<SeqHash>,
    },
    /// A batch of token-id lists: the ids in all of them, the first one's hashes (None: empty).
    TokenLists {
        count: u64,
        first: Option<Vec<SeqHash>>,
    },
}

/// The prompt's size and identity from what a reader found: the one step both readers share, so
/// they cannot differ in it. `tools` is the raw JSON of a chat request's `tools` (not `null`).
fn identify(
    endpoint: Endpoint,
    prompt: Option<PromptRead<'_>>,
    (turns, tools): (Option<&[ChatTurn<'_>]>, Option<&str>),
    (lora, cache_salt): (Option<&str>, Option<&str>),
    block_size: usize,
    mut tokenizer: Option<&mut dyn PromptTokenizer>,
) -> Result<(u64, PromptIdentity), RequestError> {
    let bad_size = |_| RequestError::BadPrompt("invalid block size");
    Ok(match (endpoint, prompt, turns) {
        (Endpoint::Completions, Some(p), _) => {
            let hasher = BlockHasher::new(block_size)
                .map_err(bad_size)?
                .namespaced(lora, cache_salt);
            let texter = TextHasher::new(block_size).map_err(bad_size)?;
            let mut exact_text = |s: &str| {
                tokenizer
                    .as_deref_mut()
                    .and_then(|t| t.tokenize_text(s))
                    .map(|ids| (ids.len() as u64, hasher.sequence_hashes(&ids)))
            };
            match p {
                PromptRead::Text(s) => match exact_text(s) {
                    Some((n, h)) => (n, PromptIdentity::Exact(h)),
                    None => text_identity(&texter, &[s]),
                },
                PromptRead::Texts { first, rest_chars } => {
                    let first = first.ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    if let Some((n, h)) = exact_text(first) {
                        // The batch's size is the first prompt's exact count plus the rest estimated.
                        (
                            n + TextHasher::approx_tokens(rest_chars) as u64,
                            PromptIdentity::Exact(h),
                        )
                    } else {
                        let mut out = Vec::new();
                        let chars = texter.extend(None, first, &mut out);
                        (
                            TextHasher::approx_tokens(chars + rest_chars) as u64,
                            PromptIdentity::Approximate(out),
                        )
                    }
                }
                PromptRead::Tokens { count, hashes } => (count, PromptIdentity::Exact(hashes)),
                PromptRead::TokenLists { count, first } => {
                    let first = first.ok_or(RequestError::BadPrompt("empty prompt list"))?;
                    (count, PromptIdentity::Exact(first))
                }
            }
        }
        (Endpoint::ChatCompletions, _, Some(turns)) => {
            match tokenizer.and_then(|t| t.tokenize_chat_tools(turns, tools)) {
                Some(ids) => {
                    let hasher = BlockHasher::new(block_size)
                        .map_err(bad_size)?
                        .namespaced(lora, cache_salt);
                    (
                        ids.len() as u64,
                        PromptIdentity::Exact(hasher.sequence_hashes(&ids)),
                    )
                }
                None => chat_text_identity(block_size, turns)?,
            }
        }
        _ => return Err(RequestError::MissingPrompt),
    })
}

fn finish(
    endpoint: Endpoint,
    model: Option<String>,
    stream: Option<bool>,
    output_hint: Option<u64>,
    session_key: Option<&str>,
    prompt_tokens: u64,
    identity: PromptIdentity,
) -> RouteRequest {
    RouteRequest {
        endpoint,
        model,
        stream: stream.unwrap_or(false),
        output_hint,
        session_key: session_key.map(str::to_string),
        prompt_tokens,
        identity,
    }
}

/// The approximate identity of a conversation: each message's role and text parts, framed.
fn chat_text_identity(
    block_size: usize,
    turns: &[ChatTurn<'_>],
) -> Result<(u64, PromptIdentity), RequestError> {
    let texter =
        TextHasher::new(block_size).map_err(|_| RequestError::BadPrompt("invalid block size"))?;
    let mut parts: Vec<&str> = Vec::with_capacity(turns.len() * 4);
    for t in turns {
        parts.push("<|");
        parts.push(t.role.unwrap_or(""));
        parts.push("|>");
        parts.extend_from_slice(&t.parts);
        parts.push("\n");
    }
    Ok(text_identity(&texter, &parts))
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

    /// A request for a LoRA adapter is hashed in the adapter's namespace (as vLLM and the feed
    /// adapter hash its blocks), wherever `model` stands in the body and by either reader; a base
    /// model, or no adapter configuration, in the plain one.
    #[test]
    fn an_adapters_prompt_is_hashed_in_its_namespace() {
        let cfg = AdapterParams {
            base_models: vec!["base".into()],
            ..AdapterParams::default()
        };
        let h = BlockHasher::new(4).unwrap();
        let ids = [1, 2, 3, 4, 5, 6, 7, 8, 9];
        let plain = PromptIdentity::Exact(h.sequence_hashes(&ids[..8]));
        let lora = PromptIdentity::Exact(
            h.namespaced(Some("sql"), Some("s"))
                .sequence_hashes(&ids[..8]),
        );
        let bodies = [
            r#"{"model":"sql","cache_salt":"s","prompt":[1,2,3,4,5,6,7,8,9]}"#,
            r#"{"prompt":[1,2,3,4,5,6,7,8,9],"cache_salt":"s","model":"sql"}"#,
        ];
        for body in bodies {
            let with = |a: Option<&AdapterParams>| {
                read_request_early(
                    "/v1/completions",
                    body.as_bytes(),
                    None,
                    4,
                    1 << 20,
                    None,
                    None,
                    a,
                )
                .unwrap()
                .identity
            };
            assert_eq!(with(Some(&cfg)), lora, "{body}");
            let reference = general::read(
                Endpoint::Completions,
                body.as_bytes(),
                None,
                4,
                None,
                Some(&cfg),
            )
            .unwrap();
            assert_eq!(reference.identity, lora, "{body}");
            assert_ne!(with(None), lora);
        }
        let base = r#"{"model":"base","prompt":[1,2,3,4,5,6,7,8,9]}"#;
        let r = read_request_early(
            "/v1/completions",
            base.as_bytes(),
            None,
            4,
            1 << 20,
            None,
            None,
            Some(&cfg),
        );
        assert_eq!(r.unwrap().identity, plain);
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
    fn token_prompts_agree_with_the_reference() {
        for s in [
            "[]",
            "[ ]",
            "[0]",
            " [1,2 ,3]\n",
            "[4294967295]",
            "[4294967296]",
            "[99999999999999999999]",
            "[12345678,123456789,1234567]",
            "[01]",
            "[-1]",
            "[-0]",
            "[1.0]",
            "[1e3]",
            "[1,]",
            "[,1]",
            "[1 2]",
            "[\"a\"]",
            "[[1]]",
            "[1]x",
            "",
            "[",
            "[1,2",
        ] {
            let body = format!("{{\"prompt\":{s}}}");
            let fast = read("/v1/completions", &body);
            let reference = read_request_reference(
                "/v1/completions",
                body.as_bytes(),
                Some("s1"),
                4,
                1 << 20,
                None,
            );
            match (&fast, &reference) {
                (Ok(a), Ok(b)) => assert_eq!(a, b, "{body:?}"),
                (Err(_), Err(_)) => {}
                _ => panic!("{body:?}: {fast:?} vs {reference:?}"),
            }
        }
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
