"""The policy worker: the actor (trainable) or the reference model (frozen).

A worker is an object with plain methods that take and return `Batch`es and dicts, so a
multi-GPU worker group can replace it without changing the fit loop.

The batch it reads, in sample order (from the rollout):
- `input_ids`, `attention_mask`, `position_ids` `[B, P+R]`: left-padded prompt + right-
  padded response;
- `responses`, `response_mask` `[B, R]` (1 on tokens the policy generated);
- for `update`: `old_log_probs`, `advantages` `[B, R]`, and `ref_log_probs` `[B, R]` for
  the KL loss (or just the `actor/kl` metric when present).

Log-probs follow the engine's definition (reprorl/rollout/sampling.py): the log-prob of
response token j is `log_softmax(logits.float() / T)` at that token, where the logits are
those at position P-1+j (the position that predicts it), T the rollout temperature, and
T = 1 for greedy (temperature 0); the model's kernels compute them (`token_log_probs`,
on CUDA one fused pass over the logits). With `batch_invariant=True` the model runs on its
device's batch-invariant kernels (`reprorl.kernels`), so a sample's log-probs do not
depend on which micro-batch it sits in.

Each micro-batch drops the columns that are padding in all of its rows (`trim_padding`), so
it costs its own longest sample, not the batch's width. With a token budget
(`max_token_len`, micro_batches.py) the micro-batches are cut by padded tokens from
samples in length order instead of `micro_batch_size` samples in sample order; outputs
still come back in sample order.

One `update` call is one training step: `ppo_epochs` passes over the batch, each cut into
consecutive mini-batches of `mini_batch_size` samples (sample order, no shuffling; the last
may be smaller), one optimizer step per mini-batch. A mini-batch is cut into micro-batches
(of `micro_batch_size` samples, or by token budget) for gradient accumulation; each
micro-batch's loss is its share of the mini-batch loss (`agg_loss` with the mini-batch's
token and sequence counts), so the accumulated gradient equals that of the whole
mini-batch at once, whatever the micro-batches. The learning rate is stepped once per `update` (see optim.py).
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reprorl.algos import agg_loss, kl_penalty, policy_loss
from reprorl.determinism_report import model_part_info
from reprorl.kernels import select_kernels, verify_batch_invariance
from reprorl.models.hf_io import dtype_from_name, load_model, save_model
from reprorl.models.lora import LoraSpec, adapters_disabled
from reprorl.protocol import Batch
from reprorl.workers.micro_batches import in_sample_order, micro_batch_rows, rows_tensor, take
from reprorl.workers.optim import (
    LRSchedule,
    OptimArgs,
    check_finite_loss,
    guarded_step,
    make_adamw,
    set_lr,
)

# Files copied from the model directory next to exported weights: the tokenizer (and
# generation defaults), so the export is a complete HF model directory.
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
    "vocab.json", "merges.txt", "tokenizer.model", "chat_template.jinja", "chat_template.json",
    "generation_config.json",
)


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
    max_response_length: int | None = None
    """Divisor of "seq-mean-token-sum-norm" (data.max_response_length); None = the batch's R."""
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


class PolicyWorker:
    """The actor (`optim` given: trainable) or the reference policy (`optim=None`: frozen).

    `PolicyWorker(path, optim=OptimArgs(lr=1e-6, total_steps=100), batch_invariant=True)`;
    `device="cuda"` loads on the host, moves the model there and takes that device's kernels.
    """

    def __init__(
        self,
        model_path: str | os.PathLike,
        *,
        optim: OptimArgs | None = None,
        dtype: str | torch.dtype | None = None,
        batch_invariant: bool = False,
        name: str | None = None,
        device: str | torch.device = "cpu",
        lora: LoraSpec | None = None,
    ) -> None:
        self.model_path = Path(model_path)
        self.trainable = optim is not None
        self.name = name or ("actor" if self.trainable else "ref")
        self.batch_invariant = batch_invariant
        self.model, self.model_args = load_model(self.model_path, kind="causal_lm", dtype=dtype_from_name(dtype),
                                                 lora=lora)
        self.model.to(device)
        first = next(self.model.parameters())  # the kernels of the device it runs on
        self.model.kernels = select_kernels(first.device, batch_invariant)
        verify_batch_invariance(self.model.kernels, self.model_args, first.dtype, first.device)
        # reprorl's models have no dropout; eval() everywhere keeps the update's forward
        # identical to compute_log_probs' (the first mini-batch's ratio is exactly 1).
        self.model.eval()
        if lora is None or not self.trainable:  # with LoRA only the adapters train (load_model froze the rest)
            self.model.requires_grad_(self.trainable)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optim_args = optim
        self.optimizer = make_adamw(self.params, optim) if optim is not None else None
        self.schedule = (
            LRSchedule(optim.lr, optim.warmup_steps, optim.total_steps, optim.lr_schedule) if optim else None
        )

    # ---------------------------------------------------------------- forward

    def _response_log_probs(self, micro: Batch, temperature: float, with_entropy: bool = False
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(`[b, R]` log-probs of the response tokens, `[b, R]` entropy of each token's
        distribution or None), float32, differentiable. The model's kernels compute them
        (`token_log_probs`) with the engine's log-softmax arithmetic, or the rollout's and
        the trainer's log-probs part in the last bits."""
        hidden = self.model.hidden_states(micro["input_ids"], micro["attention_mask"], micro["position_ids"],
                                          position_bound=micro.meta.get(MAX_POSITION))
        # Only the positions that predict a response token go through the LM head (the same
        # rows' bits as the whole sequence's logits: each row of a linear is its own).
        r = micro["responses"].shape[1]
        logits = self.model.logits(hidden[:, -r - 1 : -1])  # [b, R, V]
        return self.model.kernels.token_log_probs(logits, micro["responses"], temperature, with_entropy)

    def compute_log_probs(
        self, batch: Batch, *, temperature: float, micro_batch_size: int, max_token_len: int | None = None,
        with_entropy: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Log-prob of every response token under this policy: `[B, R]` float32 in sample
        order, 0 where `response_mask` is 0; with `with_entropy`, also the entropy of each
        token's distribution `[B, R]`. Micro-batches of `micro_batch_size` in sample order,
        or by token budget with `max_token_len` (micro_batches.py); no grad."""
        check_positive(micro_batch_size=micro_batch_size)
        micros = micro_batch_rows(batch, micro_batch_size, max_token_len)
        parts = self.micro_batch_log_probs((take(batch, rows) for rows in micros), temperature=temperature,
                                           with_entropy=with_entropy)
        rows = rows_tensor(micros)
        if with_entropy:
            return tuple(in_sample_order(torch.cat([p[i] for p in parts]), rows) for i in range(2))
        return in_sample_order(torch.cat(parts), rows)

    def micro_batch_log_probs(
        self, micros: Iterable[Batch], *, temperature: float, with_entropy: bool = False, base: bool = False,
    ) -> list[torch.Tensor] | list[tuple[torch.Tensor, torch.Tensor]]:
        """Per micro-batch, its `[b, R]` log-probs (and entropies) as `compute_log_probs`
        gives them; each micro-batch is trimmed first (`trim_padding`), unless it was. No grad.
        `base`: the base model's, LoRA adapters switched off (the reference policy)."""
        out = []
        with torch.no_grad(), adapters_disabled(self.model) if base else contextlib.nullcontext():
            for micro in micros:
                micro = trim_padding(micro)
                width = micro.meta[RESPONSE_WIDTH]
                micro_log_probs, entropy = self._response_log_probs(micro, temperature, with_entropy)  # [b, R']
                mask = micro["response_mask"] > 0
                log_probs = pad_responses(torch.where(mask, micro_log_probs, 0.0), width)
                if with_entropy:
                    entropy = torch.where(mask, entropy, 0.0)
                    out.append((log_probs, pad_responses(entropy, width)))
                else:
                    out.append(log_probs)
        return out

    # ---------------------------------------------------------------- training

    def update(
        self,
        batch: Batch,
        loss: PolicyLossArgs,
        *,
        temperature: float,
        ppo_epochs: int,
        mini_batch_size: int,
        micro_batch_size: int,
        max_token_len: int | None = None,
    ) -> dict[str, float]:
        """One training step of PPO on `batch`; returns its metrics.

        `mini_batch_size` is in SAMPLES (verl's ppo_mini_batch_size in prompts times
        rollout.n); `max_token_len`: micro-batches by token budget (micro_batches.py), else
        of `micro_batch_size` samples. Metrics: `actor/pg_loss`, `actor/entropy` (the
        entropy term of the loss), `actor/kl` (the KL-loss term before its coefficient;
        present when the batch has `ref_log_probs`), `actor/pg_clipfrac`, `actor/ppo_kl`
        (token means), each exact
        per mini-batch whatever the micro-batch size, then the mean over the step's
        mini-batches in order; `actor/grad_norm` (before clipping, mean over mini-batches);
        `actor/lr`. A non-finite loss or gradient norm raises `NonFiniteError` naming the
        update (1-based: the trainer's step), epoch, mini-batch and micro-batch; the
        optimizer is not stepped for that mini-batch (earlier mini-batches of the update have
        been) nor the schedule advanced.
        """
        self._require_trainable("update")
        check_positive(ppo_epochs=ppo_epochs, mini_batch_size=mini_batch_size)
        if loss.use_kl_loss and "ref_log_probs" not in batch:
            raise ValueError(f"{self.name}: use_kl_loss needs 'ref_log_probs' in the batch; it has {batch.keys()}")
        lr = self.schedule.lr()
        set_lr(self.optimizer, lr)
        records = []
        for epoch in range(ppo_epochs):
            for m, mini in enumerate(batch.split(mini_batch_size)):
                # Updates count from 1, as the trainer's steps.
                where = f"{self.name} update {self.schedule.step + 1} (epoch {epoch}, mini-batch {m})"
                stats = self.accumulate_gradients(mini, loss, temperature=temperature,
                                                  micro_batch_size=micro_batch_size, max_token_len=max_token_len,
                                                  where=where)
                stats[f"{self.name}/grad_norm"] = guarded_step(
                    self.optimizer, self.params, self.optim_args.grad_clip, where
                )
                records.append(stats)
        self.schedule.step += 1
        metrics = {key: sum(r[key] for r in records) / len(records) for key in records[0]}
        metrics[f"{self.name}/lr"] = lr
        return metrics

    def accumulate_gradients(
        self, mini: Batch, loss: PolicyLossArgs, *, temperature: float, micro_batch_size: int,
        max_token_len: int | None = None, where: str = "",
    ) -> dict[str, float]:
        """Forward and backward over one mini-batch, micro-batch by micro-batch (in
        `micro_batch_rows` order), adding into the parameters' `.grad` (the optimizer step
        is the caller's). Returns the mini-batch's loss terms and token-mean stats (see `update`)."""
        check_positive(micro_batch_size=micro_batch_size)
        norms = mini_batch_norms(mini, loss.max_response_length)
        stats = []
        for k, rows in enumerate(micro_batch_rows(mini, micro_batch_size, max_token_len)):
            total, micro_stats = self.micro_batch_loss(take(mini, rows), norms, loss=loss, temperature=temperature)
            check_finite_loss(total, self.optimizer, f"{where}, micro-batch {k}")
            total.backward()
            stats.append(micro_stats)
        totals: dict[str, float] = {}
        for micro_stats in read_stats(stats):
            for key, value in micro_stats.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def micro_batch_loss(
        self, micro: Batch, norms: dict[str, Any], *, loss: PolicyLossArgs, temperature: float
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(differentiable loss, stats) of one micro-batch: its share of the loss of the
        mini-batch whose `norms` (`mini_batch_norms`) are given. The stats add up over a
        mini-batch's micro-batches, in order, to the mini-batch's (see `update`); they are
        0-dim tensors on the model's device (`read_stats` reads a mini-batch's at once: a
        read per micro-batch would stop the host from queueing the next one's kernels)."""
        micro = trim_padding(micro)
        mask = micro["response_mask"].to(torch.float32)  # [b, R']
        log_probs, token_entropy = self._response_log_probs(micro, temperature, with_entropy=True)  # [b, R]
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
        return total, {f"{self.name}/{key}": value.detach() for key, value in stats.items()}

    # ---------------------------------------------------------------- weights and state

    def named_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF parameter name, detached tensor) of every weight, to push to rollout replicas."""
        for name, p in self.model.named_parameters():
            yield name, p.detach()

    def save_hf(self, out_dir: str | os.PathLike) -> Path:
        """Export the current weights as a transformers-loadable directory (config.json,
        model.safetensors) plus the tokenizer files of the model path."""
        out = Path(out_dir)
        save_model(self.model, self.model_args, out)
        for name in TOKENIZER_FILES:
            if (self.model_path / name).is_file():
                shutil.copyfile(self.model_path / name, out / name)
        return out

    def state_dict(self) -> dict[str, Any]:
        """{"model", "optimizer", "scheduler"} (the model only for a reference). Tensors are
        the live ones, as torch's state_dict: save them before the next update."""
        state: dict[str, Any] = {"model": self.model.state_dict()}
        if self.trainable:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.schedule.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        if self.trainable:
            self.optimizer.load_state_dict(state["optimizer"])
            self.schedule.load_state_dict(state["scheduler"])

    def determinism_info(self) -> dict[str, Any]:
        """This worker's determinism mode, for the run's determinism report."""
        first = next(self.model.parameters())
        return model_part_info(backend="torch", batch_invariant=self.batch_invariant, dtype=first.dtype,
                               kernels=self.model.kernels.name, device=first.device)

    def _require_trainable(self, what: str) -> None:
        if not self.trainable:
            raise RuntimeError(f"{what}: the {self.name} worker is frozen (built without optim)")


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


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")
