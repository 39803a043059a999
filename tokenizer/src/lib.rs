//! Engine-exact tokenization of text prompts for kvsteer: the chat template rendered as the engine
//! renders it, then a real BPE (o200k_base / o200k_harmony) with a per-segment cache, so the router
//! can compute the same KV block hashes the engine does (see docs/design/tokenizer.md).
//!
//! [`TextTokenizer`] implements the core's [`PromptTokenizer`]: give it to
//! `Router::read_request_with`. Anything it cannot do exactly (unknown roles, non-text parts, tool
//! calls, a template that fails, an enormous prompt) returns None, counted by [`FallbackReason`], and
//! the request keeps the approximate identity.

pub mod calendar_date;
pub mod chat_template;
pub mod python_json;
pub mod sample;
pub mod segment_cache;
pub mod vocabulary;

use calendar_date::CalendarDate;
use chat_template::{ChatTemplate, PartJoin, RenderMessage, TemplateSettings};
use kvsteer_core::request::{ChatTurn, PromptTokenizer};
use segment_cache::SegmentCache;
use serde::Deserialize;
pub use vocabulary::{Bpe, Segment, Vocabulary};

fn d_template() -> String {
    "harmony".into()
}
fn d_cache_tokens() -> usize {
    1 << 20
}
fn d_max_prompt_bytes() -> usize {
    4 << 20
}
fn d_effort() -> String {
    "medium".into()
}

/// The `tokenizer` section of the plugin configuration.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// `o200k_harmony` (gpt-oss, the default) or `o200k_base`.
    #[serde(default)]
    pub vocabulary: Vocabulary,
    /// Built-in template: `harmony` (default: gpt-oss's own template), `harmony_vllm` (gpt-oss as vLLM
    /// renders it; needs `current_date`) or `kvsteer_sim`; ignored when `chat_template_jinja` is set.
    #[serde(default = "d_template")]
    pub chat_template: String,
    /// A model's own chat template (Jinja text), used instead of a built-in one.
    #[serde(default)]
    pub chat_template_jinja: Option<String>,
    /// The engine's "today" (`YYYY-MM-DD`): harmony's `Current date:` line and what templates'
    /// `strftime_now` formats. None: harmony prints no date line and `strftime_now` fails to render
    /// (the request falls back), because the router will not guess the engine's clock.
    #[serde(default)]
    pub current_date: Option<String>,
    /// `harmony`: the reasoning effort in the system header.
    #[serde(default = "d_effort")]
    pub reasoning_effort: String,
    /// `bos_token` as the engine's tokenizer config gives it to the template (empty by default).
    #[serde(default)]
    pub bos_token: String,
    /// `eos_token` likewise.
    #[serde(default)]
    pub eos_token: String,
    /// Bound of the per-segment cache, in token ids (4 bytes each). 0 disables it.
    #[serde(default = "d_cache_tokens")]
    pub cache_tokens: usize,
    /// Rendered prompts longer than this are not tokenized (approximate identity instead).
    #[serde(default = "d_max_prompt_bytes")]
    pub max_prompt_bytes: usize,
}

impl Default for TokenizerConfig {
    fn default() -> Self {
        serde_json_default()
    }
}

fn serde_json_default() -> TokenizerConfig {
    TokenizerConfig {
        vocabulary: Vocabulary::default(),
        chat_template: d_template(),
        chat_template_jinja: None,
        current_date: None,
        reasoning_effort: d_effort(),
        bos_token: String::new(),
        eos_token: String::new(),
        cache_tokens: d_cache_tokens(),
        max_prompt_bytes: d_max_prompt_bytes(),
    }
}

/// Why a text prompt kept the approximate identity.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FallbackReason {
    /// Longer than `max_prompt_bytes`.
    TooLarge,
    /// A message without a role or with one outside system, developer, user, assistant, tool.
    UnknownRole,
    /// Image, audio or other non-text parts.
    NonText,
    /// Assistant tool calls (not rendered).
    ToolCalls,
    /// The chat template failed to render (includes roles the template refuses).
    Template,
    /// The BPE could not encode (regex backtrack limit).
    Encode,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 6] = [
        FallbackReason::TooLarge,
        FallbackReason::UnknownRole,
        FallbackReason::NonText,
        FallbackReason::ToolCalls,
        FallbackReason::Template,
        FallbackReason::Encode,
    ];

    /// Metric label.
    pub fn name(self) -> &'static str {
        match self {
            FallbackReason::TooLarge => "too_large",
            FallbackReason::UnknownRole => "unknown_role",
            FallbackReason::NonText => "non_text",
            FallbackReason::ToolCalls => "tool_calls",
            FallbackReason::Template => "template",
            FallbackReason::Encode => "encode",
        }
    }
}

/// Counters for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizerStats {
    /// Prompts tokenized exactly.
    pub exact: u64,
    /// Token ids produced.
    pub tokens: u64,
    /// Fallbacks, in [`FallbackReason::ALL`] order.
    pub fallbacks: [u64; 6],
    pub cache_hits: u64,
    pub cache_misses: u64,
    pub cache_evictions: u64,
    pub cache_tokens: u64,
    pub cache_segments: u64,
    /// The last fallback's detail (a template error's message), for logs.
    pub last_error: Option<String>,
}

/// Roles a conversation may carry; anything else is refused before rendering.
pub const KNOWN_ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

/// A vocabulary, a chat template and a segment cache: one per proxy worker.
pub struct TextTokenizer {
    bpe: Bpe,
    template: ChatTemplate,
    cache: SegmentCache,
    max_prompt_bytes: usize,
    stats: TokenizerStats,
}

impl TextTokenizer {
    /// Loads the vocabulary (parsed once per process, tens of milliseconds natively) and compiles the
    /// template. The error names the offending field.
    pub fn new(cfg: &TokenizerConfig) -> Result<TextTokenizer, String> {
        let current_date = match &cfg.current_date {
            Some(d) => Some(CalendarDate::parse(d).map_err(|e| format!("current_date: {e}"))?),
            None => None,
        };
        let settings = TemplateSettings {
            current_date,
            reasoning_effort: cfg.reasoning_effort.clone(),
            bos_token: cfg.bos_token.clone(),
            eos_token: cfg.eos_token.clone(),
        };
        let template = ChatTemplate::new(
            &cfg.chat_template,
            cfg.chat_template_jinja.as_deref(),
            settings,
        )
        .map_err(|e| format!("chat_template: {e}"))?;
        Ok(TextTokenizer {
            bpe: Bpe::load(cfg.vocabulary),
            template,
            cache: SegmentCache::new(cfg.cache_tokens),
            max_prompt_bytes: cfg.max_prompt_bytes,
            stats: TokenizerStats::default(),
        })
    }

    pub fn stats(&self) -> TokenizerStats {
        let mut s = self.stats.clone();
        s.cache_hits = self.cache.hits;
        s.cache_misses = self.cache.misses;
        s.cache_evictions = self.cache.evictions;
        s.cache_tokens = self.cache.tokens() as u64;
        s.cache_segments = self.cache.segments() as u64;
        s
    }

    pub fn bpe(&self) -> &Bpe {
        &self.bpe
    }

    fn fail(&mut self, why: FallbackReason, detail: Option<String>) -> Option<Vec<u32>> {
        self.stats.fallbacks[why as usize] += 1;
        if detail.is_some() {
            self.stats.last_error = detail;
        }
        None
    }

    /// Token ids of rendered text: special tokens recognised, ordinary segments through the cache.
    pub fn encode(&mut self, text: &str) -> Option<Vec<u32>> {
        if text.len() > self.max_prompt_bytes {
            return self.fail(FallbackReason::TooLarge, None);
        }
        let mut out = Vec::with_capacity(text.len() / 4 + 8);
        let mut ok = true;
        let (bpe, cache) = (&self.bpe, &mut self.cache);
        bpe.segments(text, |seg| {
            if !ok {
                return;
            }
            match seg {
                Segment::Special(id) => out.push(id),
                Segment::Text(t) => {
                    ok = cache
                        .encode_into(t, &mut out, |t| bpe.encode_ordinary(t))
                        .is_some()
                }
            }
        });
        if !ok {
            return self.fail(FallbackReason::Encode, None);
        }
        self.stats.exact += 1;
        self.stats.tokens += out.len() as u64;
        Some(out)
    }

    /// The rendered prompt of a conversation, or why it cannot be rendered exactly.
    pub fn render_chat(&self, turns: &[ChatTurn<'_>]) -> Result<String, (FallbackReason, String)> {
        let mut msgs = Vec::with_capacity(turns.len());
        let mut bytes = 0usize;
        for (i, t) in turns.iter().enumerate() {
            let role = t
                .role
                .filter(|r| KNOWN_ROLES.contains(r))
                .ok_or_else(|| (FallbackReason::UnknownRole, format!("messages[{i}].role")))?;
            if t.non_text {
                return Err((FallbackReason::NonText, format!("messages[{i}]")));
            }
            if t.tool_calls {
                return Err((FallbackReason::ToolCalls, format!("messages[{i}]")));
            }
            bytes += t.parts.iter().map(|p| p.len() + 1).sum::<usize>();
            if bytes > self.max_prompt_bytes {
                return Err((FallbackReason::TooLarge, String::new()));
            }
            let content = match self.template.join {
                PartJoin::Newline => t.parts.join("\n"),
                PartJoin::Concat => t.parts.concat(),
            };
            msgs.push(RenderMessage { role, content });
        }
        self.template
            .render(&msgs)
            .map_err(|e| (FallbackReason::Template, e))
    }
}

impl PromptTokenizer for TextTokenizer {
    fn tokenize_text(&mut self, text: &str) -> Option<Vec<u32>> {
        self.encode(text)
    }

    fn tokenize_chat(&mut self, turns: &[ChatTurn<'_>]) -> Option<Vec<u32>> {
        match self.render_chat(turns) {
            Ok(text) => self.encode(&text),
            Err((why, detail)) => self.fail(why, (!detail.is_empty()).then_some(detail)),
        }
    }
}
