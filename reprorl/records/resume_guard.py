"""Where a run starts, decided before anything in its run directory changes (`plan_resume`).

- `trainer.resume=never` in a directory that holds a run: an error;
- otherwise the newest intact checkpoint (a damaged one is skipped with a warning naming it;
  none intact is an error naming each: reprorl/records/checkpoint.py);
- no checkpoint, but steps recorded in metrics.jsonl or fingerprints.jsonl (a finished
  run with `save_freq=0`, a run that crashed before its first save): an error, since
  training again would overwrite them;
- a checkpoint: the config checked against the one it was saved with (below).

Each checkpoint's meta records the config of the run that saved it (`flat_config`: dotted
key -> JSON value). A resume compares the current config with it (`check_resume_config`):
a changed key that can change the results (a learning rate, the reward function, the
sampling temperature, the data) stops the run with a one-line error listing each key with
both values, unless `trainer.allow_changed_keys` names it; the keys in `SAME_BITS_KEYS`
(logging, paths, checkpoint cadence, how many replicas, workers and agent-loop workers
serve the run, time-outs: the determinism contract in docs/design.md says the bits do not
depend on them) change freely. `trainer.max_staleness` never changes: a checkpoint holds the
batches made ahead for its value. Either way the changes are recorded in the run's history.jsonl.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reprorl.algos.registry import estimator
from reprorl.config import Config, load_config, resolve_config
from reprorl.errors import ConfigError
from reprorl.fingerprint import FINGERPRINTS_FILE, read_complete_fingerprints
from reprorl.records.checkpoint import CHECKPOINTS_DIR, find_valid_checkpoint, read_meta
from reprorl.records.tracking import METRICS_FILE

logger = logging.getLogger(__name__)

SAME_BITS_KEYS = frozenset({
    "trainer.num_workers", "trainer.test_freq", "trainer.save_freq", "trainer.run_dir", "trainer.loggers",
    "trainer.resume", "trainer.max_ckpt_to_keep", "trainer.max_restarts", "trainer.val_before_train",
    "trainer.project_name", "trainer.experiment_name", "trainer.allow_changed_keys",
    "rollout.num_replicas", "rollout.num_agent_workers", "rollout.routing", "rollout.max_num_seqs",
    "rollout.max_num_batched_tokens", "rollout.gpu_memory_utilization", "rollout.lookahead",
    "reward.num_replicas", "reward.num_workers", "reward.max_num_seqs",
    "reward.max_error_rate",  # that one: only whether a step stops
    "model.gradient_checkpointing", "model.gpu_gradient_vectors", "model.shard_params",
    "actor.optimizer_offload", "critic.optimizer_offload",
    "data.val_batch_size", "resources.gpu_share_rollout",
    "resources.rollout_gpus", "trainer.log_generations", "actor.log_prob_check_freq",
})
"""Keys whose change leaves every bit of the run as it was (batch-invariant kernels, fixed
reduction orders, request seeds from the sample's identity). Any key ending in `timeout_s`
is one too: under full determinism a time-out decides only whether a run waits or stops
(without it, no run is bitwise anyway)."""

_ABSENT = "<absent>"  # a key the saving run's config did not have


def flat_config(cfg: Config) -> dict[str, Any]:
    """`cfg` as {dotted key: value}, values as JSON gives them back (tuples become lists)."""
    def flatten(section: dict[str, Any], prefix: str) -> dict[str, Any]:
        out = {}
        for name, value in section.items():
            if isinstance(value, dict):
                out.update(flatten(value, f"{prefix}{name}."))
            else:
                out[prefix + name] = value
        return out

    return json.loads(json.dumps(flatten(dataclasses.asdict(cfg), "")))


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, list[Any]]:
    """{key: [saved value, current value]} of the keys of `current` whose value differs.

    A key the saved config lacks (added to reprorl since) counts as changed only when its
    value is not the default, which is what the saving run did; keys since removed are
    ignored: they cannot be set.
    """
    defaults = flat_config(resolve_config(Config()))
    changes = {}
    for key, value in current.items():
        before = saved.get(key, defaults.get(key, _ABSENT))
        if before != value:
            changes[key] = [saved.get(key, _ABSENT), value]
    return changes


def result_changing(changes: dict[str, list[Any]], current: dict[str, Any]) -> list[str]:
    """The keys of `changes` that can change the run's results.

    `trainer.total_steps` may change when no learning-rate schedule depends on it (both
    `constant`): a cosine schedule's every step after the resume would differ.
    `actor.old_log_probs` may change under full determinism with the built-in engine, whose
    log-probs are the trainer's bit for bit: there every choice gives the same numbers.
    """
    cosine = current["actor.lr_schedule"] == "cosine" or (
        estimator(current["algorithm.adv_estimator"]).needs_critic and current["critic.lr_schedule"] == "cosine")
    exact_log_probs = current["full_determinism"] and current["rollout.backend"] == "native"
    keys = []
    for key in changes:
        if key == "trainer.total_steps":
            if cosine:
                keys.append(key)
        elif key == "actor.old_log_probs":
            if not exact_log_probs:
                keys.append(key)
        elif key not in SAME_BITS_KEYS and not key.endswith("timeout_s"):
            keys.append(key)
    return keys


def check_resume_config(saved: dict[str, Any], cfg: Config, checkpoint: str) -> dict[str, list[Any]]:
    """The config changes since `checkpoint` (see `config_changes`); a ConfigError naming
    each one that can change the results and is not in `trainer.allow_changed_keys`."""
    current = flat_config(cfg)
    changes = config_changes(saved, current)
    if "trainer.max_staleness" in changes:
        before, now = changes["trainer.max_staleness"]
        raise ConfigError(
            f"trainer.resume: trainer.max_staleness {json.dumps(before)} -> {now} since checkpoint {checkpoint!r}, "
            "which holds the batches made ahead for the saved value (their weights are not in it): a resume cannot "
            "change it, not even with trainer.allow_changed_keys; set it back, or start a new run in another "
            "trainer.run_dir"
        )
    refused = [key for key in result_changing(changes, current) if key not in cfg.trainer.allow_changed_keys]
    if refused:
        listed = ", ".join(f"{key} {json.dumps(changes[key][0])} -> {json.dumps(changes[key][1])}" for key in refused)
        raise ConfigError(
            f"trainer.resume: the config differs from checkpoint {checkpoint!r}'s in keys that change the run's "
            f"results: {listed}; set them back, or accept the change with "
            f"trainer.allow_changed_keys=[{','.join(refused)}] (recorded in history.jsonl), "
            "or start a new run in another trainer.run_dir"
        )
    return changes


# ------------------------------------------------------------------------------ the plan


@dataclass(frozen=True)
class ResumePlan:
    checkpoint: Path | None  # None: the run starts from step 0
    step: int
    changes: dict[str, list[Any]]  # config changes since the checkpoint: key -> [saved, current]


def plan_resume(cfg: Config, run_dir: Path) -> ResumePlan:
    """Where the run in `run_dir` starts, as `cfg.trainer.resume` says (see the module doc);
    reads only, so a refused run leaves the directory as it was."""
    mode = cfg.trainer.resume
    if mode == "never":
        if (run_dir / METRICS_FILE).exists() or (run_dir / CHECKPOINTS_DIR).exists():
            raise ConfigError(
                f"trainer.run_dir {str(run_dir)!r} already holds a run and trainer.resume=never; "
                "choose another trainer.run_dir, or trainer.resume=auto to continue it"
            )
        return ResumePlan(None, 0, {})
    ckpt = find_valid_checkpoint(run_dir if mode == "auto" else Path(mode))
    if ckpt is None:
        if mode != "auto":
            raise ConfigError(f"trainer.resume: no checkpoint found at {mode!r}")
        _refuse_unsaved_steps(run_dir)
        return ResumePlan(None, 0, {})
    meta = read_meta(ckpt)
    saved = _saved_config(ckpt, meta)
    return ResumePlan(ckpt, meta["step"], {} if saved is None else check_resume_config(saved, cfg, str(ckpt)))


def _refuse_unsaved_steps(run_dir: Path) -> None:
    """Trained steps on record and no checkpoint: starting over would overwrite them."""
    steps = set()
    if (run_dir / FINGERPRINTS_FILE).is_file():
        steps.update(read_complete_fingerprints(run_dir)[0])
    if (run_dir / METRICS_FILE).is_file():
        for line in (run_dir / METRICS_FILE).read_text(encoding="utf-8").splitlines():
            try:
                steps.add(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                continue  # a torn last line; any step is enough here
    trained = sorted(step for step in steps if isinstance(step, int) and step > 0)
    if trained:
        raise ConfigError(
            f"trainer.run_dir {str(run_dir)!r} holds {len(trained)} trained steps (up to step {trained[-1]}) and no "
            f"checkpoint to resume from (trainer.save_freq=0?); training again would overwrite its {METRICS_FILE} "
            f"and {FINGERPRINTS_FILE}: choose another trainer.run_dir, or move those files away to train it again"
        )


def _saved_config(ckpt: Path, meta: dict[str, Any]) -> dict[str, Any] | None:
    """The flat config `ckpt` was saved with; for a checkpoint older than that record, its
    run's config.yaml (not yet rewritten by this run); None, with a warning, when neither is there."""
    if "config" in meta:
        return meta["config"]
    path = ckpt.parent.parent / "config.yaml"
    try:
        return flat_config(load_config(path))
    except ConfigError as err:
        logger.warning("checkpoint %s records no config, and %s cannot stand in (%s): the config is not compared",
                       ckpt, path, err)
        return None
