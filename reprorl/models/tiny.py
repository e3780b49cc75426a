"""Tiny HF-format models made from a seed: the models of the tests and the default run.

A tiny model is a Qwen2 shaped so that transformers, vLLM's CPU backend (head_dim >= 32)
and our engine all load it: hidden 128, 2 layers, 2 query heads sharing 1 KV head of
width 64, vocabulary 128 (the character tokenizer), float32. The weights are drawn by our
own code from `torch.Generator(seed)`, not by transformers' initialisers, so the same seed
writes the same bytes whatever the transformers version. Every other family of
`models/arch.py` comes at the same shape with its own switches (`TINY_FAMILIES`): a
sliding window of 16 tokens where the family has windows, so short prompts cross it.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import save_model
from reprorl.models.tokenizer import IM_END, PAD_TOKEN, VOCAB_SIZE, make_char_tokenizer
from reprorl.models.transformer import CausalLM, SequenceClassifier


WINDOW = 16
TINY_FAMILIES: dict[str, dict[str, Any]] = {  # each family's switches over the qwen2 tiny model's
    "qwen2": {},
    "qwen3": dict(qkv_bias=False, qk_norm=True),
    "llama": dict(qkv_bias=False),
    "mistral": dict(qkv_bias=False, sliding_window=WINDOW, layer_types=("sliding_attention",) * 2),
    "olmo2": dict(qkv_bias=False, qk_norm_whole=True, post_norm=True),
    "phi3": dict(qkv_bias=False, fused_projections=True, partial_rotary_factor=0.5),
    "gemma3_text": dict(qkv_bias=False, qk_norm=True, post_norm=True, sandwich_norm=True, norm_plus_one=True,
                        scale_embeddings=True, hidden_act="gelu_pytorch_tanh", sliding_window=WINDOW,
                        layer_types=("sliding_attention", "full_attention"), local_rope_theta=10000.0,
                        query_pre_attn_scalar=64),
}


def tiny_args(kind: str = "policy", family: str = "qwen2") -> ModelArgs:
    """The tiny model's shape; kind "policy" (tied embeddings) or "reward" (one score);
    `family` one of TINY_FAMILIES."""
    if family not in TINY_FAMILIES:
        raise ConfigError(f"tiny model family {family!r} is not supported; expected one of {sorted(TINY_FAMILIES)}")
    return dataclasses.replace(_tiny_qwen2(kind), model_type=family, **TINY_FAMILIES[family])


def _tiny_qwen2(kind: str) -> ModelArgs:
    tokenizer = make_char_tokenizer()
    return ModelArgs(
        model_type="qwen2",
        vocab_size=VOCAB_SIZE,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        max_position_embeddings=2048,
        tie_word_embeddings=kind == "policy",
        qkv_bias=True,
        torch_dtype="float32",
        eos_token_id=tokenizer.convert_tokens_to_ids(IM_END),
        pad_token_id=tokenizer.convert_tokens_to_ids(PAD_TOKEN),
        num_labels=1,
    )


def init_weights(model: nn.Module, seed: int, std: float = 0.02) -> None:
    """Norms the identity (weights 1, or 0 where stored as offsets from 1: gemma3), every
    other parameter normal(0, std), drawn in parameter order from one
    `torch.Generator(seed)` (the global RNG is not touched)."""
    generator = torch.Generator().manual_seed(seed)
    plus_one = getattr(getattr(model, "args", None), "norm_plus_one", False)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(0.0 if plus_one else 1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=generator) * std)


def make_tiny(out_dir: str | os.PathLike, kind: str = "policy", seed: int = 0, family: str = "qwen2") -> Path:
    """Write a tiny model directory (config.json, model.safetensors, tokenizer files).

    kind: "policy" (XForCausalLM, tied embeddings) or "reward" (XForSequenceClassification,
    num_labels 1, pad_token_id set); `family`: one of TINY_FAMILIES (Qwen2 by default). The
    same seed writes the same bytes in every file; an existing out_dir has these files
    overwritten.
    """
    if kind not in ("policy", "reward"):
        raise ConfigError(f"tiny model kind {kind!r} is not supported; expected 'policy' or 'reward'")
    args = tiny_args(kind, family)
    model = CausalLM(args) if kind == "policy" else SequenceClassifier(args)
    init_weights(model, seed)
    out_dir = save_model(model, args, out_dir)
    make_char_tokenizer().save_pretrained(out_dir)
    return out_dir
