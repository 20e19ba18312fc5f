#!/usr/bin/env python3
"""Hugging Face reference fixtures for Prism's non-Llama architectures (CPU check).

For each of Qwen2ForCausalLM, Qwen3ForCausalLM, MistralForCausalLM and Gemma3ForCausalLM this
builds a tiny model with seeded random weights (every parameter, norms and biases included, drawn
from a seeded normal so that each feature the engine implements moves the logits), rounds the
weights to bf16 (the fixture stores bf16 to stay small; the reference runs on the same values in
f32, so the check is exact math on both sides), saves it as a Hugging Face directory
(config.json, model.safetensors, the byte-level BPE tokenizer of tests/fixtures/hf-tiny) under
tests/fixtures/arch/<name>/ and writes reference.json there:

- prompts: token-id prompts (one shorter and one longer than the sliding window, so windowed
  attention is exercised where the architecture has windows);
- logits: for each prompt, the f32 last-token logits of transformers (eager attention);
- greedy: the argmax of those logits;
- decode_logits: for the long prompt, the logits of 4 further greedy steps (the KV-cache path);
- versions: torch and transformers.

It also writes the same weights as a GGUF file, tests/fixtures/arch/<name>.gguf, the way
llama.cpp's convert_hf_to_gguf.py lays them out (gguf-py; general.architecture llama for
Mistral with Q/K rows permuted and llama.attention.sliding_window, qwen2, qwen3, gemma3 with the
norm gains shifted by +1 and gemma3.attention.sliding_window_pattern; matrices in bf16, norms and
biases in f32, the tokenizer as tokenizer.ggml.* gpt2 BPE), with gguf_logits: transformers' logits of the model
as llama.cpp computes that file (the same as logits except for Gemma 3, whose GGUF softmax
scale is head_dim^-0.5 where the Hugging Face fixture sets query_pre_attn_scalar 24).

worker/engine/tests/arch_reference.rs loads each directory and each GGUF file with the engine
and asserts max |Δlogit| <= 1e-4 on the CPU backend and the same greedy tokens.

Pinned: torch==2.15.0, transformers==5.24.0, gguf==0.19.0 (pip install torch transformers
safetensors gguf; the CPU is enough). Usage: python3 tests/reference/hf_arch_reference.py [OUT_ROOT] [--device cpu|cuda]
(OUT_ROOT defaults to tests/fixtures/arch). scripts/gpu/hf_arch_reference.py runs the same models
on the GPU machine for the CUDA backend's check.
"""

import argparse
import copy
import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import torch
import transformers

from hf_arch_models import BOS, EOS, ROOT, TOKENIZER, Shape, last_logits, models, randomize

SEED = 20261201
SHORT_LEN, LONG_LEN = 5, 29
DECODE_STEPS = 4
# query_pre_attn_scalar differs from head_dim so Gemma 3's scale is checked.
SHAPE = Shape(hidden_size=32, intermediate_size=64, head_dim=16, max_position_embeddings=256, layers=2, window=8,
              query_pre_attn_scalar=24, final_logit_softcapping=None, matrix_std=0.2)


def prompts(gen):
    body = lambda n: [BOS] + torch.randint(0, 256, (n - 1,), generator=gen).tolist()  # noqa: E731
    return [body(SHORT_LEN), body(LONG_LEN)]


@torch.no_grad()
def decode(model, ids, steps, device):
    """Greedy steps with the KV cache: the logits of each new position."""
    out = model(torch.tensor([ids], device=device), use_cache=True)
    past, rows = out.past_key_values, []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(steps):
        out = model(torch.tensor([[nxt]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
        row = out.logits[0, -1].float().cpu()
        rows.append({"token": nxt, "logits": row.tolist()})
        nxt = int(row.argmax())
    return rows


GGUF_ARCH = {"qwen2": "qwen2", "qwen3": "qwen3", "mistral": "llama", "gemma3": "gemma3"}
HF_TO_GGUF = {
    "input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
GEMMA_NORMS = {"post_attention_layernorm": "post_attention_norm", "pre_feedforward_layernorm": "ffn_norm",
               "post_feedforward_layernorm": "post_ffw_norm"}


def gguf_tensor_name(hf, gemma):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    rest = hf.removeprefix("model.layers.")
    layer, tail = rest.split(".", 1)
    base, kind = tail.rsplit(".", 1)
    table = dict(HF_TO_GGUF, **(GEMMA_NORMS if gemma else {"post_attention_layernorm": "ffn_norm"}))
    return f"blk.{layer}.{table[base]}.{kind}"


def permute(w, n_head):
    """convert_hf_to_gguf.py's LlamaModel.permute (rotate-half → interleaved rows)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(name, model, cfg, path):
    arch = GGUF_ARCH[name]
    gemma = name == "gemma3"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    rp = cfg.rope_parameters
    w.add_rope_freq_base((rp["full_attention"] if gemma else rp)["rope_theta"])
    if gemma:
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_freq_base_swa(rp["sliding_attention"]["rope_theta"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    elif cfg.sliding_window is not None:
        w.add_sliding_window(cfg.sliding_window)
    tok = json.loads((TOKENIZER / "tokenizer.json").read_text())
    vocab = dict(tok["model"]["vocab"])
    special = {a["id"] for a in tok["added_tokens"]}
    for a in tok["added_tokens"]:
        vocab[a["content"]] = a["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([3 if i in special else 1 for i in range(len(tokens))])
    merges = tok["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(BOS)
    w.add_eos_token_id(EOS)
    w.add_add_bos_token(False)
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        v = t.detach().to(torch.float32).numpy().copy()
        if gemma and hf_name.endswith("norm.weight"):
            v = v + 1.0
        if arch == "llama" and hf_name.endswith("q_proj.weight"):
            v = permute(v, cfg.num_attention_heads)
        if arch == "llama" and hf_name.endswith("k_proj.weight"):
            v = permute(v, cfg.num_key_value_heads)
        name = gguf_tensor_name(hf_name, gemma)
        if v.ndim == 1:
            # Norm gains and biases in f32, as llama.cpp stores them (Gemma's 1 + w is not a
            # bf16 value).
            w.add_tensor(name, v.astype(np.float32))
            continue
        bf = torch.from_numpy(np.ascontiguousarray(v)).to(torch.bfloat16).view(torch.int16).numpy()
        w.add_tensor(name, bf, raw_shape=v.shape, raw_dtype=gguf.GGMLQuantizationType.BF16)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_view(name, cls, cfg, model, device):
    """The model as llama.cpp computes its GGUF file (Gemma 3: scale head_dim^-0.5)."""
    if name != "gemma3":
        return model
    c = cfg.__class__.from_dict(cfg.to_dict())
    c.query_pre_attn_scalar = cfg.head_dim
    c._attn_implementation = "eager"
    m = cls(c).to(torch.float32)
    m.load_state_dict(model.state_dict())
    return m.to(device).eval()


def build(name, cls, cfg, out_root, device):
    gen = torch.Generator().manual_seed(SEED + sum(map(ord, name)))
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(torch.float32)
    randomize(model, gen, gemma=name == "gemma3", matrix_std=SHAPE.matrix_std)
    model.eval()
    out = out_root / name
    if out.exists():
        shutil.rmtree(out)
    # Saved as bf16 (the values are bf16 already: lossless) from a copy: casting the model
    # itself would round its RoPE inv_freq buffers to bf16 too. The reference runs in f32.
    copy.deepcopy(model).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    model.to(device)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(TOKENIZER / f, out / f)
    (out / "generation_config.json").unlink(missing_ok=True)
    ps = prompts(gen)
    logits = [last_logits(model, p, device) for p in ps]
    write_gguf(name, model.to("cpu"), cfg, out_root / f"{name}.gguf")
    model.to(device)
    gm = gguf_view(name, cls, cfg, model, device)
    ref = {
        "architecture": cls.__name__,
        "gguf_logits": [last_logits(gm, p, device).tolist() for p in ps],
        "prompts": ps,
        "logits": [row.tolist() for row in logits],
        "greedy": [int(row.argmax()) for row in logits],
        "decode_logits": decode(model, ps[1], DECODE_STEPS, device),
        "window": SHAPE.window,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
        "device": device,
    }
    (out / "reference.json").write_text(json.dumps(ref))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"{name}: {out} ({size} bytes), greedy {ref['greedy']}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_root", nargs="?", default=str(ROOT / "tests" / "fixtures" / "arch"))
    ap.add_argument("--device", default="cpu")
    a = ap.parse_args()
    torch.manual_seed(SEED)
    out_root = Path(a.out_root)
    out_root.mkdir(parents=True, exist_ok=True)
    for name, cls, cfg in models(SHAPE):
        build(name, cls, cfg, out_root, a.device)


if __name__ == "__main__":
    main()
