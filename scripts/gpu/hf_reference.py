#!/usr/bin/env python3
"""Hugging Face reference models for Prism's CUDA backend (run on the GPU machine; torch +
transformers, no network).

Two models of one architecture: `LlamaForCausalLM` with GQA (4 layers, hidden 512, 8 heads, 2 KV
heads, head_dim 64, Llama 3 rope scaling, untied lm_head, vocab 272), saved as bf16 safetensors
with the byte-level BPE tokenizer of tests/fixtures/hf-tiny (tokenizer.json, tokenizer_config.json,
generation_config.json), each with a reference.json:

- OUT_DIR: seeded random weights (std 0.04). Its top-2 logits are nearly tied at many greedy steps,
  so it checks logits (against a bound) but cannot make "64 greedy tokens match" strict.
- OUT_DIR/trained: the same random init trained briefly (AdamW, seeded, bf16 autocast, a few
  hundred steps) on a deterministic synthetic language (see `Language`), so that its greedy
  continuations of prompts from that language have top-1 − top-2 logit margins far above the logit
  bound: any bf16 engine that computes the model correctly picks the same 64 tokens.

reference.json (both models):
- prompts: 8 token-id prompts (lengths 1..300; the random model's start with BOS 256, the trained
  model's are prefixes of sentences of the language, no BOS);
- logits_bf16: last-token logits of the bf16 model (sdpa attention), one prompt at a time;
- logits_f32: the same from an f32 copy of the same (bf16-valued) weights: "exact" math;
- greedy_bf16 / greedy_f32: 64 greedy tokens per prompt (argmax, KV cache, no EOS stop);
- margins_f32: top-1 minus top-2 logit at each f32 greedy step (near-ties explain flips);
- hf_bf16_vs_f32_max_abs (e_hf), bound = 2·e_hf + 0.01 (the bound `cuda_check` applies),
  min_margin_f32, frac_margin_f32_lt_1, greedy_bf16_eq_f32.
The trained model's also has: language (rule and seed), rule_continuations (the language's own
next 64 tokens), greedy_f32_eq_rule, train (steps, batch, losses, seconds), parity_prompts (5
prompts of 9..200 tokens for `cuda_engine_parity`) with parity_greedy_f32 / parity_margins_f32.

Exit status: 0; 3 when the trained model is not confident (min f32 margin below
max(1.0, 4 · bound)): the outputs are still written and the failure is printed, not hidden.

Usage: python3 scripts/gpu/hf_reference.py OUT_DIR [--train-steps N] [--train-batch B]
         [--device cuda|cpu]   (a CPU run with a few steps is a smoke test only)
"""

import os

# cuBLAS is deterministic only with a fixed workspace configuration, read when its handle is made.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import argparse  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import shutil  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

SEED = 20261129
THETA = 10000.0
ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256}
LENGTHS = [1, 7, 16, 33, 64, 100, 200, 300]
NEW_TOKENS = 64
# cuda_engine_parity's prompt lengths (it generates 16 tokens per prompt).
PARITY_LENGTHS = [9, 21, 45, 150, 200]
VOCAB = 272
FIXTURE = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "hf-tiny"

# Training of the confident model (seeded; all positions of a sentence are supervised).
TRAIN_SEED = SEED + 1
LANG_SEED = SEED + 2
PROMPT_SEED = SEED + 3
PARITY_SEED = SEED + 4
TRAIN_STEPS = 400
TRAIN_BATCH = 64
# Longer than the longest checked context (300 + 64): every position the check reaches was trained.
TRAIN_LEN = 384
LR = 1e-3
WARMUP = 30


class Language:
    """A deterministic synthetic language over the 256 byte tokens (ids 0..255).

    K = 4 seeded random cyclic permutations P_0..P_3 of 0..255 (each one cycle through all 256
    tokens). A sentence x_0, x_1, ... starts with a uniform random x_0; then
    x_{n+1} = P_k[x_n] with k = x_0 mod 4: the first token selects the permutation for the whole
    sentence. Every token after x_0 is determined by the prefix, so a model that learned the
    language continues any prefix (even a single token) with one clearly best token. Predicting
    needs attention: from each position back to position 0 (up to 363 positions away, across the
    engine's 128-position attention chunks), or to the previous tokens to infer k.
    """

    K = 4

    def __init__(self, seed: int):
        g = torch.Generator().manual_seed(seed)
        perms = []
        for _ in range(self.K):
            order = torch.randperm(256, generator=g)
            p = torch.empty(256, dtype=torch.long)
            p[order] = order.roll(-1)  # order[i] -> order[i+1]: one cycle of length 256
            perms.append(p)
        self.perms = torch.stack(perms)

    def sample(self, n: int, length: int, g: torch.Generator) -> torch.Tensor:
        """`n` sentences of `length` tokens, `[n, length]` int64 on the CPU."""
        x = torch.empty(n, length, dtype=torch.long)
        x[:, 0] = torch.randint(0, 256, (n,), generator=g)
        k = x[:, 0] % self.K
        for t in range(1, length):
            x[:, t] = self.perms[k, x[:, t - 1]]
        return x

    def describe(self) -> dict:
        return {"rule": "x[n+1] = P[x[0] % 4][x[n]]; P = 4 seeded random 256-cycles", "seed": LANG_SEED,
                "perms": self.perms.tolist()}


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


def set_rope(model, scaled: torch.Tensor, dev) -> None:
    """Use exactly the llama3-scaled frequencies that config.json describes (transformers 5 ignores
    the legacy `rope_scaling` kwarg)."""
    rot = model.model.rotary_emb
    rot.inv_freq = scaled.float().to(dev)
    rot.original_inv_freq = rot.inv_freq
    rot.attention_scaling = 1.0


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


def save_model(model, out_dir: Path) -> None:
    """bf16 safetensors + config.json describing what the reference computes + tokenizer files."""
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    conf = json.loads((out_dir / "config.json").read_text())
    conf.update({"architectures": ["LlamaForCausalLM"], "rope_theta": THETA, "hidden_size": 512,
                 "intermediate_size": 1536, "num_hidden_layers": 4, "num_attention_heads": 8,
                 "num_key_value_heads": 2, "head_dim": 64, "vocab_size": VOCAB, "rms_norm_eps": 1e-5,
                 "max_position_embeddings": 1024, "tie_word_embeddings": False, "bos_token_id": 256,
                 "eos_token_id": 257})
    conf["rope_scaling"] = dict(ROPE)
    (out_dir / "config.json").write_text(json.dumps(conf, indent=2))
    for f in ["tokenizer.json", "tokenizer_config.json", "generation_config.json"]:
        shutil.copy(FIXTURE / f, out_dir / f)


@torch.no_grad()
def reference(model, f32, prompts: list[list[int]]) -> dict:
    """Logits, greedy tokens and margins of the bf16 model and its f32 copy on `prompts`."""
    dev = next(model.parameters()).device
    ref = {"prompts": prompts, "logits_bf16": [], "logits_f32": [], "greedy_bf16": [], "greedy_f32": [],
           "margins_f32": []}
    for p in prompts:
        ids = torch.tensor([p], device=dev)
        ref["logits_bf16"].append(model(input_ids=ids).logits[0, -1].float().cpu().tolist())
        ref["logits_f32"].append(f32(input_ids=ids).logits[0, -1].float().cpu().tolist())
        ref["greedy_bf16"].append(greedy(model, p, dev)[0])
        toks, margins = greedy(f32, p, dev)
        ref["greedy_f32"].append(toks)
        ref["margins_f32"].append(margins)
    errs = [max(abs(a - b) for a, b in zip(x, y)) for x, y in zip(ref["logits_bf16"], ref["logits_f32"])]
    e_hf = max(errs)
    ref["hf_bf16_vs_f32_max_abs"] = e_hf
    ref["bound"] = 2.0 * e_hf + 0.01
    ref["greedy_bf16_eq_f32"] = [a == b for a, b in zip(ref["greedy_bf16"], ref["greedy_f32"])]
    flat = [m for ms in ref["margins_f32"] for m in ms]
    ref["min_margin_f32"] = min(flat)
    ref["frac_margin_f32_lt_1"] = sum(m < 1.0 for m in flat) / len(flat)
    return ref


def twins(cfg: LlamaConfig, state: dict, scaled: torch.Tensor, dev) -> tuple:
    """The bf16 model (sdpa) with `state`'s bf16 values and its f32 copy, both in eval mode."""
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).to(dev).eval()
    model.load_state_dict({k: v.to(torch.bfloat16) for k, v in state.items()})
    f32 = LlamaForCausalLM(cfg).to(dev).eval()
    f32.load_state_dict({k: v.to(torch.bfloat16).float() for k, v in state.items()})
    for m in (model, f32):
        set_rope(m, scaled, dev)
    return model, f32


def train(cfg: LlamaConfig, init: dict, lang: Language, scaled: torch.Tensor, dev, steps: int,
          batch: int) -> tuple[dict, dict]:
    """Trains an f32 copy of `init` on sentences of `lang` (next-token cross-entropy at every
    position, bf16 autocast on CUDA, eager attention: deterministic backward). Returns the trained
    weights (bf16) and a summary (losses every 25 steps, seconds)."""
    torch.manual_seed(TRAIN_SEED)
    tcfg = LlamaConfig.from_dict(cfg.to_dict())
    tcfg._attn_implementation = "eager"
    model = LlamaForCausalLM(tcfg).to(dev)
    model.load_state_dict({k: v.float() for k, v in init.items()})
    set_rope(model, scaled, dev)
    model.train()
    data = lang.sample(steps * batch, TRAIN_LEN, torch.Generator().manual_seed(TRAIN_SEED))
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.01, eps=1e-8)
    losses = []
    t0 = time.time()
    for s in range(steps):
        # Linear warm-up, then cosine decay to LR/10.
        lr = LR * min(1.0, (s + 1) / WARMUP) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / max(steps, 1))))
        for group in opt.param_groups:
            group["lr"] = lr
        x = data[s * batch:(s + 1) * batch].to(dev)
        with torch.autocast(device_type=dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            logits = model(input_ids=x).logits
        loss = F.cross_entropy(logits[:, :-1].float().reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if s % 25 == 0 or s == steps - 1:
            val = loss.detach().item()
            losses.append([s, val])
            print(f"train step {s}: loss {val:.5f} lr {lr:.2e} ({time.time() - t0:.1f} s)", flush=True)
    secs = time.time() - t0
    state = {k: v.detach().to(torch.bfloat16) for k, v in model.state_dict().items()}
    return state, {"steps": steps, "batch": batch, "seq_len": TRAIN_LEN, "lr": LR, "warmup": WARMUP,
                   "optimizer": "AdamW(0.9, 0.95, wd 0.01), grad clip 1.0", "seed": TRAIN_SEED,
                   "losses": losses, "seconds": secs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out_dir", type=Path)
    ap.add_argument("--train-steps", type=int, default=TRAIN_STEPS)
    ap.add_argument("--train-batch", type=int, default=TRAIN_BATCH)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    out_dir: Path = args.out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    dev = torch.device(args.device)
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.manual_seed(SEED)
    t_start = time.time()

    # 1. The random model (same seed and creation order as before: the same weights).
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1536, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=1024,
                      rms_norm_eps=1e-5, rope_theta=THETA, rope_scaling=dict(ROPE), tie_word_embeddings=False,
                      bos_token_id=256, eos_token_id=257, initializer_range=0.04, attn_implementation="sdpa")
    init = {k: v.to(torch.bfloat16) for k, v in LlamaForCausalLM(cfg).state_dict().items()}
    scaled = llama3_inv_freq(64)
    plain = 1.0 / (THETA ** (torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    probe = LlamaForCausalLM(cfg)
    used = probe.model.rotary_emb.inv_freq.double().cpu()
    del probe
    print("transformers RoPE: llama3-scaled" if torch.allclose(used, scaled, rtol=1e-5)
          else "transformers RoPE: plain" if torch.allclose(used, plain, rtol=1e-5) else "transformers RoPE: other",
          "-> overridden with llama3-scaled inv_freq")
    model, f32 = twins(cfg, init, scaled, dev)
    save_model(model, out_dir)
    g = torch.Generator().manual_seed(SEED)
    prompts = [[256] + torch.randint(0, 256, (n - 1,), generator=g).tolist() for n in LENGTHS]
    ref = {"seed": SEED, "rope_scaled": True, "torch": torch.__version__, **reference(model, f32, prompts)}
    (out_dir / "reference.json").write_text(json.dumps(ref))
    summary = {"random": {k: ref[k] for k in ["hf_bf16_vs_f32_max_abs", "bound", "min_margin_f32",
                                              "frac_margin_f32_lt_1", "greedy_bf16_eq_f32"]}}
    print(json.dumps(summary))
    del model, f32

    # 2. The trained model: same init, taught the language.
    lang = Language(LANG_SEED)
    state, train_info = train(cfg, init, lang, scaled, dev, args.train_steps, args.train_batch)
    tdir = out_dir / "trained"
    model, f32 = twins(cfg, state, scaled, dev)
    save_model(model, tdir)
    sentences = lang.sample(len(LENGTHS), max(LENGTHS) + NEW_TOKENS, torch.Generator().manual_seed(PROMPT_SEED))
    prompts = [sentences[i, :n].tolist() for i, n in enumerate(LENGTHS)]
    rule = [sentences[i, n:n + NEW_TOKENS].tolist() for i, n in enumerate(LENGTHS)]
    tref = {"seed": SEED, "rope_scaled": True, "torch": torch.__version__, "language": lang.describe(),
            "train": train_info, **reference(model, f32, prompts)}
    tref["rule_continuations"] = rule
    tref["greedy_f32_eq_rule"] = [a == b for a, b in zip(tref["greedy_f32"], rule)]
    par = lang.sample(len(PARITY_LENGTHS), max(PARITY_LENGTHS), torch.Generator().manual_seed(PARITY_SEED))
    tref["parity_prompts"] = [par[i, :n].tolist() for i, n in enumerate(PARITY_LENGTHS)]
    tref["parity_greedy_f32"], tref["parity_margins_f32"] = [], []
    for p in tref["parity_prompts"]:
        toks, margins = greedy(f32, p, dev)
        tref["parity_greedy_f32"].append(toks)
        tref["parity_margins_f32"].append(margins)
    # cuda_engine_parity compares 16 tokens per prompt.
    tref["parity_min_margin_f32_16"] = min(m for ms in tref["parity_margins_f32"] for m in ms[:16])
    need = max(1.0, 4.0 * tref["bound"])
    tref["confident"] = tref["min_margin_f32"] >= need and tref["parity_min_margin_f32_16"] >= need
    (tdir / "reference.json").write_text(json.dumps(tref))
    summary = {"trained": {k: tref[k] for k in ["hf_bf16_vs_f32_max_abs", "bound", "min_margin_f32",
                                                "frac_margin_f32_lt_1", "parity_min_margin_f32_16", "confident",
                                                "greedy_bf16_eq_f32", "greedy_f32_eq_rule"]},
               "train_seconds": train_info["seconds"], "final_loss": train_info["losses"][-1][1],
               "total_seconds": time.time() - t_start}
    print(json.dumps(summary))
    print(f"trained model: min HF f32 top-2 margin {tref['min_margin_f32']:.3f} over {len(LENGTHS)}x{NEW_TOKENS} "
          f"greedy steps (bound {tref['bound']:.4f}, need >= {need:.3f}); fraction of steps with margin < 1.0: "
          f"{tref['frac_margin_f32_lt_1']:.4f}; parity prompts min margin (16 tokens) "
          f"{tref['parity_min_margin_f32_16']:.3f}; greedy == language rule on "
          f"{sum(tref['greedy_f32_eq_rule'])}/{len(LENGTHS)} prompts")
    if not tref["confident"]:
        print("hf_reference: TRAINED MODEL NOT CONFIDENT (the strict greedy check on it is not meaningful)")
        return 3
    print("hf_reference: trained model confident")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
