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
each (`Trainer._start_parts`); if one fails, it stops the others before the error
propagates.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
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
from reprorl.agent_loop.tools import select_tools, tool_schemas
from reprorl.agent_loop.manager import DO_SAMPLE, AgentLoopManager
from reprorl.config import Config, config_to_yaml, reward_fn_name
from reprorl.data.dataset import PromptDataset, PromptSampler
from reprorl.data.rewards import REWARD_FNS, check_ground_truth
from reprorl.determinism import determinism_env, enable_full_determinism
from reprorl.determinism_report import build_report, format_report, write_report
from reprorl.errors import ConfigError, DeterminismError
from reprorl.fingerprint import FingerprintWriter, truncate_fingerprints
from reprorl.models.hf_io import load_tokenizer
from reprorl.models.lora import spec_from_config
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardFnError, RewardLoop, RewardTimeoutError, WeightedFn
from reprorl.reward.user_fn import resolve_reward_fn
from reprorl.rollout.pool import init_ray, replica_cpus
from reprorl.rollout.replica import ReplicaPool
from reprorl.rollout.sampling import SamplingParams
from reprorl.rollout.supervision import FaultError, PartTimeoutError, Restarts
from reprorl.trainer import weight_sync
from reprorl.trainer.dynamic_sampling import FilterGroupsError, GroupFilter
from reprorl.trainer.checks import check_models, check_paths, check_train_set_size
from reprorl.trainer.checkpoint import (
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from reprorl.trainer.memory import check_gpu_memory, gpu_total_bytes
from reprorl.trainer.placement import Placement, plan_placement
from reprorl.trainer.resume_guard import flat_config, plan_resume
from reprorl.trainer.run_dir import append_history, lock_run_dir
from reprorl.trainer.tracking import (
    CURVES_FILE,
    GENERATIONS_FILE,
    METRICS_FILE,
    Tracker,
    plot_curves,
    read_metrics,
    truncate_metrics,
)
from reprorl.trainer.val_metrics import per_source_metrics
from reprorl.workers.group import WorkerError, WorkerGroup
from reprorl.workers.optim import NonFiniteError, OptimArgs
from reprorl.workers.policy import PolicyLossArgs, mask_truncated

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


def _optim_args(section: Any, total_steps: int) -> OptimArgs:
    return OptimArgs(
        lr=section.lr,
        betas=tuple(section.betas),
        weight_decay=section.weight_decay,
        warmup_steps=section.warmup_steps,
        lr_schedule=section.lr_schedule,
        total_steps=total_steps,
        grad_clip=section.grad_clip,
    )


def _sampling_params(temperature: float, top_p: float, top_k: int, max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=temperature, top_p=top_p, top_k=top_k, max_tokens=max_tokens)


def _vllm_options(ro: Any) -> dict[str, Any]:
    """The rollout section's vllm_* settings as `vllm_replica.engine_kwargs` names them."""
    return {"gpu_memory_utilization": ro.vllm_gpu_memory_utilization, "kv_cache_gib": ro.vllm_kv_cache_gib,
            "enforce_eager": ro.vllm_enforce_eager}


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


def _reward_fns(rw: Any) -> Any:
    """The rule function of `reward.fn`, or the `WeightedFn`s of `reward.fns`, resolved."""
    batch = rw.reward_manager == "batch"
    if not rw.fns:
        return resolve_reward_fn(rw.fn, batch)
    return [WeightedFn(reward_fn_name(e.fn), resolve_reward_fn(e.fn, batch), e.weight) for e in rw.fns]


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


class Trainer:
    """Builds every part of a run from its config and runs `fit()`.

    Parts take plain arguments; this class is the one place that reads the config. The fit
    loop reaches the actor, reference and critic only through their methods, so a worker
    group with the same methods can stand in for a worker.
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
        self._record_start()
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        else:
            torch.manual_seed(cfg.seed)  # weight init of fresh heads only; sampling seeds are per request

        self.lora = spec_from_config(cfg.model, cfg.seed)  # None: full fine-tuning
        self.train_set, self.val_set = self._make_datasets()
        self.placement = self._plan_placement()
        if self.placement.device == "cuda":  # every part shares one GPU: refuse a run that cannot fit it
            check_gpu_memory(cfg, gpu_total_bytes())
        check_train_set_size(cfg, len(self.train_set))
        self.sampler = PromptSampler(len(self.train_set), cfg.data.train_batch_size, cfg.seed, shuffle=cfg.data.shuffle)
        self.loss_args = self._policy_loss_args()
        self.kl_ctrl = self._make_kl_controller()
        self.restarts = Restarts(cfg.trainer.max_restarts)  # shared by both pools and the agent loop
        # The run's records are opened in `fit`, after `resume` has cut them to its step.
        self.tracker: Tracker | None = None
        self.fingerprints: FingerprintWriter | None = None
        self.step = 0
        self.actor: WorkerGroup | None = None
        self.ref = self.critic = None
        self.reward_model, self.reward_loop, self.pool, self.agent = None, None, None, None
        self._owns_ray = not ray.is_initialized()  # a caller's Ray (tests, a cluster) stays up
        init_ray()
        try:
            self._start_parts()
        except BaseException:
            self._stop_parts()  # a part that failed to start stops the others, not only itself
            raise

    # ------------------------------------------------------------------ parts

    def _start_parts(self) -> None:
        """Start the processes of every model part at once, then wait for each in turn.

        Each process imports torch (and Triton) and checks its kernels before it answers:
        one part after another, that was most of a short run. The waits go in the order the
        parts used to start (actor, ref, critic, reward model, rollout), so a part that fails
        raises the error it raised alone, naming the part and its rank or replica; the
        caller then stops the others (`_stop_parts`).
        """
        t0 = time.perf_counter()
        reward_fn = _reward_fns(self.cfg.reward)  # a bad reward.fn fails before any process starts
        reward_cpus, rollout_cpus = self._replica_cpus()
        # Each part is kept as soon as it exists, so that `_stop_parts` finds it if a later one fails.
        self._start_workers()
        self.reward_model = self._make_reward_model(reward_cpus)
        self.pool = self._make_rollout(rollout_cpus)
        self.reward_loop = self._make_reward_loop(reward_fn)  # its rule-reward process starts meanwhile
        for part in (self.actor, self.ref, self.critic, self.reward_model, self.pool):
            if part is not None:
                part.wait_ready()
        self.agent = self._make_agent()  # after the waits: a failing part's error comes first, as it did
        logger.info("started %s in %.1f s", self._parts_summary(), time.perf_counter() - t0)

    def _replica_cpus(self) -> tuple[float, float]:
        """Ray CPUs per (reward-model replica, rollout replica), counted as if the reward pool
        started first and the rollout pool took its share of what was left (`replica_cpus`):
        Ray counts a replica's CPUs only once it is placed, so pools that start together
        cannot ask Ray what the other one took. The worker groups ask for none."""
        cfg = self.cfg
        free = ray.available_resources().get("CPU", 0.0)
        reward_cpus = 0.0
        if cfg.reward.model_path is not None:
            reward_cpus = replica_cpus(cfg.reward.num_replicas, free)
            free -= cfg.reward.num_replicas * reward_cpus
        return reward_cpus, replica_cpus(cfg.rollout.num_replicas, free)

    def _parts_summary(self) -> str:
        """What started, e.g. "actor, ref, 1 reward replica(s), 2 rollout replica(s)"."""
        workers = self.cfg.trainer.num_workers
        names = [f"{g.role}" + (f" ({workers} workers)" if workers > 1 else "")
                 for g in (self.actor, self.ref, self.critic) if g is not None]
        if self.reward_model is not None:
            names.append(f"{len(self.reward_model.replicas)} reward replica(s)")
        names.append(f"{len(self.pool.replicas)} rollout replica(s)")
        return ", ".join(names)

    def _plan_placement(self) -> Placement:
        cfg = self.cfg
        workers = cfg.trainer.num_workers
        return plan_placement(
            cfg.resources.device, actor_workers=workers,
            ref_workers=workers if self._needs_ref_group() else 0,
            critic_workers=workers if cfg.algorithm.adv_estimator == "gae" else 0,
            rollout_replicas=cfg.rollout.num_replicas, rollout_share=cfg.resources.gpu_share_rollout,
            reward_replicas=cfg.reward.num_replicas if cfg.reward.model_path is not None else 0,
        )

    def _uses_kl(self) -> bool:
        """A KL term (in the loss or the reward) needs the reference policy's log-probs."""
        return self.cfg.actor.use_kl_loss or self.cfg.algorithm.use_kl_in_reward

    def _needs_ref_group(self) -> bool:
        """With LoRA the actor gives the reference log-probs (adapters off): no ref group."""
        return self._uses_kl() and self.lora is None

    def _make_datasets(self) -> tuple[PromptDataset, PromptDataset | None]:
        """(train set, validation set or None for `data.val_files=[]`)."""
        data, rw = self.cfg.data, self.cfg.reward
        # The built-in rule rewards know which sources and ground truths they can ever match: a
        # row that could only score 0 is an error naming it, before the run starts.
        specs = [entry.fn for entry in rw.fns] if rw.fns else [rw.fn]
        builtin_rules = None in specs and (rw.model_path is None or rw.rule_weight != 0)
        def dataset(files: list[str]) -> PromptDataset:
            return PromptDataset(files, self.tokenizer, data.max_prompt_length, overlong=data.overlong_prompts,
                                 prompt_key=data.prompt_key,
                                 check_ground_truth=check_ground_truth if builtin_rules else None,
                                 known_sources=REWARD_FNS if builtin_rules else None,
                                 template_kwargs=self._template_kwargs)

        return dataset(data.train_files), (dataset(data.val_files) if data.val_files else None)

    def _start_workers(self) -> None:
        """The actor, the reference (only for a KL term, and not with LoRA) and the critic
        (only for GAE), each a group of `trainer.num_workers` processes: started, not waited
        for. Each is kept as it is made, so that a later one's constructor raising leaves
        `_stop_parts` the earlier."""
        cfg = self.cfg
        total = cfg.trainer.total_steps
        common = {"num_workers": cfg.trainer.num_workers, "seed": cfg.seed, "full_determinism": cfg.full_determinism,
                  "dtype": cfg.model.dtype, "device": self.placement.device, "num_gpus": self.placement.worker_gpus,
                  "gradient_checkpointing": cfg.model.gradient_checkpointing,
                  "gpu_gradient_vectors": cfg.model.gpu_gradient_vectors, "wait": False,
                  "part_timeout_s": cfg.trainer.part_timeout_s}
        self.actor = WorkerGroup("actor", model_path=cfg.model.path, optim=_optim_args(cfg.actor, total),
                                 lora=self.lora, **common)
        if self._needs_ref_group():
            self.ref = WorkerGroup("ref", model_path=cfg.model.ref_path, optim=None, **common)
        if cfg.algorithm.adv_estimator == "gae":
            self.critic = WorkerGroup("critic", model_path=cfg.model.critic_path,
                                      optim=_optim_args(cfg.critic, total), **common)

    def _policy_loss_args(self) -> PolicyLossArgs:
        actor = self.cfg.actor
        return PolicyLossArgs(
            policy_loss=actor.policy_loss, clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode,
            entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
            kl_loss_type=actor.kl_loss_type, kl_loss_coef=actor.kl_loss_coef,
            cov=_cov_options(actor),
        )

    def _make_kl_controller(self) -> algos.FixedKLController | algos.AdaptiveKLController:
        kl = self.cfg.algorithm.kl_ctrl
        if kl.type == "adaptive":
            return algos.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
        return algos.FixedKLController(kl.kl_coef)

    def _make_reward_model(self, num_cpus_per_replica: float) -> Any:
        """The reward-model pool, started but not waited for; None without `reward.model_path`."""
        cfg, rw = self.cfg, self.cfg.reward
        if rw.model_path is None:
            return None
        from reprorl.reward.reward_model import RewardModelPool

        return RewardModelPool(
            rw.model_path, rw.num_replicas, seed=cfg.seed, full_determinism=cfg.full_determinism,
            max_num_seqs=rw.max_num_seqs, backend=rw.backend, vllm_options=_vllm_options(cfg.rollout),
            restarts=self.restarts, num_cpus_per_replica=num_cpus_per_replica, device=self.placement.device,
            dtype=cfg.model.dtype, num_gpus=self.placement.reward_gpus, wait=False,
            part_timeout_s=cfg.trainer.part_timeout_s,
        )

    def _make_reward_loop(self, reward_fn: Any) -> RewardLoop:
        """The reward loop: the rule function(s) `reward_fn` and the reward-model pool, weighted."""
        cfg, rw = self.cfg, self.cfg.reward
        buffer = rw.overlong_buffer
        return RewardLoop(reward_fn, self.reward_model, rule_weight=rw.rule_weight, model_weight=rw.model_weight,
                          batch=rw.reward_manager == "batch", timeout_s=rw.timeout_s,
                          timeout_is_error=cfg.full_determinism, max_error_rate=rw.max_error_rate,
                          start_timeout_s=cfg.trainer.part_timeout_s,
                          overlong_buffer=buffer.len if buffer.enable else None,
                          overlong_penalty_factor=buffer.penalty_factor, max_length=cfg.rollout.max_tokens)

    def _make_rollout(self, num_cpus_per_replica: float) -> ReplicaPool:
        """The rollout replica pool, started but not waited for."""
        cfg, ro, data = self.cfg, self.cfg.rollout, self.cfg.data
        return ReplicaPool(
            cfg.model.path, ro.num_replicas, seed=cfg.seed, full_determinism=cfg.full_determinism,
            max_num_seqs=ro.max_num_seqs, max_num_batched_tokens=ro.max_num_batched_tokens,
            max_model_len=data.max_prompt_length + data.max_response_length,  # within the model's: check_models
            backend=ro.backend, vllm_options=_vllm_options(ro), restarts=self.restarts,
            num_cpus_per_replica=num_cpus_per_replica, wait=False, part_timeout_s=cfg.trainer.part_timeout_s,
            device=self.placement.device, dtype=cfg.model.dtype, num_gpus=self.placement.rollout_gpus,
            native_options={"gpu_memory_utilization": ro.gpu_memory_utilization, "cuda_graphs": ro.cuda_graphs,
                            "prefix_sharing": ro.prefix_sharing, "lookahead": ro.lookahead, "lora": self.lora},
        )

    @functools.cached_property
    def _template_kwargs(self) -> dict[str, Any]:
        """The chat template's keywords beyond the messages: `data.apply_chat_template_kwargs`
        and the tool loop's tools, listed for the model as the template lists them (once: a
        tool file of the user's is executed to read its schemas)."""
        ro = self.cfg.rollout
        tools = {"tools": tool_schemas(select_tools(ro.tools))} if ro.agent_loop == "tool" else {}
        return {**self.cfg.data.apply_chat_template_kwargs, **tools}

    def _make_agent(self) -> AgentLoopManager:
        """The agent-loop manager that sends the rollout pool its requests."""
        cfg, ro, data = self.cfg, self.cfg.rollout, self.cfg.data
        val_temperature = ro.val.temperature if ro.val.do_sample else 0.0
        return AgentLoopManager(
            self.pool, ro.num_agent_workers, cfg.model.path,
            max_response_length=data.max_response_length,
            max_prompt_length=data.max_prompt_length,
            sampling_params=_sampling_params(ro.temperature, ro.top_p, ro.top_k, ro.max_tokens),
            val_sampling_params=_sampling_params(val_temperature, ro.val.top_p, ro.val.top_k, ro.max_tokens),
            agent=ro.agent_loop, max_turns=ro.max_turns, routing=ro.routing, tools=ro.tools,
            template_kwargs=self._template_kwargs,
            part_timeout_s=cfg.trainer.part_timeout_s,
        )

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
        if self.cfg.algorithm.adv_estimator != "remax":
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
        calls_before = self.agent.num_generate_sequences_calls
        rollout, num_sampled = self._rollout_batch(prompts)
        output = self.agent.generate_sequences(rollout)
        metrics["rollout/num_generate_calls"] = self.agent.num_generate_sequences_calls - calls_before
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
        rewards = self.reward_loop.compute(batch, self.tokenizer)  # [B*n]
        scores, rule = rewards.scores, rewards.rule
        metrics.update(rewards.metrics)
        reward_baselines = None
        if baseline is not None:
            # ReMax's baseline is the greedy response's reward only, without the KL penalty
            # (as in the paper and verl): the KL term belongs to the sampled trajectory.
            baseline_scores = self.reward_loop.compute(baseline, self.tokenizer).scores  # [B]
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
        batch["old_log_probs"] = self.actor.compute_log_probs(batch, temperature=temperature, **micro)
        if "rollout_log_probs" in batch:
            # 0 when the engine's log-probs equal the trainer's bit for bit (batch-invariant paths).
            gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask
            metrics["rollout/log_prob_max_gap"] = gap.max().item()
            self._check_log_prob_gap(metrics["rollout/log_prob_max_gap"])
        if self._uses_kl():  # the ref group, or with LoRA the actor with its adapters off
            ref = self.ref if self.ref is not None else self.actor
            batch["ref_log_probs"] = ref.compute_log_probs(batch, temperature=temperature, base=self.ref is None, **micro)
        if self.critic is not None:
            batch["values"] = self.critic.compute_values(
                batch, micro_batch_size=cfg.critic.ppo_micro_batch_size,
                max_token_len=cfg.critic.ppo_max_token_len_per_micro_batch)
        metrics["timing/old_log_prob_s"] = time.perf_counter() - t0

    def _check_log_prob_gap(self, gap: float) -> None:
        """Under full determinism the built-in engine's log-probs ARE the trainer's (docs/design.md,
        contract point 2): a gap means a kernel or the engine broke that, and every step
        after it would train on a mismatch, so the run stops here. vLLM's kernels are not
        ours: its gap is only reported. A gap that is not finite is left to `_require_finite`,
        which names the non-finite log-probs (diverged weights) right after."""
        if math.isfinite(gap) and gap != 0.0 and self.cfg.full_determinism and self.cfg.rollout.backend == "native":
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
        on_device = weight_sync.device_replicas(self.actor, self.pool) if on_gpu else []
        if on_gpu:
            self.pool.sleep(keep_weights=bool(on_device))
        if self.critic is not None:
            metrics.update(self.critic.update(
                batch, ppo_epochs=cfg.critic.ppo_epochs, mini_batch_size=cfg.critic.ppo_mini_batch_size * n,
                micro_batch_size=cfg.critic.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
                max_token_len=cfg.critic.ppo_max_token_len_per_micro_batch,
                cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic.loss_agg_mode,
            ))
        actor_batch = batch
        if cfg.actor.mask_truncated:  # a shallow copy: the critic and the fingerprint keep the real mask
            actor_batch = batch.slice(0, len(batch))
            actor_batch["response_mask"] = mask_truncated(batch["response_mask"], batch.non_tensors["finish_reason"])
        metrics.update(self.actor.update(
            actor_batch, ppo_epochs=cfg.actor.ppo_epochs, mini_batch_size=cfg.actor.ppo_mini_batch_size * n,
            micro_batch_size=cfg.actor.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
            max_token_len=cfg.actor.ppo_max_token_len_per_micro_batch, loss=self.loss_args,
            temperature=cfg.rollout.temperature,
        ))
        t_sync = time.perf_counter()
        weight_sync.push_weights(self.actor, self.pool, step, on_device)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t_sync
        if on_gpu:
            self.pool.wake_up()
        metrics["timing/update_s"] = time.perf_counter() - t0
        return self.actor.weight_digests()

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
                **({"values": batch["values"]} if self.critic is not None else {}),
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
        estimator = algo.adv_estimator
        if estimator == "gae":
            return algos.gae_advantages(token_rewards, batch["values"], mask, algo.gamma, algo.lam)
        if estimator == "remax":
            adv = algos.remax_advantages(token_rewards, reward_baselines, mask)
        elif estimator == "reinforce_pp":
            adv = algos.reinforce_pp_advantages(token_rewards, mask, algo.gamma)
        else:
            sequence_scores = token_rewards.sum(-1)  # [B*n]
            uids = list(batch.non_tensors["uid"])
            if estimator == "grpo":
                adv = algos.grpo_outcome_advantages(sequence_scores, mask, uids, norm_by_std=algo.norm_adv_by_std)
            elif estimator == "rloo":
                adv = algos.rloo_advantages(sequence_scores, mask, uids)
            else:
                adv = algos.reinforce_pp_baseline_advantages(sequence_scores, mask, uids)
        return adv, adv  # outcome estimators: the returns are the advantages (no critic)

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
            output = self.agent.generate_sequences(self._repeat(prompts, cfg.rollout.val.n))
            rewards = self.reward_loop.compute(output, self.tokenizer)
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

    # ------------------------------------------------------------------ checkpoints

    def _trained_groups(self) -> dict[str, WorkerGroup]:
        return {name: group for name, group in (("actor", self.actor), ("critic", self.critic)) if group is not None}

    def save(self, step: int) -> Path:
        """A checkpoint of the step: the driver's state, and each trained group's shards
        (`<name>.shards/`, one file a worker) written into the same atomic directory."""
        state: dict[str, Any] = {
            "trainer": {"step": step},
            "sampler": self.sampler.state_dict(),
            "kl_ctrl": self.kl_ctrl.state_dict(),
            "rng": capture_rng_state(),
        }
        groups = self._trained_groups()
        state.update({name: group.state_dict() for name, group in groups.items()})
        path = save_checkpoint(self.run_dir, step, state, max_to_keep=self.cfg.trainer.max_ckpt_to_keep,
                               write_dirs={f"{name}.shards": group.save for name, group in groups.items()},
                               meta={"config": flat_config(self.cfg)})  # what a resume checks its config against
        logger.info("saved checkpoint %s", path)
        return path

    def _checkpoint_note(self) -> str:
        """Where a stopped run can continue from: the newest checkpoint on disk, untouched."""
        ckpt = find_checkpoint(self.run_dir)
        if ckpt is None:
            return "No checkpoint was saved before it."
        return f"The newest checkpoint, {str(ckpt)!r}, is unchanged; trainer.resume=auto continues from it."

    def _record_start(self) -> None:
        """A line of history.jsonl: from which checkpoint the run starts, and its config changes."""
        plan, allowed = self.resume_plan, self.cfg.trainer.allow_changed_keys
        append_history(self.run_dir, {
            "event": "resume" if plan.checkpoint is not None else "start", "step": plan.step,
            "checkpoint": None if plan.checkpoint is None else str(plan.checkpoint),
            "changed": plan.changes, "accepted": [key for key in plan.changes if key in allowed],
        })

    def resume(self) -> int:
        """Restore the checkpoint `plan_resume` chose at start; returns its step (0 = fresh)."""
        ckpt = self.resume_plan.checkpoint
        if ckpt is None:
            # From the start: drop the records of an attempt that trained no step (plan_resume
            # refuses to start over where steps were trained), such as a validation at step 0.
            truncate_metrics(self.run_dir / METRICS_FILE, 0)
            truncate_metrics(self.run_dir / GENERATIONS_FILE, 0)
            truncate_fingerprints(self.run_dir, 0)
            return 0
        step, state = load_checkpoint(ckpt, verify=False)  # verified by plan_resume
        for name, group in self._trained_groups().items():
            group.load(ckpt / f"{name}.shards", state[name])  # shards of any number of workers
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        restore_rng_state(state["rng"])
        # Replicas start from model.path: give them the checkpoint's weights as its version.
        weight_sync.push_weights(self.actor, self.pool, step, weight_sync.device_replicas(self.actor, self.pool))
        truncate_metrics(self.run_dir / METRICS_FILE, step)
        truncate_metrics(self.run_dir / GENERATIONS_FILE, step)  # the same steps are validated again
        truncate_fingerprints(self.run_dir, step)
        logger.info("resumed from step %d (%s)", step, ckpt)
        return step

    # ------------------------------------------------------------------ determinism report

    def report_determinism(self, step: int) -> dict[str, Any]:
        """Ask every part for its determinism mode; write, log and return the report."""
        parts: dict[str, dict[str, Any]] = {}
        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                parts.update(group.determinism_info())  # "actor worker 0", ...
        parts.update({f"rollout replica {i}": info for i, info in self.pool.determinism_info().items()})
        if self.reward_model is not None:
            parts.update({f"reward replica {i}": info for i, info in self.reward_model.determinism_info().items()})
        parts.update({f"agent-loop worker {i}": info for i, info in self.agent.determinism_info().items()})
        report = build_report(parts, full_determinism=self.cfg.full_determinism, seed=self.cfg.seed)
        report["started_at_step"] = step
        report["placement"] = dataclasses.asdict(self.placement)
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
        start = self.resume()
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
                self.save(step)
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
            raise type(err)(f"step {step}: {err}; the run stopped. {self._checkpoint_note()}") from err

    def close(self) -> None:
        """Stop the replicas and workers, then close the loggers and draw the curves: the parts
        go first (a hung one's processes, CPUs and GPU memory at once), the records whatever they do."""
        try:
            self._stop_parts()
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

    def _stop_parts(self) -> None:
        """Stop every part that was started (all of them after `__init__`; fewer when a start
        failed), then Ray if this trainer started it."""
        if self.reward_loop is not None:
            self.reward_loop.close()
        if self.agent is not None:
            self.agent.shutdown()
        for part in (self.pool, self.actor, self.ref, self.critic, self.reward_model):
            if part is not None:
                part.shutdown()
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


def _cov_options(actor: Any) -> dict[str, float] | None:
    """The keywords of `actor.policy_loss` clip_cov or kl_cov (None for the other losses)."""
    if actor.policy_loss == "clip_cov":
        return {"clip_cov_ratio": actor.clip_cov_ratio, "clip_cov_lb": actor.clip_cov_lb,
                "clip_cov_ub": actor.clip_cov_ub}
    if actor.policy_loss == "kl_cov":
        return {"kl_cov_ratio": actor.kl_cov_ratio, "ppo_kl_coef": actor.ppo_kl_coef}
    return None
