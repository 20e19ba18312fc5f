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

The models are those of tests/reference/hf_arch_models.py at SHAPE.

Usage: python3 scripts/gpu/hf_arch_cuda.py OUT_DIR [--device cuda|cpu]
"""

import argparse
import json
import os
import shutil
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "reference"))
from hf_arch_models import BOS, Shape, f32_and_bf16_logits, models, randomize  # noqa: E402

# PRISM_HF_TINY: another directory to take the tiny tokenizer from (default: the tree's).
TOKENIZER = Path(os.environ.get("PRISM_HF_TINY", ROOT / "tests" / "fixtures" / "hf-tiny"))
SEED = 20261202
LENGTHS = [5, 40, 150, 300]
SHAPE = Shape(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=1024, layers=3, window=48,
              query_pre_attn_scalar=48, final_logit_softcapping=30.0, matrix_std=0.05)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(SEED)
    for name, cls, cfg in models(SHAPE):
        torch.manual_seed(SEED)
        model = cls(cfg)
        randomize(model, gen, name == "gemma3", SHAPE.matrix_std)
        model.eval()
        out = Path(a.out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        model.to(torch.bfloat16).save_pretrained(out)
        for f in ("tokenizer.json", "tokenizer_config.json"):
            if (TOKENIZER / f).exists():
                shutil.copy(TOKENIZER / f, out / f)
        prompts = [[BOS] + torch.randint(0, 256, (n - 1,), generator=gen).tolist() for n in LENGTHS]
        f32, bf, e_hf = f32_and_bf16_logits(cls, out, prompts, a.device)
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
