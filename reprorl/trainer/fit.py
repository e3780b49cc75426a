"""The fit loop: prompts -> one rollout call -> rewards -> log-probs -> advantages -> updates.

One training step, in the order of docs/design.md:

    batch of prompts (uid per prompt) -> repeat n, interleaved (ReMax: + one greedy row
    per prompt, same call) -> rollout -> reward (with dynamic sampling: until enough groups
    vary, dynamic_sampling.py) -> old log-probs -> ref log-probs ->
    values (gae) -> KL (in reward or as a loss) -> advantages -> critic update -> actor
    update -> push weights to the replicas (versioned; device to device to the replicas on
    the actor's GPU: weight_sync.py) -> metrics, validation, checkpoint

Actor, reference and critic are worker groups of `trainer.num_workers` Ray processes each
(reprorl/workers: the same bits for every allowed count); rollout and reward-model
replicas are Ray actors too. Every reduction over the batch runs in sample order, and every random draw
comes from a seed named by its origin, so a run is a pure function of its config.

Start-up: the Trainer starts the processes of all those parts at once and then waits for
each (`parts.start_parts`, which builds every part from the config); if one fails, it
stops the others before the error propagates. Checkpoints and resuming: saving.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import json
import logging
import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from reprorl import algos
from reprorl.agent_loop.manager import DO_SAMPLE
from reprorl.config import Config, config_to_yaml
from reprorl.data.dataset import PromptDataset, PromptSampler
from reprorl.determinism import determinism_env, enable_full_determinism
from reprorl.determinism_report import build_report, format_report, write_report
from reprorl.errors import ConfigError, DeterminismError
from reprorl.fingerprint import FingerprintWriter
from reprorl.models.hf_io import load_tokenizer
from reprorl.models.lora import spec_from_config
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardFnError, RewardTimeoutError
from reprorl.rollout.pool import init_ray
from reprorl.supervision import FaultError, PartTimeoutError, Restarts
from reprorl.trainer import saving, weight_sync
from reprorl.trainer.dynamic_sampling import FilterGroupsError, GroupFilter
from reprorl.trainer.checks import check_models, check_paths, check_train_set_size
from reprorl.trainer.memory import check_gpu_memory, gpu_total_bytes
from reprorl.trainer.placement import uses_kl
from reprorl.trainer.parts import (
    chat_template_kwargs,
    make_datasets,
    make_kl_controller,
    plan_run_placement,
    policy_loss_args,
    start_parts,
)
from reprorl.trainer.resume_guard import plan_resume
from reprorl.trainer.run_dir import lock_run_dir
from reprorl.trainer.tracking import CURVES_FILE, GENERATIONS_FILE, METRICS_FILE, Tracker, plot_curves, read_metrics
from reprorl.trainer.val_metrics import per_source_metrics
from reprorl.workers.group import WorkerError
from reprorl.workers.optim import NonFiniteError
from reprorl.workers.policy import mask_truncated

logger = logging.getLogger(__name__)

TEST_KILL_AT_STEP_ENV = "REPRORL_TEST_KILL_AT_STEP"
"""A test hook, not a setting: with it set to N, `fit` SIGKILLs its own process at the end of
step N, right after the step's metrics and checkpoint are written, so a crash-and-resume
test kills the run at a known point (tests/trainer/test_fit.py) instead of racing it."""

TEST_KILL_IN_FILL_ENV = "REPRORL_TEST_KILL_IN_FILL"
"""A test hook like `TEST_KILL_AT_STEP_ENV`: with it set to "S:K" and
`algorithm.filter_groups` on, the trainer SIGKILLs its own process when step S, its batch
not yet full, is about to draw generation batch K (K >= 1), so a test kills a run in the
middle of filling a batch (tests/trainer/test_dynamic_sampling.py)."""


def length_metrics(batch: Batch) -> dict[str, float]:
    """The length metrics verl reports, of a rollout batch.

    `response_length/mean`, `/max`, `/min`: model tokens per response (`response_mask`);
    `response_length/clip_ratio`: the share of responses that ran out of budget (finish
    reason "length": rollout.max_tokens, or a tool turn that did not fit);
    `prompt_length/mean`, `/max`: prompt tokens, padding left out.
    """
    response = batch["response_mask"].sum(-1).float()  # [B]
    prompt = batch["attention_mask"][:, : batch["prompts"].shape[1]].sum(-1).float()  # [B]
    reasons = list(batch.non_tensors["finish_reason"])
    return {
        "response_length/mean": response.mean().item(),
        "response_length/max": response.max().item(),
        "response_length/min": response.min().item(),
        "response_length/clip_ratio": sum(r == "length" for r in reasons) / len(reasons),
        "prompt_length/mean": prompt.mean().item(),
        "prompt_length/max": prompt.max().item(),
    }


def _test_kill_step() -> int | None:
    """The step `TEST_KILL_AT_STEP_ENV` names, or None when it is unset."""
    value = os.environ.get(TEST_KILL_AT_STEP_ENV)
    if value is None:
        return None
    if not value.isdigit():
        raise ConfigError(f"{TEST_KILL_AT_STEP_ENV}={value!r}: expected a step number (a test hook; unset it)")
    return int(value)


def _test_kill_in_fill() -> tuple[int, int] | None:
    """The (step, generation batch) `TEST_KILL_IN_FILL_ENV` names, or None when it is unset."""
    value = os.environ.get(TEST_KILL_IN_FILL_ENV)
    if value is None:
        return None
    step, _, batch = value.partition(":")
    if not (step.isdigit() and batch.isdigit() and int(batch) >= 1):
        raise ConfigError(f"{TEST_KILL_IN_FILL_ENV}={value!r}: expected STEP:K, K >= 1 (a test hook; unset it)")
    return int(step), int(batch)


def _require_finite(batch: Batch, keys: tuple[str, ...]) -> None:
    """Raise `NonFiniteError` naming the first of `keys` (those in `batch`) that holds NaN
    or an infinity, and its samples: a clearer cause than the NaN loss it would become."""
    for key in keys:
        if key in batch:
            rows = (~torch.isfinite(batch[key])).flatten(1).any(-1).nonzero().flatten().tolist()  # [B, R] -> rows
            if rows:
                raise NonFiniteError(
                    f"{key} not finite in samples {rows[:8]} of {len(batch)} (diverged weights? check the "
                    "learning rates); optimizer not stepped"
                )


def engine_log_probs_exact(cfg: Config) -> bool:
    """The engine's log-probs are the trainer's bit for bit by construction: the built-in
    engine under full determinism (docs/design.md, contract point 2)."""
    return cfg.full_determinism and cfg.rollout.backend == "native"


def old_log_probs_from_rollout(cfg: Config) -> bool:
    """Whether the loss's old log-probs are the engine's (`actor.old_log_probs`); `auto` takes
    them where they are exact, which saves the trainer a forward pass over the batch a step."""
    if cfg.actor.old_log_probs == "auto":
        return engine_log_probs_exact(cfg)
    return cfg.actor.old_log_probs == "rollout"


class Trainer:
    """Builds every part of a run from its config (parts.py) and runs `fit()`.

    Parts take plain arguments; parts.py and this class are the places that read the
    config. The fit loop reaches the actor, reference and critic only through their
    methods, so a worker group with the same methods can stand in for a worker.
    """

    def __init__(self, cfg: Config) -> None:
        check_paths(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        check_models(cfg, self.tokenizer)
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.run_dir)
        # Held until close(): a second run here would delete this one's checkpoint in progress.
        self._run_lock = lock_run_dir(self.run_dir)
        try:
            self._start_run()
        except BaseException:
            self._run_lock.release()
            raise

    def _start_run(self) -> None:
        """Everything a run does once its directory is this process's: decide where it
        starts (refusing before anything there changes), record that, build every part."""
        cfg = self.cfg
        self.resume_plan = plan_resume(cfg, self.run_dir)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
        saving.record_start(self.run_dir, self.resume_plan, cfg.trainer.allow_changed_keys)
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        else:
            torch.manual_seed(cfg.seed)  # weight init of fresh heads only; sampling seeds are per request

        lora = spec_from_config(cfg.model, cfg.seed)  # None: full fine-tuning
        template_kwargs = chat_template_kwargs(cfg.data, cfg.rollout)
        self.train_set, self.val_set = make_datasets(cfg.data, cfg.reward, self.tokenizer, template_kwargs)
        self.placement = plan_run_placement(cfg, lora)
        if self.placement.device == "cuda":  # every part shares one GPU: refuse a run that cannot fit it
            check_gpu_memory(cfg, gpu_total_bytes())
        check_train_set_size(cfg, len(self.train_set))
        self.sampler = PromptSampler(len(self.train_set), cfg.data.train_batch_size, cfg.seed, shuffle=cfg.data.shuffle)
        self.loss_args = policy_loss_args(cfg.actor)
        self.kl_ctrl = make_kl_controller(cfg.algorithm.kl_ctrl)
        self.restarts = Restarts(cfg.trainer.max_restarts)  # shared by both pools and the agent loop
        # The run's records are opened in `fit`, after `saving.resume` has cut them to its step.
        self.tracker: Tracker | None = None
        self.fingerprints: FingerprintWriter | None = None
        self.step = 0
        self._first_step = 1  # the first step this process trains (`fit` sets it past a resumed checkpoint)
        self._owns_ray = not ray.is_initialized()  # a caller's Ray (tests, a cluster) stays up
        init_ray()
        try:  # the parts started before one that fails are stopped by start_parts
            self.parts = start_parts(cfg, placement=self.placement, lora=lora, restarts=self.restarts,
                                     template_kwargs=template_kwargs)
        except BaseException:
            self._stop_ray()
            raise

    # ------------------------------------------------------------------ batches

    def _prompt_batch(self, dataset: PromptDataset, positions: list[int], *, step: int, validate: bool,
                      gen_batch: int = 0) -> Batch:
        """One row per prompt, with its identity (`uid`; `.g<k>` in generation batch k >= 1
        of dynamic sampling) and what the reward needs."""
        rows = [dataset[i] for i in positions]
        prefix = "val" if validate else "train"
        suffix = f".g{gen_batch}" if gen_batch else ""
        return Batch(
            non_tensors={
                "uid": [f"{prefix}-{row.index}{suffix}" for row in rows],
                "prompt_ids": [list(row.prompt_ids) for row in rows],
                "raw_prompt": [row.messages for row in rows],
                "data_source": [row.data_source for row in rows],
                "ground_truth": [row.ground_truth for row in rows],
                "extra_info": [row.extra_info for row in rows],
            },
            meta={"step": step, "validate": validate},
        )

    @staticmethod
    def _repeat(prompts: Batch, n: int) -> Batch:
        """n copies of each prompt, interleaved (a a b b), each with its `repeat_index`."""
        repeated = prompts.repeat(n, interleave=True)
        repeated["repeat_index"] = [j for _ in range(len(prompts)) for j in range(n)]
        return repeated

    def _rollout_batch(self, prompts: Batch) -> tuple[Batch, int]:
        """The rows of the step's ONE rollout call, and how many of them are sampled.

        ReMax appends one greedy row per prompt (`DO_SAMPLE` False); the agent loop
        gives those rows greedy params, and they are split off after the call.
        """
        n = self.cfg.rollout.n
        sampled = self._repeat(prompts, n)
        if not algos.estimator(self.cfg.algorithm.adv_estimator).greedy_baseline:
            return sampled, len(sampled)
        baseline = prompts.slice(0, len(prompts))
        baseline["repeat_index"] = [n] * len(prompts)  # an identity apart from the n samples
        sampled[DO_SAMPLE] = [True] * len(sampled)
        baseline[DO_SAMPLE] = [False] * len(baseline)
        return Batch.concat([sampled, baseline]), len(sampled)

    # ------------------------------------------------------------------ one step

    def train_step(self, step: int, positions: list[int]) -> dict[str, float]:
        """One training step on the prompts at `positions` (with `algorithm.filter_groups`, and
        on as many of the sampler's next batches as it takes to fill the batch); returns its metrics."""
        metrics: dict[str, float] = {}
        t_step = time.perf_counter()
        if self.cfg.algorithm.filter_groups.enable:
            batch, scores, reward_baselines = self._filled_batch(step, positions, metrics)
        else:
            batch, scores, _, reward_baselines = self._generation_batch(step, positions, metrics)
        mask = batch["response_mask"].float()
        self._log_probs_and_values(batch, mask, metrics)
        token_rewards = self._token_rewards(batch, scores, mask, metrics)
        advantages, returns = self._advantages(batch, token_rewards, mask, reward_baselines)
        batch["advantages"] = advantages
        batch["returns"] = returns
        _require_finite(batch, ("old_log_probs", "ref_log_probs", "values", "advantages", "returns"))
        weight_digests = self._update(step, batch, metrics)

        metrics["reward/mean"] = scores.mean().item()
        metrics["reward/std"] = scores.std(unbiased=False).item()
        metrics.update(length_metrics(batch))
        metrics["advantages/mean"] = algos.masked_mean(advantages, mask).item()
        metrics["timing/step_s"] = time.perf_counter() - t_step
        metrics["throughput/tokens_per_s"] = mask.sum().item() / max(metrics["timing/gen_s"], 1e-9)
        if self.cfg.trainer.log_generations:
            self._log_generations(step, "train", batch, scores)
        self._write_fingerprint(step, batch, scores, metrics, weight_digests)
        return metrics

    def _generation_batch(self, step: int, positions: list[int], metrics: dict[str, float], gen_batch: int = 0
                          ) -> tuple[Batch, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The prompts at `positions` rolled out and scored: (sampled rows, scores `[B*n]`,
        rule scores `[B*n]` or None, ReMax's baseline rewards `[B*n]` or None)."""
        batch, baseline = self._generate(step, positions, metrics, gen_batch)
        scores, rule, reward_baselines = self._score(batch, baseline, metrics)
        return batch, scores, rule, reward_baselines

    def _filled_batch(self, step: int, positions: list[int], metrics: dict[str, float]
                      ) -> tuple[Batch, torch.Tensor, torch.Tensor | None]:
        """DAPO's dynamic sampling: generation batches, the first at `positions`, the next
        from the sampler, until `data.train_batch_size` groups vary (dynamic_sampling.py);
        returns the step's (batch, scores, ReMax baselines) as `_generation_batch` does."""
        groups_cfg = self.cfg.algorithm.filter_groups
        groups = GroupFilter(groups_cfg.metric, self.cfg.rollout.n, self.cfg.data.train_batch_size,
                             groups_cfg.max_num_gen_batches)
        kill_at = _test_kill_in_fill()
        for k in itertools.count():
            if k > 0:
                if kill_at == (step, k):
                    os.kill(os.getpid(), signal.SIGKILL)  # TEST_KILL_IN_FILL_ENV: between generation batches
                positions = next(self.sampler)
            batch_metrics: dict[str, float] = {}
            if groups.add(*self._generation_batch(step, positions, batch_metrics, gen_batch=k), batch_metrics):
                break
        batch, scores, reward_baselines, fill_metrics = groups.result()
        metrics.update(fill_metrics)
        return batch, scores, reward_baselines

    def _generate(self, step: int, positions: list[int], metrics: dict[str, float], gen_batch: int = 0
                  ) -> tuple[Batch, Batch | None]:
        """One rollout call (the step's one, without dynamic sampling): (the sampled rows,
        ReMax's greedy rows or None)."""
        t0 = time.perf_counter()
        prompts = self._prompt_batch(self.train_set, positions, step=step, validate=False, gen_batch=gen_batch)
        calls_before = self.parts.agent.num_generate_sequences_calls
        rollout, num_sampled = self._rollout_batch(prompts)
        output = self.parts.agent.generate_sequences(rollout)
        metrics["rollout/num_generate_calls"] = self.parts.agent.num_generate_sequences_calls - calls_before
        metrics["rollout/turns_mean"] = float(sum(output.non_tensors["num_turns"]) / len(output))  # > 1: tool turns ran
        batch = output.slice(0, num_sampled)
        baseline = output.slice(num_sampled, len(output)) if num_sampled < len(output) else None
        if baseline is not None:
            batch.pop(non_tensor_keys=[DO_SAMPLE])
        metrics["timing/gen_s"] = time.perf_counter() - t0
        return batch, baseline

    def _score(
        self, batch: Batch, baseline: Batch | None, metrics: dict[str, float]
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """(scores `[B*n]`, rule scores `[B*n]` or None, ReMax's baseline reward of each
        sample's prompt `[B*n]` or None)."""
        t0 = time.perf_counter()
        rewards = self.parts.reward_loop.compute(batch, self.tokenizer)  # [B*n]
        scores, rule = rewards.scores, rewards.rule
        metrics.update(rewards.metrics)
        reward_baselines = None
        if baseline is not None:
            # ReMax's baseline is the greedy response's reward only, without the KL penalty
            # (as in the paper and verl): the KL term belongs to the sampled trajectory.
            baseline_scores = self.parts.reward_loop.compute(baseline, self.tokenizer).scores  # [B]
            metrics["reward/baseline_mean"] = baseline_scores.mean().item()
            reward_baselines = baseline_scores.repeat_interleave(self.cfg.rollout.n)  # [B*n]: row i is prompt i // n
        metrics["timing/reward_s"] = time.perf_counter() - t0
        return scores, rule, reward_baselines

    def _log_probs_and_values(self, batch: Batch, mask: torch.Tensor, metrics: dict[str, float]) -> None:
        """Add `old_log_probs`, and `ref_log_probs` and `values` where those workers exist, to `batch`."""
        cfg = self.cfg
        t0 = time.perf_counter()
        temperature = cfg.rollout.temperature
        micro = {"micro_batch_size": cfg.actor.ppo_micro_batch_size,
                 "max_token_len": cfg.actor.ppo_max_token_len_per_micro_batch}  # the reference's too
        from_rollout = old_log_probs_from_rollout(cfg)
        if not from_rollout or self._log_prob_check_due():
            trainer_log_probs = self.parts.actor.compute_log_probs(batch, temperature=temperature, **micro)
            # 0 when the engine's log-probs equal the trainer's bit for bit (batch-invariant paths).
            gap = (batch["rollout_log_probs"] - trainer_log_probs).abs() * mask
            metrics["rollout/log_prob_max_gap"] = gap.max().item()
            self._check_log_prob_gap(metrics["rollout/log_prob_max_gap"], batch["rollout_log_probs"], trainer_log_probs,
                                     from_rollout)
        # From the rollout: the trainer's bits under full determinism (checked on the check steps).
        batch["old_log_probs"] = batch["rollout_log_probs"].clone() if from_rollout else trainer_log_probs
        if uses_kl(cfg.actor, cfg.algorithm):  # the ref group, or with LoRA the actor with its adapters off
            ref = self.parts.ref if self.parts.ref is not None else self.parts.actor
            batch["ref_log_probs"] = ref.compute_log_probs(batch, temperature=temperature, base=self.parts.ref is None,
                                                           **micro)
        if self.parts.critic is not None:
            batch["values"] = self.parts.critic.compute_values(
                batch, micro_batch_size=cfg.critic.ppo_micro_batch_size,
                max_token_len=cfg.critic.ppo_max_token_len_per_micro_batch)
        metrics["timing/old_log_prob_s"] = time.perf_counter() - t0

    def _log_prob_check_due(self) -> bool:
        """With old log-probs from the rollout: whether this step recomputes them to check
        (`actor.log_prob_check_freq`, and the first step this process trains)."""
        freq = self.cfg.actor.log_prob_check_freq
        return self.step == self._first_step or (freq > 0 and self.step % freq == 0)

    def _check_log_prob_gap(self, gap: float, rollout: torch.Tensor, trainer: torch.Tensor, exact: bool) -> None:
        """Under full determinism the built-in engine's log-probs ARE the trainer's (docs/design.md,
        contract point 2): a gap means a kernel or the engine broke that, and every step
        after it would train on a mismatch, so the run stops here. vLLM's kernels are not
        ours: its gap is only reported. A gap that is not finite is left to `_require_finite`,
        which names the non-finite log-probs (diverged weights) right after. `exact`: the
        run takes the engine's log-probs for the trainer's, so they must match in every bit,
        the sign of a zero included (a gap of 0 does not show -0.0 against 0.0)."""
        promised = engine_log_probs_exact(self.cfg)
        if promised and exact and gap == 0.0 and not torch.equal(rollout.view(torch.int32), trainer.view(torch.int32)):
            raise DeterminismError(
                f"step {self.step}: the engine's log-probs equal the trainer's in value but not in every bit (a zero's "
                "sign) with actor.old_log_probs taking the engine's; set actor.old_log_probs=recompute"
            )
        if math.isfinite(gap) and gap != 0.0 and promised:
            raise DeterminismError(
                f"step {self.step}: the engine's log-probs differ from the trainer's by up to {gap:.3g} "
                "(rollout/log_prob_max_gap) with full_determinism=true and rollout.backend=native, where they are "
                "equal bit for bit by construction; the run stops (set full_determinism=false to run without the "
                "promise)"
            )

    def _token_rewards(
        self, batch: Batch, scores: torch.Tensor, mask: torch.Tensor, metrics: dict[str, float]
    ) -> torch.Tensor:
        """`[B*n, R]`: each score at its sample's last token, minus the KL penalty when it is in the reward."""
        token_scores = algos.scores_to_token_rewards(scores, mask)  # [B*n, R]
        if not self.cfg.algorithm.use_kl_in_reward:
            return token_scores
        kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], self.cfg.algorithm.kl_penalty)
        token_rewards, mean_kl = algos.apply_kl_to_rewards(token_scores, kl, self.kl_ctrl.value, mask)
        metrics["actor/reward_kl_penalty"] = mean_kl.item()
        metrics["actor/reward_kl_coef"] = self.kl_ctrl.value
        self.kl_ctrl.update(mean_kl.item(), n_steps=len(batch))
        return token_rewards

    def _update(self, step: int, batch: Batch, metrics: dict[str, float]) -> dict[str, str]:
        """Critic update, actor update, then the new weights to the replicas as version `step`;
        returns their per-parameter digests (computed by the actor: the weights stay there)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t0 = time.perf_counter()
        # Sharing one GPU: the engines give back their KV cache (and, unless the new weights
        # come device to device, their weights) while the trainer updates, and take them
        # back once the new weights are in (reprorl/trainer/weight_sync.py).
        on_gpu = self.placement.device == "cuda"
        on_device = weight_sync.device_replicas(self.parts.actor, self.parts.pool) if on_gpu else []
        if on_gpu:
            self.parts.pool.sleep(keep_weights=bool(on_device))
        if self.parts.critic is not None:
            metrics.update(self.parts.critic.update(
                batch, ppo_epochs=cfg.critic.ppo_epochs, mini_batch_size=cfg.critic.ppo_mini_batch_size * n,
                micro_batch_size=cfg.critic.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
                max_token_len=cfg.critic.ppo_max_token_len_per_micro_batch,
                cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic.loss_agg_mode,
            ))
        actor_batch = batch
        if cfg.actor.mask_truncated:  # a shallow copy: the critic and the fingerprint keep the real mask
            actor_batch = batch.slice(0, len(batch))
            actor_batch["response_mask"] = mask_truncated(batch["response_mask"], batch.non_tensors["finish_reason"])
        metrics.update(self.parts.actor.update(
            actor_batch, ppo_epochs=cfg.actor.ppo_epochs, mini_batch_size=cfg.actor.ppo_mini_batch_size * n,
            micro_batch_size=cfg.actor.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
            max_token_len=cfg.actor.ppo_max_token_len_per_micro_batch, loss=self.loss_args,
            temperature=cfg.rollout.temperature,
        ))
        t_sync = time.perf_counter()
        weight_sync.push_weights(self.parts.actor, self.parts.pool, step, on_device)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t_sync
        if on_gpu:
            self.parts.pool.wake_up()
        metrics["timing/update_s"] = time.perf_counter() - t0
        return self.parts.actor.weight_digests()

    def _write_fingerprint(self, step: int, batch: Batch, scores: torch.Tensor, metrics: dict[str, float],
                           weight_digests: dict[str, str]) -> None:
        """The step's fingerprint record: digests of what it computed and of the new weights."""
        self.fingerprints.write(
            step,
            fields={
                "prompts": batch["prompts"], "responses": batch["responses"],
                "rollout_log_probs": batch["rollout_log_probs"], "rewards": scores,
                "old_log_probs": batch["old_log_probs"], "advantages": batch["advantages"],
                **({"ref_log_probs": batch["ref_log_probs"]} if "ref_log_probs" in batch else {}),
                **({"values": batch["values"]} if self.parts.critic is not None else {}),
                "losses": torch.tensor([metrics[k] for k in sorted(metrics) if k.endswith("_loss")], dtype=torch.float64),
                "grad_norms": torch.tensor(
                    [metrics[k] for k in sorted(metrics) if k.endswith("grad_norm")], dtype=torch.float64
                ),
            },
            param_digests=weight_digests,
        )

    def _advantages(
        self, batch: Batch, token_rewards: torch.Tensor, mask: torch.Tensor, reward_baselines: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) `[B*n, R]` for the configured estimator."""
        algo = self.cfg.algorithm
        est = algos.estimator(algo.adv_estimator)
        return est.advantages(algos.AdvantageInputs(
            token_rewards, mask, batch.non_tensors["uid"], algo.gamma, algo.lam, algo.norm_adv_by_std,
            values=batch["values"] if est.needs_critic else None, reward_baselines=reward_baselines,
        ))

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> dict[str, float]:
        """Roll out the whole validation set with the validation sampling params.

        `val/accuracy` is the share of samples whose rule reward is full credit (>= 1.0),
        absent when the rule function does not run (a reward model alone, rule_weight 0);
        `val/reward_mean` is the mean of the final reward (rule and model, weighted); and
        per data source, over the `rollout.val.n` samples of each prompt, `val_metrics`'s.
        `trainer.log_generations` = K writes the first K samples to generations.jsonl.
        """
        cfg = self.cfg
        if self.val_set is None:  # data.val_files=[]
            return {}
        positions = list(range(len(self.val_set)))
        size = cfg.data.val_batch_size or len(positions)
        scores, correct, lengths, sources, uids, answers = [], [], [], [], [], []
        t0 = time.perf_counter()
        for start in range(0, len(positions), size):
            prompts = self._prompt_batch(self.val_set, positions[start : start + size], step=step, validate=True)
            output = self.parts.agent.generate_sequences(self._repeat(prompts, cfg.rollout.val.n))
            rewards = self.parts.reward_loop.compute(output, self.tokenizer)
            scores.append(rewards.scores)
            if rewards.rule is not None:
                correct.append((rewards.rule >= 1.0).float())
            answers += rewards.answers or [None] * len(rewards.scores)
            lengths.append(output["response_mask"].float().sum(-1))
            sources += list(output.non_tensors["data_source"])
            uids += list(output.non_tensors["uid"])
            if start == 0 and cfg.trainer.log_generations:
                self._log_generations(step, "val", output, rewards.scores)
        all_scores = torch.cat(scores)
        metrics = {
            "val/reward_mean": all_scores.mean().item(),
            "val/response_length_mean": torch.cat(lengths).mean().item(),
            "timing/val_s": time.perf_counter() - t0,
        }
        if correct:
            metrics["val/accuracy"] = torch.cat(correct).mean().item()
        metrics.update(per_source_metrics(sources, uids, all_scores, cfg.rollout.val.n,
                                          correct=torch.cat(correct) if correct else None,
                                          answers=answers if any(a is not None for a in answers) else None))
        return metrics

    def _log_generations(self, step: int, split: str, output: Batch, scores: torch.Tensor) -> None:
        """The first `trainer.log_generations` samples of the step's training batch or
        validation (`split`: "train" or "val"), as lines of generations.jsonl in the run
        directory (appended, durably), and as a table in TensorBoard and wandb."""
        lines = []
        for i in range(min(self.cfg.trainer.log_generations, len(output))):
            model_tokens = output["response_mask"][i].nonzero()
            length = int(model_tokens[-1]) + 1 if len(model_tokens) else 0  # tool turns between included
            response = output["responses"][i][:length].tolist()
            lines.append({
                "step": step, "split": split, "uid": output.non_tensors["uid"][i],
                "data_source": output.non_tensors["data_source"][i],
                "prompt": self.tokenizer.decode(list(output.non_tensors["prompt_ids"][i])),
                "response": self.tokenizer.decode(response), "reward": float(scores[i]),
            })
        with open(self.run_dir / GENERATIONS_FILE, "a", encoding="utf-8") as f:
            f.write("".join(json.dumps(line, sort_keys=True) + "\n" for line in lines))
            f.flush()
            os.fsync(f.fileno())
        if self.tracker is not None:
            self.tracker.log_generations(step, split, lines)

    # ------------------------------------------------------------------ determinism report

    def report_determinism(self, step: int) -> dict[str, Any]:
        """Ask every part for its determinism mode; write, log and return the report."""
        parts = self.parts
        infos: dict[str, dict[str, Any]] = {}
        for group in (parts.actor, parts.ref, parts.critic):
            if group is not None:
                infos.update(group.determinism_info())  # "actor worker 0", ...
        infos.update({f"rollout replica {i}": info for i, info in parts.pool.determinism_info().items()})
        if parts.reward_model is not None:
            infos.update({f"reward replica {i}": info for i, info in parts.reward_model.determinism_info().items()})
        infos.update({f"agent-loop worker {i}": info for i, info in parts.agent.determinism_info().items()})
        report = build_report(infos, full_determinism=self.cfg.full_determinism, seed=self.cfg.seed)
        report["started_at_step"] = step
        report["placement"] = self.placement.summary()
        write_report(self.run_dir, report)
        logger.info("%s", format_report(report))
        return report

    # ------------------------------------------------------------------ the loop

    def fit(self) -> Path:
        """Train from the resumed step to `trainer.total_steps`; returns the run directory.

        A NaN or infinity in a step raises `NonFiniteError` naming the step and where, and
        a rule reward past `reward.timeout_s` with full determinism `RewardTimeoutError`, one
        that fails on more than `reward.max_error_rate` of a batch `RewardFnError`;
        the step is not finished (no optimizer step for that mini-batch, no weights pushed,
        no metrics or checkpoint written), so the newest checkpoint is the one to resume from.
        A part that dies past `trainer.max_restarts` replacements raises `FaultError` alike.
        """
        from tqdm import tqdm

        cfg = self.cfg.trainer
        kill_at = _test_kill_step()
        parts = self.parts
        start = saving.resume(self.run_dir, self.resume_plan.checkpoint, actor=parts.actor, critic=parts.critic,
                              pool=parts.pool, sampler=self.sampler, kl_ctrl=self.kl_ctrl)
        self.tracker = Tracker(
            self.run_dir, cfg.loggers, project_name=cfg.project_name,
            experiment_name=cfg.experiment_name, config=dataclasses.asdict(self.cfg),
        )
        self.fingerprints = FingerprintWriter(self.run_dir)
        self.report_determinism(start)
        if start >= cfg.total_steps:
            logger.info("run in %s is already at step %d of %d: nothing to do", self.run_dir, start, cfg.total_steps)
            return self.run_dir
        if start == 0 and cfg.val_before_train and self.val_set is not None:
            with self._stop_note(0):
                self.tracker.log(0, self.validate(0))
        self._first_step = start + 1
        progress = tqdm(range(start + 1, cfg.total_steps + 1), initial=start, total=cfg.total_steps,
                        desc="train", unit="step", dynamic_ncols=True)
        for step in progress:
            self.step = step
            last = step == cfg.total_steps
            with self._stop_note(step):
                metrics = self.train_step(step, next(self.sampler))
                if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or last):
                    metrics.update(self.validate(step))
            restarts = self.restarts.pop_metrics()
            metrics.update(restarts)
            if any(restarts.values()):
                self.report_determinism(start)  # with the replacements, checked like the parts they replace
            self.tracker.log(step, metrics)
            progress.set_postfix(
                {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in ("reward/mean", "val/accuracy", "actor/pg_loss")
                 if k in metrics}
            )
            if cfg.save_freq > 0 and (step % cfg.save_freq == 0 or last):
                saving.save(self.run_dir, step, self.cfg, actor=parts.actor, critic=parts.critic,
                            sampler=self.sampler, kl_ctrl=self.kl_ctrl)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # TEST_KILL_AT_STEP_ENV: no close(), no flush
        return self.run_dir

    @contextlib.contextmanager
    def _stop_note(self, step: int) -> Iterator[None]:
        """Errors that stop a run in a step say which step, and where it can resume from."""
        try:
            yield
        except (NonFiniteError, RewardTimeoutError, RewardFnError, FaultError, WorkerError, PartTimeoutError,
                FilterGroupsError) as err:
            raise type(err)(f"step {step}: {err}; the run stopped. {saving.checkpoint_note(self.run_dir)}") from err

    def close(self) -> None:
        """Stop the replicas and workers, then close the loggers and draw the curves: the parts
        go first (a hung one's processes, CPUs and GPU memory at once), the records whatever they do."""
        try:
            self.parts.stop()
            self._stop_ray()
        finally:
            if self.tracker is not None:
                self.tracker.close()
            if self.fingerprints is not None:
                self.fingerprints.close()
            metrics_path = self.run_dir / METRICS_FILE
            if metrics_path.exists():
                plot_curves(read_metrics(metrics_path), self.run_dir / CURVES_FILE,
                            title=self.cfg.trainer.experiment_name)
            self._run_lock.release()  # last: the run directory is finished with

    def _stop_ray(self) -> None:
        """Stop Ray if this trainer started it."""
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()


def train(cfg: Config) -> Path:
    """Run the training job `cfg` describes; returns its run directory."""
    # Every process of the run, Ray's included, must see the same determinism environment:
    # set it here, before Ray starts, as well as in each actor's runtime_env.
    os.environ.update(determinism_env(cfg.seed, cfg.full_determinism))
    trainer = Trainer(cfg)
    try:
        return trainer.fit()
    finally:
        trainer.close()

