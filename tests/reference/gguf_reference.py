#!/usr/bin/env python3
"""Reference outputs for the bundled SmolLM2-135M-Instruct GGUF from independent
implementations:
  - llama.cpp through llama-cpp-python: tokenizer ids (the acceptance reference) and its
    greedy ids (informational: llama.cpp multiplies Q4_1/Q8_0 weights with activations
    quantized to 8 bits, so near-ties diverge from an f32 computation after a few tokens);
  - gguf-py (llama.cpp's Python GGUF reader, its own dequantization) + a float64 numpy
    forward pass written here in llama.cpp's own conventions (GGUF tensor layout, Q/K left
    permuted, RoPE rotating adjacent pairs): the greedy ids Prism's f32 engine must equal.

Writes tests/fixtures/smollm2_reference.json with
  - tokenizer ids of 20 varied strings (special tokens parsed, no BOS: the model's
    add_bos_token is false),
  - greedy (argmax) ids of 32 new tokens for 6 prompts, one rendered with the model's
    ChatML chat template (jinja2, trim_blocks/lstrip_blocks as transformers does),
    generated without stopping at EOS.

Environment (pinned):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install numpy==2.2.6 llama-cpp-python==0.3.16 gguf==0.17.1  # builds llama.cpp (minutes)
    /tmp/refvenv/bin/python tests/reference/gguf_reference.py [models/SmolLM2-135M-Instruct.Q4_1.gguf]
"""

import hashlib
import json
import platform
import sys
from pathlib import Path

import gguf
import jinja2
import llama_cpp
import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from llama_cpp import Llama

ROOT = Path(__file__).resolve().parents[2]
MODEL = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
OUT = ROOT / "tests" / "fixtures" / "smollm2_reference.json"
NEW_TOKENS = 32

TOKENIZER_STRINGS = [
    "Hello, world!",
    "The quick brown fox jumps over the lazy dog.",
    " leading space",
    "   three leading spaces and trailing   ",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "for (int i = 0; i < 10; ++i) { printf(\"%d\\n\", i); }",
    "Numbers: 1234567890 and 3.14159 and 1e-9",
    "emoji: 😀🎉👍🏽 and a family 👨‍👩‍👧",
    "中文测试：你好，世界！",
    "日本語のテキストとカタカナ",
    "한국어 문장입니다.",
    "Ünïcödé àccents — “quotes” … ellipsis",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "<|endoftext|>",
    "tabs\tand\nnewlines\r\nmixed",
    "URL: https://example.com/path?q=1&r=two#frag",
    "I'm can't won't they'll we've",
    "CamelCaseIdentifiers and snake_case_names",
    "    indented code block",
    "",
]

TEXT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "Q: What is 12 plus 7?\nA:",
    "The three primary colors are",
]
CHAT_MESSAGES = [{"role": "user", "content": "What is the tallest mountain in the world?"}]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def greedy(llm: Llama, ids: list[int]) -> list[int]:
    llm.reset()
    llm.eval(ids)
    out = []
    for _ in range(NEW_TOKENS):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        tok = int(np.argmax(logits))
        out.append(tok)
        llm.eval([tok])
    return out


class NumpyLlama:
    """float64 llama forward pass over GGUF tensors as stored (llama.cpp's layout)."""

    def __init__(self, path: Path):
        r = GGUFReader(str(path))
        f = lambda k: r.fields[k].parts[r.fields[k].data[0]][0]  # noqa: E731
        self.n_layer = int(f("llama.block_count"))
        self.n_head = int(f("llama.attention.head_count"))
        self.n_kv = int(f("llama.attention.head_count_kv"))
        self.eps = float(f("llama.attention.layer_norm_rms_epsilon"))
        self.base = float(f("llama.rope.freq_base"))
        self.w = {t.name: dequantize(t.data, t.tensor_type).astype(np.float64) for t in r.tensors}
        self.hd = self.w["token_embd.weight"].shape[1] // self.n_head
        self.out = self.w.get("output.weight", self.w["token_embd.weight"])

    def rope(self, x: np.ndarray, pos: int) -> np.ndarray:
        # llama.cpp LLAMA_ROPE_TYPE_NORM: rotate adjacent pairs (2i, 2i+1).
        hd = self.hd
        theta = pos * self.base ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
        c, s = np.cos(theta), np.sin(theta)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        y = np.empty_like(x)
        y[..., 0::2] = x0 * c - x1 * s
        y[..., 1::2] = x0 * s + x1 * c
        return y

    def greedy(self, ids: list[int], new: int) -> list[int]:
        w, hd, nh, nkv = self.w, self.hd, self.n_head, self.n_kv
        rms = lambda x, g: x / np.sqrt(np.mean(x * x) + self.eps) * g  # noqa: E731
        ks = [[] for _ in range(self.n_layer)]
        vs = [[] for _ in range(self.n_layer)]
        out, seq = [], list(ids)
        for pos in range(len(ids) + new - 1):
            x = w["token_embd.weight"][seq[pos]]
            for l in range(self.n_layer):
                b = f"blk.{l}."
                h = rms(x, w[b + "attn_norm.weight"])
                q = self.rope((w[b + "attn_q.weight"] @ h).reshape(nh, hd), pos)
                ks[l].append(self.rope((w[b + "attn_k.weight"] @ h).reshape(nkv, hd), pos))
                vs[l].append((w[b + "attn_v.weight"] @ h).reshape(nkv, hd))
                K, V = np.stack(ks[l]), np.stack(vs[l])  # [t, nkv, hd]
                att = np.empty((nh, hd))
                for hh in range(nh):
                    g = hh // (nh // nkv)
                    sc = K[:, g, :] @ q[hh] / np.sqrt(hd)
                    p = np.exp(sc - sc.max())
                    att[hh] = (p / p.sum()) @ V[:, g, :]
                x = x + w[b + "attn_output.weight"] @ att.reshape(-1)
                h = rms(x, w[b + "ffn_norm.weight"])
                gt, up = w[b + "ffn_gate.weight"] @ h, w[b + "ffn_up.weight"] @ h
                x = x + w[b + "ffn_down.weight"] @ (gt / (1 + np.exp(-gt)) * up)
            if pos >= len(ids) - 1:
                tok = int(np.argmax(self.out @ rms(x, w["output_norm.weight"])))
                out.append(tok)
                seq.append(tok)
        return out


def main() -> None:
    llm = Llama(model_path=str(MODEL), n_ctx=1024, n_threads=2, n_batch=512, seed=0, logits_all=True, verbose=False)
    tok = lambda s: llm.tokenize(s.encode("utf-8"), add_bos=False, special=True)  # noqa: E731

    template = llm.metadata["tokenizer.chat_template"]
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    chat_text = env.from_string(template).render(
        messages=CHAT_MESSAGES, add_generation_prompt=True, bos_token="", eos_token="<|im_end|>"
    )

    prompts = [{"kind": "text", "text": p} for p in TEXT_PROMPTS]
    prompts.append({"kind": "chat", "messages": CHAT_MESSAGES, "text": chat_text})
    ref = NumpyLlama(MODEL)
    for p in prompts:
        p["prompt_ids"] = tok(p["text"])
        p["greedy_ids"] = ref.greedy(p["prompt_ids"], NEW_TOKENS)
        p["greedy_text"] = llm.detokenize(p["greedy_ids"]).decode("utf-8", errors="replace")
        p["llama_cpp_greedy_ids"] = greedy(llm, p["prompt_ids"])
        agree = 0
        while agree < NEW_TOKENS and p["llama_cpp_greedy_ids"][agree] == p["greedy_ids"][agree]:
            agree += 1
        p["llama_cpp_agreeing_prefix"] = agree
        print(f"{p['text'][:30]!r}: llama.cpp agrees on the first {agree} tokens", file=sys.stderr)

    fixture = {
        "generator": "tests/reference/gguf_reference.py",
        "implementation": {
            "tokenizer_and_prompt_ids": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp)",
            "greedy_ids": f"gguf-py {gguf.__version__ if hasattr(gguf, '__version__') else '0.17.1'} dequantization + float64 numpy forward pass (this script)",
            "llama_cpp_greedy_ids": f"llama-cpp-python {llama_cpp.__version__} (llama.cpp CPU, 2 threads, 8-bit activations)",
        },
        "versions": {
            "python": platform.python_version(),
            "llama_cpp_python": llama_cpp.__version__,
            "numpy": np.__version__,
            "jinja2": jinja2.__version__,
            "gguf": "0.17.1",
        },
        "model": {"file": MODEL.name, "sha256": sha256(MODEL)},
        "new_tokens": NEW_TOKENS,
        "decoding": "greedy argmax of the last-token logits, EOS not treated specially",
        "tokenizer": [{"text": s, "ids": tok(s)} for s in TOKENIZER_STRINGS],
        "prompts": prompts,
    }
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(fixture, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
