#!/usr/bin/env python3
"""Reference token ids for the Hugging Face conformance test (tokenizer/tests/hf_conformance.rs).

For each model family under DIR (DIR/<family>/tokenizer.json and tokenizer_config.json, fetched by
tokenizer/scripts/hf-fetch), renders a corpus of chat requests with transformers' apply_chat_template
(add_generation_prompt=True, tokenize=False: what vLLM does for chat completions) and tokenizes the
text with the `tokenizers` library without adding special tokens (vLLM's chat path); plain texts are
tokenized with add_special_tokens=True (vLLM's completions path). Writes DIR/<family>/reference.json
with every case's input, rendered text and ids (or the template's error).

The ids come from `tokenizers` on tokenizer.json, not from transformers' AutoTokenizer: transformers
5 loads DeepSeek V3's bundle (tokenizer_class LlamaTokenizerFast) as its own LlamaTokenizer with a
Metaspace pre-tokenizer and tokenizes differently ("hello world" -> hell/ow/orld). Each case also
records whether AutoTokenizer agrees, so that difference is counted, not hidden.

A message's text parts are joined with "\\n" before rendering, as vLLM does for string-content
templates; the filter does the same.

Usage: hf_reference.py DIR FAMILY...
"""
import json
import random
import sys
from pathlib import Path

import tokenizers
import transformers
from tokenizers import Tokenizer
from transformers import AutoTokenizer

TEXTS = {
    "ascii": "Route the request to the replica that already caches most of its prompt.",
    "cjk": "日本語のテキストを分割します。中文分词测试，汉字和かなカナ。한국어 텍스트도 있습니다.",
    "emoji": "👋🏽 Hello 🌍! 👨‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 🤖🤖🤖 robots ✨",
    "accents": "Café naïve résumé Ångström façade — déjà vu, Ærøskøbing, São Paulo, Zürich.",
    "decomposed": "Cafe\u0301 nai\u0308ve re\u0301sume\u0301 A\u030angstro\u0308m (combining marks)",
    "digits": "1234567890 3.14159265358979 0000000 12,345,678 2024-06-01 x1y22z333 ١٢٣ ½",
    "whitespace": "a  b   c    d\t\te\n\n\nf     \n  g \u00a0 h\u3000i   \r\n\r\nj \u2003k    ",
    "code_py": "def fib(n: int) -> int:\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n\n\nprint([fib(i) for i in range(10)])  # 0 1 1 2 ...\n",
    "code_rust": "fn main() {\n\tlet v: Vec<u32> = (0..10).map(|x| x * x).collect();\n\tprintln!(\"{:?}\", v);\n}\n",
    "json": '{"model": "llama", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 128}',
    "contractions": "I'm sure you're right; they've said we'll see. It's He'd DON'T I'M YOU'RE can’t",
    "camel": "HTTPServer XMLHttpRequest camelCase iPhone McDonald's OAuth2Token ÉCOLE écoLE",
    "scripts": "Привет, мир! Γειά σου κόσμε. مرحبا بالعالم. नमस्ते दुनिया। สวัสดีชาวโลก",
    "specials": "text with <|eot_id|> and <s> and [INST] and <|im_end|> and <｜User｜> inside",
    "punct": "Wait... what?!? (yes) [no] {maybe} <tag/> --flag=value ~/path/to/file.txt @user #tag $5 100%",
    "urls": "See https://example.com/a/b?c=d&e=f#g and mailto:someone@example.org, or ./scripts/test.",
    "lead_trail": "   leading and trailing spaces   ",
    "newlines": "\n\nline one\nline two\n\n\n\nline three\n",
    "long_word": "a" * 3000,
    "long_digits": "9" * 500,
    "long_spaces": " " * 1000 + "x",
    "long_punct": "=-" * 400,
    "zwj": "zero\u200bwidth\u200djoin\ufeffbom\u00adsoft",
}

WORDS = [
    "the", "routing", "KV-cache", "42", "réplica", " ", "\n\n", "tokens;", "日本語", "(x)", "don't",
    "  indent", "🙂", "Ünïcödé", "3.14", "\t", "HTTP", "naïve", "\u00a0", "—", "x86_64", "'quoted'",
]


def prose(rng, words):
    return " ".join(rng.choice(WORDS) for _ in range(words))


def chat_cases():
    cases = []
    for name, text in TEXTS.items():
        cases.append((f"user_{name}", [{"role": "user", "content": text}], None))
    sys_prompt = "You are a careful assistant. Answer briefly.\nRules:\n  1. Be exact.\n  2. Cite sources."
    cases.append(("system_user", [{"role": "system", "content": sys_prompt},
                                  {"role": "user", "content": TEXTS["ascii"]}], None))
    turns = [{"role": "system", "content": sys_prompt}]
    for i, key in enumerate(["cjk", "emoji", "code_py", "digits", "accents"]):
        turns.append({"role": "user", "content": TEXTS[key]})
        if i < 4:
            turns.append({"role": "assistant", "content": f"Answer {i}: " + TEXTS["contractions"]})
    cases.append(("multi_turn", turns, None))
    cases.append(("multi_part", [{"role": "user", "content": ["First part.", "Second part: 日本語", "  third  "]}], None))
    cases.append(("empty_assistant", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": ""},
                                      {"role": "user", "content": "again"}], None))
    cases.append(("tool_result", [{"role": "user", "content": "What is the weather?"},
                                  {"role": "tool", "content": '{"temp": 21, "unit": "C"}'}], None))
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
    cases.append(("tools_defined", [{"role": "system", "content": sys_prompt},
                                    {"role": "user", "content": "Weather in Zürich?"}], tools))
    cases += tool_cases(sys_prompt, tools)
    rng = random.Random(7)
    for i in range(24):
        msgs = []
        if rng.random() < 0.5:
            msgs.append({"role": "system", "content": prose(rng, rng.randint(5, 80))})
        for t in range(rng.randint(1, 4)):
            msgs.append({"role": "user", "content": prose(rng, rng.randint(1, 300))})
            msgs.append({"role": "assistant", "content": prose(rng, rng.randint(1, 200))})
        msgs.pop()
        cases.append((f"random_{i}", msgs, None))
    return cases


def tool_cases(sys_prompt, weather):
    """Requests with tool definitions, as clients send them: key order not alphabetical (`required`
    before `properties`, `type` before `function`), every JSON type in schemas (numbers, floats,
    booleans, null, nested objects and arrays, enums), text a JSON encoder may escape (`<`, `&`,
    quotes, backslashes, non-ASCII), a tool without description or parameters."""
    search = {"type": "function", "function": {
        "name": "search_docs",
        "description": "Search the <docs> & \"notes\" \\ index — fast; 日本語 ok",
        "parameters": {"type": "object", "required": ["query"], "properties": {
            "query": {"type": "string", "description": "what to look for"},
            "limit": {"type": "integer", "minimum": 1, "maximum": 50, "default": 10},
            "threshold": {"type": "number", "default": 0.5},
            "exact": {"type": "boolean", "default": False},
            "tags": {"type": "array", "items": {"type": "string", "enum": ["a", "b", "c"]}},
            "filter": {"type": ["object", "null"], "default": None,
                       "properties": {"after": {"type": "string", "format": "date"}}},
        }, "additionalProperties": False}}}
    ping = {"type": "function", "function": {"name": "ping"}}
    multi = [{"role": "system", "content": sys_prompt}]
    for i in range(3):
        multi.append({"role": "user", "content": TEXTS[["ascii", "cjk", "code_py"][i]]})
        multi.append({"role": "assistant", "content": f"Answer {i}."})
    multi.append({"role": "user", "content": "And the weather?"})
    return [
        ("tools_no_system", [{"role": "user", "content": "Weather in Zürich?"}], weather),
        ("tools_two", [{"role": "user", "content": "Find the routing docs."}], weather + [search]),
        ("tools_minimal", [{"role": "system", "content": sys_prompt},
                           {"role": "user", "content": "ping?"}], [ping]),
        ("tools_multi_turn", multi, [search] + weather),
        ("tools_empty_list", [{"role": "user", "content": "No tools here."}], []),
        # Refused by transformers ("Tools should either be a JSON schema, or a callable ..."), so by
        # the engine: the filter falls back (counted as `tools`).
        ("tools_not_objects", [{"role": "user", "content": "hi"}], [search, "get_weather"]),
    ]


def text_cases():
    cases = [(f"text_{k}", v) for k, v in TEXTS.items()]
    rng = random.Random(11)
    cases += [(f"text_random_{i}", prose(rng, rng.randint(1, 400))) for i in range(12)]
    cases += [(f"text_unicode_{i}", unicode_soup(rng, rng.randint(20, 400))) for i in range(100)]
    return cases


# Characters where regex engines and normalizers are likely to disagree: every general category
# (letters of all cases, marks, numbers, punctuation, symbols), Unicode spaces and line breaks,
# contractions' apostrophes, CJK and kana ranges DeepSeek splits on, Hangul (NFC composes it),
# emoji with modifiers and joiners.
POOL = (" \t\n\r\x0b\x0c\x85\xa0\u1680\u2000\u2009\u200a\u2028\u2029\u202f\u205f\u3000"
        "'’sStTmMdD\"\\!?.,;:-_/()[]{}<>|@#$%^&*~`+="
        "aZéÉßſǅǈǋΣσςЖжԱաאبअािंक्षก่ี๕日本語かなカナー한국어ᄀ\u1161\u11a8"
        "0123456789٠١٢³½Ⅻ①𝟘"
        "\u0300\u0301\u0308\u20dd\u200b\u200c\u200d\ufe0f\U0001f3fd"
        "😀👍🏿👨‍💻🇫🇷©®™€£¥₿∑√∞≠≤")


def unicode_soup(rng, n):
    """Random text from POOL and from the whole of Unicode, unassigned code points included: NFC
    orders combining marks by tables of a Unicode version, so a filter on another version than
    `tokenizers`' (9.0) differs here (docs/design/tokenizer.md)."""
    out = []
    for _ in range(n):
        r = rng.random()
        if r < 0.75:
            out.append(rng.choice(POOL))
        elif r < 0.9:
            out.append(chr(rng.randint(0x20, 0x2FFF)))
        else:
            out.append(chr(rng.choice([rng.randint(0x3000, 0xD7FF), rng.randint(0xE000, 0xFFFD),
                                       rng.randint(0x10000, 0x1FAFF)])))
    return "".join(out)


def joined(messages):
    """vLLM's string-content rule: a list of text parts becomes one string, parts joined by newlines."""
    out = []
    for m in messages:
        c = m["content"]
        out.append({**m, "content": "\n".join(c) if isinstance(c, list) else c})
    return out


def family(dirpath: Path):
    tok = Tokenizer.from_file(str(dirpath / "tokenizer.json"))
    auto = AutoTokenizer.from_pretrained(str(dirpath))
    out, agree = [], 0
    for name, messages, tools in chat_cases():
        case = {"name": name, "kind": "chat", "messages": messages, "tools": tools}
        if tools is not None:
            # The request's `tools` as a client sends it, key order kept (a reader of this file
            # that sorts keys would otherwise hand the template another order than the engine's).
            case["tools_json"] = json.dumps(tools, ensure_ascii=False)
        try:
            text = auto.apply_chat_template(joined(messages), tools=tools, add_generation_prompt=True,
                                            tokenize=False)
        except Exception as e:  # the template refused the conversation (raise_exception ...)
            case["error"] = f"{type(e).__name__}: {e}"
            out.append(case)
            continue
        case["rendered"] = text
        case["ids"] = tok.encode(text, add_special_tokens=False).ids
        case["auto_agrees"] = auto(text, add_special_tokens=False)["input_ids"] == case["ids"]
        agree += case["auto_agrees"]
        out.append(case)
    for name, text in text_cases():
        ids = tok.encode(text, add_special_tokens=True).ids
        auto_ok = auto(text)["input_ids"] == ids
        agree += auto_ok
        out.append({"name": name, "kind": "text", "text": text, "ids": ids, "auto_agrees": auto_ok})
    return out, agree


def main():
    root = Path(sys.argv[1])
    for fam in sys.argv[2:]:
        cases, agree = family(root / fam)
        ref = {"family": fam, "tokenizers": tokenizers.__version__, "transformers": transformers.__version__,
               "cases": cases}
        (root / fam / "reference.json").write_text(json.dumps(ref, ensure_ascii=False))
        n = sum(1 for c in cases if "ids" in c)
        print(f"hf_reference: {fam}: {len(cases)} cases, {n} with ids; AutoTokenizer agrees on {agree}")


if __name__ == "__main__":
    main()
