#!/usr/bin/env python3
"""GPU-machine reference for the non-Llama architectures (Qwen2, Qwen3, Mistral, Gemma 3) on
Prism's CUDA backend, the sibling of scripts/gpu/hf_reference.py (torch + transformers, no
network).

It reads the committed CPU fixtures tests/fixtures/arch/<name>/ (seeded-random checkpoints from
tests/reference/hf_arch_reference.py, bf16 safetensors) and, for each, writes
OUT_DIR/<name>/reference.json with:
- prompts: the fixture's prompts;
- logits_f32: last-token logits of the model in f32 on the device (the CPU fixture's values);
- logits_bf16: the same in bf16 (eager attention), as the CUDA backend computes;
- hf_bf16_vs_f32_max_abs (e_hf) and bound = 2·e_hf + 0.01, the bound scripts/gpu/hf_reference.py
  sets for Llama: the engine's CUDA logits must be within it of logits_f32, with the same greedy
  token wherever the f32 top-2 margin exceeds it (margins_f32 says where).

Usage: python3 scripts/gpu/hf_arch_reference.py OUT_DIR [--device cuda]
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "reference"))
from hf_arch_models import f32_and_bf16_logits  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "arch"
NAMES = ["qwen2", "qwen3", "mistral", "gemma3"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("out_dir")
    ap.add_argument("--device", default="cuda")
    a = ap.parse_args()
    for name in NAMES:
        src = FIXTURES / name
        fixture = json.loads((src / "reference.json").read_text())
        prompts = fixture["prompts"]
        f32, bf, e_hf = f32_and_bf16_logits(AutoModelForCausalLM, src, prompts, a.device)
        margins = [float(r.topk(2).values[0] - r.topk(2).values[1]) for r in f32]
        out = Path(a.out_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        ref = {
            "prompts": prompts,
            "logits_f32": [r.tolist() for r in f32],
            "logits_bf16": [r.tolist() for r in bf],
            "greedy_f32": [int(r.argmax()) for r in f32],
            "margins_f32": margins,
            "hf_bf16_vs_f32_max_abs": e_hf,
            "bound": 2 * e_hf + 0.01,
            "cpu_fixture_vs_device_f32_max_abs": max(
                float((r - torch.tensor(c)).abs().max()) for r, c in zip(f32, fixture["logits"])),
        }
        (out / "reference.json").write_text(json.dumps(ref))
        print(f"{name}: e_hf {e_hf:.4g}, bound {ref['bound']:.4g}, min margin {min(margins):.4g}")


if __name__ == "__main__":
    main()
