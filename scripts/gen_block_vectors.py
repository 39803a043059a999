#!/usr/bin/env python3
"""Independent block-identity vectors for kvsteer-core (docs/design/design.md section 4).

Recomputes Dynamo-style block hashes with the Python `xxhash` package (a C binding of the reference
xxHash library, not the Rust `xxhash-rust` crate the core uses) and writes them to
core/tests/data/block_vectors.json. core/tests/block_vectors.rs compares the Rust implementation
against this file, so a change to either side's hashing shows up as a failing test.

Usage: python3 -m venv /tmp/venv-core && /tmp/venv-core/bin/pip install xxhash
       /tmp/venv-core/bin/python scripts/gen_block_vectors.py
"""

import json
import pathlib
import struct

import xxhash

SEED = 1337
TEXT_DOMAIN = b"kvsteer/approximate-text-identity/v1"


def h64(data: bytes, seed: int) -> int:
    return xxhash.xxh3_64_intdigest(data, seed=seed)


def namespace_seed(lora, salt) -> int:
    if lora is None and salt is None:
        return SEED
    buf = b"lora\0" + (lora or "").encode() + b"\0salt\0" + (salt or "").encode()
    return h64(buf, SEED)


def chain(parent: int, local: int, seed: int) -> int:
    return h64(struct.pack("<QQ", parent, local), seed)


def seq_hashes(tokens, block_size, seed):
    out, prev = [], None
    for i in range(0, len(tokens) - block_size + 1, block_size):
        block = tokens[i : i + block_size]
        local = h64(struct.pack(f"<{len(block)}I", *block), seed)
        cur = local if prev is None else chain(prev, local, seed)
        out.append(cur)
        prev = cur
    return out


def text_hashes(text: str, block_size: int):
    seed = h64(TEXT_DOMAIN, SEED)
    n = block_size * 4
    out, prev = [], None
    for i in range(0, len(text) - n + 1, n):
        local = h64(text[i : i + n].encode("utf-8"), seed)
        cur = local if prev is None else chain(prev, local, seed)
        out.append(cur)
        prev = cur
    return out


def lcg_tokens(count: int, state: int):
    # A fixed linear congruential sequence: reproducible without Python's random module.
    toks = []
    for _ in range(count):
        state = (state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        toks.append((state >> 33) % 200_000)
    return toks


def main():
    token_cases = []
    for block_size, count, lora, salt in [
        (1, 5, None, None),
        (4, 18, None, None),
        (16, 100, None, None),
        (16, 100, "adapter-a", None),
        (16, 100, None, "tenant-7"),
        (16, 100, "adapter-a", "tenant-7"),
        (64, 300, None, None),
        (512, 1100, None, None),
    ]:
        tokens = lcg_tokens(count, block_size * 7919 + count)
        # Include the extreme token ids so byte order mistakes show.
        tokens[0] = 0xFFFFFFFF
        seed = namespace_seed(lora, salt)
        token_cases.append(
            {
                "block_size": block_size,
                "lora_name": lora,
                "cache_salt": salt,
                "seed": str(seed),
                "tokens": tokens,
                "sequence_hashes": [str(h) for h in seq_hashes(tokens, block_size, seed)],
            }
        )
    text_cases = []
    for block_size, text in [
        (1, "ééééaaaab"),
        (4, "The quick brown fox jumps over the lazy dog. " * 3),
        (16, "def main():\n    print('héllo wörld ✓')\n" * 12),
    ]:
        text_cases.append(
            {
                "block_size": block_size,
                "text": text,
                "text_hashes": [str(h) for h in text_hashes(text, block_size)],
            }
        )
    out = {
        "generator": "scripts/gen_block_vectors.py (python xxhash %s)" % xxhash.VERSION,
        "hash_seed": SEED,
        "token_cases": token_cases,
        "text_cases": text_cases,
    }
    path = pathlib.Path(__file__).resolve().parent.parent / "core/tests/data/block_vectors.json"
    path.write_text(json.dumps(out, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {path} ({len(token_cases)} token cases, {len(text_cases)} text cases)")


if __name__ == "__main__":
    main()
