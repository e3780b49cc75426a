"""The critic's math on a model: the PPO value model (GAE only), as plain functions (the
rank, worker.py, owns the model and its optimizer).

The batch is the policy's (see policy.py); the loss also reads `values` (the critic's
values at rollout time) and `returns` `[B, R]`.

The value of response token j is the value of the state BEFORE it: the critic's output at
position P-1+j (the last prompt token for j = 0), as verl's `values[:, -R-1:-1]`. It is
what GAE pairs with the reward of token j. Micro-batches are trimmed and their losses are
shares of the mini-batch's, as the policy's.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from reprorl.algos import value_loss
from reprorl.models.hf_io import dtype_from_name, load_model
from reprorl.models.transformer import ValueModel
from reprorl.protocol import Batch
from reprorl.workers.policy import MAX_POSITION, RESPONSE_WIDTH, pad_responses, place_model, trim_padding


VALUE_HEAD = ("score.weight", "score.bias")  # ValueModel's head, as XForTokenClassification


def response_values(values: torch.Tensor, response_length: int) -> torch.Tensor:
    """`[B, P+R]` per-position values -> `[B, R]`: positions P-1 .. P+R-2, in float32."""
    return values[:, -response_length - 1 : -1].float()


def checkpoint_tensor_names(path: str | os.PathLike) -> set[str]:
    """The tensor names stored in an HF model directory (model.safetensors or its shards'
    index), read from the headers only."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        return set(json.loads(index.read_text())["weight_map"])
    with safe_open(path / "model.safetensors", framework="pt") as f:
        return set(f.keys())


def init_value_head(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """The value head as transformers initialises XForTokenClassification's `score`
    (weight normal(0, std), bias 0), drawn from `torch.Generator(seed)`, not the global RNG."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        weight = model.score.weight
        weight.copy_(torch.randn(weight.shape, generator=generator, dtype=torch.float32) * std)
        model.score.bias.zero_()


def load_critic(model_path: str | os.PathLike, *, seed: int, dtype: str | torch.dtype | None = None,
                batch_invariant: bool = False, device: str | torch.device = "cpu",
                weights_on_host: bool = False) -> ValueModel:
    """The value model at `model_path` (trainable), on `device` with that device's kernels
    (`weights_on_host`: see `place_model`).

    `load_model(kind="critic")` gives a `ValueModel` (backbone + `score` head [1, H] with
    bias). When the checkpoint has no head (a policy checkpoint: the usual start),
    load_model leaves it at zero, which would give the backbone no gradient on the first
    step; the head is then drawn from `torch.Generator(seed)` (`init_value_head`). A
    checkpoint with a head (a trained critic, a reward model's `score.weight`) keeps it.
    """
    model, model_args = load_model(Path(model_path), kind="critic", dtype=dtype_from_name(dtype))
    if not set(VALUE_HEAD) & checkpoint_tensor_names(model_path):
        init_value_head(model, seed)  # on the host, where it loaded: the same draws on any device
    place_model(model, model_args, device, batch_invariant, weights_on_host=weights_on_host)
    return model


def token_values(model: ValueModel, micro: Batch) -> torch.Tensor:
    """`[b, R]` float32 values of the states before each response token (differentiable)."""
    values = model(micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                   position_bound=micro.meta.get(MAX_POSITION))  # [b, P+R]
    return response_values(values, micro["responses"].shape[1])


def micro_batch_values(model: ValueModel, micros: Iterable[Batch]) -> list[torch.Tensor]:
    """Per micro-batch, its `[b, R]` float32 values, 0 where `response_mask` is 0 (trimmed
    first). No grad."""
    out = []
    with torch.no_grad():
        for micro in micros:
            m = trim_padding(micro)
            out.append(pad_responses(torch.where(m["response_mask"] > 0, token_values(model, m), 0.0),
                                     m.meta[RESPONSE_WIDTH]))
    return out


def micro_batch_loss(
    model: ValueModel, micro: Batch, norms: dict[str, Any], *, cliprange_value: float, loss_agg_mode: str
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(differentiable clipped value loss, stats) of one micro-batch, as its share of the
    mini-batch whose `norms` (`policy.mini_batch_norms`) are given; the stats (`vf_loss`,
    `vf_clipfrac`) are 0-dim tensors that add up over the mini-batch, as the policy's."""
    micro = trim_padding(micro)
    mask = micro["response_mask"].to(torch.float32)
    vf_loss, clipfrac = value_loss(
        token_values(model, micro), micro["values"].float(), micro["returns"].float(), mask,
        cliprange_value, loss_agg_mode, **norms,
    )
    share = mask.sum() / norms["global_num_tokens"].clamp(min=1)
    return vf_loss, {"vf_loss": vf_loss.detach(), "vf_clipfrac": (clipfrac * share).detach()}
