//! Model chat templates (`chat_template_jinja`) in the style of the Llama 3.x, Qwen 2.5 and Mistral
//! families render here exactly as Jinja2 renders them in the engine.
//!
//! The templates are written for these tests (not copied from any model): they use the constructs the
//! families' templates use (`messages[0]['role']`, `.strip()`, `| trim`, `loop.first`/`loop.last`,
//! `raise_exception` on a bad role order, `strftime_now('%d %b %Y')`, `namespace()`, `tojson`, the
//! `tools`/`custom_tools`/`tools_in_user_message`/`date_string` checks) and the families' special
//! tokens, which are facts about the models: Llama 3 `<|begin_of_text|>`, `<|start_header_id|>`,
//! `<|end_header_id|>`, `<|eot_id|>` and the `Cutting Knowledge Date` / `Today Date` system lines
//! (Meta's Llama 3.1 model card, prompt format); Qwen 2.5 ChatML `<|im_start|>`, `<|im_end|>` and
//! `<tool_response>` (Qwen2.5 `tokenizer_config.json`); Mistral `<s>`, `[INST]`, `[/INST]`, `</s>`
//! (mistral-common's v3 tokenizer). Every expected string below is derived by hand from the template.

use kvsteer_core::ChatTurn;
use kvsteer_core::request::{PromptIdentity, RouteRequest, read_request_with};
use kvsteer_tokenizer::{FallbackReason, TextTokenizer, TokenizerConfig};

const LLAMA3_STYLE: &str = r#"{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = strftime_now("%d %b %Y") %}
{%- endif %}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_text = messages[0]['content'].strip() %}
    {%- set turns = messages[1:] %}
{%- else %}
    {%- set system_text = "" %}
    {%- set turns = messages %}
{%- endif %}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{{- system_text }}
{{- "<|eot_id|>" }}
{%- for m in turns %}
    {%- if m.role not in ['user', 'assistant'] %}
        {{- raise_exception("Only user and assistant turns may follow the system message, got " + m.role) }}
    {%- endif %}
    {{- "<|start_header_id|>" + m['role'] + "<|end_header_id|>\n\n" + m['content'] | trim + "<|eot_id|>" }}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- "<|start_header_id|>assistant<|end_header_id|>\n\n" }}
{%- endif %}
"#;

const QWEN25_STYLE: &str = r#"{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- for tool in tools %}
        {{- tool | tojson }}
    {%- endfor %}
    {{- '<|im_end|>\n' }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
{%- else %}
    {{- '<|im_start|>system\nYou answer questions.<|im_end|>\n' }}
{%- endif %}
{%- for message in messages %}
    {%- if message.role in ['user', 'assistant'] or (message.role == 'system' and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' }}
    {%- elif message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- message.content | tojson }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
{%- endif %}
"#;

const MISTRAL_STYLE: &str = r#"{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content'] %}
    {%- set loop_messages = messages[1:] %}
{%- else %}
    {%- set loop_messages = messages %}
{%- endif %}
{%- set ns = namespace(users=0) %}
{{- bos_token }}
{%- for message in loop_messages %}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Roles must alternate user/assistant after an optional system message') }}
    {%- endif %}
    {%- if message['role'] == 'user' %}
        {%- set ns.users = ns.users + 1 %}
        {%- if loop.last and system_message is defined %}
            {{- '[INST] ' + system_message + '\n\n' + message['content'] + '[/INST]' }}
        {%- else %}
            {{- '[INST] ' + message['content'] + '[/INST]' }}
        {%- endif %}
    {%- elif message['role'] == 'assistant' %}
        {%- if message['content'].startswith(' ') %}
            {{- message['content'].rstrip() + eos_token }}
        {%- else %}
            {{- ' ' + message['content'] | trim + eos_token }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
"#;

fn tokenizer(template: &str, date: Option<&str>, bos: &str, eos: &str) -> TextTokenizer {
    TextTokenizer::new(&TokenizerConfig {
        chat_template: "model".into(),
        chat_template_jinja: Some(template.into()),
        current_date: date.map(str::to_string),
        bos_token: bos.into(),
        eos_token: eos.into(),
        ..TokenizerConfig::default()
    })
    .unwrap()
}

fn turns<'a>(msgs: &[(&'a str, &'a str)]) -> Vec<ChatTurn<'a>> {
    msgs.iter()
        .map(|(role, text)| ChatTurn {
            role: Some(role),
            parts: vec![text],
            non_text: false,
            tool_calls: false,
        })
        .collect()
}

/// A chat completions body through the core's request reader with `t` as its tokenizer (16-token
/// blocks), as the filter reads it.
fn read_chat(t: &mut TextTokenizer, body: &str) -> RouteRequest {
    read_request_with(
        "/v1/chat/completions",
        body.as_bytes(),
        None,
        16,
        1 << 20,
        Some(t),
    )
    .unwrap()
}

fn render(t: &TextTokenizer, msgs: &[(&str, &str)]) -> Result<String, String> {
    t.render_chat(&turns(msgs)).map_err(|(why, e)| {
        assert_eq!(why, FallbackReason::Template);
        e
    })
}

const CONVERSATION: [(&str, &str); 4] = [
    ("system", "  Be brief.\n"),
    ("user", "Hi there "),
    ("assistant", "\nHello!"),
    ("user", "Bye"),
];

#[test]
fn llama3_style_renders_with_the_configured_date() {
    let t = tokenizer(
        LLAMA3_STYLE,
        Some("2024-07-26"),
        "<|begin_of_text|>",
        "<|eot_id|>",
    );
    assert_eq!(
        render(&t, &CONVERSATION).unwrap(),
        concat!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
            "Be brief.<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\nHi there<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\nHello!<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\nBye<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        )
    );
    // No system message: an empty system block, still dated.
    assert_eq!(
        render(&t, &[("user", "x")]).unwrap(),
        concat!(
            "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\n",
            "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n<|eot_id|>",
            "<|start_header_id|>user<|end_header_id|>\n\nx<|eot_id|>",
            "<|start_header_id|>assistant<|end_header_id|>\n\n",
        )
    );
    // A bad role order raises, with the template's message.
    let e = render(&t, &[("system", "s"), ("user", "u"), ("system", "again")]).unwrap_err();
    assert!(e.contains("got system"), "{e}");
}

#[test]
fn llama3_style_without_a_date_falls_back_instead_of_guessing() {
    let mut t = tokenizer(LLAMA3_STYLE, None, "<|begin_of_text|>", "");
    let e = render(&t, &[("user", "x")]).unwrap_err();
    assert!(e.contains("current_date"), "{e}");
    // Through the request reader: approximate identity, counted as a template fallback.
    let body = r#"{"messages":[{"role":"user","content":"x"}]}"#;
    let r = read_chat(&mut t, body);
    assert!(matches!(r.identity, PromptIdentity::Approximate(_)));
    assert_eq!(t.stats().fallbacks[FallbackReason::Template as usize], 1);
}

#[test]
fn qwen25_style_renders_chatml_and_tool_results_as_json() {
    let t = tokenizer(QWEN25_STYLE, None, "", "<|im_end|>");
    assert_eq!(
        render(&t, &CONVERSATION).unwrap(),
        concat!(
            "<|im_start|>system\n  Be brief.\n<|im_end|>\n",
            "<|im_start|>user\nHi there <|im_end|>\n",
            "<|im_start|>assistant\n\nHello!<|im_end|>\n",
            "<|im_start|>user\nBye<|im_end|>\n",
            "<|im_start|>assistant\n",
        )
    );
    // No system message: the template's default; consecutive tool results share one user turn, each
    // a JSON string as Python's json.dumps writes it (non-ASCII kept, `<` not escaped).
    assert_eq!(
        render(
            &t,
            &[
                ("user", "Weather?"),
                ("assistant", "Checking."),
                ("tool", "{\"temp\": 21}"),
                ("tool", "rain <later>\nnaïve"),
                ("assistant", "Mild."),
            ]
        )
        .unwrap(),
        concat!(
            "<|im_start|>system\nYou answer questions.<|im_end|>\n",
            "<|im_start|>user\nWeather?<|im_end|>\n",
            "<|im_start|>assistant\nChecking.<|im_end|>\n",
            "<|im_start|>user",
            "\n<tool_response>\n\"{\\\"temp\\\": 21}\"\n</tool_response>",
            "\n<tool_response>\n\"rain <later>\\nnaïve\"\n</tool_response>",
            "<|im_end|>\n",
            "<|im_start|>assistant\nMild.<|im_end|>\n",
            "<|im_start|>assistant\n",
        )
    );
    // A later system message is rendered in place (not loop.first).
    assert_eq!(
        render(&t, &[("user", "a"), ("system", "b")]).unwrap(),
        concat!(
            "<|im_start|>system\nYou answer questions.<|im_end|>\n",
            "<|im_start|>user\na<|im_end|>\n<|im_start|>system\nb<|im_end|>\n",
            "<|im_start|>assistant\n",
        )
    );
}

#[test]
fn mistral_style_folds_the_system_prompt_into_the_last_user_turn() {
    let t = tokenizer(MISTRAL_STYLE, None, "<s>", "</s>");
    assert_eq!(
        render(&t, &CONVERSATION).unwrap(),
        "<s>[INST] Hi there [/INST] Hello!</s>[INST]   Be brief.\n\n\nBye[/INST]"
    );
    // An assistant reply that starts with a space keeps it (the `.startswith(' ')` branch).
    assert_eq!(
        render(&t, &[("user", "a"), ("assistant", " b  "), ("user", "c")]).unwrap(),
        "<s>[INST] a[/INST] b</s>[INST] c[/INST]"
    );
    // Two user turns in a row: the template raises.
    let e = render(&t, &[("user", "a"), ("user", "b")]).unwrap_err();
    assert!(e.contains("alternate"), "{e}");
}

#[test]
fn model_templates_get_the_exact_identity_through_the_reader() {
    let mut t = tokenizer(QWEN25_STYLE, None, "", "");
    let body = serde_json::json!({"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "part one"}, {"type": "text", "text": "part two"}]},
    ]})
    .to_string();
    let r = read_chat(&mut t, &body);
    // Text parts are joined with a newline (vLLM's rule for string-content templates).
    let rendered = "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\npart one\npart two<|im_end|>\n<|im_start|>assistant\n";
    let expect = tiktoken_rs::o200k_harmony_singleton().encode_with_special_tokens(rendered);
    assert_eq!(r.prompt_tokens, expect.len() as u64);
    assert!(matches!(r.identity, PromptIdentity::Exact(_)));
    assert_eq!(t.stats().exact, 1);
}

#[test]
fn a_bad_current_date_refuses_the_configuration() {
    for bad in ["2024-02-30", "yesterday", "26 Jul 2024"] {
        let e = TextTokenizer::new(&TokenizerConfig {
            current_date: Some(bad.into()),
            ..TokenizerConfig::default()
        })
        .err()
        .unwrap();
        assert!(e.starts_with("current_date:"), "{e}");
    }
}

/// A request's `tools` reach the template through the request reader, key order as sent (Python
/// keeps it; `tojson` writes it), and the same with either reader; a `tools` value transformers
/// refuses, or a built-in template that does not render tools, falls back counted as `tools`.
#[test]
fn tools_reach_the_template_in_the_clients_key_order() {
    let mut t = tokenizer(QWEN25_STYLE, None, "", "<|im_end|>");
    let tools = r#"[{"type":"function","function":{"name":"f","parameters":{"type":"object","required":["b"],"properties":{"b":{"type":"number","default":0.5}}}}}]"#;
    let body = format!(r#"{{"tools":{tools},"messages":[{{"role":"user","content":"x"}}]}}"#);
    let text = t
        .render_chat_tools(&turns(&[("user", "x")]), Some(tools))
        .unwrap();
    assert!(
        text.contains(r#"{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "required": ["b"], "properties": {"b": {"type": "number", "default": 0.5}}}}}"#),
        "{text}"
    );
    let r = read_chat(&mut t, &body);
    assert!(matches!(r.identity, PromptIdentity::Exact(_)));
    // Without tools the text differs: the tools were rendered, not ignored.
    let plain = read_chat(&mut t, r#"{"messages":[{"role":"user","content":"x"}]}"#);
    assert_ne!(plain.identity, r.identity);
    // The serde_json reader (an escaped key sends the body there) gives the same identity.
    let escaped = body.replacen("\"messages\"", "\"m\\u0065ssages\"", 1);
    assert_eq!(read_chat(&mut t, &escaped).identity, r.identity);
    // `null` is no tools.
    let null = r#"{"tools":null,"messages":[{"role":"user","content":"x"}]}"#;
    assert_eq!(read_chat(&mut t, null).identity, plain.identity);
    for bad in [r#""f""#, r#"{"a":1}"#, r#"[1]"#, r#"[{"a":1},"f"]"#] {
        let body = format!(r#"{{"tools":{bad},"messages":[{{"role":"user","content":"x"}}]}}"#);
        let before = t.stats().fallbacks[FallbackReason::Tools as usize];
        let r = read_chat(&mut t, &body);
        assert!(
            matches!(r.identity, PromptIdentity::Approximate(_)),
            "{bad}"
        );
        assert_eq!(
            t.stats().fallbacks[FallbackReason::Tools as usize],
            before + 1
        );
    }
    // The built-in harmony template does not render gpt-oss's tool section: fall back, counted.
    let mut h = TextTokenizer::new(&TokenizerConfig::default()).unwrap();
    let r = read_chat(&mut h, &body);
    assert!(matches!(r.identity, PromptIdentity::Approximate(_)));
    assert_eq!(h.stats().fallbacks[FallbackReason::Tools as usize], 1);
}
