#!/usr/bin/env python3
"""FP8 (e4m3) KV cache simulated in Hugging Face on a reference model of `hf_reference.py`: is
the FP8 KV cache's loss of greedy agreement a property of e4m3 with a per-tensor scale of 1, of
e4m3 at any scale, or of Prism's kernels? (Run on the GPU machine after `hf_reference.py DIR`.)

The model runs in bf16 (sdpa attention); every attention call rounds the cached K (after RoPE)
and V to e4m3 as `e4m3(x / s) · s` with a per-layer scale `s`, saturated to +-448, before the
attention reads them (rounding with a fixed scale is idempotent, so re-rounding the whole cache
at each call equals rounding each token once, as the cache write does). Modes:
- `bf16`: no rounding (HF's own bf16 run);
- `e4m3_scale1`: s = 1 for K and V (Prism's `--kv-cache-dtype fp8` today, vLLM without scales);
- `e4m3_calibrated`: per layer k_scale = amax(K) / 448, v_scale = amax(V) / 448 over one prefill
  of all prompts (vLLM's `calculate_kv_scales` takes them from the first forward pass).
Per mode: last-token logits' max |error| vs HF f32 (reference.json) over the prompts, and the 64
greedy tokens vs `greedy_bf16` (tokens equal before the first divergence, prompts identical).
Also per layer: amax, rms and the fraction of |x| < 2^-6 (e4m3 subnormals at scale 1) of K and V,
and the relative rms rounding error of each mode.

Usage: python3 scripts/gpu/fp8_kv_sim.py MODEL_DIR OUT.json
"""

import importlib.util
import json
import sys
from pathlib import Path

import torch
from transformers import AttentionInterface, LlamaForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

E4M3_MAX = 448.0
NEW_TOKENS = 64

spec = importlib.util.spec_from_file_location("hf_reference", Path(__file__).with_name("hf_reference.py"))
hf_reference = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hf_reference)

# Per-layer (k_scale, v_scale) of the current mode; None: no rounding. STATS collects K/V.
SCALES: dict[int, tuple[float, float]] | None = None
STATS: dict[int, list[torch.Tensor]] | None = None


def e4m3(x: torch.Tensor, s: float) -> torch.Tensor:
    q = (x.float() / s).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).float() * s
    return q.to(x.dtype)


def fp8_kv_attention(module, query, key, value, attention_mask, **kwargs):
    layer = module.layer_idx
    if STATS is not None:
        STATS.setdefault(layer, [torch.empty(0), torch.empty(0)])
        k, v = STATS[layer]
        STATS[layer] = [torch.cat([k, key.float().flatten().cpu()]), torch.cat([v, value.float().flatten().cpu()])]
    if SCALES is not None:
        ks, vs = SCALES[layer]
        key, value = e4m3(key, ks), e4m3(value, vs)
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("fp8_kv_sim", fp8_kv_attention)
try:  # the causal mask of sdpa for the new name (transformers >= 4.53 looks masks up by name)
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionMaskInterface.register("fp8_kv_sim", sdpa_mask)
except ImportError:
    pass


@torch.no_grad()
def run(model, prompts, dev):
    logits, greedy = [], []
    for p in prompts:
        out = model(input_ids=torch.tensor([p], device=dev), use_cache=True)
        past, lg = out.past_key_values, out.logits[0, -1].float()
        logits.append(lg.cpu())
        toks = []
        for _ in range(NEW_TOKENS):
            nxt = int(torch.argmax(lg))
            toks.append(nxt)
            out = model(input_ids=torch.tensor([[nxt]], device=dev), past_key_values=past, use_cache=True)
            past, lg = out.past_key_values, out.logits[0, -1].float()
        greedy.append(toks)
    return logits, greedy


def main() -> int:
    global SCALES, STATS
    d, out_path = Path(sys.argv[1]), Path(sys.argv[2])
    ref = json.loads((d / "reference.json").read_text())
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = LlamaForCausalLM.from_pretrained(d, dtype=torch.bfloat16, attn_implementation="fp8_kv_sim").to(dev)
    model.eval()
    hf_reference.set_rope(model, hf_reference.llama3_inv_freq(model.config.head_dim), dev)
    prompts = ref["prompts"]

    # K/V of one prefill of every prompt: the statistics and the calibrated scales.
    STATS = {}
    with torch.no_grad():
        for p in prompts:
            model(input_ids=torch.tensor([p], device=dev), use_cache=False)
    stats, calibrated = {}, {}
    for layer, (k, v) in sorted(STATS.items()):
        calibrated[layer] = (float(k.abs().max()) / E4M3_MAX, float(v.abs().max()) / E4M3_MAX)
        row = {}
        for name, x, s in (("k", k, calibrated[layer][0]), ("v", v, calibrated[layer][1])):
            rms = float(x.pow(2).mean().sqrt())
            row[name] = {
                "amax": float(x.abs().max()), "rms": rms,
                "frac_below_2^-6": float((x.abs() < 2.0**-6).float().mean()),
                "rel_rms_err_scale1": float((e4m3(x, 1.0) - x).pow(2).mean().sqrt()) / rms,
                "rel_rms_err_calibrated": float((e4m3(x, s) - x).pow(2).mean().sqrt()) / rms,
            }
        stats[layer] = row
        print(f"layer {layer}: " + "; ".join(
            f"{n} amax {r['amax']:.3f} rms {r['rms']:.3f} <2^-6 {100 * r['frac_below_2^-6']:.2f}% "
            f"rel err s=1 {r['rel_rms_err_scale1']:.4f} calibrated {r['rel_rms_err_calibrated']:.4f}"
            for n, r in row.items()))
    STATS = None

    n = len(prompts)
    modes = {"bf16": None, "e4m3_scale1": {layer: (1.0, 1.0) for layer in calibrated}, "e4m3_calibrated": calibrated}
    report = {"model": str(d), "kv_stats": stats, "calibrated_scales": calibrated, "modes": {}}
    for name, scales in modes.items():
        SCALES = scales
        logits, greedy = run(model, prompts, dev)
        err = max(float((lg - torch.tensor(f)).abs().max()) for lg, f in zip(logits, ref["logits_f32"]))
        agree = sum(next((i for i, (a, b) in enumerate(zip(g, r)) if a != b), len(g))
                    for g, r in zip(greedy, ref["greedy_bf16"]))
        identical = sum(g == r for g, r in zip(greedy, ref["greedy_bf16"]))
        report["modes"][name] = {"max_abs_vs_hf_f32": err, "greedy_tokens_agree_before_divergence": agree,
                                 "greedy_tokens_total": n * NEW_TOKENS, "prompts_identical": identical}
        print(f"SUMMARY fp8_kv_sim {d.name} {name}: max |logit - hf32| {err:.4f}; greedy vs HF bf16 "
              f"{agree}/{n * NEW_TOKENS} tokens before the first divergence, {identical}/{n} prompts identical")
    out_path.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
