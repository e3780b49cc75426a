"""The fit loop: prompts -> one rollout call -> rewards -> log-probs -> advantages -> updates.

One training step, in the order of DESIGN.md:

    batch of prompts (uid per prompt) -> repeat n, interleaved (ReMax: + one greedy row
    per prompt, same call) -> rollout -> reward -> old log-probs -> ref log-probs ->
    values (gae) -> KL (in reward or as a loss) -> advantages -> critic update -> actor
    update -> push weights to the replicas (versioned) -> metrics, validation, checkpoint

Actor, reference and critic are worker groups of `trainer.num_workers` Ray processes each
(reprorl/workers: the same bits for every allowed count); rollout and reward-model
replicas are Ray actors too. Every reduction over the batch runs in sample order, and every random draw
comes from a seed named by its origin, so a run is a pure function of its config.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoTokenizer

from reprorl import algos
from reprorl.config import Config, config_to_yaml
from reprorl.data.dataset import PromptDataset, PromptSampler
from reprorl.determinism import determinism_env, enable_full_determinism
from reprorl.determinism_report import build_report, format_report, write_report
from reprorl.errors import ConfigError
from reprorl.fingerprint import FingerprintWriter, truncate_fingerprints
from reprorl.models.arch import ModelArgs
from reprorl.models.hf_io import load_tokenizer
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardLoop, decode_responses
from reprorl.reward.user_fn import resolve_reward_fn
from reprorl.rollout.engine import eos_ids_from_dir
from reprorl.rollout.sampling import SamplingParams
from reprorl.trainer.checkpoint import (
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from reprorl.trainer.optim import NonFiniteError, OptimArgs
from reprorl.trainer.policy import PolicyLossArgs
from reprorl.workers.group import WorkerError, WorkerGroup
from reprorl.trainer.tracking import CURVES_FILE, METRICS_FILE, Tracker, plot_curves, read_metrics, truncate_metrics

logger = logging.getLogger(__name__)

# Estimators that compare the n samples of a prompt with each other.
GROUP_ESTIMATORS = ("grpo", "rloo", "reinforce_pp_baseline")


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


def check_paths(cfg: Config) -> None:
    """Fail before any work starts if a model or data path does not exist, naming the key."""
    models = {"model.path": cfg.model.path, "model.ref_path": cfg.model.ref_path}
    if cfg.algorithm.adv_estimator == "gae":
        models["model.critic_path"] = cfg.model.critic_path
    if cfg.reward.model_path is not None:
        models["reward.model_path"] = cfg.reward.model_path
    for key, path in models.items():
        if not (Path(path) / "config.json").is_file():
            what = "does not exist" if not Path(path).exists() else "has no config.json"
            raise ConfigError(f"{key}: {path!r} {what}; expected a HF-format model directory")
    for key in ("train_files", "val_files"):
        for path in getattr(cfg.data, key):
            if not Path(path).is_file():
                raise ConfigError(f"data.{key}: {path!r} does not exist")


def _model_args(key: str, path: str) -> ModelArgs:
    """The shape config.json gives the model at `path` (config key `key`), read without loading weights."""
    try:
        return ModelArgs.from_hf_config(json.loads((Path(path) / "config.json").read_text(encoding="utf-8")))
    except ConfigError as err:  # a model type or setting reprorl's models do not support
        raise ConfigError(f"{key}: {path!r}: {err}") from None
    except KeyError as err:
        raise ConfigError(f"{key}: {path!r} config.json has no {err}") from None
    except ValueError as err:  # not JSON
        raise ConfigError(f"{key}: {path!r} config.json is not valid JSON: {err}") from None


def check_models(cfg: Config, tokenizer: Any) -> None:
    """Fail before any model loads or Ray actor starts if a model cannot serve this run.

    `tokenizer` is model.path's. Every model that reads its token ids (actor and rollout,
    reference, critic) needs `vocab_size` >= the tokenizer's size (larger is normal:
    padded embeddings, as in Qwen) and positions for a whole prompt plus response
    (`data.max_prompt_length + data.max_response_length`); the tokenizer needs a pad
    token (the rollout pads with it; `load_tokenizer` falls back to eos), and the eos ids
    the engine stops on must be ids the model can produce. A reward model is checked
    against its own tokenizer.
    """
    data = cfg.data
    length = data.max_prompt_length + data.max_response_length
    if tokenizer.pad_token_id is None:
        raise ConfigError(f"model.path: the tokenizer in {cfg.model.path!r} has neither a pad token nor an eos "
                          "token; expected one of them (set pad_token in its tokenizer_config.json)")
    models = {"model.path": cfg.model.path}
    if cfg.actor.use_kl_loss or cfg.algorithm.use_kl_in_reward:
        models["model.ref_path"] = cfg.model.ref_path
    if cfg.algorithm.adv_estimator == "gae":
        models["model.critic_path"] = cfg.model.critic_path
    num_tokens = len(tokenizer)
    shapes = {key: _model_args(key, path) for key, path in models.items()}
    for key, path in models.items():
        args = shapes[key]
        if args.vocab_size < num_tokens:
            raise ConfigError(
                f"{key}: {path!r} has vocab_size={args.vocab_size} in config.json but the tokenizer of model.path "
                f"has {num_tokens} tokens; expected vocab_size >= {num_tokens} (a model and the tokenizer it was "
                "trained with)"
            )
        if length > args.max_position_embeddings:
            raise ConfigError(
                f"data.max_prompt_length + data.max_response_length = {data.max_prompt_length} + "
                f"{data.max_response_length} = {length} tokens is more than {key} {path!r} holds "
                f"(max_position_embeddings={args.max_position_embeddings}); expected at most "
                f"{args.max_position_embeddings}"
            )
    vocab_size = shapes["model.path"].vocab_size
    eos = eos_ids_from_dir(cfg.model.path)  # the ids the engine stops at
    for token_id in [eos] if isinstance(eos, int) else eos or []:
        if not 0 <= token_id < vocab_size:
            raise ConfigError(
                f"model.path: {cfg.model.path!r} stops generation at eos_token_id={token_id} "
                f"(generation_config.json or config.json), which its vocab_size={vocab_size} cannot produce; "
                f"expected an id in [0, {vocab_size})"
            )
    if cfg.reward.model_path is not None:
        path = cfg.reward.model_path
        args = _model_args("reward.model_path", path)
        num_rm_tokens = len(AutoTokenizer.from_pretrained(path))
        if args.vocab_size < num_rm_tokens:
            raise ConfigError(
                f"reward.model_path: {path!r} has vocab_size={args.vocab_size} in config.json but its tokenizer has "
                f"{num_rm_tokens} tokens; expected vocab_size >= {num_rm_tokens}"
            )
        if args.max_position_embeddings < length:
            # Not an error: the reward model re-tokenizes the text with its own tokenizer (and
            # chat template), which may need fewer tokens than the policy's; a sample that
            # does not fit fails the step with the sample's length, after the last checkpoint.
            logger.warning(
                "reward.model_path: %r has max_position_embeddings=%d, fewer than "
                "data.max_prompt_length + data.max_response_length = %d policy tokens: long samples may not fit",
                path, args.max_position_embeddings, length)


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

    Parts take plain arguments; this class is the one place that reads the config.
    """

    def __init__(self, cfg: Config) -> None:
        check_paths(cfg)
        self.tokenizer = load_tokenizer(cfg.model.path)
        check_models(cfg, self.tokenizer)
        self.cfg = cfg
        self.run_dir = Path(cfg.trainer.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg), encoding="utf-8")
        if cfg.full_determinism:
            enable_full_determinism(cfg.seed)
        else:
            torch.manual_seed(cfg.seed)  # weight init of fresh heads only; sampling seeds are per request

        data = cfg.data
        self.train_set = PromptDataset(
            data.train_files, self.tokenizer, data.max_prompt_length, overlong=data.overlong_prompts,
            prompt_key=data.prompt_key,
        )
        self.val_set = PromptDataset(
            data.val_files, self.tokenizer, data.max_prompt_length, overlong=data.overlong_prompts,
            prompt_key=data.prompt_key,
        )
        if len(self.train_set) < data.train_batch_size:
            raise ConfigError(
                f"data.train_batch_size={data.train_batch_size} is larger than the train set "
                f"({len(self.train_set)} prompts after overlong handling)"
            )
        self.sampler = PromptSampler(len(self.train_set), data.train_batch_size, cfg.seed, shuffle=data.shuffle)

        import ray

        from reprorl.rollout.replica import init_ray

        self._owns_ray = not ray.is_initialized()  # a caller's Ray (tests, a cluster) stays up
        init_ray()
        estimator = cfg.algorithm.adv_estimator
        actor, total = cfg.actor, cfg.trainer.total_steps
        groups = {"num_workers": cfg.trainer.num_workers, "seed": cfg.seed, "full_determinism": cfg.full_determinism,
                  "dtype": cfg.model.dtype}
        self.actor = WorkerGroup("actor", model_path=cfg.model.path, optim=_optim_args(actor, total), **groups)
        self.loss_args = PolicyLossArgs(
            clip_ratio_low=actor.clip_ratio_low, clip_ratio_high=actor.clip_ratio_high,
            clip_ratio_c=actor.clip_ratio_c, loss_agg_mode=actor.loss_agg_mode,
            entropy_coeff=actor.entropy_coeff, use_kl_loss=actor.use_kl_loss,
            kl_loss_type=actor.kl_loss_type, kl_loss_coef=actor.kl_loss_coef,
            max_response_length=data.max_response_length,
        )
        self.needs_ref = actor.use_kl_loss or cfg.algorithm.use_kl_in_reward
        self.ref = WorkerGroup("ref", model_path=cfg.model.ref_path, optim=None, **groups) if self.needs_ref else None
        self.critic = (
            WorkerGroup("critic", model_path=cfg.model.critic_path, optim=_optim_args(cfg.critic, total), **groups)
            if estimator == "gae"
            else None
        )
        kl = cfg.algorithm.kl_ctrl
        self.kl_ctrl = (
            algos.AdaptiveKLController(kl.kl_coef, kl.target_kl, kl.horizon)
            if kl.type == "adaptive"
            else algos.FixedKLController(kl.kl_coef)
        )

        self.reward_model = None
        if cfg.reward.model_path is not None:
            from reprorl.reward.reward_model import RewardModelPool

            self.reward_model = RewardModelPool(
                cfg.reward.model_path, cfg.reward.num_replicas, seed=cfg.seed,
                full_determinism=cfg.full_determinism, max_num_seqs=cfg.reward.max_num_seqs,
                backend=cfg.reward.backend, vllm_options=_vllm_options(cfg.rollout),
            )
        self.reward_loop = RewardLoop(
            resolve_reward_fn(cfg.reward.fn), self.reward_model,
            rule_weight=cfg.reward.rule_weight, model_weight=cfg.reward.model_weight,
        )

        from reprorl.agent_loop.manager import AgentLoopManager
        from reprorl.rollout.replica import ReplicaPool

        ro = cfg.rollout
        self.pool = ReplicaPool(
            cfg.model.path, ro.num_replicas, seed=cfg.seed, full_determinism=cfg.full_determinism,
            max_num_seqs=ro.max_num_seqs, max_num_batched_tokens=ro.max_num_batched_tokens,
            max_model_len=data.max_prompt_length + data.max_response_length,  # within the model's: check_models
            backend=ro.backend, vllm_options=_vllm_options(ro),
        )
        val_temperature = ro.val.temperature if ro.val.do_sample else 0.0
        self.agent = AgentLoopManager(
            self.pool, ro.num_agent_workers, cfg.model.path,
            max_response_length=data.max_response_length,
            max_prompt_length=data.max_prompt_length,
            sampling_params=_sampling_params(ro.temperature, ro.top_p, ro.top_k, ro.max_tokens),
            val_sampling_params=_sampling_params(val_temperature, ro.val.top_p, ro.val.top_k, ro.max_tokens),
            agent=ro.agent_loop, max_turns=ro.max_turns, routing=ro.routing, tools=ro.tools,
        )
        # The run's records are opened in `fit`, after `resume` has cut them to its step.
        self.tracker: Tracker | None = None
        self.fingerprints: FingerprintWriter | None = None
        self.step = 0

    # ------------------------------------------------------------------ batches

    def _prompt_batch(self, dataset: PromptDataset, positions: list[int], *, step: int, validate: bool) -> Batch:
        """One row per prompt, with its identity (`uid`) and what the reward needs."""
        rows = [dataset[i] for i in positions]
        prefix = "val" if validate else "train"
        return Batch(
            non_tensors={
                "uid": [f"{prefix}-{row.index}" for row in rows],
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

        ReMax appends one greedy row per prompt (`__do_sample__` False); the agent loop
        gives those rows greedy params, and they are split off after the call.
        """
        n = self.cfg.rollout.n
        sampled = self._repeat(prompts, n)
        if self.cfg.algorithm.adv_estimator != "remax":
            return sampled, len(sampled)
        baseline = prompts.slice(0, len(prompts))
        baseline["repeat_index"] = [n] * len(prompts)  # an identity apart from the n samples
        sampled["__do_sample__"] = [True] * len(sampled)
        baseline["__do_sample__"] = [False] * len(baseline)
        return Batch.concat([sampled, baseline]), len(sampled)

    # ------------------------------------------------------------------ one step

    def train_step(self, step: int, positions: list[int]) -> dict[str, float]:
        cfg, n = self.cfg, self.cfg.rollout.n
        metrics: dict[str, float] = {}
        t_step = time.perf_counter()
        prompts = self._prompt_batch(self.train_set, positions, step=step, validate=False)

        t0 = time.perf_counter()
        calls_before = self.agent.num_generate_sequences_calls
        rollout, num_sampled = self._rollout_batch(prompts)
        output = self.agent.generate_sequences(rollout)
        metrics["rollout/num_generate_calls"] = self.agent.num_generate_sequences_calls - calls_before
        metrics["rollout/turns_mean"] = float(sum(output.non_tensors["num_turns"]) / len(output))  # > 1: tool turns ran
        batch = output.slice(0, num_sampled)
        baseline = output.slice(num_sampled, len(output)) if num_sampled < len(output) else None
        if baseline is not None:
            batch.pop(non_tensor_keys=["__do_sample__"])
        metrics["timing/gen_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        scores, reward_metrics = self.reward_loop.compute(batch, self.tokenizer)  # [B*n]
        metrics.update(reward_metrics)
        reward_baselines = None
        if baseline is not None:
            # ReMax's baseline is the greedy response's reward only, without the KL penalty
            # (as in the paper and verl): the KL term belongs to the sampled trajectory.
            baseline_scores, _ = self.reward_loop.compute(baseline, self.tokenizer)  # [B]
            metrics["reward/baseline_mean"] = baseline_scores.mean().item()
            reward_baselines = baseline_scores.repeat_interleave(n)  # [B*n]: row i is prompt i // n
        metrics["timing/reward_s"] = time.perf_counter() - t0

        t0 = time.perf_counter()
        mask = batch["response_mask"].float()
        actor = cfg.actor
        batch["old_log_probs"] = self.actor.compute_log_probs(
            batch, temperature=cfg.rollout.temperature, micro_batch_size=actor.ppo_micro_batch_size
        )
        if "rollout_log_probs" in batch:
            # 0 when the engine's log-probs equal the trainer's bit for bit (batch-invariant paths).
            gap = (batch["rollout_log_probs"] - batch["old_log_probs"]).abs() * mask
            metrics["rollout/log_prob_max_gap"] = gap.max().item()
        if self.ref is not None:
            batch["ref_log_probs"] = self.ref.compute_log_probs(
                batch, temperature=cfg.rollout.temperature, micro_batch_size=actor.ppo_micro_batch_size
            )
        if self.critic is not None:
            batch["values"] = self.critic.compute_values(batch, micro_batch_size=cfg.critic.ppo_micro_batch_size)
        metrics["timing/old_log_prob_s"] = time.perf_counter() - t0

        token_scores = algos.scores_to_token_rewards(scores, mask)  # [B*n, R]
        if cfg.algorithm.use_kl_in_reward:
            kl = algos.kl_penalty(batch["old_log_probs"], batch["ref_log_probs"], cfg.algorithm.kl_penalty)
            token_rewards, mean_kl = algos.apply_kl_to_rewards(token_scores, kl, self.kl_ctrl.value, mask)
            metrics["actor/reward_kl_penalty"] = mean_kl.item()
            metrics["actor/reward_kl_coef"] = self.kl_ctrl.value
            self.kl_ctrl.update(mean_kl.item(), n_steps=len(batch))
        else:
            token_rewards = token_scores
        advantages, returns = self._advantages(batch, token_rewards, mask, reward_baselines)
        batch["advantages"] = advantages
        batch["returns"] = returns
        _require_finite(batch, ("old_log_probs", "ref_log_probs", "values", "advantages", "returns"))

        t0 = time.perf_counter()
        if self.critic is not None:
            metrics.update(self.critic.update(
                batch, ppo_epochs=cfg.critic.ppo_epochs, mini_batch_size=cfg.critic.ppo_mini_batch_size * n,
                micro_batch_size=cfg.critic.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
                cliprange_value=cfg.critic.cliprange_value, loss_agg_mode=cfg.critic.loss_agg_mode,
            ))
        metrics.update(self.actor.update(
            batch, ppo_epochs=actor.ppo_epochs, mini_batch_size=actor.ppo_mini_batch_size * n,
            micro_batch_size=actor.ppo_micro_batch_size, max_response_length=cfg.data.max_response_length,
            loss=self.loss_args, temperature=cfg.rollout.temperature,
        ))
        weights = self.actor.named_weights()
        self.pool.update_weights(weights, version=step)
        metrics["timing/update_s"] = time.perf_counter() - t0

        response_lengths = mask.sum(-1)
        metrics["reward/mean"] = scores.mean().item()
        metrics["reward/std"] = scores.std(unbiased=False).item()
        metrics["response_length/mean"] = response_lengths.mean().item()
        metrics["advantages/mean"] = algos.masked_mean(advantages, mask).item()
        metrics["timing/step_s"] = time.perf_counter() - t_step
        metrics["throughput/tokens_per_s"] = response_lengths.sum().item() / max(metrics["timing/gen_s"], 1e-9)
        self.fingerprints.write(
            step,
            fields={
                "prompts": batch["prompts"], "responses": batch["responses"],
                "rollout_log_probs": batch["rollout_log_probs"], "rewards": scores,
                "old_log_probs": batch["old_log_probs"], "advantages": advantages,
                **({"ref_log_probs": batch["ref_log_probs"]} if self.ref is not None else {}),
                **({"values": batch["values"]} if self.critic is not None else {}),
                "losses": torch.tensor([metrics[k] for k in sorted(metrics) if k.endswith("_loss")], dtype=torch.float64),
                "grad_norms": torch.tensor(
                    [metrics[k] for k in sorted(metrics) if k.endswith("grad_norm")], dtype=torch.float64
                ),
            },
            params=weights,
        )
        return metrics

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

        `val/accuracy` is the share of samples whose rule reward is full credit (>= 1.0);
        `val/reward_mean` is the mean of the final reward (rule and model, weighted).
        """
        cfg = self.cfg
        positions = list(range(len(self.val_set)))
        size = cfg.data.val_batch_size or len(positions)
        scores, correct, lengths = [], [], []
        t0 = time.perf_counter()
        for start in range(0, len(positions), size):
            prompts = self._prompt_batch(self.val_set, positions[start : start + size], step=step, validate=True)
            output = self.agent.generate_sequences(self._repeat(prompts, cfg.rollout.val.n))
            batch_scores, _ = self.reward_loop.compute(output, self.tokenizer)
            solutions = decode_responses(output["responses"], output["response_mask"], self.tokenizer)
            rule, _ = self.reward_loop.rule_scores(output, solutions)
            scores.append(batch_scores)
            correct.append((rule >= 1.0).float())
            lengths.append(output["response_mask"].float().sum(-1))
        return {
            "val/accuracy": torch.cat(correct).mean().item(),
            "val/reward_mean": torch.cat(scores).mean().item(),
            "val/response_length_mean": torch.cat(lengths).mean().item(),
            "timing/val_s": time.perf_counter() - t0,
        }

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
                               write_dirs={f"{name}.shards": group.save for name, group in groups.items()})
        logger.info("saved checkpoint %s", path)
        return path

    def _checkpoint_note(self) -> str:
        """Where a stopped run can continue from: the newest checkpoint on disk, untouched."""
        ckpt = find_checkpoint(self.run_dir)
        if ckpt is None:
            return "No checkpoint was saved before it."
        return f"The newest checkpoint, {str(ckpt)!r}, is unchanged; trainer.resume=auto continues from it."

    def _has_history(self) -> bool:
        return (self.run_dir / METRICS_FILE).exists() or (self.run_dir / "checkpoints").exists()

    def resume(self) -> int:
        """Restore the newest checkpoint as `trainer.resume` says; returns its step (0 = fresh)."""
        mode = self.cfg.trainer.resume
        if mode == "never":
            if self._has_history():
                raise ConfigError(
                    f"trainer.run_dir {str(self.run_dir)!r} already holds a run and trainer.resume=never; "
                    "choose another trainer.run_dir, or trainer.resume=auto to continue it"
                )
            return 0
        source = self.run_dir if mode == "auto" else Path(mode)
        try:
            ckpt = find_checkpoint(source)
            if ckpt is None:
                raise FileNotFoundError(source)
            step, state = load_checkpoint(ckpt)
        except FileNotFoundError:
            if mode != "auto":
                raise ConfigError(f"trainer.resume: no checkpoint found at {mode!r}") from None
            if self._has_history():
                # Steps ran but none was saved: start over, dropping the records of that attempt.
                truncate_metrics(self.run_dir / METRICS_FILE, 0)
                truncate_fingerprints(self.run_dir, 0)
            return 0
        for name, group in self._trained_groups().items():
            group.load(ckpt / f"{name}.shards", state[name])  # shards of any number of workers
        self.sampler.load_state_dict(state["sampler"])
        self.kl_ctrl.load_state_dict(state["kl_ctrl"])
        restore_rng_state(state["rng"])
        # Replicas start from model.path: give them the checkpoint's weights as its version.
        self.pool.update_weights(self.actor.named_weights(), version=step)
        truncate_metrics(self.run_dir / METRICS_FILE, step)
        truncate_fingerprints(self.run_dir, step)
        logger.info("resumed from step %d (%s)", step, source)
        return step

    # ------------------------------------------------------------------ determinism report

    def report_determinism(self, step: int) -> dict[str, Any]:
        """Ask every part for its determinism mode; write, log and return the report."""
        parts: dict[str, dict[str, Any]] = {}
        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                parts.update(group.determinism_info())
        parts.update({f"rollout replica {i}": info for i, info in self.pool.determinism_info().items()})
        if self.reward_model is not None:
            parts.update({f"reward replica {i}": info for i, info in self.reward_model.determinism_info().items()})
        parts.update({f"agent-loop worker {i}": info for i, info in self.agent.determinism_info().items()})
        report = build_report(parts, full_determinism=self.cfg.full_determinism, seed=self.cfg.seed)
        report["started_at_step"] = step
        write_report(self.run_dir, report)
        logger.info("%s", format_report(report))
        return report

    # ------------------------------------------------------------------ the loop

    def fit(self) -> Path:
        """Train from the resumed step to `trainer.total_steps`; returns the run directory.

        A NaN or infinity in a step raises `NonFiniteError` naming the step and where; the
        step is not finished (no optimizer step for that mini-batch, no weights pushed, no
        metrics or checkpoint written), so the newest checkpoint is the one to resume from.
        """
        from tqdm import tqdm

        cfg = self.cfg.trainer
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
        if start == 0 and cfg.val_before_train:
            self.tracker.log(0, self.validate(0))
        progress = tqdm(range(start + 1, cfg.total_steps + 1), initial=start, total=cfg.total_steps,
                        desc="train", unit="step", dynamic_ncols=True)
        for step in progress:
            self.step = step
            try:
                metrics = self.train_step(step, next(self.sampler))
            except NonFiniteError as err:
                raise NonFiniteError(f"step {step}: {err}; the run stopped. {self._checkpoint_note()}") from err
            except WorkerError as err:
                raise WorkerError(f"step {step}: {err}; the run stopped. {self._checkpoint_note()}") from err
            last = step == cfg.total_steps
            if cfg.test_freq > 0 and (step % cfg.test_freq == 0 or last):
                metrics.update(self.validate(step))
            self.tracker.log(step, metrics)
            progress.set_postfix(
                {k.split("/")[-1]: f"{metrics[k]:.3g}" for k in ("reward/mean", "val/accuracy", "actor/pg_loss")
                 if k in metrics}
            )
            if cfg.save_freq > 0 and (step % cfg.save_freq == 0 or last):
                self.save(step)
        return self.run_dir

    def close(self) -> None:
        """Stop the replicas and workers, close the loggers, draw the curves."""
        import ray

        if self.tracker is not None:
            self.tracker.close()
        if self.fingerprints is not None:
            self.fingerprints.close()
        metrics_path = self.run_dir / METRICS_FILE
        if metrics_path.exists():
            plot_curves(read_metrics(metrics_path), self.run_dir / CURVES_FILE, title=self.cfg.trainer.experiment_name)
        self.agent.shutdown()
        self.pool.shutdown()
        for group in (self.actor, self.ref, self.critic):
            if group is not None:
                group.shutdown()
        if self.reward_model is not None:
            self.reward_model.shutdown()
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
