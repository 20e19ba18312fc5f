#!/usr/bin/env python3
"""Hugging Face references for the CUDA backend's model families (run on the GPU machine; torch +
transformers, no network), the sibling of scripts/gpu/hf_reference.py for Qwen2, Qwen3, Mistral
and Gemma 3 at shapes the CUDA kernels take (head_dim 64; the CPU fixtures of
tests/reference/hf_arch_reference.py use head_dim 16).

For each family it builds a small model with seeded random weights (every parameter: matrices
std 0.05, biases std 0.1, norm gains 1 + 0.2·N, Gemma's stored w of x̂·(1 + w) 0.2·N), rounded
to bf16, saved as OUT_DIR/<name>/ (config.json, model.safetensors in bf16, the tiny byte-level
tokenizer) with reference.json:
- prompts: 4 prompts of 5, 40, 150 and 300 tokens (longer than the 48-position sliding window of
  Mistral and Gemma 3's local layers, and than 2 attention chunks of 128 positions);
- logits_f32: last-token logits of the f32 model on the bf16-valued weights (eager attention);
- logits_bf16: the same in bf16;
- hf_bf16_vs_f32_max_abs (e_hf) and bound = 2·e_hf + 0.01 (the bound of hf_reference.py).

Usage: python3 scripts/gpu/hf_arch_cuda.py OUT_DIR [--device cuda|cpu]
"""

import argparse
import json
import os
import shutil
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
# PRISM_HF_TINY: where the tiny tokenizer is when the script runs from outside the tree.
TOKENIZER = Path(os.environ.get("PRISM_HF_TINY", ROOT / "tests" / "fixtures" / "hf-tiny"))
SEED = 20261202
BOS = 256
WINDOW = 48
LENGTHS = [5, 40, 150, 300]
COMMON = dict(
    vocab_size=272,
    hidden_size=256,
    intermediate_size=512,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    bos_token_id=BOS,
    eos_token_id=257,
    pad_token_id=None,
)


def models():
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(
        **COMMON, num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True)
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(
        **COMMON, num_hidden_layers=3, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False)
    yield "mistral", MistralForCausalLM, MistralConfig(
        **COMMON, num_hidden_layers=3, sliding_window=WINDOW,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=False)
    yield "gemma3", Gemma3ForCausalLM, Gemma3TextConfig(
        **COMMON, num_hidden_layers=4, sliding_window=WINDOW,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        query_pre_attn_scalar=48, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
        final_logit_softcapping=30.0, attn_logit_softcapping=None)


def randomize(model, gen, gemma):
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                v = 0.2 * r + (0.0 if gemma else 1.0)
            elif name.endswith(".bias"):
                v = 0.1 * r
            else:
                v = 0.05 * r
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def last_logits(model, ids, device):
    return model(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float().cpu()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(SEED)
    for name, cls, cfg in models():
        torch.manual_seed(SEED)
        model = cls(cfg)
        randomize(model, gen, name == "gemma3")
        model.eval()
        out = Path(a.out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (TOKENIZER / f).exists():
                shutil.copy(TOKENIZER / f, out / f)
        prompts = [[BOS] + torch.randint(0, 256, (n - 1,), generator=gen).tolist() for n in LENGTHS]
        rows = {}
        for dtype in (torch.float32, torch.bfloat16):
            m = cls.from_pretrained(out, dtype=dtype, attn_implementation="eager").to(a.device)
            m.eval()
            rows[dtype] = [last_logits(m, p, a.device) for p in prompts]
        f32, bf = rows[torch.float32], rows[torch.bfloat16]
        e_hf = max(float((x - y).abs().max()) for x, y in zip(f32, bf))
        ref = {
            "prompts": prompts,
            "logits_f32": [r.tolist() for r in f32],
            "logits_bf16": [r.tolist() for r in bf],
            "hf_bf16_vs_f32_max_abs": e_hf,
            "bound": 2 * e_hf + 0.01,
            "max_abs_logit_f32": max(float(r.abs().max()) for r in f32),
        }
        (out / "reference.json").write_text(json.dumps(ref))
        print(f"{name}: e_hf {e_hf:.4g}, bound {ref['bound']:.4g}, max |logit| {ref['max_abs_logit_f32']:.3g}")


if __name__ == "__main__":
    main()
