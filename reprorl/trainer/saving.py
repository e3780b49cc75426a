"""Saving a run and resuming it: a step's checkpoint, its restore, and the run's record of each start.

- `save`: the driver's state (step, sampler, KL controller, RNGs), each trained group's
  shards and, with `trainer.max_staleness` > 0, the batches made for the steps after it
  (async_rollouts.py), in one atomic checkpoint (checkpoint.py) that records the run's config;
- `resume`: the checkpoint `plan_resume` chose at start (resume_guard.py) back into the
  parts, the run's records cut to its step;
- `record_start`: where the run starts, and its config changes, in history.jsonl (run_dir.py);
- `checkpoint_note`: where a stopped run can continue from.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

from reprorl import algos
from reprorl.config import Config
from reprorl.data.dataset import PromptSampler
from reprorl.fingerprint import truncate_fingerprints
from reprorl.rollout.replica import ReplicaPool
from reprorl.trainer import weight_sync
from reprorl.trainer.async_rollouts import IN_FLIGHT_DIR, in_flight_state, load_in_flight, save_in_flight
from reprorl.trainer.generation import ScoredBatch
from reprorl.records.checkpoint import (
    capture_rng_state,
    find_checkpoint,
    load_checkpoint,
    restore_rng_state,
    save_checkpoint,
)
from reprorl.records.resume_guard import ResumePlan, flat_config
from reprorl.records.run_dir import append_history
from reprorl.records.tracking import GENERATIONS_FILE, METRICS_FILE, truncate_metrics
from reprorl.workers.group import WorkerGroup

logger = logging.getLogger(__name__)


def _trained_groups(actor: WorkerGroup, critic: WorkerGroup | None) -> dict[str, WorkerGroup]:
    return {name: group for name, group in (("actor", actor), ("critic", critic)) if group is not None}


def save(run_dir: Path, step: int, cfg: Config, *, actor: WorkerGroup, critic: WorkerGroup | None,
         sampler: PromptSampler, kl_ctrl: algos.FixedKLController | algos.AdaptiveKLController,
         in_flight: list[ScoredBatch] = ()) -> Path:
    """A checkpoint of the step: the driver's state, each trained group's shards
    (`<name>.shards/`, one file a worker) and the batches `in_flight` (made for the steps
    after it; the sampler's position is after them) written into the same atomic directory."""
    state: dict[str, Any] = {
        "trainer": {"step": step},
        "sampler": sampler.state_dict(),
        "kl_ctrl": kl_ctrl.state_dict(),
        "rng": capture_rng_state(),
    }
    groups = _trained_groups(actor, critic)
    state.update({name: group.state_dict() for name, group in groups.items()})
    write_dirs = {f"{name}.shards": group.save for name, group in groups.items()}
    if in_flight:
        state["in_flight"] = in_flight_state(list(in_flight))
        write_dirs[IN_FLIGHT_DIR] = lambda directory: save_in_flight(Path(directory), list(in_flight))
    path = save_checkpoint(run_dir, step, state, max_to_keep=cfg.trainer.max_ckpt_to_keep,
                           write_dirs=write_dirs,
                           meta={"config": flat_config(cfg)})  # what a resume checks its config against
    logger.info("saved checkpoint %s", path)
    return path


def resume(run_dir: Path, ckpt: Path | None, *, actor: WorkerGroup, critic: WorkerGroup | None, pool: ReplicaPool,
           sampler: PromptSampler, kl_ctrl: algos.FixedKLController | algos.AdaptiveKLController
           ) -> tuple[int, list[ScoredBatch]]:
    """Restore `ckpt`, the checkpoint `plan_resume` chose at start (None: none); returns its
    step (0 = fresh) and the batches it holds for the steps after it (`save`'s `in_flight`)."""
    if ckpt is None:
        # From the start: drop the records of an attempt that trained no step (plan_resume
        # refuses to start over where steps were trained), such as a validation at step 0.
        truncate_metrics(run_dir / METRICS_FILE, 0)
        truncate_metrics(run_dir / GENERATIONS_FILE, 0)
        truncate_fingerprints(run_dir, 0)
        return 0, []
    step, state = load_checkpoint(ckpt, verify=False)  # verified by plan_resume
    for name, group in _trained_groups(actor, critic).items():
        group.load(ckpt / f"{name}.shards", state[name])  # shards of any number of workers
    sampler.load_state_dict(state["sampler"])
    kl_ctrl.load_state_dict(state["kl_ctrl"])
    restore_rng_state(state["rng"])
    # Replicas start from model.path: give them the checkpoint's weights as its version.
    weight_sync.push_weights(actor, pool, step, weight_sync.device_replicas(actor, pool))
    truncate_metrics(run_dir / METRICS_FILE, step)
    truncate_metrics(run_dir / GENERATIONS_FILE, step)  # the same steps are validated again
    truncate_fingerprints(run_dir, step)
    logger.info("resumed from step %d (%s)", step, ckpt)
    in_flight = load_in_flight(ckpt / IN_FLIGHT_DIR, state["in_flight"]) if "in_flight" in state else []
    return step, in_flight


def record_start(run_dir: Path, plan: ResumePlan, allowed: list[str]) -> None:
    """A line of history.jsonl: from which checkpoint the run starts, and its config changes
    (`allowed`: `trainer.allow_changed_keys`, the changes accepted)."""
    append_history(run_dir, {
        "event": "resume" if plan.checkpoint is not None else "start", "step": plan.step,
        "checkpoint": None if plan.checkpoint is None else str(plan.checkpoint),
        "changed": plan.changes, "accepted": [key for key in plan.changes if key in allowed],
    })


def checkpoint_note(run_dir: Path) -> str:
    """Where a stopped run can continue from: the newest checkpoint on disk, untouched."""
    ckpt = find_checkpoint(run_dir)
    if ckpt is None:
        return "No checkpoint was saved before it."
    return f"The newest checkpoint, {str(ckpt)!r}, is unchanged; trainer.resume=auto continues from it."
