#!/usr/bin/env python3
"""Writes an FP8 (E4M3) checkpoint in the Hugging Face compressed-tensors layout from a bf16 /
f16 / f32 Llama-family checkpoint, as llm-compressor's `FP8` / `FP8_DYNAMIC` schemes do:

- every decoder linear (`q/k/v/o_proj`, `gate/up/down_proj`) becomes `weight` F8_E4M3 plus
  `weight_scale` (f32): per output channel `[out, 1]` (default) or per tensor `[]`
  (`--strategy tensor`), scale = amax / 448, code = round-to-nearest-even(w · (1 / scale))
  saturated to +-448, in f32: the rule of Prism's at-load quantization (`--quantization fp8`,
  `backend/cuda/fp8.rs`) bit for bit, so a checkpoint written here loads to the same codes;
  (`w / scale`, as llm-compressor rounds, differs from it in the last f32 bit of the quotient,
  which moves a code where it lies on a rounding boundary);
- embeddings, norms and `lm_head` keep their dtype (`lm_head` is in `ignore`);
- `config.json` gets `quantization_config` (`quant_method: compressed-tensors`,
  `format: float-quantized`, weights `num_bits: 8, type: float`, activations dynamic per
  token, as FP8_DYNAMIC); `--layout fp8` writes the transformers / vLLM "fp8" layout instead
  (`quant_method: fp8`, `activation_scheme: dynamic`, per-tensor `weight_scale`);
- tokenizer and generation files are copied unchanged; a sharded input stays sharded.

Only numpy is needed (no torch, no safetensors package: the files are read and written by
hand — 8-byte little-endian header length, JSON header, raw little-endian data).

    python3 scripts/quantize_fp8.py SRC_DIR DST_DIR [--strategy channel|tensor] [--layout compressed-tensors|fp8]
"""

import argparse
import json
import shutil
import struct
import sys
from pathlib import Path

import numpy as np

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
E4M3_MAX = 448.0
COPY = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "special_tokens_map.json",
        "tokenizer.model", "chat_template.jinja")


def read_safetensors(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8:8 + n])
    data = raw[8 + n:]
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = (t["dtype"], t["shape"], data[a:b])
    return out


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    header = {}
    chunks = []
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with path.open("wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for c in chunks:
            f.write(c)


def to_f32(dtype: str, shape: list[int], data: bytes) -> np.ndarray:
    if dtype == "F32":
        a = np.frombuffer(data, dtype="<f4")
    elif dtype == "F16":
        a = np.frombuffer(data, dtype="<f2").astype(np.float32)
    elif dtype == "BF16":
        a = (np.frombuffer(data, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    else:
        raise SystemExit(f"cannot quantize a {dtype} tensor (expected F32, F16 or BF16)")
    return a.reshape(shape)


def f32_to_e4m3(x: np.ndarray) -> np.ndarray:
    """float32 -> E4M3 codes (uint8): nearest, ties to even; beyond +-448 saturates; NaN -> 0x7f."""
    x = np.ascontiguousarray(x, dtype=np.float32)
    bits = x.view(np.uint32)
    sign = ((bits >> 31).astype(np.uint8)) << 7
    a = np.abs(x)
    code = np.zeros(x.shape, dtype=np.uint32)
    sub = a < (1.0 / 64.0)
    # Subnormals: a * 2^9 is exact; np.rint rounds ties to even.
    code[sub] = np.rint(a[sub] * 512.0).astype(np.uint32)
    normal = ~sub & (a < 512.0)
    ab = a.view(np.uint32)[normal]
    exp = (ab >> 23).astype(np.int64) - 127
    keep = (ab >> 20) & 7
    rest = ab & 0xFFFFF
    up = (rest > 0x80000) | ((rest == 0x80000) & ((keep & 1) == 1))
    code[normal] = ((exp + 7).astype(np.uint32) << 3) + keep + up.astype(np.uint32)
    code[a >= 512.0] = 0x7E
    code = np.minimum(code, 0x7E)
    code[np.isnan(x)] = 0x7F
    return code.astype(np.uint8) | sign


def quantize(w: np.ndarray, strategy: str) -> tuple[np.ndarray, np.ndarray]:
    """(codes [out, in] uint8, scale f32 [out, 1] or []) with w ~= codes * scale."""
    w = w.astype(np.float32)
    amax = np.abs(w).max(axis=1, keepdims=True) if strategy == "channel" else np.abs(w).max()
    amax = np.asarray(amax, dtype=np.float32)
    # An all-zero row keeps scale 1 (its codes are 0 whatever the scale).
    scale = np.where(amax > 0, amax / np.float32(E4M3_MAX), np.float32(1.0)).astype(np.float32)
    inv = (np.float32(1.0) / scale).astype(np.float32)
    return f32_to_e4m3(w * inv), scale


def is_linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS and name.startswith("model.layers.")


def quantization_config(layout: str, strategy: str) -> dict:
    if layout == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ["lm_head"]}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True,
                            "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                      "dynamic": True},
            }
        },
        "ignore": ["lm_head"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("src", type=Path, help="Hugging Face model directory (bf16/f16/f32 safetensors)")
    ap.add_argument("dst", type=Path, help="output directory (created)")
    ap.add_argument("--strategy", choices=("channel", "tensor"), default="channel")
    ap.add_argument("--layout", choices=("compressed-tensors", "fp8"), default="compressed-tensors")
    args = ap.parse_args()
    if args.layout == "fp8" and args.strategy != "tensor":
        ap.error("--layout fp8 stores per-tensor scales: use --strategy tensor")

    config = json.loads((args.src / "config.json").read_text())
    if "quantization_config" in config:
        ap.error(f"{args.src} is already quantized ({config['quantization_config'].get('quant_method')})")
    config["quantization_config"] = quantization_config(args.layout, args.strategy)
    args.dst.mkdir(parents=True, exist_ok=True)
    (args.dst / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in COPY:
        if (args.src / name).exists():
            shutil.copyfile(args.src / name, args.dst / name)

    index = args.src / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["model.safetensors"]
    new_map = {}
    quantized = 0
    for file in files:
        out = {}
        for name, (dtype, shape, data) in read_safetensors(args.src / file).items():
            if is_linear(name) and len(shape) == 2:
                codes, scale = quantize(to_f32(dtype, shape, data), args.strategy)
                prefix = name[: -len(".weight")]
                out[name] = ("F8_E4M3", shape, codes.tobytes())
                out[prefix + ".weight_scale"] = ("F32", list(scale.shape), scale.astype("<f4").tobytes())
                new_map[prefix + ".weight_scale"] = file
                quantized += 1
            else:
                out[name] = (dtype, shape, data)
            new_map[name] = file
        write_safetensors(args.dst / file, out)
    if weight_map is not None:
        (args.dst / "model.safetensors.index.json").write_text(json.dumps({"weight_map": new_map}, indent=2) + "\n")
    print(f"{quantized} linear weights -> F8_E4M3 ({args.strategy} scales, {args.layout}) in {args.dst}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
