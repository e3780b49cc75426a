"""The critic worker: the PPO value model (GAE only).

The batch is the policy worker's (see policy.py); `update` also reads `values` (the
critic's values at rollout time, from `compute_values`) and `returns` `[B, R]`.

The value of response token j is the value of the state BEFORE it: the critic's output at
position P-1+j (the last prompt token for j = 0), as verl's `values[:, -R-1:-1]`. It is
what GAE pairs with the reward of token j.

Mini-batches, micro-batches (by samples or by token budget), gradient accumulation with
the mini-batch's normalisers, the guarded optimizer step and the once-per-update
learning-rate schedule are as in the policy worker.
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
from reprorl.determinism_report import model_part_info
from reprorl.kernels import select_kernels, verify_batch_invariance
from reprorl.models.hf_io import dtype_from_name, load_model
from reprorl.protocol import Batch
from reprorl.workers.micro_batches import in_sample_order, micro_batch_rows, rows_tensor, take
from reprorl.workers.optim import LRSchedule, OptimArgs, check_finite_loss, guarded_step, make_adamw, set_lr
from reprorl.workers.policy import (
    MAX_POSITION,
    RESPONSE_WIDTH,
    check_positive,
    mini_batch_norms,
    pad_responses,
    read_stats,
    trim_padding,
)


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


class CriticWorker:
    """The value model: `CriticWorker(critic_path, optim=OptimArgs(lr=1e-5, ...), seed=run_seed)`.

    `load_model(kind="critic")` gives a `ValueModel` (backbone + `score` head [1, H] with
    bias). When the checkpoint at `critic_path` has no head (a policy checkpoint: the usual
    start), load_model leaves it at zero, which would give the backbone no gradient on the
    first step; the head is then drawn from `torch.Generator(seed)` (`init_value_head`).
    A checkpoint with a head (a trained critic, a reward model's `score.weight`) keeps it.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        optim: OptimArgs,
        seed: int,
        dtype: str | torch.dtype | None = None,
        batch_invariant: bool = False,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model_path = Path(model_path)
        self.batch_invariant = batch_invariant
        self.model, self.model_args = load_model(self.model_path, kind="critic", dtype=dtype_from_name(dtype))
        if not set(VALUE_HEAD) & checkpoint_tensor_names(self.model_path):
            init_value_head(self.model, seed)  # on the host, where it loaded: the same draws on any device
        self.model.to(device)
        first = next(self.model.parameters())
        self.model.kernels = select_kernels(first.device, batch_invariant)  # the kernels of the device it runs on
        verify_batch_invariance(self.model.kernels, self.model_args, first.dtype, first.device)
        self.model.eval()  # no dropout in reprorl's models: compute_values and update see the same forward
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim_args = optim
        self.optimizer = make_adamw(self.params, optim)
        self.schedule = LRSchedule(optim.lr, optim.warmup_steps, optim.total_steps, optim.lr_schedule)

    def _values(self, micro: Batch) -> torch.Tensor:
        """`[b, R]` float32 values of the states before each response token (differentiable)."""
        values = self.model(micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                            position_bound=micro.meta.get(MAX_POSITION))  # [b, P+R]
        return response_values(values, micro["responses"].shape[1])

    def compute_values(self, batch: Batch, *, micro_batch_size: int, max_token_len: int | None = None) -> torch.Tensor:
        """`[B, R]` float32 values in sample order, 0 where `response_mask` is 0; micro-batches
        of `micro_batch_size` in sample order, or by token budget with `max_token_len`."""
        check_positive(micro_batch_size=micro_batch_size)
        micros = micro_batch_rows(batch, micro_batch_size, max_token_len)
        parts = self.micro_batch_values(take(batch, rows) for rows in micros)
        return in_sample_order(torch.cat(parts), rows_tensor(micros))

    def micro_batch_values(self, micros: Iterable[Batch]) -> list[torch.Tensor]:
        """Per micro-batch, its `[b, R]` values as `compute_values` gives them (trimmed first). No grad."""
        out = []
        with torch.no_grad():
            for micro in micros:
                m = trim_padding(micro)
                out.append(pad_responses(torch.where(m["response_mask"] > 0, self._values(m), 0.0),
                                         m.meta[RESPONSE_WIDTH]))
        return out

    def update(
        self,
        batch: Batch,
        *,
        ppo_epochs: int,
        mini_batch_size: int,
        micro_batch_size: int,
        cliprange_value: float,
        loss_agg_mode: str,
        max_response_length: int | None = None,
        max_token_len: int | None = None,
    ) -> dict[str, float]:
        """One training step of the clipped value loss (`algos.value_loss`).

        `mini_batch_size` in samples; `max_response_length`: the divisor of
        "seq-mean-token-sum-norm" (None = the batch's R); `max_token_len`: micro-batches by
        token budget (micro_batches.py), else of `micro_batch_size` samples. Returns `critic/vf_loss`,
        `critic/vf_clipfrac` (token mean), each exact per mini-batch whatever the
        micro-batch size, then averaged over the step's mini-batches; `critic/grad_norm`
        (before clipping) and `critic/lr`."""
        check_positive(ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size)
        lr = self.schedule.lr()
        set_lr(self.optimizer, lr)
        records = []
        for epoch in range(ppo_epochs):
            for m, mini in enumerate(batch.split(mini_batch_size)):
                where = f"critic update {self.schedule.step + 1} (epoch {epoch}, mini-batch {m})"  # from 1, as steps
                stats = self.accumulate_gradients(
                    mini, micro_batch_size=micro_batch_size, cliprange_value=cliprange_value,
                    loss_agg_mode=loss_agg_mode, max_response_length=max_response_length,
                    max_token_len=max_token_len, where=where,
                )
                stats["critic/grad_norm"] = guarded_step(self.optimizer, self.params, self.optim_args.grad_clip, where)
                records.append(stats)
        self.schedule.step += 1
        metrics = {key: sum(r[key] for r in records) / len(records) for key in records[0]}
        metrics["critic/lr"] = lr
        return metrics

    def accumulate_gradients(
        self,
        mini: Batch,
        *,
        micro_batch_size: int,
        cliprange_value: float,
        loss_agg_mode: str,
        max_response_length: int | None = None,
        max_token_len: int | None = None,
        where: str = "",
    ) -> dict[str, float]:
        """Forward and backward over one mini-batch into `.grad`, micro-batch by micro-batch
        (`micro_batch_rows` order); returns its `critic/vf_loss` and `critic/vf_clipfrac`."""
        check_positive(micro_batch_size=micro_batch_size)
        norms = mini_batch_norms(mini, max_response_length)
        totals = {"critic/vf_loss": 0.0, "critic/vf_clipfrac": 0.0}
        stats = []
        for k, rows in enumerate(micro_batch_rows(mini, micro_batch_size, max_token_len)):
            vf_loss, micro_stats = self.micro_batch_loss(take(mini, rows), norms, cliprange_value=cliprange_value,
                                                         loss_agg_mode=loss_agg_mode)
            check_finite_loss(vf_loss, self.optimizer, f"{where}, micro-batch {k}")
            vf_loss.backward()
            stats.append(micro_stats)
        for micro_stats in read_stats(stats):
            for key, value in micro_stats.items():
                totals[key] += value
        return totals

    def micro_batch_loss(
        self, micro: Batch, norms: dict[str, Any], *, cliprange_value: float, loss_agg_mode: str
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(differentiable value loss, stats) of one micro-batch, as its share of the
        mini-batch whose `norms` (`policy.mini_batch_norms`) are given; the stats are 0-dim
        tensors, as the policy's (`policy.read_stats`)."""
        micro = trim_padding(micro)
        mask = micro["response_mask"].to(torch.float32)
        vf_loss, clipfrac = value_loss(
            self._values(micro), micro["values"].float(), micro["returns"].float(), mask,
            cliprange_value, loss_agg_mode, **norms,
        )
        share = mask.sum() / norms["global_num_tokens"].clamp(min=1)
        return vf_loss, {"critic/vf_loss": vf_loss.detach(), "critic/vf_clipfrac": (clipfrac * share).detach()}

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer", "scheduler"}: live tensors, as torch's state_dict."""
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.schedule.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.schedule.load_state_dict(state["scheduler"])

    def determinism_info(self) -> dict[str, Any]:
        """This worker's determinism mode, for the run's determinism report."""
        first = next(self.model.parameters())
        return model_part_info(backend="torch", batch_invariant=self.batch_invariant, dtype=first.dtype,
                               kernels=self.model.kernels.name, device=first.device)
