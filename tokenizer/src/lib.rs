//! Engine-exact tokenization of text prompts for kvsteer: the chat template rendered as the engine
//! renders it, then a real BPE (o200k_base / o200k_harmony compiled in, or a Hugging Face bundle's
//! byte-level BPE read from its files at run time) with a per-segment cache, so the router can compute
//! the same KV block hashes the engine does (see docs/design/tokenizer.md).
//!
//! [`TextTokenizer`] implements the core's [`PromptTokenizer`]: give it to
//! `Router::read_request_with`. Anything it cannot do exactly (unknown roles, non-text parts, tool
//! calls, a template that fails, an enormous prompt) returns None, counted by [`FallbackReason`], and
//! the request keeps the approximate identity.

pub mod calendar_date;
pub mod chat_template;
pub mod fetch;
pub mod hf;
pub mod python_json;
pub mod sample;
pub mod segment_cache;
pub mod vocabulary;

use calendar_date::CalendarDate;
use chat_template::{ChatTemplate, PartJoin, RenderMessage, TemplateSettings};
use hf::{HfChatConfig, HfTokenizer};
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
fn d_true() -> bool {
    true
}
fn d_max_bundle_bytes() -> usize {
    hf::DEFAULT_MAX_BUNDLE_BYTES
}

/// A Hugging Face bundle: a model's `tokenizer.json` and `tokenizer_config.json`. The files are not
/// compiled in (each model has its own, and their licences are the models'); this section carries
/// their text inline, and a host that fetches them itself gives the bytes to
/// [`TextTokenizer::with_huggingface`].
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct HuggingFaceSource {
    /// The text of `tokenizer.json` (the BPE, its pre-tokenizer, added tokens, post-processor).
    #[serde(default)]
    pub tokenizer_json: Option<String>,
    /// The text of `tokenizer_config.json`: its `chat_template`, `bos_token` and `eos_token` are used
    /// unless `chat_template_jinja`, `bos_token` or `eos_token` are set in the section.
    #[serde(default)]
    pub tokenizer_config_json: Option<String>,
    /// Whether a completions prompt gets the post-processor's special tokens (Llama 3's and Mistral's
    /// BOS), as engines tokenize completions prompts by default; chat prompts never do (the template
    /// writes them, and engines tokenize rendered chats without adding any).
    #[serde(default = "d_true")]
    pub add_special_tokens: bool,
    /// Bound on each file's size in bytes, checked before parsing.
    #[serde(default = "d_max_bundle_bytes")]
    pub max_bytes: usize,
    /// Fetch the files at run time instead (exclusive with the inline text): each worker VM fetches
    /// the bundle over an HTTP callout and routes text prompts by the approximate identity until it
    /// has loaded it.
    #[serde(default)]
    pub fetch: Option<fetch::BundleFetch>,
}

/// The `tokenizer` section of the plugin configuration.
#[derive(Clone, Debug, Deserialize, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct TokenizerConfig {
    /// `o200k_harmony` (gpt-oss, the default without `huggingface`) or `o200k_base`.
    #[serde(default)]
    pub vocabulary: Option<Vocabulary>,
    /// A Hugging Face bundle instead of a built-in vocabulary (exclusive with `vocabulary`).
    #[serde(default)]
    pub huggingface: Option<HuggingFaceSource>,
    /// Built-in template: `harmony` (default: gpt-oss's own template), `harmony_vllm` (gpt-oss as vLLM
    /// renders it; needs `current_date`) or `kvsteer_sim`; ignored when `chat_template_jinja` or a
    /// `huggingface` bundle is set.
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
        vocabulary: None,
        huggingface: None,
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
    /// The request's `tools` is not a list of JSON objects, or the template does not render tool
    /// definitions as the engine does (the built-in harmony templates).
    Tools,
}

impl FallbackReason {
    pub const ALL: [FallbackReason; 7] = [
        FallbackReason::TooLarge,
        FallbackReason::UnknownRole,
        FallbackReason::NonText,
        FallbackReason::ToolCalls,
        FallbackReason::Template,
        FallbackReason::Encode,
        FallbackReason::Tools,
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
            FallbackReason::Tools => "tools",
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
    pub fallbacks: [u64; 7],
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

/// The BPE behind a [`TextTokenizer`].
enum Backend {
    /// o200k, compiled in.
    Tiktoken(Bpe),
    /// A Hugging Face bundle, and whether completions prompts get its post-processor's ids.
    HuggingFace(Box<HfTokenizer>, bool),
}

impl Backend {
    fn segments(&self, text: &str, f: impl FnMut(Segment<'_>)) {
        match self {
            Backend::Tiktoken(b) => b.segments(text, f),
            Backend::HuggingFace(h, _) => h.segments(text, f),
        }
    }

    fn encode_ordinary(&self, text: &str) -> Option<Vec<u32>> {
        match self {
            Backend::Tiktoken(b) => b.encode_ordinary(text),
            Backend::HuggingFace(h, _) => h.encode_ordinary(text),
        }
    }
}

/// A vocabulary, a chat template and a segment cache: one per proxy worker.
pub struct TextTokenizer {
    bpe: Backend,
    template: ChatTemplate,
    cache: SegmentCache,
    max_prompt_bytes: usize,
    stats: TokenizerStats,
}

impl TextTokenizer {
    /// Loads the vocabulary (o200k: parsed once per process, tens of milliseconds natively; a Hugging
    /// Face bundle: from the section's inline text) and compiles the template. The error names the
    /// offending field.
    pub fn new(cfg: &TokenizerConfig) -> Result<TextTokenizer, String> {
        if let Some(src) = &cfg.huggingface {
            if cfg.vocabulary.is_some() {
                return Err(
                    "huggingface: give either `vocabulary` or `huggingface`, not both".into(),
                );
            }
            if src.fetch.is_some() {
                return Err(
                    "huggingface.fetch: the bundle is fetched at run time: check the \
                            configuration with check_deferred, then load it with with_huggingface"
                        .into(),
                );
            }
            let json = src.tokenizer_json.as_deref().ok_or(
                "huggingface.tokenizer_json: missing (the text of the model's tokenizer.json, \
                 or `fetch` to fetch it)",
            )?;
            let config = src.tokenizer_config_json.as_deref().map(str::as_bytes);
            return TextTokenizer::with_huggingface(cfg, json.as_bytes(), config);
        }
        let template = template(cfg, None)?;
        Ok(TextTokenizer::assemble(
            cfg,
            Backend::Tiktoken(Bpe::load(cfg.vocabulary.unwrap_or_default())),
            template,
        ))
    }

    /// A Hugging Face bundle from its files' bytes, however the host got them: `tokenizer.json` and,
    /// when the configuration has no `chat_template_jinja`, `tokenizer_config.json` for the template
    /// (and `bos_token` / `eos_token` unless the configuration sets them). Errors start with the field
    /// or the file they are about; hostile bytes are errors, never panics.
    pub fn with_huggingface(
        cfg: &TokenizerConfig,
        tokenizer_json: &[u8],
        tokenizer_config_json: Option<&[u8]>,
    ) -> Result<TextTokenizer, String> {
        let src = cfg.huggingface.clone().unwrap_or(HuggingFaceSource {
            tokenizer_json: None,
            tokenizer_config_json: None,
            add_special_tokens: true,
            max_bytes: hf::DEFAULT_MAX_BUNDLE_BYTES,
            fetch: None,
        });
        let hf_cfg = match tokenizer_config_json {
            Some(b) => HfChatConfig::from_bytes(b, src.max_bytes),
            None => Ok(HfChatConfig::default()),
        }
        .map_err(|e| format!("huggingface: {e}"))?;
        let bpe = HfTokenizer::from_bytes(tokenizer_json, src.max_bytes)
            .map_err(|e| format!("huggingface: {e}"))?;
        let template = template(cfg, Some(&hf_cfg))?;
        Ok(TextTokenizer::assemble(
            cfg,
            Backend::HuggingFace(Box::new(bpe), src.add_special_tokens),
            template,
        ))
    }

    /// Whether the configuration's bundle is fetched at run time (`huggingface.fetch`).
    pub fn deferred(cfg: &TokenizerConfig) -> Option<&fetch::BundleFetch> {
        cfg.huggingface.as_ref().and_then(|h| h.fetch.as_ref())
    }

    /// For a bundle fetched at run time: every check that needs no bundle (the fetch section, the
    /// date, a configured `chat_template_jinja`), so a bad configuration is refused when it is
    /// given, not when the bundle arrives.
    pub fn check_deferred(cfg: &TokenizerConfig) -> Result<(), String> {
        let Some(src) = &cfg.huggingface else {
            return Ok(());
        };
        let Some(f) = &src.fetch else { return Ok(()) };
        if cfg.vocabulary.is_some() {
            return Err("huggingface: give either `vocabulary` or `huggingface`, not both".into());
        }
        if src.tokenizer_json.is_some() || src.tokenizer_config_json.is_some() {
            return Err("huggingface.fetch: give the files inline or fetch them, not both".into());
        }
        f.check().map_err(|e| format!("huggingface.fetch.{e}"))?;
        if cfg.chat_template_jinja.is_some() {
            template(cfg, None)?;
        } else if let Some(d) = &cfg.current_date {
            CalendarDate::parse(d).map_err(|e| format!("current_date: {e}"))?;
        }
        Ok(())
    }

    fn assemble(cfg: &TokenizerConfig, bpe: Backend, template: ChatTemplate) -> TextTokenizer {
        TextTokenizer {
            bpe,
            template,
            cache: SegmentCache::new(cfg.cache_tokens),
            max_prompt_bytes: cfg.max_prompt_bytes,
            stats: TokenizerStats::default(),
        }
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

    /// The Hugging Face bundle, when this tokenizer has one.
    pub fn huggingface(&self) -> Option<&HfTokenizer> {
        match &self.bpe {
            Backend::HuggingFace(h, _) => Some(h),
            Backend::Tiktoken(_) => None,
        }
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
        self.encode_with(text, &[], &[])
    }

    /// [`TextTokenizer::encode`] between the given ids (a post-processor's BOS ...).
    fn encode_with(&mut self, text: &str, before: &[u32], after: &[u32]) -> Option<Vec<u32>> {
        if text.len() > self.max_prompt_bytes {
            return self.fail(FallbackReason::TooLarge, None);
        }
        let mut out = Vec::with_capacity(text.len() / 4 + 8);
        out.extend_from_slice(before);
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
        out.extend_from_slice(after);
        self.stats.exact += 1;
        self.stats.tokens += out.len() as u64;
        Some(out)
    }

    /// The rendered prompt of a conversation, or why it cannot be rendered exactly.
    pub fn render_chat(&self, turns: &[ChatTurn<'_>]) -> Result<String, (FallbackReason, String)> {
        self.render_chat_tools(turns, None)
    }

    /// [`TextTokenizer::render_chat`] with the request's `tools` (the raw JSON of its value).
    pub fn render_chat_tools(
        &self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
    ) -> Result<String, (FallbackReason, String)> {
        let tools = match tools {
            None => minijinja::Value::from(()),
            Some(raw) => self.tools_value(raw)?,
        };
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
            .render_with_tools(&msgs, &tools)
            .map_err(|e| (FallbackReason::Template, e))
    }

    /// A request's `tools` as the template sees them: a list of JSON objects, key order kept, as
    /// transformers takes them (anything else it refuses, so the engine refuses the request too).
    fn tools_value(&self, raw: &str) -> Result<minijinja::Value, (FallbackReason, String)> {
        use minijinja::value::ValueKind;
        let tools = |m: String| (FallbackReason::Tools, format!("tools: {m}"));
        if !self.template.renders_tools {
            return Err(tools(format!(
                "the built-in {} template does not render tool definitions",
                self.template.name
            )));
        }
        if raw.len() > self.max_prompt_bytes {
            return Err((FallbackReason::TooLarge, String::new()));
        }
        let v: minijinja::Value = serde_json::from_str(raw).map_err(|e| tools(e.to_string()))?;
        if v.kind() != ValueKind::Seq {
            return Err(tools(format!("a {}, not a list", v.kind())));
        }
        let items = v.try_iter().map_err(|e| tools(e.to_string()))?;
        for (i, t) in items.enumerate() {
            if t.kind() != ValueKind::Map {
                return Err(tools(format!("[{i}] is a {}, not an object", t.kind())));
            }
        }
        Ok(v)
    }
}

/// The chat template: `chat_template_jinja` if set, else a bundle's own template (a bundle without one
/// is refused: a built-in gpt-oss template would render another model's format), else the built-in
/// `chat_template`. A bundle's `bos_token` / `eos_token` are used unless the configuration sets them.
fn template(cfg: &TokenizerConfig, bundle: Option<&HfChatConfig>) -> Result<ChatTemplate, String> {
    let current_date = match &cfg.current_date {
        Some(d) => Some(CalendarDate::parse(d).map_err(|e| format!("current_date: {e}"))?),
        None => None,
    };
    let or_bundle = |own: &String, theirs: Option<&Option<String>>| match theirs {
        Some(Some(t)) if own.is_empty() => t.clone(),
        _ => own.clone(),
    };
    let settings = TemplateSettings {
        current_date,
        reasoning_effort: cfg.reasoning_effort.clone(),
        bos_token: or_bundle(&cfg.bos_token, bundle.map(|b| &b.bos_token)),
        eos_token: or_bundle(&cfg.eos_token, bundle.map(|b| &b.eos_token)),
    };
    let jinja = match (&cfg.chat_template_jinja, bundle) {
        (Some(own), _) => Some(own.as_str()),
        (None, Some(b)) => Some(b.chat_template.as_deref().ok_or(
            "chat_template: the bundle's tokenizer_config.json has no chat_template; \
             give chat_template_jinja",
        )?),
        (None, None) => None,
    };
    ChatTemplate::new(&cfg.chat_template, jinja, settings)
        .map_err(|e| format!("chat_template: {e}"))
}

impl PromptTokenizer for TextTokenizer {
    /// A completions prompt: with a Hugging Face bundle, between its post-processor's ids when
    /// `add_special_tokens` (engines' default for completions).
    fn tokenize_text(&mut self, text: &str) -> Option<Vec<u32>> {
        match &self.bpe {
            Backend::HuggingFace(h, true) => {
                let (before, after) = h.special_around();
                let (before, after) = (before.to_vec(), after.to_vec());
                self.encode_with(text, &before, &after)
            }
            _ => self.encode(text),
        }
    }

    fn tokenize_chat(&mut self, turns: &[ChatTurn<'_>]) -> Option<Vec<u32>> {
        self.tokenize_chat_tools(turns, None)
    }

    /// Tool definitions are rendered by templates that render them (a model's own); the built-in
    /// harmony templates do not, and such a request falls back, counted as `tools`.
    fn tokenize_chat_tools(
        &mut self,
        turns: &[ChatTurn<'_>],
        tools: Option<&str>,
    ) -> Option<Vec<u32>> {
        match self.render_chat_tools(turns, tools) {
            Ok(text) => self.encode(&text),
            Err((why, detail)) => self.fail(why, (!detail.is_empty()).then_some(detail)),
        }
    }
}
