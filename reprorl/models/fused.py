"""Checkpoints whose projections are fused (Phi-3's `qkv_proj` and `gate_up_proj`), read
into and written from the model's separate q/k/v and gate/up linears.

One model definition serves every family: a fused family's checkpoint is cut on load and
joined on save, along the output rows, in HF's order (q, k, v; gate, up). The math is the
same; a fused matmul and its three parts may round differently in a vendor BLAS, within
float32's usual distance, while the batch-invariant kernels give every row the same bits
whatever the output width.
"""

from __future__ import annotations

import re

import torch
from torch import Tensor

from reprorl.models.arch import ModelArgs

QKV = re.compile(r"^(.*\.self_attn)\.qkv_proj\.(weight|bias)$")
GATE_UP = re.compile(r"^(.*\.mlp)\.gate_up_proj\.(weight|bias)$")


def split_fused(tensors: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """`tensors` with each fused projection cut into the model's separate ones."""
    if not args.fused_projections:
        return tensors
    q, kv = args.num_attention_heads * args.head_dim, args.num_key_value_heads * args.head_dim
    out: dict[str, Tensor] = {}
    for name, t in tensors.items():
        if m := QKV.match(name):
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), torch.split(t, [q, kv, kv])):
                out[f"{m[1]}.{part}.{m[2]}"] = piece
        elif m := GATE_UP.match(name):
            for part, piece in zip(("gate_proj", "up_proj"), torch.chunk(t, 2)):
                out[f"{m[1]}.{part}.{m[2]}"] = piece
        else:
            out[name] = t
    return out


def join_fused(tensors: dict[str, Tensor], args: ModelArgs) -> dict[str, Tensor]:
    """The inverse of `split_fused`: the model's separate projections joined as the family's
    checkpoint holds them (contiguous, ready for safetensors)."""
    if not args.fused_projections:
        return tensors
    out = dict(tensors)
    for name in list(tensors):
        if m := re.match(r"^(.*\.self_attn)\.q_proj\.(weight|bias)$", name):
            parts = [out.pop(f"{m[1]}.{p}.{m[2]}") for p in ("q_proj", "k_proj", "v_proj")]
            out[f"{m[1]}.qkv_proj.{m[2]}"] = torch.cat(parts).contiguous()
        elif m := re.match(r"^(.*\.mlp)\.gate_proj\.(weight|bias)$", name):
            parts = [out.pop(f"{m[1]}.{p}.{m[2]}") for p in ("gate_proj", "up_proj")]
            out[f"{m[1]}.gate_up_proj.{m[2]}"] = torch.cat(parts).contiguous()
    return out
