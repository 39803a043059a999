//! Chat templates: a conversation rendered to the exact text the engine tokenizes, with a
//! Jinja-compatible engine (minijinja) configured as Hugging Face's `apply_chat_template` configures
//! Jinja2 (`trim_blocks`, `lstrip_blocks`, no autoescape) and given the same variables (`messages`,
//! `add_generation_prompt`, `bos_token`, `eos_token`, `raise_exception`).
//!
//! Built in:
//! - `harmony`: gpt-oss's format (`<|start|>ROLE<|message|>TEXT<|end|>`): the system header the model
//!   card's template emits, a `system`/`developer` message as the developer instructions, user turns,
//!   assistant turns in the `final` channel, then `<|start|>assistant`. Not covered (they make the
//!   request fall back): tools, tool calls, tool results, reasoning content. The real template stamps
//!   the current date into the system header; here it is the `current_date` setting (none by default),
//!   which must be set to match an engine that stamps it.
//! - `kvsteer_sim`: the simulator's fixed framing (`<|start|>ROLE\nTEXT<|end|>\n` ... `<|start|>assistant\n`),
//!   so the test fleet's engines and the filter agree.
//! - any other template as Jinja text (a model's `chat_template`). Templates that call Python string
//!   methods (`.strip()`) or functions minijinja does not have fail to render: the request falls back.

use minijinja::{Environment, Error, ErrorKind, context};
use serde::Serialize;

/// The gpt-oss (harmony) template, without tools.
pub const HARMONY: &str = concat!(
    "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
    "Knowledge cutoff: 2024-06\n",
    "{% if current_date %}Current date: {{ current_date }}\n{% endif %}",
    // trim_blocks eats a newline right after a block tag: emit it as an expression.
    "{{ '\\n' }}Reasoning: {{ reasoning_effort }}\n\n",
    "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
    "{% for m in messages %}",
    "{% if m.role == 'system' or m.role == 'developer' %}",
    "<|start|>developer<|message|># Instructions\n\n{{ m.content }}\n\n<|end|>",
    "{% elif m.role == 'user' %}",
    "<|start|>user<|message|>{{ m.content }}<|end|>",
    "{% elif m.role == 'assistant' %}",
    "<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>",
    "{% else %}{{ raise_exception('harmony: unsupported role ' ~ m.role) }}",
    "{% endif %}",
    "{% endfor %}",
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}",
);

/// The simulator's framing (sim/src/server.rs `chat_prompt`).
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

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    pub join: PartJoin,
    pub name: String,
    current_date: Option<String>,
    reasoning_effort: String,
}

fn raise_exception(msg: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

impl ChatTemplate {
    /// `name` is `harmony`, `kvsteer_sim`, or anything else with `jinja` given.
    pub fn new(
        name: &str,
        jinja: Option<&str>,
        current_date: Option<String>,
        reasoning_effort: String,
    ) -> Result<ChatTemplate, String> {
        let (source, join) = match (name, jinja) {
            (_, Some(src)) => (src.to_string(), PartJoin::Newline),
            ("harmony", None) => (HARMONY.to_string(), PartJoin::Newline),
            ("kvsteer_sim", None) => (KVSTEER_SIM.to_string(), PartJoin::Concat),
            (other, None) => {
                return Err(format!(
                    "unknown chat template {other:?} (built in: harmony, kvsteer_sim; or give chat_template_jinja)"
                ));
            }
        };
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_keep_trailing_newline(true);
        env.add_function("raise_exception", raise_exception);
        env.add_template_owned("chat", source)
            .map_err(|e| format!("chat template does not compile: {e}"))?;
        Ok(ChatTemplate {
            env,
            join,
            name: name.to_string(),
            current_date,
            reasoning_effort,
        })
    }

    /// Renders a conversation with the generation prompt appended.
    pub fn render(&self, messages: &[RenderMessage<'_>]) -> Result<String, String> {
        let t = self.env.get_template("chat").map_err(|e| e.to_string())?;
        t.render(context! {
            messages => messages,
            add_generation_prompt => true,
            bos_token => "",
            eos_token => "",
            current_date => self.current_date,
            reasoning_effort => self.reasoning_effort,
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

    #[test]
    fn sim_framing_matches_the_simulator() {
        let t = ChatTemplate::new("kvsteer_sim", None, None, "medium".into()).unwrap();
        let out = t
            .render(&msgs(&[("system", "Be brief."), ("user", "Hi\nthere")]))
            .unwrap();
        assert_eq!(
            out,
            "<|start|>system\nBe brief.<|end|>\n<|start|>user\nHi\nthere<|end|>\n<|start|>assistant\n"
        );
    }

    #[test]
    fn harmony_renders_gpt_oss_format() {
        let t = ChatTemplate::new("harmony", None, None, "medium".into()).unwrap();
        let out = t
            .render(&msgs(&[
                ("system", "Be brief."),
                ("user", "Hi"),
                ("assistant", "Hello!"),
                ("user", "Bye"),
            ]))
            .unwrap();
        let expect = concat!(
            "<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\n",
            "Knowledge cutoff: 2024-06\n\nReasoning: medium\n\n",
            "# Valid channels: analysis, commentary, final. Channel must be included for every message.<|end|>",
            "<|start|>developer<|message|># Instructions\n\nBe brief.\n\n<|end|>",
            "<|start|>user<|message|>Hi<|end|>",
            "<|start|>assistant<|channel|>final<|message|>Hello!<|end|>",
            "<|start|>user<|message|>Bye<|end|>",
            "<|start|>assistant"
        );
        assert_eq!(out, expect);
        let dated = ChatTemplate::new("harmony", None, Some("2026-11-29".into()), "high".into())
            .unwrap()
            .render(&msgs(&[("user", "Hi")]))
            .unwrap();
        assert!(
            dated.contains(
                "Knowledge cutoff: 2024-06\nCurrent date: 2026-11-29\n\nReasoning: high\n"
            )
        );
        assert!(t.render(&msgs(&[("tool", "42")])).is_err());
    }

    #[test]
    fn custom_templates_and_their_failures() {
        let t = ChatTemplate::new(
            "mine",
            Some("{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}"),
            None,
            "medium".into(),
        )
        .unwrap();
        assert_eq!(t.render(&msgs(&[("user", "x")])).unwrap(), "[user]x");
        assert!(ChatTemplate::new("bad", Some("{% for %}"), None, "m".into()).is_err());
        assert!(ChatTemplate::new("nope", None, None, "m".into()).is_err());
        // Python string methods are not there: a render error, not a panic.
        let py = ChatTemplate::new(
            "py",
            Some("{{ messages[0].content.strip() }}"),
            None,
            "m".into(),
        )
        .unwrap();
        assert!(py.render(&msgs(&[("user", " x ")])).is_err());
    }
}
