//! Chat templates: a conversation rendered to the exact text the engine tokenizes, with a
//! Jinja-compatible engine (minijinja) configured as Hugging Face's `apply_chat_template` configures
//! Jinja2 and given the same variables, so a model's own template renders here as it does in the
//! engine.
//!
//! What transformers sets up (source: transformers `utils/chat_template_utils.py`,
//! `_compile_jinja_template` and `render_jinja_template`), and what is done here:
//! - Jinja2 `trim_blocks`, `lstrip_blocks`, no autoescape, `keep_trailing_newline` off (Jinja2's
//!   default: one trailing newline of the template source is dropped), the `loopcontrols` extension:
//!   the same minijinja settings.
//! - Python string, dict and list methods (`.strip()`, `.startswith()`, `.split()`, `.items()`,
//!   `.get()` ...) work because Jinja2 calls the real Python objects: here minijinja-contrib's
//!   `pycompat` callback implements them.
//! - `raise_exception(msg)`: a render error (the request falls back).
//! - `tojson`: Python's `json.dumps` (see [`crate::python_json`]), not Jinja2's HTML-safe filter.
//! - `strftime_now(fmt)`: the engine formats its wall clock; here the configured `current_date`
//!   ([`CalendarDate`]), never the router's clock, and an error when none is configured, so a
//!   template that stamps the date falls back (counted) instead of rendering a date the engine may not.
//! - Variables: `messages`, `add_generation_prompt = true`, `bos_token`, `eos_token` (configured,
//!   empty by default), `tools` (the request's tool definitions, `none` without) and `documents =
//!   none` (transformers' `render_jinja_template` always passes both, `None` when the request has
//!   none); `custom_tools`,
//!   `tools_in_user_message`, `date_string` stay undefined, as they are when the engine gets no
//!   `chat_template_kwargs`, so templates take their own defaults. Also
//!   `current_date` (`YYYY-MM-DD` or none) and `reasoning_effort` for the built-in harmony template
//!   (gpt-oss's own template reads `reasoning_effort` too).
//!
//! Built in:
//! - `harmony`: gpt-oss's format, following the model's `chat_template.jinja` for the covered cases
//!   (see [`HARMONY`]). Not covered (the request falls back): tools, tool calls, tool results.
//! - `harmony_vllm`: gpt-oss as vLLM renders chat completions, with openai-harmony rather than the
//!   Jinja template (see [`HARMONY_VLLM`]).
//! - `kvsteer_sim`: the simulator's fixed framing (`<|start|>ROLE\nTEXT<|end|>\n` ...
//!   `<|start|>assistant\n`), so the test fleet's engines and the filter agree.
//! - any other template as Jinja text (a model's `chat_template`).

pub use crate::calendar_date::CalendarDate;
use minijinja::{Environment, Error, ErrorKind, Value, context};
use serde::Serialize;

/// The harmony system header (as both gpt-oss's template and openai-harmony write it, the date line
/// only when `current_date` is set), then `developer` = the text of a first system/developer message
/// and `turns` = the rest.
macro_rules! harmony_system_and_instructions {
    () => {
        concat!(
            "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
            "Knowledge cutoff: 2024-06\n",
            "{% if current_date %}Current date: {{ current_date }}\n{% endif %}",
            // trim_blocks eats a newline right after a block tag: emit it as an expression.
            "{{ '\\n' }}Reasoning: {{ reasoning_effort }}\n\n",
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
            "{% if messages and messages[0].role in ['system', 'developer'] %}",
            "{% set developer = messages[0].content %}{% set turns = messages[1:] %}",
            "{% else %}{% set developer = '' %}{% set turns = messages %}{% endif %}",
        )
    };
}

/// The gpt-oss (harmony) template, without tools. Checked against gpt-oss's `chat_template.jinja`
/// (Hugging Face `openai/gpt-oss-120b`, as vendored in llama.cpp `models/templates/`) and openai/harmony's
/// renderer (`src/encoding.rs`, system and developer content):
/// - System header: identity line, `Knowledge cutoff: 2024-06`, `Current date: ...` (the model card's
///   template always stamps `strftime_now("%Y-%m-%d")`; openai/harmony prints the line only when a
///   conversation start date is set: with no `current_date` this renders harmony's form), a blank
///   line, `Reasoning: EFFORT`, a blank line, the valid-channels line.
/// - Only a first `system` or `developer` message becomes the developer message (`# Instructions`,
///   a blank line, the text, a blank line, as the model card's template writes it), and only when its
///   text is not empty; later `system`/`developer` messages are dropped, as that template drops them.
/// - Assistant turns render their `content` in the `final` channel closed by `<|end|>`; reasoning of
///   earlier turns is never rendered for inference (the template drops it unless the turn made a tool
///   call, and tool calls fall back before rendering). `<|return|>` closes only a last assistant
///   message rendered without a generation prompt (training); requests always get the generation
///   prompt, so never here. Assistant content holding `<|channel|>analysis<|message|>` or
///   `<|channel|>final<|message|>` is refused, as the template refuses it.
/// - A `tool` message is refused (the template needs a preceding tool call, which is not covered).
pub const HARMONY: &str = concat!(
    harmony_system_and_instructions!(),
    "{% if developer %}<|start|>developer<|message|># Instructions\n\n{{ developer }}\n\n<|end|>{% endif %}",
    "{% for m in turns %}",
    "{% if m.role == 'assistant' %}",
    "{% if '<|channel|>analysis<|message|>' in m.content or '<|channel|>final<|message|>' in m.content %}",
    "{{ raise_exception('harmony: channel tags in assistant content') }}",
    "{% endif %}",
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>",
    "{% elif m.role == 'user' %}",
    "<|start|>user<|message|>{{ m.content }}<|end|>",
    "{% elif m.role == 'tool' %}",
    "{{ raise_exception('harmony: a tool message needs the tool call before it (not covered)') }}",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
);

/// gpt-oss as vLLM serves chat completions: vLLM does not use the model's Jinja template for gpt-oss
/// but builds openai-harmony messages and renders them with the openai-harmony library (vLLM
/// `vllm/entrypoints/openai/parser/harmony_utils.py`: `get_system_message`,
/// `extract_instructions_from_messages`, `build_harmony_preamble`,
/// `parse_chat_input_to_harmony_message`; read, not run against a vLLM here). Differences from
/// [`HARMONY`]:
/// - vLLM always stamps a date (`datetime.now()`, or `VLLM_SYSTEM_START_DATE` where that exists), so
///   `current_date` is required (the configuration is refused without it).
/// - The first system/developer message is the developer instructions as openai-harmony renders them:
///   `# Instructions`, a blank line, the text, no trailing blank line (checked against openai-harmony
///   0.0.8 by `tokenizer/scripts/harmony_reference.py`).
/// - Later system and developer messages are rendered as their own role with the raw text; an
///   assistant message with empty content is dropped; text parts are concatenated.
///
/// Not covered: a per-request `reasoning_effort` (the request's field is not read; the configured one
/// is used), tools, tool calls, tool results (refused), and vLLM versions that open the analysis
/// channel in the generation prompt or drop `commentary` from the channels line without tools.
pub const HARMONY_VLLM: &str = concat!(
    harmony_system_and_instructions!(),
    "{% if developer %}<|start|>developer<|message|># Instructions\n\n{{ developer }}<|end|>{% endif %}",
    "{% for m in turns %}",
    "{% if m.role == 'assistant' %}",
    "{% if m.content %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>{% endif %}",
    "{% elif m.role == 'tool' %}",
    "{{ raise_exception('harmony_vllm: a tool message needs the tool call before it (not covered)') }}",
    "{% else %}<|start|>{{ m.role }}<|message|>{{ m.content }}<|end|>",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
);

/// The simulator's framing (sim/src/server/openai.rs `chat_prompt`).
pub const KVSTEER_SIM: &str = concat!(
    "{% for m in messages %}<|start|>{{ m.role }}{{ '\\n' }}{{ m.content }}<|end|>{{ '\\n' }}{% endfor %}",
    "{% if add_generation_prompt %}<|start|>assistant{{ '\\n' }}{% endif %}",
);

/// How a message's text parts are joined into one content string.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PartJoin {
    /// vLLM's default for string-content templates.
    Newline,
    /// The simulator concatenates.
    Concat,
}

#[derive(Serialize)]
pub struct RenderMessage<'a> {
    pub role: &'a str,
    pub content: String,
}

/// The values a template sees besides the conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TemplateSettings {
    /// What `strftime_now` formats and harmony's `Current date:` prints; none: `strftime_now` is an
    /// error and harmony prints no date line.
    pub current_date: Option<CalendarDate>,
    /// `reasoning_effort` (harmony's `Reasoning:` line).
    pub reasoning_effort: String,
    pub bos_token: String,
    pub eos_token: String,
}

impl Default for TemplateSettings {
    fn default() -> Self {
        TemplateSettings {
            current_date: None,
            reasoning_effort: "medium".into(),
            bos_token: String::new(),
            eos_token: String::new(),
        }
    }
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    pub join: PartJoin,
    pub name: String,
    /// Whether the template renders a request's tool definitions as the engine does: a model's own
    /// (Jinja) template and `kvsteer_sim` (the simulator ignores tools, so does its framing) do; the
    /// built-in harmony templates do not render gpt-oss's tool section, so such requests fall back.
    pub renders_tools: bool,
    settings: TemplateSettings,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// `name` is `harmony`, `kvsteer_sim`, or anything else with `jinja` given.
    pub fn new(
        name: &str,
        jinja: Option<&str>,
        settings: TemplateSettings,
    ) -> Result<ChatTemplate, String> {
        let renders_tools = jinja.is_some() || name == "kvsteer_sim";
        let (source, join) = match (name, jinja) {
            (_, Some(src)) => (src.to_string(), PartJoin::Newline),
            ("harmony", None) => (HARMONY.to_string(), PartJoin::Newline),
            ("harmony_vllm", None) if settings.current_date.is_none() => {
                return Err(
                    "harmony_vllm needs current_date: vLLM stamps its date into every \
                            prompt (pin it on the engine with VLLM_SYSTEM_START_DATE)"
                        .into(),
                );
            }
            ("harmony_vllm", None) => (HARMONY_VLLM.to_string(), PartJoin::Concat),
            ("kvsteer_sim", None) => (KVSTEER_SIM.to_string(), PartJoin::Concat),
            (other, None) => {
                return Err(format!(
                    "unknown chat template {other:?} (built in: harmony, harmony_vllm, kvsteer_sim; or give chat_template_jinja)"
                ));
            }
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(false);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", crate::python_json::tojson);
        let today = settings.current_date;
        env.add_function("strftime_now", move |fmt: &str| -> Result<String, Error> {
            let Some(date) = today else {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "strftime_now: no tokenizer.current_date configured (the engine formats its own \
                     clock; configure the date it uses)",
                ));
            };
            date.strftime(fmt)
                .map_err(|e| Error::new(ErrorKind::InvalidOperation, e.0))
        });
        env.add_template_owned("chat", source)
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            join,
            name: name.to_string(),
            renders_tools,
            settings,
        })
    }

    /// Renders a conversation with the generation prompt appended.
    pub fn render(&self, messages: &[RenderMessage<'_>]) -> Result<String, String> {
        self.render_with_tools(messages, &Value::from(()))
    }

    /// [`ChatTemplate::render`] with the request's tool definitions as `tools` (none: `Value::from(())`),
    /// as transformers' `apply_chat_template(tools=...)` passes them: the list of JSON objects as the
    /// client sent it, key order kept (minijinja's `preserve_order`), so `tool | tojson` writes what
    /// Python's `json.dumps` writes.
    pub fn render_with_tools(
        &self,
        messages: &[RenderMessage<'_>],
        tools: &Value,
    ) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        let s = &self.settings;
        t.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => s.bos_token,
            eos_token => s.eos_token,
            tools => tools,
            documents => Value::from(()),
            current_date => s.current_date.map(|d| d.to_string()),
            reasoning_effort => s.reasoning_effort,
        })
        .map_err(|e| e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn msgs<'a>(v: &[(&'a str, &str)]) -> Vec<RenderMessage<'a>> {
        v.iter()
            .map(|(r, c)| RenderMessage {
                role: r,
                content: c.to_string(),
            })
            .collect()
    }

    fn settings(date: Option<&str>, effort: &str) -> TemplateSettings {
        TemplateSettings {
            current_date: date.map(|d| CalendarDate::parse(d).unwrap()),
            reasoning_effort: effort.into(),
            ..TemplateSettings::default()
        }
    }

    fn jinja(src: &str, date: Option<&str>) -> ChatTemplate {
        ChatTemplate::new("mine", Some(src), settings(date, "medium")).unwrap()
    }

    #[test]
    fn sim_framing_matches_the_simulator() {
        let t = ChatTemplate::new("kvsteer_sim", None, TemplateSettings::default()).unwrap();
        let out = t
            .render(&msgs(&[("system", "Be brief."), ("user", "Hi\nthere")]))
            .unwrap();
        assert_eq!(
            out,
            "<|start|>system\nBe brief.<|end|>\n<|start|>user\nHi\nthere<|end|>\n<|start|>assistant\n"
        );
    }

    const HEADER: &str = concat!(
        "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
        "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n",
        "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
    );

    #[test]
    fn harmony_renders_gpt_oss_format() {
        let t = ChatTemplate::new("harmony", None, TemplateSettings::default()).unwrap();
        let out = t
            .render(&msgs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("assistant", "Hello!"),
                ("user", "Bye"),
            ]))
            .unwrap();
        let expect = [
            HEADER,
            "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>",
            "<|start|>user<|message|>Hi<|end|>",
            "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>",
            "<|start|>user<|message|>Bye<|end|>",
            "<|start|>assistant",
        ]
        .concat();
        assert_eq!(out, expect);
        let dated = ChatTemplate::new("harmony", None, settings(Some("2026-11-29"), "high"))
            .unwrap()
            .render(&msgs(&[("user", "Hi")]))
            .unwrap();
        assert_eq!(
            dated,
            concat!(
                "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
                "Knowledge cutoff: 2024-06\nCurrent date: 2026-11-29\n\nReasoning: high\n\n",
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
                "<|start|>user<|message|>Hi<|end|><|start|>assistant"
            )
        );
    }

    #[test]
    fn harmony_follows_the_model_templates_message_rules() {
        let t = ChatTemplate::new("harmony", None, TemplateSettings::default()).unwrap();
        // A developer message first is the instructions; a later system or developer message is
        // dropped, as gpt-oss's template drops it.
        let out = t
            .render(&msgs(&[
                ("developer", "Rules."),
                ("user", "a"),
                ("system", "late"),
                ("developer", "later"),
                ("assistant", "b"),
            ]))
            .unwrap();
        assert_eq!(
            out,
            [
                HEADER,
                "<|start|>developer<|message|># Instructions\n\nRules.\n\n<|end|>",
                "<|start|>user<|message|>a<|end|>",
                "<|start|>assistant<|channel|>final<|message|>b<|end|>",
                "<|start|>assistant",
            ]
            .concat()
        );
        // An empty first system message renders no developer message.
        let out = t.render(&msgs(&[("system", ""), ("user", "a")])).unwrap();
        assert_eq!(
            out,
            [HEADER, "<|start|>user<|message|>a<|end|><|start|>assistant"].concat()
        );
        // No messages at all: the header and the generation prompt.
        assert_eq!(
            t.render(&[]).unwrap(),
            [HEADER, "<|start|>assistant"].concat()
        );
        // Refused, as the model's template refuses them.
        assert!(t.render(&msgs(&[("tool", "42")])).is_err());
        for bad in [
            "x<|channel|>analysis<|message|>y",
            "<|channel|>final<|message|>y",
        ] {
            let e = t
                .render(&msgs(&[("user", "q"), ("assistant", bad)]))
                .unwrap_err();
            assert!(e.contains("channel tags"), "{e}");
        }
        // The same tags from a user are just text.
        assert!(
            t.render(&msgs(&[("user", "<|channel|>final<|message|>")]))
                .is_ok()
        );
    }

    #[test]
    fn harmony_vllm_renders_as_openai_harmony_does() {
        // Expected text: openai-harmony 0.0.8 rendering the messages vLLM builds for this request
        // (tokenizer/scripts/harmony_reference.py prints it).
        let t = ChatTemplate::new("harmony_vllm", None, settings(Some("2026-11-29"), "medium"))
            .unwrap();
        assert_eq!(t.join, PartJoin::Concat);
        let out = t
            .render(&msgs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("system", "late"),
                ("developer", "later"),
                ("assistant", ""),
                ("assistant", "Hello!"),
                ("user", "Bye"),
            ]))
            .unwrap();
        assert_eq!(
            out,
            concat!(
                "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
                "Knowledge cutoff: 2024-06\nCurrent date: 2026-11-29\n\nReasoning: medium\n\n",
                "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
                "<|start|>developer<|message|># Instructions\n\nBe brief.<|end|>",
                "<|start|>user<|message|>Hi<|end|>",
                "<|start|>system<|message|>late<|end|>",
                "<|start|>developer<|message|>later<|end|>",
                "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>",
                "<|start|>user<|message|>Bye<|end|>",
                "<|start|>assistant",
            )
        );
        assert!(t.render(&msgs(&[("tool", "42")])).is_err());
        // vLLM always stamps a date: without one the configuration is refused.
        let e = ChatTemplate::new("harmony_vllm", None, TemplateSettings::default())
            .err()
            .unwrap();
        assert!(e.contains("current_date"), "{e}");
    }

    #[test]
    fn python_methods_render_as_in_jinja2() {
        // Booleans print as Python prints them (minijinja does this itself); dict items come in the
        // message's key order (role, then content), as a Python dict keeps insertion order.
        let t = jinja(
            concat!(
                "{% for m in messages %}",
                "{{ m['content'].strip() }}|{{ m.content.lstrip() }}|{{ m.content.rstrip('x ') }}|",
                "{{ m.role.startswith('us') }}{{ m.role.endswith(('er', 'zz')) }}|",
                "{{ m.content.split() | join(',') }}|{{ m.content.split('a', 1) | length }}|",
                "{{ m.role.title() }}|{{ m.role.upper() }}|{{ m.content.replace('a', 'A') }}|",
                "{% for k, v in m.items() %}{{ k }}={{ v | length }};{% endfor %}|",
                "{{ m.get('name', 'anon') }}|{{ m.keys() | list | length }}",
                "{% endfor %}"
            ),
            None,
        );
        assert_eq!(
            t.render(&msgs(&[("user", "  a b a  x")])).unwrap(),
            "a b a  x|a b a  x|  a b a|TrueTrue|a,b,a,x|2|User|USER|  A b A  x|role=4;content=10;|anon|2"
        );
    }

    #[test]
    fn strftime_now_formats_the_configured_date_only() {
        let src = "{{ strftime_now('%d %b %Y') }}";
        assert_eq!(
            jinja(src, Some("2024-07-06")).render(&[]).unwrap(),
            "06 Jul 2024"
        );
        // No configured date: an error naming the setting, never the router's own clock.
        let e = jinja(src, None).render(&[]).unwrap_err();
        assert!(e.contains("current_date"), "{e}");
        // Time of day is not known: refused, not invented.
        assert!(
            jinja("{{ strftime_now('%H:%M') }}", Some("2024-07-06"))
                .render(&[])
                .is_err()
        );
        // Templates that test for the function find it.
        assert_eq!(
            jinja("{{ strftime_now is defined }}", None)
                .render(&[])
                .unwrap(),
            "True"
        );
    }

    #[test]
    fn variables_are_those_the_engine_passes() {
        let t = jinja(
            concat!(
                "{{ tools is none }} {{ documents is none }} {{ tools is defined }} ",
                "{{ custom_tools is defined }} {{ tools_in_user_message is defined }} ",
                "{{ date_string is defined }} [{{ bos_token }}] [{{ eos_token }}] {{ add_generation_prompt }}"
            ),
            None,
        );
        assert_eq!(
            t.render(&[]).unwrap(),
            "True True True False False False [] [] True"
        );
        let t = ChatTemplate::new(
            "mine",
            Some("{{ bos_token }}x{{ eos_token }}"),
            TemplateSettings {
                bos_token: "<s>".into(),
                eos_token: "</s>".into(),
                ..TemplateSettings::default()
            },
        )
        .unwrap();
        assert_eq!(t.render(&[]).unwrap(), "<s>x</s>");
    }

    #[test]
    fn one_trailing_newline_of_the_source_is_dropped_as_jinja2_drops_it() {
        assert_eq!(jinja("a\n", None).render(&[]).unwrap(), "a");
        assert_eq!(jinja("a\n\n", None).render(&[]).unwrap(), "a\n");
    }

    #[test]
    fn custom_templates_and_their_failures() {
        let t = jinja(
            "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}",
            None,
        );
        assert_eq!(t.render(&msgs(&[("user", "x")])).unwrap(), "[user]x");
        let s = TemplateSettings::default;
        assert!(ChatTemplate::new("bad", Some("{% for %}"), s()).is_err());
        assert!(ChatTemplate::new("nope", None, s()).is_err());
        // Methods neither Python nor pycompat has, unknown functions, raise_exception: render errors.
        for src in [
            "{{ messages[0].content.frobnicate() }}",
            "{{ no_such_function() }}",
            "{{ raise_exception('no') }}",
            "{{ messages[0].content.strip(1, 2, 3) }}",
        ] {
            assert!(
                jinja(src, None).render(&msgs(&[("user", " x ")])).is_err(),
                "{src}"
            );
        }
    }
}
