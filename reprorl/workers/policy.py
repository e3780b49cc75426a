"""The policy's math on a model: the actor's (trainable) or the reference's (frozen)
log-probs, and the actor's per-micro-batch loss. Plain functions of a model and a batch:
the rank (worker.py) owns the model and the optimizer and runs the one training loop.

The batch they read, in sample order (from the rollout):
- `input_ids`, `attention_mask`, `position_ids` `[B, P+R]`: left-padded prompt + right-
  padded response;
- `responses`, `response_mask` `[B, R]` (1 on tokens the policy generated);
- for the loss: `old_log_probs`, `advantages` `[B, R]`, and `ref_log_probs` `[B, R]` for
  the KL loss (or just the `actor/kl` metric when present).

Log-probs follow the engine's definition (reprorl/rollout/sampling.py): the log-prob of
response token j is `log_softmax(logits.float() / T)` at that token, where the logits are
those at position P-1+j (the position that predicts it), T the rollout temperature, and
T = 1 for greedy (temperature 0); the model's kernels compute them (`token_log_probs`,
on CUDA one fused pass over the logits). With `batch_invariant=True` the model runs on its
device's batch-invariant kernels (`reprorl.kernels`), so a sample's log-probs do not
depend on which micro-batch it sits in.

Each micro-batch drops the columns that are padding in all of its rows (`trim_padding`), so
it costs its own longest sample, not the batch's width. A micro-batch's loss is its share
of the mini-batch loss (`agg_loss` with the mini-batch's token and sequence counts,
`mini_batch_norms`), so the gradients summed over any cut of a mini-batch into
micro-batches equal that of the whole mini-batch at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reprorl.algos import agg_loss, kl_penalty, policy_loss
from reprorl.kernels import select_kernels, verify_batch_invariance
from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import dtype_from_name, load_model
from reprorl.models.lora import LoraSpec, adapters_disabled
from reprorl.models.transformer import CausalLM
from reprorl.protocol import Batch


@dataclass(frozen=True)
class PolicyLossArgs:
    """The actor's loss settings (`actor.*` in the config)."""

    policy_loss: str = "vanilla"
    """`algos.policy_loss`'s mode: "vanilla" (PPO clip), "gspo", "cispo"."""
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_type: str = "k3"
    kl_loss_coef: float = 0.0
    cov: dict[str, float] | None = None
    """clip_cov's or kl_cov's own keywords (`algos.clip_cov_policy_loss`, `kl_cov_policy_loss`)."""


FULL_WIDTH_KEYS = ("input_ids", "attention_mask", "position_ids")  # [b, P+R]


RESPONSE_WIDTH = "response_width"
"""A trimmed micro-batch's meta key: its response width before `trim_padding` cut it (the
width its outputs are padded back to). A micro-batch that has it is not trimmed again."""
MAX_POSITION = "max_position"
"""A trimmed micro-batch's meta key: the largest of its `position_ids`, read where it was
trimmed, so that the forward's position check reads nothing from the GPU."""


def trim_padding(micro: Batch) -> Batch:
    """`micro` without the columns that are padding in every one of its rows: the leading
    prompt columns and the trailing response columns where `attention_mask` is 0 throughout
    (one prompt and one response column always stay).

    A micro-batch then costs its own longest sample, not the batch's width. The columns cut
    are a function of the micro-batch's rows alone (cut without regard to the worker count:
    micro_batches.py), and a row's logits do not depend on its padding (each row already has
    its own in a batch), so log-probs keep their bits. Response-width tensors (`[b, R]`, any key)
    keep their first columns; `[b, P+R]` ones (`FULL_WIDTH_KEYS`) and `prompts` are cut alike.
    The result carries `RESPONSE_WIDTH` and `MAX_POSITION`. Finding them reads the mask and
    the positions: the workers trim on the host, before a micro-batch goes to the GPU, where
    each read would wait for the GPU's queue.
    """
    if RESPONSE_WIDTH in micro.meta:
        return micro
    response_len = micro["responses"].shape[1]
    prompt_len = micro["input_ids"].shape[1] - response_len
    real = micro["attention_mask"].bool().any(0)  # [P+R]: a real token in some row
    prompt_real = real[:prompt_len].nonzero()
    lead = int(prompt_real[0]) if len(prompt_real) else prompt_len - 1
    response_real = real[prompt_len:].nonzero()
    keep = int(response_real[-1]) + 1 if len(response_real) else 1
    meta = {**micro.meta, RESPONSE_WIDTH: response_len}
    if "position_ids" in micro.tensors and micro["position_ids"].numel():
        meta[MAX_POSITION] = int(micro["position_ids"].max())
    if lead == 0 and keep == response_len:
        return Batch(micro.tensors, {k: list(v) for k, v in micro.non_tensors.items()}, meta)
    tensors = {}
    for key, t in micro.tensors.items():
        if key in FULL_WIDTH_KEYS:
            tensors[key] = t[:, lead : prompt_len + keep]
        elif key == "prompts":
            tensors[key] = t[:, lead:]
        elif t.dim() >= 2 and t.shape[1] == response_len:
            tensors[key] = t[:, :keep]
        else:
            tensors[key] = t
    return Batch(tensors, {k: list(v) for k, v in micro.non_tensors.items()}, meta)


def pad_responses(t: torch.Tensor, response_len: int) -> torch.Tensor:
    """`[b, R']` -> `[b, R]`, zeros on the right (undoes `trim_padding` for an output)."""
    return torch.nn.functional.pad(t, (0, response_len - t.shape[1]))


def load_policy(model_path: str | os.PathLike, *, trainable: bool, dtype: str | torch.dtype | None = None,
                batch_invariant: bool = False, device: str | torch.device = "cpu",
                lora: LoraSpec | None = None, weights_on_host: bool = False) -> CausalLM:
    """The actor (`trainable`) or the reference policy at `model_path`, on `device` with that
    device's kernels (batch-invariant ones with `batch_invariant`, checked here). With
    `lora`, only the adapters are trainable (load_model froze the rest). `weights_on_host`:
    see `place_model`."""
    model, model_args = load_model(Path(model_path), kind="causal_lm", dtype=dtype_from_name(dtype), lora=lora)
    place_model(model, model_args, device, batch_invariant, weights_on_host=weights_on_host)
    if lora is None or not trainable:
        model.requires_grad_(trainable)
    return model


def place_model(model: torch.nn.Module, model_args: ModelArgs, device: str | torch.device,
                batch_invariant: bool, *, weights_on_host: bool = False) -> None:
    """Move a model loaded on the host to `device` and give it that device's kernels, checked
    for batch invariance there. reprorl's models have no dropout; eval() everywhere keeps the
    update's forward identical to the log-prob pass (the first mini-batch's ratio is exactly 1).
    `weights_on_host`: the kernels are `device`'s but the weights stay on the host, for
    parameters sharded at rest (units.py moves a rank's range alone, so no device ever holds
    the whole model)."""
    if not weights_on_host:
        model.to(device)
        device = next(model.parameters()).device  # "cuda" resolved to its index
    device = torch.device(device)
    model.kernels = select_kernels(device, batch_invariant)
    verify_batch_invariance(model.kernels, model_args, next(model.parameters()).dtype, device)
    model.eval()


def response_log_probs(model: CausalLM, micro: Batch, temperature: float, with_entropy: bool = False
                       ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(`[b, R]` log-probs of the response tokens, `[b, R]` entropy of each token's
    distribution or None), float32, differentiable. The model's kernels compute them
    (`token_log_probs`) with the engine's log-softmax arithmetic, or the rollout's and
    the trainer's log-probs part in the last bits."""
    hidden = model.hidden_states(micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                                 position_bound=micro.meta.get(MAX_POSITION))
    # Only the positions that predict a response token go through the LM head (the same
    # rows' bits as the whole sequence's logits: each row of a linear is its own).
    r = micro["responses"].shape[1]
    logits = model.logits(hidden[:, -r - 1 : -1])  # [b, R, V]
    return model.kernels.token_log_probs(logits, micro["responses"], temperature, with_entropy)


def micro_batch_log_probs(
    model: CausalLM, micros: Iterable[Batch], *, temperature: float, with_entropy: bool = False, base: bool = False,
) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
    """Per micro-batch, its `[b, R]` log-probs (and entropies), 0 where `response_mask` is
    0; each micro-batch is trimmed first (`trim_padding`), unless it was. No grad. `base`:
    the base model's, LoRA adapters switched off (the reference policy)."""
    out = []
    with torch.no_grad(), adapters_disabled(model) if base else contextlib.nullcontext():
        for micro in micros:
            micro = trim_padding(micro)
            width = micro.meta[RESPONSE_WIDTH]
            micro_log_probs, entropy = response_log_probs(model, micro, temperature, with_entropy)  # [b, R']
            mask = micro["response_mask"] > 0
            log_probs = pad_responses(torch.where(mask, micro_log_probs, 0.0), width)
            if with_entropy:
                entropy = torch.where(mask, entropy, 0.0)
                out.append((log_probs, pad_responses(entropy, width)))
            else:
                out.append(log_probs)
    return out


def micro_batch_loss(
    model: CausalLM, micro: Batch, norms: dict[str, Any], *, loss: PolicyLossArgs, temperature: float
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """(differentiable loss, stats) of one micro-batch: its share of the loss of the
    mini-batch whose `norms` (`mini_batch_norms`) are given. The stats (`pg_loss`,
    `entropy`, `pg_clipfrac`, `ppo_kl`, and `kl` when the batch has `ref_log_probs`) add up
    over a mini-batch's micro-batches, in order, to the mini-batch's; they are 0-dim
    tensors on the model's device (`read_stats` reads a mini-batch's at once: a read per
    micro-batch would stop the host from queueing the next one's kernels)."""
    if loss.use_kl_loss and "ref_log_probs" not in micro:
        raise ValueError(f"use_kl_loss needs 'ref_log_probs' in the batch; it has {micro.keys()}")
    micro = trim_padding(micro)
    mask = micro["response_mask"].to(torch.float32)  # [b, R']
    log_probs, token_entropy = response_log_probs(model, micro, temperature, with_entropy=True)  # [b, R']
    pg_loss, pg_stats = policy_loss(
        loss.policy_loss, micro["old_log_probs"], log_probs, micro["advantages"], mask,
        clip_ratio_low=loss.clip_ratio_low, clip_ratio_high=loss.clip_ratio_high, clip_ratio_c=loss.clip_ratio_c,
        loss_agg_mode=loss.loss_agg_mode, cov=loss.cov, **norms,
    )
    # The entropy only takes part in the graph when it is in the loss.
    with contextlib.nullcontext() if loss.entropy_coeff != 0 else torch.no_grad():
        entropy = agg_loss(token_entropy, mask, loss.loss_agg_mode, **norms)
    total = pg_loss - loss.entropy_coeff * entropy
    share = mask.sum() / norms["global_num_tokens"].clamp(min=1)  # this micro-batch's share of the tokens
    stats = {"pg_loss": pg_loss, "entropy": entropy,
             "pg_clipfrac": pg_stats["clipfrac"] * share, "ppo_kl": pg_stats["approx_kl"] * share}
    if "ref_log_probs" in micro:
        kl = agg_loss(kl_penalty(log_probs, micro["ref_log_probs"], loss.kl_loss_type), mask,
                      loss.loss_agg_mode, **norms)
        if loss.use_kl_loss:
            total = total + loss.kl_loss_coef * kl
        stats["kl"] = kl
    return total, {key: value.detach() for key, value in stats.items()}


def mini_batch_norms(mini: Batch, max_response_length: int | None) -> dict[str, Any]:
    """The normalisers of a mini-batch's loss (`agg_loss`'s global_* arguments), which make
    each micro-batch's loss its share of the whole: token and sequence counts, and the
    divisor of "seq-mean-token-sum-norm" (`max_response_length`; None = the batch's R)."""
    return {
        "global_num_tokens": mini["response_mask"].sum().to(torch.float32),
        "global_num_seqs": len(mini),
        "max_response_length": max_response_length or mini["responses"].shape[1],
    }


def mask_truncated(response_mask: torch.Tensor, finish_reasons: Sequence[str]) -> torch.Tensor:
    """The actor's loss mask without truncated responses (`actor.mask_truncated`): `response_mask`
    [B, R] with the rows whose finish reason is "length" (cut at rollout.max_tokens) zeroed, so
    they add nothing to the loss nor to its token count (DAPO's overlong filtering); the
    seq-mean loss_agg_modes still count them among the mini-batch's sequences
    (`mini_batch_norms`), as a 0.

    >>> mask_truncated(torch.tensor([[1, 1, 0], [1, 1, 1]]), ["stop", "length"]).tolist()
    [[1, 1, 0], [0, 0, 0]]
    """
    if len(finish_reasons) != response_mask.shape[0]:
        raise ValueError(f"{len(finish_reasons)} finish reasons for {response_mask.shape[0]} responses")
    keep = torch.tensor([reason != "length" for reason in finish_reasons], device=response_mask.device)  # [B]
    return response_mask * keep.unsqueeze(-1).to(response_mask.dtype)


def read_stats(stats: list[dict[str, torch.Tensor]]) -> list[dict[str, float]]:
    """Micro-batches' stats (0-dim tensors, `micro_batch_loss`) as floats, in one read of
    the device."""
    if not stats:
        return []
    values = torch.stack([v.to(torch.float64) for s in stats for v in s.values()]).tolist()
    out, i = [], 0
    for s in stats:
        out.append(dict(zip(s, values[i : i + len(s)])))
        i += len(s)
    return out
