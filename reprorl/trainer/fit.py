"""The fit loop: prompts -> one rollout call -> rewards -> log-probs -> advantages -> updates.

One training step, in the order of docs/design.md:

    batch of prompts (uid per prompt) -> repeat n, interleaved (ReMax: + one greedy row
    per prompt, same call) -> rollout -> reward (with dynamic sampling: until enough groups
    vary) [generation.py] -> old log-probs -> ref log-probs -> values (gae) [log_probs.py]
    -> KL (in reward or as a loss) -> advantages -> critic update -> actor update -> push
    weights to the replicas (versioned; device to device to the replicas on the actor's
    GPU: weight_sync.py) -> metrics, validation, checkpoint

With `trainer.max_staleness` = k >= 1 the batches are made by a producer thread, up to k
steps ahead, each with the weights a fixed rule names (async_rollouts.py); the step then
publishes its weights to the producer instead of pushing them. k = 0 is the loop above.

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
import logging
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import ray
import torch

from reprorl import algos
from reprorl.config import Config, config_to_yaml
from reprorl.data.dataset import PromptSampler
from reprorl.determinism import determinism_env, enable_full_determinism
from reprorl.errors import ConfigError
from reprorl.fingerprint import FingerprintWriter
from reprorl.models.hf_io import load_tokenizer
from reprorl.models.lora import spec_from_config
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardFnError, RewardTimeoutError
from reprorl.actors.pool import init_ray
from reprorl.actors.supervision import FaultError, PartTimeoutError, Restarts
from reprorl.trainer import saving, weight_sync
from reprorl.trainer.async_rollouts import AsyncRollouts, behaviour_version
from reprorl.trainer.checks import check_models, check_paths, check_train_set_size, warn_if_stale_on_shared_gpu
from reprorl.trainer.dynamic_sampling import FilterGroupsError
from reprorl.trainer.generation import REWARD_COMPONENTS, Generator, ScoredBatch
from reprorl.trainer.log_probs import actor_batch, add_log_probs_and_values
from reprorl.resources.memory import check_gpu_memory, gpu_total_bytes
from reprorl.trainer.parts import (
    chat_template_kwargs,
    make_datasets,
    make_kl_controller,
    plan_run_placement,
    policy_loss_args,
    start_parts,
)
from reprorl.records.resume_guard import plan_resume
from reprorl.records.run_dir import lock_run_dir
from reprorl.trainer.run_records import log_generations, report_determinism, write_fingerprint
from reprorl.records.tracking import CURVES_FILE, METRICS_FILE, Tracker, plot_curves, read_metrics
from reprorl.workers.group import WorkerError
from reprorl.workers.optim import NonFiniteError

logger = logging.getLogger(__name__)

TEST_KILL_AT_STEP_ENV = "REPRORL_TEST_KILL_AT_STEP"
"""A test hook, not a setting: with it set to N, `fit` SIGKILLs its own process at the end of
step N, right after the step's metrics and checkpoint are written, so a crash-and-resume
test kills the run at a known point (tests/trainer/test_fit.py) instead of racing it."""

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
    """Builds every part of a run from its config (parts.py) and runs `fit()`.

    Parts take plain arguments; parts.py and this class are the places that read the
    config. The fit loop reaches the actor, reference and critic only through their
    methods, so a worker group with the same methods can stand in for a worker.
    """

    rollouts: AsyncRollouts | None = None
    """The producer of the batches ahead with `trainer.max_staleness` >= 1 (made in `fit`); None: synchronous."""

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

        self.generator = Generator(cfg, self.parts.agent, self.parts.reward_loop, self.tokenizer, self.train_set,
                                   self.val_set, self.sampler)

    # ------------------------------------------------------------------ one step

    def train_step(self, step: int, scored: ScoredBatch | None = None) -> dict[str, float]:
        """One training step on `scored`, step `step`'s batch (None: generated now, the
        synchronous loop's); returns its metrics."""
        t_step = time.perf_counter()
        if scored is None:
            scored = self.generator.generate(step)
        batch, scores, metrics = scored.batch, scored.scores, dict(scored.metrics)
        # gdpo's reward terms [B*n, K] out of the batch: the workers read none of it (and would trim
        # it as a response-width column where K = R)
        components = batch.pop([REWARD_COMPONENTS])[REWARD_COMPONENTS] if REWARD_COMPONENTS in batch else None
        mask = batch["response_mask"].float()
        staleness = step - 1 - behaviour_version(step, self.cfg.trainer.max_staleness)
        correction = add_log_probs_and_values(self.cfg, self.parts, batch, mask, metrics, step=step,
                                              check_due=self._log_prob_check_due(), staleness=staleness)
        token_rewards = self._token_rewards(batch, scores, mask, metrics)
        advantages, returns = self._advantages(batch, token_rewards, mask, scored.reward_baselines, components)
        batch["advantages"] = advantages
        batch["returns"] = returns
        _require_finite(batch, ("old_log_probs", "ref_log_probs", "values", "advantages", "returns"))
        weight_digests = self._update(step, batch, correction, metrics)

        metrics["reward/mean"] = scores.mean().item()
        metrics["reward/std"] = scores.std(unbiased=False).item()
        metrics.update(length_metrics(batch))
        metrics["advantages/mean"] = algos.masked_mean(advantages, mask).item()
        metrics["timing/step_s"] = time.perf_counter() - t_step
        metrics["throughput/tokens_per_s"] = mask.sum().item() / max(metrics["timing/gen_s"], 1e-9)
        if self.cfg.trainer.log_generations:
            self._log_generations(step, "train", batch, scores)
        write_fingerprint(self.fingerprints, step, batch, scores, metrics, weight_digests)
        return metrics

    def _log_prob_check_due(self) -> bool:
        """With old log-probs from the rollout: whether this step recomputes them to check
        (`actor.log_prob_check_freq`, and the first step this process trains)."""
        freq = self.cfg.actor.log_prob_check_freq
        return self.step == self._first_step or (freq > 0 and self.step % freq == 0)

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

    def _update(self, step: int, batch: Batch, correction: algos.Correction | None,
                metrics: dict[str, float]) -> dict[str, str]:
        """Critic update, actor update, then the new weights as version `step`: pushed to the
        replicas, or with stale batches published to the producer, which pushes them when a
        batch needs them; returns their per-parameter digests (computed by the actor)."""
        cfg, n = self.cfg, self.cfg.rollout.n
        t0 = time.perf_counter()
        # Sharing one GPU synchronously: the engines give back their KV cache (and, unless the
        # new weights come device to device, their weights) while the trainer updates, and
        # take them back once the new weights are in (reprorl/trainer/weight_sync.py). With
        # stale batches they generate meanwhile instead.
        on_gpu = self.placement.device == "cuda" and self.rollouts is None
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
        metrics.update(self.parts.actor.update(
            actor_batch(cfg, batch, correction), ppo_epochs=cfg.actor.ppo_epochs,
            mini_batch_size=cfg.actor.ppo_mini_batch_size * n, micro_batch_size=cfg.actor.ppo_micro_batch_size,
            max_response_length=cfg.data.max_response_length, max_token_len=cfg.actor.ppo_max_token_len_per_micro_batch,
            loss=self.loss_args, temperature=cfg.rollout.temperature,
        ))
        t_sync = time.perf_counter()
        if self.rollouts is not None:
            self.rollouts.publish(step, self.parts.actor.named_weights())
        else:
            weight_sync.push_weights(self.parts.actor, self.parts.pool, step, on_device)
        metrics["timing/weight_sync_s"] = time.perf_counter() - t_sync
        if on_gpu:
            self.parts.pool.wake_up()
        metrics["timing/update_s"] = time.perf_counter() - t0
        return self.parts.actor.weight_digests()

    def _advantages(
        self, batch: Batch, token_rewards: torch.Tensor, mask: torch.Tensor, reward_baselines: torch.Tensor | None,
        reward_components: torch.Tensor | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(advantages, returns) `[B*n, R]` for the configured estimator; `reward_components`
        `[B*n, K]` the reward's terms (with an estimator that reads them, else None)."""
        algo = self.cfg.algorithm
        est = algos.estimator(algo.adv_estimator)
        weights = () if reward_components is None else self.parts.reward_loop.component_weights
        return est.advantages(algos.AdvantageInputs(
            token_rewards, mask, batch.non_tensors["uid"], algo.gamma, algo.lam, algo.norm_adv_by_std,
            values=batch["values"] if est.needs_critic else None, reward_baselines=reward_baselines,
            reward_components=reward_components, component_weights=weights,
        ))

    # ------------------------------------------------------------------ validation

    def validate(self, step: int) -> dict[str, float]:
        """Validate the current weights (`Generator.validate`); returns the metrics.
        `trainer.log_generations` = K writes the first K samples to generations.jsonl."""
        return self._validated(step, self.generator.validate(step))

    def _validated(self, step: int, validation: Any) -> dict[str, float]:
        if validation.first is not None and self.cfg.trainer.log_generations:
            self._log_generations(step, "val", *validation.first)
        return validation.metrics

    def _log_generations(self, step: int, split: str, output: Batch, scores: torch.Tensor) -> None:
        log_generations(self.run_dir, self.tracker, self.tokenizer, self.cfg.trainer.log_generations, step, split,
                        output, scores)

    def report_determinism(self, step: int) -> dict[str, Any]:
        """Ask every part for its determinism mode; write, log and return the report."""
        return report_determinism(self.run_dir, self.parts, full_determinism=self.cfg.full_determinism,
                                  seed=self.cfg.seed, placement=self.placement, step=step)

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
        start, in_flight = saving.resume(self.run_dir, self.resume_plan.checkpoint, actor=parts.actor,
                                         critic=parts.critic, pool=parts.pool, sampler=self.sampler,
                                         kl_ctrl=self.kl_ctrl)
        if cfg.max_staleness > 0:
            warn_if_stale_on_shared_gpu(self.cfg)
            self.rollouts = AsyncRollouts(self.generator, parts.pool, cfg.max_staleness, cfg.total_steps, start)
            self.rollouts.restore(in_flight, start)
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
            t_step = time.perf_counter()
            with self._stop_note(step):
                metrics = self._step(step, validate=cfg.test_freq > 0 and (step % cfg.test_freq == 0 or last))
            metrics["timing/wall_s"] = time.perf_counter() - t_step  # waits and validation in, the checkpoint out
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
                with self._stop_note(step):  # the batches in flight are finished first, and saved with it
                    ahead = self.rollouts.drain() if self.rollouts is not None else []
                saving.save(self.run_dir, step, self.cfg, actor=parts.actor, critic=parts.critic,
                            sampler=self.sampler, kl_ctrl=self.kl_ctrl, in_flight=ahead)
            if step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # TEST_KILL_AT_STEP_ENV: no close(), no flush
        return self.run_dir

    def _step(self, step: int, validate: bool) -> dict[str, float]:
        """Step `step` trained, and with `validate` its weights validated: its metrics."""
        if self.rollouts is None:
            metrics = self.train_step(step)
            if validate:
                metrics.update(self.validate(step))
            return metrics
        scored, wait = self.rollouts.batch(step)
        metrics = self.train_step(step, scored)
        metrics.update(wait)
        if validate:  # after the batches through step + k, which the replicas make with older weights
            metrics.update(self._validated(step, self.rollouts.validate(step).result()))
        return metrics

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
            if self.rollouts is not None:  # its thread's call, if any, ends as its parts stop
                self.rollouts.close()
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


