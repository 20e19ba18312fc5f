#!/usr/bin/env python3
"""Writes a 128,256-token vocabulary built the way Llama 3's is, for `cuda_bench --json-schema`.

Llama 3's tokenizer is tiktoken's cl100k_base (100,256 BPE tokens) plus 28,000 further tokens
(mostly non-English) plus 256 special tokens. No Llama-3 tokenizer.json can be fetched here, so
this takes cl100k_base, then o200k_base's tokens that cl100k_base lacks (by rank, i.e. most
frequent first) up to 128,000, then 256 special tokens `<|reserved_special_token_i|>`.
The `.tiktoken` files ship in the tiktoken-rs crate (`assets/`; `cargo fetch` a crate that
depends on it).

Output records (the format of `cuda_bench --write-vocab`): special u8, length u16 LE, bytes.

usage: llama3_like_vocab.py CL100K.tiktoken O200K.tiktoken OUT
"""
import base64
import struct
import sys

VOCAB = 128_256
SPECIAL = 256


def ranks(path):
    out = []
    with open(path, "rb") as f:
        for line in f:
            tok, rank = line.split()
            out.append((int(rank), base64.b64decode(tok)))
    out.sort()
    return [t for _, t in out]


def main():
    cl, o2, dst = sys.argv[1:4]
    tokens = ranks(cl)
    seen = set(tokens)
    for t in ranks(o2):
        if len(tokens) >= VOCAB - SPECIAL:
            break
        if t not in seen:
            seen.add(t)
            tokens.append(t)
    assert len(tokens) == VOCAB - SPECIAL, len(tokens)
    with open(dst, "wb") as f:
        for t in tokens:
            f.write(struct.pack("<BH", 0, len(t)) + t)
        for i in range(SPECIAL):
            t = f"<|reserved_special_token_{i}|>".encode()
            f.write(struct.pack("<BH", 1, len(t)) + t)
    lens = [len(t) for t in tokens]
    print(f"wrote {VOCAB} tokens to {dst}: mean token length {sum(lens) / len(lens):.2f} bytes")


if __name__ == "__main__":
    main()
