#!/usr/bin/env python3
"""Writes a tiny seeded-random Llama checkpoint in the Hugging Face layout to
tests/fixtures/hf-tiny/ and an independent float64 numpy forward pass's logits to
tests/fixtures/hf-tiny/reference_logits.json.

The checkpoint exercises: GQA (4 query heads, 2 KV heads), Llama 3 rope_scaling, an untied
lm_head, f32 / f16 / bf16 tensors (safetensors written by hand: 8-byte header length, JSON
header, raw little-endian data), a byte-level BPE tokenizer.json with a BOS post-processor,
tokenizer_config.json with a ChatML template, and generation_config.json with a list of EOS ids.

Only numpy is needed:  python3 tests/reference/hf_tiny.py   (numpy 2.2.6 used for the fixture)
"""

import json
import struct
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf-tiny"
SEED = 20241129

CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "num_hidden_layers": 2,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
    "vocab_size": 272,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
    "bos_token_id": 256,
    "eos_token_id": 257,
    "torch_dtype": "float32",
}
SPECIAL = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]  # ids 256..259
MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a"), ("e", "r"), ("o", "n"), ("Ġ", "s")]
PROMPTS = [
    [256, 72, 101, 108, 108, 111, 264, 263, 100],
    [256, 258, 117, 115, 101, 114, 198, 10, 20, 30, 40, 50, 60, 70, 80, 90, 100, 110, 120, 130, 140, 150, 160, 170,
     180, 190, 200, 210, 220, 230, 240, 250, 255, 0, 1, 2, 3, 259, 265, 266, 267],
]


def bytes_to_unicode() -> dict[int, str]:
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def tokenizer_json() -> dict:
    b2u = bytes_to_unicode()
    vocab = {b2u[b]: b for b in range(256)}
    for i, s in enumerate(SPECIAL):
        vocab[s] = 256 + i
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    added = [
        {"id": 256 + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
         "special": True}
        for i, s in enumerate(SPECIAL)
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {"<s>": {"id": "<s>", "ids": [256], "tokens": ["<s>"]}},
        },
        "decoder": byte_level,
        "model": {
            "type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
            "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
            "vocab": vocab, "merges": [f"{a} {b}" for a, b in MERGES],
        },
    }


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """f32 → bf16 by truncation (the stored values are exactly these)."""
    return (x.astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(b: np.ndarray) -> np.ndarray:
    return (b.astype(np.uint32) << 16).view(np.float32)


def write_safetensors(path: Path, tensors: dict[str, tuple[str, np.ndarray]]) -> None:
    header, blobs, off = {}, [], 0
    for name, (dtype, arr) in tensors.items():
        raw = np.ascontiguousarray(arr).astype(arr.dtype.newbyteorder("<")).tobytes()
        header[name] = {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [off, off + len(raw)]}
        blobs.append(raw)
        off += len(raw)
    header["__metadata__"] = {"format": "pt"}
    hb = json.dumps(header, separators=(",", ":")).encode()
    hb += b" " * ((8 - len(hb) % 8) % 8)
    path.write_bytes(struct.pack("<Q", len(hb)) + hb + b"".join(blobs))


def make_weights(rng: np.random.Generator) -> tuple[dict, dict]:
    """Returns (stored tensors with dtypes, the exact f64 values a loader must see)."""
    c = CONFIG
    h, i, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    stored, exact = {}, {}

    def put(name, shape, dtype, scale):
        x = (rng.standard_normal(shape) * scale).astype(np.float32)
        if dtype == "F16":
            s = x.astype(np.float16)
            stored[name], exact[name] = ("F16", s), s.astype(np.float64)
        elif dtype == "BF16":
            s = to_bf16_bits(x)
            stored[name], exact[name] = ("BF16", s), from_bf16_bits(s).astype(np.float64)
        else:
            stored[name], exact[name] = ("F32", x), x.astype(np.float64)

    put("model.embed_tokens.weight", (v, h), "F16", 1.0)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        put(f"{p}.input_layernorm.weight", (h,), "F32", 0.1)
        exact[f"{p}.input_layernorm.weight"] += 1.0
        stored[f"{p}.input_layernorm.weight"] = ("F32", exact[f"{p}.input_layernorm.weight"].astype(np.float32))
        put(f"{p}.self_attn.q_proj.weight", (q, h), "F32", h ** -0.5)
        put(f"{p}.self_attn.k_proj.weight", (kv, h), "F32", h ** -0.5)
        put(f"{p}.self_attn.v_proj.weight", (kv, h), "F32", h ** -0.5)
        put(f"{p}.self_attn.o_proj.weight", (h, q), "F32", q ** -0.5)
        put(f"{p}.post_attention_layernorm.weight", (h,), "F32", 0.1)
        exact[f"{p}.post_attention_layernorm.weight"] += 1.0
        stored[f"{p}.post_attention_layernorm.weight"] = (
            "F32", exact[f"{p}.post_attention_layernorm.weight"].astype(np.float32))
        put(f"{p}.mlp.gate_proj.weight", (i, h), "BF16", h ** -0.5)
        put(f"{p}.mlp.up_proj.weight", (i, h), "BF16", h ** -0.5)
        put(f"{p}.mlp.down_proj.weight", (h, i), "BF16", i ** -0.5)
    put("model.norm.weight", (h,), "F32", 0.1)
    exact["model.norm.weight"] += 1.0
    stored["model.norm.weight"] = ("F32", exact["model.norm.weight"].astype(np.float32))
    put("lm_head.weight", (v, h), "F32", h ** -0.5)
    return stored, exact


def inv_freq() -> np.ndarray:
    c = CONFIG
    hd = c["hidden_size"] // c["num_attention_heads"]
    inv = 1.0 / (c["rope_theta"] ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = c["rope_scaling"]
    factor, low, high, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], rs[
        "original_max_position_embeddings"]
    wavelen = 2 * np.pi / inv
    scaled = np.where(wavelen > old / low, inv / factor, inv)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old / high) & (wavelen <= old / low)
    return np.where(medium, smoothed, scaled)


def forward(w: dict, ids: list[int]) -> np.ndarray:
    """Hugging Face LlamaForCausalLM forward in float64; returns logits [len(ids), vocab]."""
    c = CONFIG
    nh, nkv = c["num_attention_heads"], c["num_key_value_heads"]
    hd = c["hidden_size"] // nh
    eps = c["rms_norm_eps"]
    n = len(ids)

    def rms(x, g):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * g

    def rot_half(x):
        return np.concatenate([-x[..., hd // 2:], x[..., : hd // 2]], axis=-1)

    ang = np.arange(n, dtype=np.float64)[:, None] * inv_freq()[None, :]
    emb = np.concatenate([ang, ang], axis=-1)
    cos, sin = np.cos(emb)[:, None, :], np.sin(emb)[:, None, :]
    x = w["model.embed_tokens.weight"][ids]
    mask = np.triu(np.full((n, n), -np.inf), k=1)
    for l in range(c["num_hidden_layers"]):
        p = f"model.layers.{l}"
        hs = rms(x, w[f"{p}.input_layernorm.weight"])
        q = (hs @ w[f"{p}.self_attn.q_proj.weight"].T).reshape(n, nh, hd)
        k = (hs @ w[f"{p}.self_attn.k_proj.weight"].T).reshape(n, nkv, hd)
        v = (hs @ w[f"{p}.self_attn.v_proj.weight"].T).reshape(n, nkv, hd)
        q = q * cos + rot_half(q) * sin
        k = k * cos + rot_half(k) * sin
        k = np.repeat(k, nh // nkv, axis=1)
        v = np.repeat(v, nh // nkv, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(hd) + mask
        scores = np.exp(scores - scores.max(axis=-1, keepdims=True))
        probs = scores / scores.sum(axis=-1, keepdims=True)
        attn = np.einsum("hqk,khd->qhd", probs, v).reshape(n, nh * hd)
        x = x + attn @ w[f"{p}.self_attn.o_proj.weight"].T
        hs = rms(x, w[f"{p}.post_attention_layernorm.weight"])
        g = hs @ w[f"{p}.mlp.gate_proj.weight"].T
        u = hs @ w[f"{p}.mlp.up_proj.weight"].T
        x = x + (g / (1 + np.exp(-g)) * u) @ w[f"{p}.mlp.down_proj.weight"].T
    return rms(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(SEED)
    stored, exact = make_weights(rng)
    write_safetensors(OUT / "model.safetensors", stored)
    (OUT / "config.json").write_text(json.dumps(CONFIG, indent=2) + "\n")
    (OUT / "generation_config.json").write_text(json.dumps({"bos_token_id": 256, "eos_token_id": [257, 259]}, indent=2) + "\n")
    (OUT / "tokenizer.json").write_text(json.dumps(tokenizer_json(), ensure_ascii=False) + "\n")
    chatml = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
              "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
    (OUT / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": True, "chat_template": chatml}, indent=2) + "\n")
    ref = {
        "generator": "tests/reference/hf_tiny.py",
        "numpy": np.__version__,
        "seed": SEED,
        "note": "float64 forward pass; logits of every position of each prompt",
        "prompts": [{"ids": ids, "logits": forward(exact, ids).round(7).tolist()} for ids in PROMPTS],
    }
    (OUT / "reference_logits.json").write_text(json.dumps(ref) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
