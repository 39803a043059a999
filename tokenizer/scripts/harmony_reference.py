#!/usr/bin/env python3
"""Reference renders of gpt-oss conversations by the openai-harmony library, the way vLLM builds the
messages for a chat completion (vLLM `harmony_utils.py`: the first system/developer message becomes the
developer instructions, later ones are passed through with their role, the system header carries the
date), for comparing with the `harmony_vllm` expectations in tokenizer/src/chat_template.rs.

Usage (needs `pip install openai-harmony`; it loads the o200k vocabulary from TIKTOKEN_ENCODINGS_BASE,
which can be tiktoken-rs's copy, so no network):
    TIKTOKEN_ENCODINGS_BASE=$(dirname ~/.cargo/registry/src/*/tiktoken-rs-*/assets/o200k_base.tiktoken) \\
        python3 tokenizer/scripts/harmony_reference.py
"""
from openai_harmony import (Conversation, DeveloperContent, HarmonyEncodingName, Message, Role,
                            SystemContent, TextContent, load_harmony_encoding)

enc = load_harmony_encoding(HarmonyEncodingName.HARMONY_GPT_OSS)


def vllm_like(chat, date):
    msgs = [Message.from_role_and_content(Role.SYSTEM, SystemContent.new().with_conversation_start_date(date))]
    if chat and chat[0][0] in ("system", "developer"):
        if chat[0][1]:
            msgs.append(Message.from_role_and_content(Role.DEVELOPER,
                                                      DeveloperContent.new().with_instructions(chat[0][1])))
        chat = chat[1:]
    for role, text in chat:
        if role == "assistant":
            if text:
                msgs.append(Message.from_role_and_content(Role.ASSISTANT, text).with_channel("final"))
        else:
            msgs.append(Message.from_role_and_contents(Role(role), [TextContent(text=text)]))
    ids = enc.render_conversation_for_completion(Conversation.from_messages(msgs), Role.ASSISTANT)
    text = enc.decode_utf8(ids)
    # The filter tokenizes the rendered text with special tokens recognised; harmony renders ids
    # directly. They must agree.
    assert enc.encode(text, allowed_special="all") == ids, "text round trip changes the token ids"
    return text


if __name__ == "__main__":
    print(repr(vllm_like([("system", "Be brief."), ("user", "Hi"), ("system", "late"), ("developer", "later"),
                          ("assistant", ""), ("assistant", "Hello!"), ("user", "Bye")], "2026-11-29")))
