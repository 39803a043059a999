//! The general request reader: serde_json over the whole body. It is the reference the one-pass
//! reader (`one_pass`) is tested against, and what reads a body whenever the one-pass reader meets
//! anything outside the shapes it reads itself (an escaped key, a body that is not an object, a
//! number that is not a plain integer, any malformed or truncated JSON): serde_json then decides,
//! and words the error. Its cost is serde's, linear in the body and bounded by `max_body_bytes`.

use serde::Deserialize;

use super::{
    ChatTurn, Endpoint, PromptRead, PromptTokenizer, RequestError, RouteRequest, finish, identify,
};
use crate::block::BlockHasher;

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
    /// Only its presence matters: a tokenizer cannot render tool calls it does not read.
    #[serde(default)]
    tool_calls: Option<serde::de::IgnoredAny>,
}

/// The fields read; everything else in the body is ignored (clients send many more).
#[derive(Deserialize)]
struct Body<'a> {
    #[serde(default)]
    model: Option<String>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    max_tokens: Option<u64>,
    #[serde(default)]
    max_completion_tokens: Option<u64>,
    /// Kept raw, then read as one of the four prompt shapes by [`parse_prompt`].
    #[serde(default, borrow)]
    prompt: Option<&'a serde_json::value::RawValue>,
    #[serde(default)]
    messages: Option<Vec<Message>>,
    /// A chat request's tool definitions, kept raw for the chat template (`null` reads as none).
    #[serde(default, borrow)]
    tools: Option<&'a serde_json::value::RawValue>,
    /// vLLM's per-request cache salt: blocks under another salt are never shared.
    #[serde(default)]
    cache_salt: Option<String>,
}

/// Reads a body with serde_json (size and path already checked by the caller).
pub(super) fn read(
    endpoint: Endpoint,
    body: &[u8],
    session_key: Option<&str>,
    block_size: usize,
    tokenizer: Option<&mut dyn PromptTokenizer>,
    adapters: Option<&crate::adapters::AdapterParams>,
) -> Result<RouteRequest, RequestError> {
    let text = core::str::from_utf8(body).map_err(|_| RequestError::NotUtf8)?;
    let b: Body = serde_json::from_str(text).map_err(|e| RequestError::Json(e.to_string()))?;
    let prompt = match b.prompt {
        Some(raw) => Some(parse_prompt(raw.get())?),
        None => None,
    };
    let turns: Option<Vec<ChatTurn>> = b
        .messages
        .as_ref()
        .map(|m| m.iter().map(chat_turn).collect());
    let lora = adapters.and_then(|a| a.adapter_of(b.model.as_deref()));
    // An invalid block size hashes nothing here: `identify` refuses it before it reads any hash.
    let hasher = BlockHasher::new(block_size)
        .ok()
        .map(|h| h.namespaced(lora, b.cache_salt.as_deref()));
    let hash = |t: &[u32]| {
        hasher
            .as_ref()
            .map_or_else(Vec::new, |h| h.sequence_hashes(t))
    };
    let read = prompt.as_ref().map(|p| match p {
        Prompt::Text(s) => PromptRead::Text(s),
        Prompt::Texts(v) => PromptRead::Texts {
            first: v.first().map(String::as_str),
            rest_chars: v.iter().skip(1).map(|s| s.chars().count()).sum(),
        },
        Prompt::Tokens(t) => PromptRead::Tokens {
            count: t.len() as u64,
            hashes: hash(t),
        },
        Prompt::TokenLists(v) => PromptRead::TokenLists {
            count: v.iter().map(|l| l.len() as u64).sum(),
            first: v.first().map(|l| hash(l)),
        },
    });
    let (prompt_tokens, identity) = identify(
        endpoint,
        read,
        (turns.as_deref(), b.tools.map(|t| t.get())),
        (lora, b.cache_salt.as_deref()),
        block_size,
        tokenizer,
    )?;
    Ok(finish(
        endpoint,
        b.model,
        b.stream,
        b.max_completion_tokens.or(b.max_tokens),
        session_key,
        prompt_tokens,
        identity,
    ))
}

fn chat_turn(m: &Message) -> ChatTurn<'_> {
    let mut parts = Vec::new();
    let mut non_text = false;
    match &m.content {
        Some(Content::Text(s)) => parts.push(s.as_str()),
        Some(Content::Parts(ps)) => {
            for p in ps {
                match (p.kind.as_deref(), &p.text) {
                    (None | Some("text"), Some(t)) => parts.push(t.as_str()),
                    _ => non_text = true,
                }
            }
        }
        None => {}
    }
    ChatTurn {
        role: m.role.as_deref(),
        parts,
        non_text,
        tool_calls: m.tool_calls.is_some(),
    }
}

/// The `prompt` value in one of its four shapes; serde words the errors.
fn parse_prompt(raw: &str) -> Result<Prompt, RequestError> {
    serde_json::from_str(raw).map_err(|e| RequestError::Json(format!("prompt: {e}")))
}
