#!/usr/bin/env python3
"""Hugging Face references for the CUDA backend's model families (run on the GPU machine; torch +
transformers, no network), the sibling of scripts/gpu/hf_reference.py for Qwen2, Qwen3, Mistral
and Gemma 3 at small shapes (head_dim 64; the CPU fixtures of tests/reference/hf_arch_reference.py
use head_dim 16), and Gemma 3 270M at its real config.

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

gemma3_270m: Gemma3ForCausalLM at google/gemma-3-270m's config (18 layers, hidden 640, 4 heads,
1 KV head, head_dim 256, FFN 2048, vocab 262,144, window 512 on 5 of every 6 layers, RoPE bases
10,000 local / 1,000,000 global, query_pre_attn_scalar 256, no soft-capping; the GGUF in models/
agrees), weights drawn as above (the real file cannot be sent to the GPU machine). Prompts of 5,
300, 700 and 1,000 tokens of random ids over the whole vocabulary (past the window and past 2
attention chunks); logits_bf16 is left out (1 MiB of JSON per prompt, unused by the check).
Also `greedy`: the f32 model's greedy continuation (GREEDY_STEPS tokens, no KV cache) of a
GREEDY_PROMPT-token prompt, decoding across position 512, with each step's 8 largest logits.

Usage: python3 scripts/gpu/hf_arch_cuda.py OUT_DIR [--device cuda|cpu] [--only NAME]
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
from hf_arch_models import BOS, EOS, Shape, f32_and_bf16_logits, models, randomize  # noqa: E402
from transformers import Gemma3ForCausalLM, Gemma3TextConfig  # noqa: E402

# PRISM_HF_TINY: another directory to take the tiny tokenizer from (default: the tree's).
TOKENIZER = Path(os.environ.get("PRISM_HF_TINY", ROOT / "tests" / "fixtures" / "hf-tiny"))
SEED = 20261202
LENGTHS = [5, 40, 150, 300]
SHAPE = Shape(hidden_size=256, intermediate_size=512, head_dim=64, max_position_embeddings=1024, layers=3, window=48,
              query_pre_attn_scalar=48, final_logit_softcapping=30.0, matrix_std=0.05)


# google/gemma-3-270m's config.json (text model).
GEMMA_270M = dict(
    vocab_size=262_144, hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
    num_key_value_heads=1, head_dim=256, max_position_embeddings=32_768, rms_norm_eps=1e-6, sliding_window=512,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
    rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                     "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
    query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True,
    final_logit_softcapping=None, attn_logit_softcapping=None, bos_token_id=BOS, eos_token_id=EOS, pad_token_id=None)
LENGTHS_270M = [5, 300, 700, 1000]
GREEDY_PROMPT = 480
GREEDY_STEPS = 40
TOP = 8


def save(model, out):
    out.mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (TOKENIZER / f).exists():
            shutil.copy(TOKENIZER / f, out / f)


def small(name, cls, cfg, out, gen, device):
    torch.manual_seed(SEED)
    model = cls(cfg)
    randomize(model, gen, name == "gemma3", SHAPE.matrix_std)
    model.eval()
    save(model, out)
    prompts = [[BOS] + torch.randint(0, 256, (n - 1,), generator=gen).tolist() for n in LENGTHS]
    f32, bf, e_hf = f32_and_bf16_logits(cls, out, prompts, device)
    return {
        "prompts": prompts,
        "logits_f32": [r.tolist() for r in f32],
        "logits_bf16": [r.tolist() for r in bf],
        "hf_bf16_vs_f32_max_abs": e_hf,
        "bound": 2 * e_hf + 0.01,
        "max_abs_logit_f32": max(float(r.abs().max()) for r in f32),
    }


@torch.no_grad()
def gemma_270m(out, gen, device):
    torch.manual_seed(SEED)
    with torch.device(device):
        model = Gemma3ForCausalLM(Gemma3TextConfig(**GEMMA_270M))
    randomize(model, gen, True, SHAPE.matrix_std)
    model.eval()
    save(model, out)
    vocab = GEMMA_270M["vocab_size"]
    prompts = [[BOS] + torch.randint(0, vocab, (n - 1,), generator=gen).tolist() for n in LENGTHS_270M]
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = Gemma3ForCausalLM.from_pretrained(out, dtype=dtype, attn_implementation="eager").to(device).eval()
        rows[dtype] = [m(torch.tensor([p], device=device), use_cache=False).logits[0, -1].float().cpu()
                       for p in prompts]
        if dtype == torch.float32:
            ids = [BOS] + torch.randint(0, vocab, (GREEDY_PROMPT - 1,), generator=gen).tolist()
            greedy = {"prompt": list(ids), "tokens": [], "top_ids": [], "top_logits": []}
            for _ in range(GREEDY_STEPS):
                lg = m(torch.tensor([ids], device=device), use_cache=False).logits[0, -1].float()
                top = torch.topk(lg, TOP)
                greedy["tokens"].append(int(top.indices[0]))
                greedy["top_ids"].append(top.indices.tolist())
                greedy["top_logits"].append(top.values.tolist())
                ids.append(int(top.indices[0]))
        del m
    f32, bf = rows[torch.float32], rows[torch.bfloat16]
    e_hf = max(float((x - y).abs().max()) for x, y in zip(f32, bf))
    return {
        "prompts": prompts,
        "logits_f32": [r.tolist() for r in f32],
        "hf_bf16_vs_f32_max_abs": e_hf,
        "bound": 2 * e_hf + 0.01,
        "max_abs_logit_f32": max(float(r.abs().max()) for r in f32),
        "greedy": greedy,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", help="build only this model (qwen2, qwen3, mistral, gemma3, gemma3_270m)")
    a = ap.parse_args()
    gen = torch.Generator().manual_seed(SEED)
    todo = [(name, cls, cfg) for name, cls, cfg in models(SHAPE)] + [("gemma3_270m", None, None)]
    for name, cls, cfg in todo:
        if a.only and name != a.only:
            continue
        out = Path(a.out_dir) / name
        ref = gemma_270m(out, gen, a.device) if cls is None else small(name, cls, cfg, out, gen, a.device)
        (out / "reference.json").write_text(json.dumps(ref))
        print(f"{name}: e_hf {ref['hf_bf16_vs_f32_max_abs']:.4g}, bound {ref['bound']:.4g}, "
              f"max |logit| {ref['max_abs_logit_f32']:.3g}", flush=True)


if __name__ == "__main__":
    main()
