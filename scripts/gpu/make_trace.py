#!/usr/bin/env python3
"""The serving trace (512 requests), written once and read by both sides of the comparison
(worker/engine/examples/cuda_trace.rs for Prism, scripts/gpu/hf_trace.py for Hugging Face).

512 requests, all arriving at once, in this order. For each request, drawn in turn from one
`random.Random(SEED)` (Python's Mersenne Twister: the same on every machine and Python 3
version, unlike numpy/torch generators): input length uniform in [128, 2048], output length
uniform in [64, 512] (both inclusive, `randint`), then the prompt's token ids, each uniform in
[0, 128000) (`randrange`), below Llama 3's special tokens.

Output JSON: {"seed", "num_requests", "input_len": [lo, hi], "output_len": [lo, hi],
"vocab_limit", "requests": [{"id", "prompt": [ids], "output_len"}], "totals": {...}}.

Usage: python3 scripts/gpu/make_trace.py OUT.json [--seed S] [--num N]
"""

import argparse
import json
import random

SEED = 20261129
NUM = 512
IN_LO, IN_HI = 128, 2048
OUT_LO, OUT_HI = 64, 512
VOCAB_LIMIT = 128000


def make(seed: int, num: int) -> dict:
    rng = random.Random(seed)
    reqs = []
    for i in range(num):
        n_in = rng.randint(IN_LO, IN_HI)
        n_out = rng.randint(OUT_LO, OUT_HI)
        prompt = [rng.randrange(VOCAB_LIMIT) for _ in range(n_in)]
        reqs.append({"id": i, "prompt": prompt, "output_len": n_out})
    totals = {
        "input_tokens": sum(len(r["prompt"]) for r in reqs),
        "output_tokens": sum(r["output_len"] for r in reqs),
    }
    return {"seed": seed, "num_requests": num, "input_len": [IN_LO, IN_HI], "output_len": [OUT_LO, OUT_HI],
            "vocab_limit": VOCAB_LIMIT, "totals": totals, "requests": reqs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--seed", type=int, default=SEED)
    ap.add_argument("--num", type=int, default=NUM)
    a = ap.parse_args()
    t = make(a.seed, a.num)
    with open(a.out, "w") as f:
        json.dump(t, f, separators=(",", ":"))
    print(f"trace: {a.num} requests, seed {a.seed}, {t['totals']['input_tokens']} input and "
          f"{t['totals']['output_tokens']} output tokens -> {a.out}")


if __name__ == "__main__":
    main()
