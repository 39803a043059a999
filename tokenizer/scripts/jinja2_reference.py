#!/usr/bin/env python3
"""Reference renders of the test chat templates by real Jinja2, set up as transformers sets it up
(`utils/chat_template_utils.py`: ImmutableSandboxedEnvironment, trim_blocks, lstrip_blocks, the
loopcontrols extension, `raise_exception`, `tojson` as `json.dumps(ensure_ascii=False, ...)`,
`strftime_now`), for comparing by eye with the expected strings in tokenizer/tests/chat_templates.rs and
host-test/tests/tokenizer.rs, which were derived by hand.

Usage: python3 tokenizer/scripts/jinja2_reference.py   (needs jinja2; no network)
"""
import datetime
import json
import pathlib
import re

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

ROOT = pathlib.Path(__file__).resolve().parents[2]
DATE = datetime.date(2024, 7, 26)  # the tests' current_date


def templates():
    found = {}
    for f in ["tokenizer/tests/chat_templates.rs", "host-test/tests/tokenizer.rs"]:
        src = (ROOT / f).read_text()
        found.update(re.findall(r'const (\w+): &str = r#"(.*?)"#;', src, re.S))
    return found


def env():
    e = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])

    def raise_exception(msg):
        raise ValueError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    e.filters["tojson"] = tojson
    e.globals["raise_exception"] = raise_exception
    e.globals["strftime_now"] = DATE.strftime
    return e


CONVERSATION = [("system", "  Be brief.\n"), ("user", "Hi there "), ("assistant", "\nHello!"), ("user", "Bye")]
CASES = {
    "LLAMA3_STYLE": [(CONVERSATION, "<|begin_of_text|>", "<|eot_id|>"), ([("user", "x")], "<|begin_of_text|>", "")],
    "QWEN25_STYLE": [
        (CONVERSATION, "", "<|im_end|>"),
        ([("user", "Weather?"), ("assistant", "Checking."), ("tool", '{"temp": 21}'),
          ("tool", "rain <later>\nnaïve"), ("assistant", "Mild.")], "", ""),
        ([("user", "a"), ("system", "b")], "", ""),
    ],
    "MISTRAL_STYLE": [
        (CONVERSATION, "<s>", "</s>"),
        ([("user", "a"), ("assistant", " b  "), ("user", "c")], "<s>", "</s>"),
    ],
    "LLAMA_STYLE": [([("system", " Be brief. "), ("user", "  what is a kv cache?")], "<|begin_of_text|>", "")],
}

if __name__ == "__main__":
    found = templates()
    e = env()
    for name, cases in CASES.items():
        t = e.from_string(found[name])
        for msgs, bos, eos in cases:
            out = t.render(messages=[{"role": r, "content": c} for r, c in msgs], add_generation_prompt=True,
                           bos_token=bos, eos_token=eos, tools=None, documents=None)
            print(f"{name}: {out!r}")
