#!/usr/bin/env python3
"""Reference dequantizations of GGUF block formats from gguf-py (llama.cpp's Python
package, `gguf.quants.dequantize`, its own numpy port of ggml's `dequantize_row_*`), for
the Rust decoders to match bit for bit.

For each type: seeded random blocks (random bytes, with every f16/f32 scale field replaced
by a sane finite value, so no block holds NaN/inf scales), dequantized by gguf-py. Q8_K has
no dequantizer in gguf-py (ggml uses it only for activations); its reference is ggml's
`dequantize_row_q8_K` (`y = d * q`) written here in numpy, in f32.

Writes tests/fixtures/kquant/<TYPE>.bin:
    u32 ggml type id, u32 block count, the raw blocks, then the expected f32 values
    (little endian).

Environment (pinned):
    python3 -m venv /tmp/kvenv && /tmp/kvenv/bin/pip install gguf==0.19.0 numpy==2.4.6
    /tmp/kvenv/bin/python tests/reference/kquant_reference.py
"""

import struct
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType as T
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "kquant"

# Byte offsets of f16 scale fields in each block (ggml's block_* structs).
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}
# Block counts: about 4 KiB of expected values per type.
BLOCKS = {T.Q4_0: 32, T.Q4_1: 32, T.Q5_0: 32, T.Q5_1: 32, T.Q8_0: 32, T.Q4_K: 4, T.Q5_K: 4, T.Q6_K: 4, T.Q8_K: 4}


def sane_scales(rng: np.random.Generator, n: int) -> np.ndarray:
    """Finite scales over several binades and both signs, as f32 (exactly f16 values)."""
    mag = rng.uniform(2.0**-14, 2.0, n) * rng.choice([1.0, 1.0 / 64, 1.0 / 4096], n)
    return (mag * rng.choice([-1.0, 1.0], n)).astype(np.float16)


def blocks_for(qtype: T, rng: np.random.Generator) -> np.ndarray:
    n = BLOCKS[qtype]
    _, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, (n, size), dtype=np.uint8)
    for off in F16_FIELDS.get(qtype, []):
        blocks[:, off : off + 2] = sane_scales(rng, n).view(np.uint8).reshape(n, 2)
    if qtype == T.Q8_K:
        d = rng.uniform(1e-4, 0.05, n).astype(np.float32) * rng.choice([-1.0, 1.0], n).astype(np.float32)
        blocks[:, 0:4] = d.view(np.uint8).reshape(n, 4)
    return blocks


def reference(qtype: T, blocks: np.ndarray) -> np.ndarray:
    if qtype == T.Q8_K:
        d = blocks[:, 0:4].copy().view(np.float32)
        q = blocks[:, 4 : 4 + 256].view(np.int8).astype(np.float32)
        return (d * q).astype(np.float32).reshape(-1)
    return dequantize(blocks.reshape(-1), qtype).astype(np.float32).reshape(-1)


def main() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for i, qtype in enumerate(BLOCKS):
        rng = np.random.default_rng(0x6B71 + i)
        blocks = blocks_for(qtype, rng)
        want = reference(qtype, blocks)
        assert np.isfinite(want).all(), qtype.name
        assert want.size == blocks.shape[0] * GGML_QUANT_SIZES[qtype][0]
        path = OUT / f"{qtype.name}.bin"
        with path.open("wb") as f:
            f.write(struct.pack("<II", int(qtype), blocks.shape[0]))
            f.write(blocks.tobytes())
            f.write(want.astype("<f4").tobytes())
        print(f"{path}: {blocks.shape[0]} blocks, {want.size} values")


if __name__ == "__main__":
    main()
