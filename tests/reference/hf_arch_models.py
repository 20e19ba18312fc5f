"""The seeded-random Hugging Face models of Prism's non-Llama architectures (Qwen2, Qwen3,
Mistral, Gemma 3), shared by the CPU fixtures (tests/reference/hf_arch_reference.py) and the
CUDA references (scripts/gpu/hf_arch_cuda.py): the two differ only in the sizes of `Shape`.

Needs torch and transformers only (the GPU machine has no gguf package), so the GPU scripts
import it with tests/reference on sys.path.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

ROOT = Path(__file__).resolve().parents[2]
# The byte-level BPE tokenizer every model uses (256 byte tokens, then BOS and EOS).
TOKENIZER = ROOT / "tests" / "fixtures" / "hf-tiny"
VOCAB = 272
BOS, EOS = 256, 257


@dataclass(frozen=True)
class Shape:
    """The sizes of the models (4 attention heads, 2 KV heads in every one)."""

    hidden_size: int
    intermediate_size: int
    head_dim: int
    max_position_embeddings: int
    # Layers of Qwen2, Qwen3 and Mistral; Gemma 3 always has 4 (layers 0, 1, 3 local, 2 global).
    layers: int
    # The sliding window of Mistral and of Gemma 3's local layers.
    window: int
    # Gemma 3's attention scale is query_pre_attn_scalar^-0.5.
    query_pre_attn_scalar: int
    final_logit_softcapping: float | None
    # The std of the random matrices (biases 0.1, norm gains 0.2 around their identity).
    matrix_std: float


def common(shape: Shape) -> dict:
    """The config fields every architecture shares."""
    return dict(
        vocab_size=VOCAB,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=shape.head_dim,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        bos_token_id=BOS,
        eos_token_id=EOS,
        pad_token_id=None,
    )


def models(shape: Shape):
    """(name, model class, config) of each architecture at `shape`."""
    c = common(shape)
    yield "qwen2", Qwen2ForCausalLM, Qwen2Config(
        **c, num_hidden_layers=shape.layers, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=True)
    yield "qwen3", Qwen3ForCausalLM, Qwen3Config(
        **c, num_hidden_layers=shape.layers, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0},
        tie_word_embeddings=False)
    yield "mistral", MistralForCausalLM, MistralConfig(
        **c, num_hidden_layers=shape.layers, sliding_window=shape.window,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}, tie_word_embeddings=False)
    # Layers 0, 1, 3 local (window, base 10 000), layer 2 global (full, base 1 000 000).
    yield "gemma3", Gemma3ForCausalLM, Gemma3TextConfig(
        **c, num_hidden_layers=4, sliding_window=shape.window,
        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
        query_pre_attn_scalar=shape.query_pre_attn_scalar, hidden_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True, final_logit_softcapping=shape.final_logit_softcapping,
        attn_logit_softcapping=None)


def randomize(model, gen, gemma, matrix_std):
    """Seeded normal weights: matrices std `matrix_std`, biases 0.1; norm gains 1 + 0.2·N
    (Gemma: the stored w of x̂·(1 + w) is 0.2·N); rounded to bf16 values."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if "norm" in name:
                v = 0.2 * r + (0.0 if gemma else 1.0)
            elif name.endswith(".bias"):
                v = 0.1 * r
            else:
                v = matrix_std * r
            p.copy_(v.to(torch.bfloat16).to(torch.float32))


@torch.no_grad()
def last_logits(model, ids, device):
    """The f32 logits of the last position of the prompt `ids` (no KV cache), on the CPU."""
    out = model(torch.tensor([ids], device=device), use_cache=False)
    return out.logits[0, -1].float().cpu()


def f32_and_bf16_logits(cls, path, prompts, device):
    """`last_logits` of each prompt for the checkpoint at `path` loaded in f32 and in bf16
    (eager attention), and e_hf, the largest |bf16 − f32| of all of them."""
    rows = {}
    for dtype in (torch.float32, torch.bfloat16):
        m = cls.from_pretrained(path, dtype=dtype, attn_implementation="eager").to(device)
        m.eval()
        rows[dtype] = [last_logits(m, p, device) for p in prompts]
    f32, bf = rows[torch.float32], rows[torch.bfloat16]
    e_hf = max(float((x - y).abs().max()) for x, y in zip(f32, bf))
    return f32, bf, e_hf
