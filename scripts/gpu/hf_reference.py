#!/usr/bin/env python3
"""Hugging Face reference for Prism's CUDA backend (run on the GPU machine; torch + transformers,
no network).

Builds a seeded-random LlamaForCausalLM with GQA (4 layers, hidden 512, 8 heads, 2 KV heads,
head_dim 64, Llama 3 rope scaling, untied lm_head, vocab 272), saves it as bf16 safetensors with
the byte-level BPE tokenizer of tests/fixtures/hf-tiny (tokenizer.json, tokenizer_config.json,
generation_config.json), and writes reference.json:

- prompts: 8 token-id prompts (lengths 1..300, BOS first);
- logits_bf16: last-token logits of the bf16 model (sdpa attention), one prompt at a time;
- logits_f32: the same from an f32 copy of the same (bf16-valued) weights: "exact" math;
- greedy_bf16 / greedy_f32: 64 greedy tokens per prompt (argmax, KV cache, no EOS stop);
- margins_f32: top-1 minus top-2 logit at each f32 greedy step (near-ties explain flips).

Usage: python3 scripts/gpu/hf_reference.py OUT_DIR
"""

import json
import math
import shutil
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

SEED = 20261129
THETA = 10000.0
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}
LENGTHS = [1, 7, 16, 33, 64, 100, 200, 300]
NEW_TOKENS = 64
FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf-tiny"


def llama3_inv_freq(hd: int) -> torch.Tensor:
    inv = 1.0 / (THETA ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    old, low, high, factor = (ROPE["original_max_position_embeddings"], ROPE["low_freq_factor"],
                              ROPE["high_freq_factor"], ROPE["factor"])
    out = []
    for f in inv.tolist():
        wl = 2 * math.pi / f
        if wl > old / low:
            f = f / factor
        elif wl >= old / high:
            s = (old / wl - low) / (high - low)
            f = (1 - s) * f / factor + s * f
        out.append(f)
    return torch.tensor(out, dtype=torch.float64)


@torch.no_grad()
def greedy(model, prompt: list[int], dev) -> tuple[list[int], list[float]]:
    ids = torch.tensor([prompt], device=dev)
    out = model(input_ids=ids, use_cache=True)
    past, toks, margins = out.past_key_values, [], []
    logits = out.logits[0, -1].float()
    for _ in range(NEW_TOKENS):
        top = torch.topk(logits, 2)
        margins.append(float(top.values[0] - top.values[1]))
        nxt = int(torch.argmax(logits))
        toks.append(nxt)
        out = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=past, use_cache=True)
        past, logits = out.past_key_values, out.logits[0, -1].float()
    return toks, margins


@torch.no_grad()
def main() -> None:
    out_dir = Path(sys.argv[1])
    out_dir.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(SEED)
    dev = torch.device("cuda")
    cfg = LlamaConfig(vocab_size=272, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=THETA, rope_scaling=dict(ROPE), tie_word_embeddings=False,
                      bos_token_id=256, eos_token_id=257, initializer_range=0.04, attn_implementation="sdpa")
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(dev).eval()
    # Which RoPE did transformers actually build? Write config.json for what it used.
    scaled = llama3_inv_freq(64)
    plain = 1.0 / (THETA ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    # transformers 5 moved rope settings to `rope_parameters`; whatever it built from the kwargs,
    # the reference uses exactly the llama3-scaled frequencies that config.json describes.
    used = model.model.rotary_emb.inv_freq.double().cpu()
    print("transformers RoPE: llama3-scaled" if torch.allclose(used, scaled, rtol=1e-5)
          else "transformers RoPE: plain" if torch.allclose(used, plain, rtol=1e-5) else "transformers RoPE: other",
          "-> overridden with llama3-scaled inv_freq")
    rope_scaled = True
    model.save_pretrained(out_dir, safe_serialization=True)
    conf = json.loads((out_dir / "config.json").read_text())
    conf.update({"architectures": ["LlamaForCausalLM"], "rope_theta": THETA, "hidden_size": 512,
                 "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 272, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 256,
                 "eos_token_id": 257})
    conf["rope_scaling"] = dict(ROPE) if rope_scaled else None
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(FIXTURE / f, out_dir / f)

    f32 = LlamaForCausalLM(cfg).to(dev).eval()
    f32.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    for m in (model, f32):
        rot = m.model.rotary_emb
        rot.inv_freq = scaled.float().to(dev)
        rot.original_inv_freq = rot.inv_freq
        rot.attention_scaling = 1.0

    g = torch.Generator().manual_seed(SEED)
    prompts = [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist() for n in LENGTHS]
    ref = {"seed": SEED, "rope_scaled": rope_scaled, "torch": torch.__version__, "prompts": prompts,
           "logits_bf16": [], "logits_f32": [], "greedy_bf16": [], "greedy_f32": [], "margins_f32": []}
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        ref["logits_bf16"].append(model(input_ids=ids).logits[0, -1].float().cpu().tolist())
        ref["logits_f32"].append(f32(input_ids=ids).logits[0, -1].float().cpu().tolist())
        ref["greedy_bf16"].append(greedy(model, p, dev)[0])
        toks, margins = greedy(f32, p, dev)
        ref["greedy_f32"].append(toks)
        ref["margins_f32"].append(margins)
    errs = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(ref["logits_bf16"], ref["logits_f32"])]
    ref["hf_bf16_vs_f32_max_abs"] = max(errs)
    ref["greedy_bf16_eq_f32"] = [a == b for a, b in zip(ref["greedy_bf16"], ref["greedy_f32"])]
    (out_dir / "reference.json").write_text(json.dumps(ref))
    print(json.dumps({"rope_scaled": rope_scaled, "hf_bf16_vs_f32_max_abs": max(errs),
                      "greedy_bf16_eq_f32": ref["greedy_bf16_eq_f32"]}))


if __name__ == "__main__":
    main()
