#!/usr/bin/env python3
"""llama.cpp (llama-cpp-python) side of the engine benchmark (`worker/engine/benches/engine.rs`):
prefill tokens/s for a 512-token prompt, TTFT, and batch-1 greedy decode tokens/s on the
same GGUF file and the same number of threads. llama-cpp-python's high-level API runs one
sequence at a time, so only batch 1 is measured here.

Environment (pinned, as tests/reference/gguf_reference.py):
    python3 -m venv /tmp/refvenv
    /tmp/refvenv/bin/pip install numpy==2.2.6 llama-cpp-python==0.3.16
    /tmp/refvenv/bin/python bench/llama_cpp_engine.py [model.gguf] [--threads 2] [--decode-tokens 64]
"""

import argparse
import os
import time

import llama_cpp
import numpy as np

TEXT = "The history of the lighthouse begins in antiquity, when fires were lit on hilltops to guide ships. "


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model", nargs="?", default="models/SmolLM2-135M-Instruct.Q4_1.gguf")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--decode-tokens", type=int, default=64)
    args = ap.parse_args()

    t = time.perf_counter()
    llm = llama_cpp.Llama(
        model_path=args.model, n_ctx=2048, n_batch=512, n_threads=args.threads,
        n_threads_batch=args.threads, verbose=False,
    )
    load_s = time.perf_counter() - t
    ids = []
    while len(ids) < 512:
        ids += llm.tokenize(TEXT.encode(), add_bos=False, special=False)
    ids = ids[:512]

    # Prefill: best of 3 evaluations of the 512-token prompt.
    prefill = float("inf")
    for _ in range(3):
        llm.reset()
        t = time.perf_counter()
        llm.eval(ids)
        prefill = min(prefill, time.perf_counter() - t)

    # Batch-1 greedy decode after a 16-token prompt.
    llm.reset()
    t0 = time.perf_counter()
    llm.eval(ids[:16])
    tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    ttft = time.perf_counter() - t0
    t = time.perf_counter()
    for _ in range(args.decode_tokens - 1):
        llm.eval([tok])
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
    decode_s = time.perf_counter() - t

    print(f"llama-cpp-python {llama_cpp.__version__}, {args.threads} threads, load {load_s:.2f} s")
    print("| metric | value |")
    print("| --- | --- |")
    print(f"| prefill, 512-token prompt | {512 / prefill:.0f} tokens/s (TTFT {prefill * 1e3:.0f} ms) |")
    print(f"| decode, batch 1 | {(args.decode_tokens - 1) / decode_s:.1f} tokens/s (TTFT {ttft * 1e3:.0f} ms) |")


if __name__ == "__main__":
    main()
