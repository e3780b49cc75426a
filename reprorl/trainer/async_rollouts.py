"""Bounded-staleness asynchronous rollouts: the next k batches generate while a step trains.

`trainer.max_staleness` = k >= 1. Steps count from 1 and policy version v is the weights
after step v (0: the initial weights). The batch that step s trains on is generated with

    behaviour_version(s) = max(0, s - 1 - k)

a function of s alone: the synchronous loop (k = 0) generates step s's batch with version
s - 1; with k = 1 (one-step-off) step s's batch generates with version s - 2 while step
s - 1 trains. One producer thread runs the jobs in step order: before generating step s's
batch it gives the replicas version `behaviour_version(s)` if they serve another, then
generates and scores the batch (generation.py). A validation of version t runs as a job
too, after step t + k's batch and before step t + k + 1's, the first to need version t.
Since a batch is a pure function of (its version's weights, the sampler's position, the
step), the order of the jobs fixes every bit: which replica served what, which request
finished first and how long anything took change nothing.

The trainer publishes each version's weights (CPU tensors, the host path) once its update
is done; the producer pushes a version once, when the first job that needs it starts, and
forgets it then (the pool keeps what it pushed, to replay to a replacement replica).

A checkpoint at step t holds the batches already made for steps t + 1 .. t + k (`drain`;
their versions are older than t, so they could not be made again from the checkpoint)
and the sampler's position after them; a resume takes them back (`restore`) and the next
job, step t + k + 1's, needs version t: the checkpoint's weights.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from reprorl.errors import ConfigError
from reprorl.protocol import Batch
from reprorl.rollout.replica import ReplicaPool
from reprorl.trainer.generation import Generator, ScoredBatch, Validation

logger = logging.getLogger(__name__)

IN_FLIGHT_DIR = "in_flight"
"""A checkpoint's directory of the batches generated for the steps after it."""


def behaviour_version(step: int, max_staleness: int) -> int:
    """The policy version whose weights generate step `step`'s batch (module doc).

    >>> [behaviour_version(s, 1) for s in range(1, 6)]
    [0, 0, 1, 2, 3]
    >>> [behaviour_version(s, 0) for s in range(1, 4)]
    [0, 1, 2]
    """
    return max(0, step - 1 - max_staleness)


class AsyncRollouts:
    """The producer of a run with `max_staleness` = k >= 1 (module doc).

    Args:
        generator: makes the batches and validations (its sampler is advanced by this
            object's thread alone from now on).
        pool: the rollout replicas, at version `start` (their weights are that version's).
        max_staleness: k.
        total_steps: no batch is made past it.
        start: the step the run resumes from (0: fresh); version `start` is served.
    """

    def __init__(self, generator: Generator, pool: ReplicaPool, max_staleness: int, total_steps: int,
                 start: int) -> None:
        if max_staleness < 1:
            raise ValueError(f"AsyncRollouts: max_staleness={max_staleness}; expected >= 1 (0 is the synchronous loop)")
        self.generator, self.pool, self.k, self.total_steps = generator, pool, max_staleness, total_steps
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="reprorl-rollouts")
        self._jobs: dict[int, Future[ScoredBatch]] = {}  # step -> its batch, not yet trained on
        self._lock = threading.Lock()  # guards _weights: published by the trainer, forgotten by the producer
        self._weights: dict[int, list[tuple[str, torch.Tensor]]] = {}
        self._submitted = start  # the last step whose batch is made or queued
        self._published = start  # the newest version the producer may serve

    # ------------------------------------------------------------------ the trainer's side

    def batch(self, step: int) -> tuple[ScoredBatch, dict[str, float]]:
        """Step `step`'s batch, waiting for it; first queues every batch through step + k
        whose version is published. Metrics: `async/staleness` (the versions between the
        batch's and the weights it trains), `async/wait_s` (how long the trainer waited)."""
        self._submit_through(step + self.k)
        if step not in self._jobs:
            raise RuntimeError(f"AsyncRollouts: step {step}'s batch was never queued (last queued: {self._submitted})")
        t0 = time.perf_counter()
        scored = self._jobs.pop(step).result()
        return scored, {"async/staleness": float(step - 1 - behaviour_version(step, self.k)),
                        "async/wait_s": time.perf_counter() - t0}

    def publish(self, version: int, weights: list[tuple[str, torch.Tensor]]) -> None:
        """Version `version`'s weights (after step `version`), for the jobs that need it."""
        with self._lock:
            self._weights[version] = weights
            self._published = version

    def validate(self, version: int) -> Future[Validation]:
        """A validation of version `version` (published), queued after the batches queued so far."""
        return self._executor.submit(self._validate, version)

    def drain(self) -> list[ScoredBatch]:
        """Wait for every queued job; the batches made for steps not yet trained, in step order."""
        return [self._jobs[step].result() for step in sorted(self._jobs)]

    def restore(self, batches: list[ScoredBatch], start: int) -> None:
        """Take back the batches a checkpoint at step `start` saved (`drain`'s): they must be
        those of steps start + 1 .. start + k (none past total_steps; none for a fresh run,
        whose first batches need version 0 alone)."""
        want = [step for step in range(start + 1, min(start + self.k, self.total_steps) + 1)
                if behaviour_version(step, self.k) < start]
        have = [b.step for b in batches]
        if have[: len(want)] != want:
            raise ConfigError(
                f"trainer.total_steps={self.total_steps}: the checkpoint of step {start} holds the batches of steps "
                f"{have or 'none'}, and with trainer.max_staleness={self.k} steps {want} need batches made with "
                "weights older than the checkpoint's, which it does not hold; resume from an earlier checkpoint, "
                "or keep the total_steps the run was saved with"
            )
        for scored in batches[: len(want)]:
            done: Future[ScoredBatch] = Future()
            done.set_result(scored)
            self._jobs[scored.step] = done
        self._submitted = start + len(want)

    def close(self) -> None:
        """Cancel the jobs not started; the one running finishes (or fails, its parts stopped)."""
        self._executor.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ the producer's side

    def _submit_through(self, last: int) -> None:
        for step in range(self._submitted + 1, min(last, self.total_steps) + 1):
            version = behaviour_version(step, self.k)
            if version > self._published:
                break
            self._jobs[step] = self._executor.submit(self._generate, step, version)
            self._submitted = step

    def _generate(self, step: int, version: int) -> ScoredBatch:
        self._serve(version)
        return self.generator.generate(step)

    def _validate(self, version: int) -> Validation:
        self._serve(version)
        return self.generator.validate(version)

    def _serve(self, version: int) -> None:
        """The replicas on `version`; versions before it are forgotten (no later job needs them)."""
        if self.pool.version != version:
            with self._lock:
                weights = self._weights[version]
            self.pool.update_weights(weights, version=version)
        with self._lock:
            for old in [v for v in self._weights if v <= version]:
                del self._weights[old]


# ---------------------------------------------------------------------- checkpoints


def in_flight_state(batches: list[ScoredBatch]) -> dict[str, Any]:
    """The plain part of `batches` for a checkpoint's state (their rows: `save_in_flight`)."""
    return {"steps": [b.step for b in batches], "scores": [b.scores for b in batches],
            "reward_baselines": [b.reward_baselines for b in batches], "metrics": [b.metrics for b in batches]}


def save_in_flight(directory: Path, batches: list[ScoredBatch]) -> None:
    """Each batch's rows as `<directory>/step_<s>.pt` (`Batch.save`)."""
    directory.mkdir(parents=True, exist_ok=True)
    for scored in batches:
        scored.batch.save(directory / f"step_{scored.step}.pt")


def load_in_flight(directory: Path, state: dict[str, Any]) -> list[ScoredBatch]:
    """The batches `in_flight_state` and `save_in_flight` wrote."""
    return [ScoredBatch(step, Batch.load(directory / f"step_{step}.pt"), scores, baselines, dict(metrics))
            for step, scores, baselines, metrics in zip(state["steps"], state["scores"], state["reward_baselines"],
                                                        state["metrics"])]
