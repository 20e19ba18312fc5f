#!/usr/bin/env python3
"""Hugging Face baseline of the serving trace (run on the GPU machine: torch 2.11,
transformers 5.17, no network).

Builds `LlamaForCausalLM` at Llama-3-8B shapes (32 layers, hidden 4096, 32 heads, 8 KV heads,
head_dim 128, FFN 14336, vocab 128256, rope_theta 500000, untied lm_head, RMS eps 1e-5), bf16,
sdpa attention, on cuda, with exactly the weights of Prism's `CudaBackend::synthetic`
(worker/engine/src/backend/cuda/weights.rs, `DeviceWeights::synthetic`):

- every matrix is `fill_uniform` of kernels/llama.cu over its flat row-major [out, in] index i:
  z = i * 0x9E3779B97F4A7C15 + (seed << 32) + seed, then splitmix64's finaliser
  (z ^= z >> 30; z *= 0xBF58476D1CE4E5B9; z ^= z >> 27; z *= 0x94D049BB133111EB; z ^= z >> 31),
  u = (z >> 40) / 2^24 in f32, value = (2u - 1) * scale in f32 (scale = f32(0.02) * sqrt_f32(3)),
  rounded to nearest-even bf16. Reproduced here in int64 torch tensors on the GPU (wrapping
  multiplies; logical right shifts as arithmetic shift + mask; constants >= 2^63 as negative
  int64), in chunks;
- seeds in fill order: weight seed + 1 embed_tokens, + 2 lm_head, then per layer l:
  + 3 + 4l fused qkv ([q | k | v] rows: q_proj, k_proj, v_proj), + 4 + 4l o_proj,
  + 5 + 4l fused gate_up ([gate | up] rows), + 6 + 4l down_proj; every norm gain 1.0;
- RoPE: plain rotate-half with Prism's inverse frequencies (f64 1 / 500000^(2i/128) rounded
  to f32), attention scaling 1.

Then runs the trace (scripts/gpu/make_trace.py) in static batches of 32 in trace order: left
padding (pad id 0, attention mask), `generate(do_sample=False, max_new_tokens=min_new_tokens=
the batch's largest output length)` so EOS never stops a row early, sdpa, default dynamic KV
cache. Counts **useful** tokens (each request's own output length, not the padding rows'
extra tokens), times each batch between `torch.cuda.synchronize()` calls, and with
`--batches K` runs only the first K of the 16 batches (the whole trace takes ~11 minutes):
the JSON says so (`partial`), and its throughput is that of those batches. A one-batch
warm-up (32 x 16 tokens, 4 new) runs before the clock.

With `--prism CUDA_TRACE.json` (the output of `cuda_trace --check-weights`) it compares:
the weight seed and scale bits; for each tensor the Prism run checked, the first 8 values,
the f64 sum and the raw-bits sum of 2^20 elements at the same offset (must be equal: FAIL
otherwise); the last-token logits of Prism's 64-token probe prompt against this model's
(max/mean abs diff, relative L2, cosine, argmax; PASS when relative L2 <= 0.1 and cosine
>= 0.99: different weights give relative L2 ~1.4, bf16 rounding differences ~1e-2); and the
throughput ratio Prism / HF.

Usage: python3 scripts/gpu/hf_trace.py TRACE.json OUT.json [--batches K] [--prism CUDA_TRACE.json]
       [--weight-seed 1234] [--skip-trace]
Exit status 1 on any FAIL.
"""

import argparse
import json
import math
import struct
import sys
import time
from pathlib import Path

import torch

BATCH = 32
PAD = 0
HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB, LAYERS = 4096, 32, 8, 128, 14336, 128256, 32
THETA = 500000.0
CHUNK = 1 << 25
CHECK_N = 1 << 20

M64 = 1 << 64


def s64(x: int) -> int:
    """A uint64 constant as the int64 with the same bits."""
    x &= M64 - 1
    return x - M64 if x >= 1 << 63 else x


PHI, MUL1, MUL2 = s64(0x9E3779B97F4A7C15), s64(0xBF58476D1CE4E5B9), s64(0x94D049BB133111EB)


def lsr(z, k: int):
    """Logical right shift of int64 values holding uint64 bits (works on torch and numpy)."""
    return (z >> k) & ((1 << (64 - k)) - 1)


def hash24(idx, seed: int):
    """Top 24 bits of splitmix64(idx * phi + (seed << 32) + seed), idx an int64 array/tensor."""
    z = idx * PHI + s64((seed << 32) + seed)
    z = (z ^ lsr(z, 30)) * MUL1
    z = (z ^ lsr(z, 27)) * MUL2
    z = z ^ lsr(z, 31)
    return lsr(z, 40)


def f32(x: float) -> float:
    return struct.unpack("<f", struct.pack("<f", x))[0]


def weight_scale() -> float:
    """f32(0.02) * sqrt_f32(3) in f32 (the product of two f32 is exact in f64, then rounded)."""
    return f32(f32(0.02) * f32(math.sqrt(3.0)))


def ref_bits(i: int, seed: int, scale: float) -> int:
    """Pure-Python fill_uniform of element i: bf16 bits (reference for the tensor version)."""
    z = (i * 0x9E3779B97F4A7C15 + (seed << 32) + seed) % M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) % M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) % M64
    z ^= z >> 31
    u = f32((z >> 40) / 16777216.0)
    v = f32((2.0 * u - 1.0) * scale)
    b = struct.unpack("<I", struct.pack("<f", v))[0]
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16  # round to nearest even (finite values)
    return b & 0xFFFF


def fill_uniform_(dst: torch.Tensor, seed: int, offset: int, scale_t: torch.Tensor) -> None:
    """dst (bf16, contiguous) <- elements offset .. offset + dst.numel() of fill_uniform(seed)."""
    flat = dst.view(-1)
    n = flat.numel()
    for start in range(0, n, CHUNK):
        m = min(CHUNK, n - start)
        idx = torch.arange(offset + start, offset + start + m, dtype=torch.int64, device=dst.device)
        u = hash24(idx, seed).to(torch.float32) * (1.0 / 16777216.0)
        flat[start:start + m] = ((2.0 * u - 1.0) * scale_t).to(torch.bfloat16)
        del idx, u


def sd(seed: int, k: int) -> int:
    """Seed of the k-th fill: the weight seed plus k, wrapping as u32 (Rust's wrapping_add)."""
    return (seed + k) & 0xFFFFFFFF


def prism_inv_freq() -> torch.Tensor:
    return torch.tensor([1.0 / THETA ** (2.0 * i / HEAD_DIM) for i in range(HEAD_DIM // 2)],
                        dtype=torch.float64).to(torch.float32)


def hf_tensor(model, name: str) -> torch.Tensor:
    """`model.embed_tokens`, `lm_head`, `layers.N.self_attn.q_proj`, ... -> weight tensor."""
    if name == "lm_head":
        return model.lm_head.weight
    mod = model.model
    for part in name.removeprefix("model.").split("."):
        mod = mod[int(part)] if part.isdigit() else getattr(mod, part)
    return mod.weight


@torch.no_grad()
def build(seed: int, dev) -> tuple:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTER, num_hidden_layers=LAYERS,
                      num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, head_dim=HEAD_DIM,
                      max_position_embeddings=8192, rms_norm_eps=1e-5,
                      rope_parameters={"rope_type": "default", "rope_theta": THETA},
                      tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
                      bos_token_id=128000, eos_token_id=128001, pad_token_id=PAD, attn_implementation="sdpa")
    t = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(dev):
            model = LlamaForCausalLM(cfg)
    finally:
        torch.set_default_dtype(torch.float32)
    model.eval()
    build_s = time.perf_counter() - t
    scale = weight_scale()
    scale_t = torch.tensor(scale, dtype=torch.float32, device=dev)
    t = time.perf_counter()
    q, kv = HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    m = model.model
    fill_uniform_(m.embed_tokens.weight, sd(seed, 1), 0, scale_t)
    fill_uniform_(model.lm_head.weight, sd(seed, 2), 0, scale_t)
    for li, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        k = 3 + 4 * li
        fill_uniform_(a.q_proj.weight, sd(seed, k), 0, scale_t)
        fill_uniform_(a.k_proj.weight, sd(seed, k), q * HIDDEN, scale_t)
        fill_uniform_(a.v_proj.weight, sd(seed, k), (q + kv) * HIDDEN, scale_t)
        fill_uniform_(a.o_proj.weight, sd(seed, k + 1), 0, scale_t)
        fill_uniform_(mlp.gate_proj.weight, sd(seed, k + 2), 0, scale_t)
        fill_uniform_(mlp.up_proj.weight, sd(seed, k + 2), INTER * HIDDEN, scale_t)
        fill_uniform_(mlp.down_proj.weight, sd(seed, k + 3), 0, scale_t)
        layer.input_layernorm.weight.fill_(1.0)
        layer.post_attention_layernorm.weight.fill_(1.0)
    m.norm.weight.fill_(1.0)
    rot = m.rotary_emb
    want = prism_inv_freq().to(dev)
    built = rot.inv_freq.detach().float()
    rope_note = f"transformers built inv_freq max rel diff {float(((built - want).abs() / want).max()):.2e} vs Prism's"
    rot.inv_freq = want
    rot.original_inv_freq = want
    rot.attention_scaling = 1.0
    torch.cuda.synchronize()
    fill_s = time.perf_counter() - t
    params = sum(p.numel() for p in model.parameters())
    print(f"HF model: {params / 1e9:.2f} B params bf16, built in {build_s:.1f}s, weights filled in {fill_s:.1f}s; "
          f"{rope_note} -> overridden")
    # Self-check of the tensor hash against the pure-Python reference.
    bad = 0
    for name, s, off in [("model.embed_tokens", sd(seed, 1), 0), ("lm_head", sd(seed, 2), 0),
                         ("layers.0.self_attn.k_proj", sd(seed, 3), q * HIDDEN)]:
        got = (hf_tensor(model, name).view(-1)[:64].view(torch.int16).to(torch.int64) & 0xFFFF).tolist()
        bad += sum(g != ref_bits(off + i, s, scale) for i, g in enumerate(got))
    print(f"{'PASS' if bad == 0 else 'FAIL'} torch fill == pure-Python reference on 3 x 64 values ({bad} differ)")
    info = {"build_s": build_s, "fill_s": fill_s, "params": params, "rope": rope_note,
            "scale": scale, "scale_bits": struct.unpack("<I", struct.pack("<f", scale))[0],
            "reference_self_check_pass": bad == 0}
    return model, info, bad == 0


def summarise(t: torch.Tensor, n: int) -> dict:
    v = t.reshape(-1)[:n]
    bits = v.view(torch.int16).to(torch.int64) & 0xFFFF
    return {"first8": v[:8].float().tolist(), "sum_f64": float(v.double().sum()), "bits_sum": int(bits.sum())}


def compare_weights(model, prism: dict) -> tuple[dict, bool]:
    wc = prism.get("weights_check")
    if not wc:
        print("SKIP weights: the Prism JSON has no weights_check (run cuda_trace with --check-weights)")
        return {"skipped": True}, True
    out, ok_all = {}, True
    scale_bits = struct.unpack("<I", struct.pack("<f", weight_scale()))[0]
    ok = wc.get("scale_bits") == scale_bits
    ok_all &= ok
    print(f"{'PASS' if ok else 'FAIL'} weight scale bits: Prism {wc.get('scale_bits')} HF {scale_bits}")
    for name, p in wc["tensors"].items():
        t = hf_tensor(model, name)
        h = summarise(t, p["n"])
        # Prism writes f32 values in their shortest f32 form: compare after rounding to f32.
        same8 = h["first8"] == [f32(x) for x in p["first8"]]
        ok = same8 and h["bits_sum"] == p["bits_sum"] and abs(h["sum_f64"] - p["sum_f64"]) <= 1e-9
        ok_all &= ok
        print(f"{'PASS' if ok else 'FAIL'} weights {name}: first {h['first8'][:3]} vs {p['first8'][:3]}, "
              f"sum {h['sum_f64']:.9f} vs {p['sum_f64']:.9f}, bits_sum {h['bits_sum']} vs {p['bits_sum']}")
        out[name] = {"hf": h, "prism": {k: p[k] for k in ("first8", "sum_f64", "bits_sum")}, "pass": ok}
    return out, ok_all


@torch.no_grad()
def compare_probe(model, prism: dict, prism_path: Path, dev) -> tuple[dict, bool]:
    p = prism.get("probe")
    if not p:
        print("SKIP probe: the Prism JSON has no probe")
        return {"skipped": True}, True
    ids = torch.tensor([p["tokens"]], device=dev)
    hf = model(input_ids=ids).logits[0, -1].float()
    raw = (prism_path.parent / p["logits_file"]).read_bytes()
    pr = torch.frombuffer(bytearray(raw), dtype=torch.float32).to(dev)
    if pr.numel() != hf.numel():
        print(f"FAIL probe: Prism logits have {pr.numel()} values, HF {hf.numel()}")
        return {"pass": False}, False
    d = (pr - hf).abs()
    rel = float((pr - hf).norm() / hf.norm())
    cos = float(torch.nn.functional.cosine_similarity(pr, hf, dim=0))
    top_hf, top_pr = torch.topk(hf, 8).indices.tolist(), torch.topk(pr, 8).indices.tolist()
    res = {"tokens": len(p["tokens"]), "max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
           "max_abs_logit": float(hf.abs().max()), "rel_l2": rel, "cosine": cos,
           "argmax_hf": top_hf[0], "argmax_prism": top_pr[0], "top8_overlap": len(set(top_hf) & set(top_pr))}
    ok = rel <= 0.1 and cos >= 0.99
    res["pass"] = ok
    print(f"{'PASS' if ok else 'FAIL'} probe logits ({res['tokens']} tokens): rel L2 {rel:.4f}, cosine {cos:.5f}, "
          f"max |d| {res['max_abs_diff']:.4f} (max |logit| {res['max_abs_logit']:.3f}), mean |d| "
          f"{res['mean_abs_diff']:.5f}, argmax HF {top_hf[0]} Prism {top_pr[0]}, top-8 overlap {res['top8_overlap']}")
    return res, ok


@torch.no_grad()
def run_batch(model, reqs: list, dev) -> dict:
    lens = [len(r["prompt"]) for r in reqs]
    L, M = max(lens), max(r["output_len"] for r in reqs)
    ids = torch.full((len(reqs), L), PAD, dtype=torch.long)
    mask = torch.zeros((len(reqs), L), dtype=torch.long)
    for i, r in enumerate(reqs):
        ids[i, L - lens[i]:] = torch.tensor(r["prompt"])
        mask[i, L - lens[i]:] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=M, min_new_tokens=M,
                         pad_token_id=PAD, eos_token_id=128001, use_cache=True)
    torch.cuda.synchronize()
    secs = time.perf_counter() - t
    useful = sum(r["output_len"] for r in reqs)
    return {"requests": len(reqs), "max_input": L, "max_output": M, "new_columns": int(out.shape[1] - L),
            "useful_tokens": useful, "generated_tokens": len(reqs) * int(out.shape[1] - L), "seconds": secs,
            "useful_tok_s": useful / secs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace")
    ap.add_argument("out")
    ap.add_argument("--batches", type=int, default=0, help="run only the first K batches of 32 (0 = all)")
    ap.add_argument("--prism", help="cuda_trace output JSON to compare weights, probe logits and throughput")
    ap.add_argument("--weight-seed", type=int, default=None, help="default: the Prism JSON's, else 1234")
    ap.add_argument("--skip-trace", action="store_true", help="only build and compare")
    ap.add_argument("--save", help="also save the model as a Hugging Face checkpoint (bf16 safetensors) in this "
                    "directory, with tests/fixtures/hf-tiny's tokenizer files (the probe uses token ids), for "
                    "cuda_trace --model")
    a = ap.parse_args()
    dev = torch.device("cuda")
    trace = json.loads(Path(a.trace).read_text())
    reqs = trace["requests"]
    prism_path = Path(a.prism) if a.prism else None
    prism = json.loads(prism_path.read_text()) if prism_path and prism_path.exists() else None
    if prism_path and prism is None:
        print(f"FAIL: {prism_path} is missing (the Prism run did not write it)")
    seed = a.weight_seed if a.weight_seed is not None else (prism or {}).get("weight_seed", 1234)
    import transformers
    report = {"versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                           "device": torch.cuda.get_device_name(0)},
              "weight_seed": seed, "trace": {"seed": trace.get("seed"), "num_requests": len(reqs)}}
    ok = not (prism_path and prism is None)
    model, info, self_ok = build(seed, dev)
    ok &= self_ok
    report["model"] = info
    if a.save:
        import shutil
        t = time.perf_counter()
        model.save_pretrained(a.save, safe_serialization=True, max_shard_size="5GB")
        fixture = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf-tiny"
        for f in ["tokenizer.json", "tokenizer_config.json"]:
            shutil.copy(fixture / f, Path(a.save) / f)
        # config.json in the classic field names Prism reads (transformers 5 writes rope_parameters).
        c = model.config
        Path(a.save, "config.json").write_text(json.dumps({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": c.hidden_size, "intermediate_size": c.intermediate_size,
            "num_attention_heads": c.num_attention_heads, "num_key_value_heads": c.num_key_value_heads,
            "head_dim": c.hidden_size // c.num_attention_heads, "num_hidden_layers": c.num_hidden_layers,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "vocab_size": c.vocab_size,
            "max_position_embeddings": 8192, "tie_word_embeddings": False,
            "torch_dtype": "bfloat16"}, indent=1))
        report["saved"] = {"dir": a.save, "seconds": time.perf_counter() - t}
        print(f"saved the HF checkpoint to {a.save} in {time.perf_counter() - t:.1f}s", flush=True)
    if prism is not None:
        if prism.get("weight_seed") != seed:
            print(f"FAIL weight seed: Prism {prism.get('weight_seed')} HF {seed}")
            ok = False
        report["weights_compare"], w_ok = compare_weights(model, prism)
        report["probe_compare"], p_ok = compare_probe(model, prism, prism_path, dev)
        ok &= w_ok and p_ok

    if not a.skip_trace:
        batches = [reqs[i:i + BATCH] for i in range(0, len(reqs), BATCH)]
        run = batches if a.batches <= 0 else batches[:a.batches]
        warm = [{"prompt": r["prompt"][:16], "output_len": 4} for r in reqs[:BATCH]]
        t = time.perf_counter()
        run_batch(model, warm, dev)
        print(f"warm-up batch: {time.perf_counter() - t:.1f}s")
        per = []
        for bi, b in enumerate(run):
            r = run_batch(model, b, dev)
            r["index"] = bi
            per.append(r)
            print(f"HF batch {bi + 1}/{len(batches)}: {r['requests']} requests, inputs <= {r['max_input']}, "
                  f"{r['max_output']} new tokens each ({r['new_columns']} generated): {r['useful_tokens']} useful "
                  f"tokens in {r['seconds']:.1f}s = {r['useful_tok_s']:.1f} useful tok/s", flush=True)
            if r["new_columns"] != r["max_output"]:
                print(f"FAIL batch {bi}: generate returned {r['new_columns']} new columns, wanted {r['max_output']}")
                ok = False
        useful = sum(r["useful_tokens"] for r in per)
        secs = sum(r["seconds"] for r in per)
        tps = useful / secs if secs > 0 else 0.0
        partial = len(run) < len(batches)
        report["hf"] = {
            "batches_run": len(run), "batches_total": len(batches), "partial": partial, "batch_size": BATCH,
            "useful_tokens": useful, "seconds": secs, "useful_tok_s": tps, "per_batch": per,
            "note": (f"throughput of the first {len(run)} of {len(batches)} static batches in trace order "
                     "(not the whole trace)" if partial else "whole trace"),
        }
        print(f"HF generate: {useful} useful output tokens in {secs:.1f}s = {tps:.1f} useful tok/s "
              f"({len(run)} of {len(batches)} batches{', partial' if partial else ''})")
        if prism is not None and tps > 0:
            ptps = prism.get("result", {}).get("output_tokens_per_s", 0.0)
            ratio = ptps / tps
            report["ratio"] = {"prism_tok_s": ptps, "hf_tok_s": tps, "ratio": ratio, "target": 25.0,
                               "hf_partial": partial}
            print(f"{'PASS' if ratio >= 25 else 'FAIL'} throughput: Prism {ptps:.0f} tok/s / HF {tps:.1f} tok/s "
                  f"= {ratio:.1f}x (target >= 25x{'; HF from the first batches only' if partial else ''})")
    report["pass"] = bool(ok)
    Path(a.out).write_text(json.dumps(report, indent=2))
    print(f"hf_trace: {'PASS' if ok else 'FAIL'} -> {a.out}")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
