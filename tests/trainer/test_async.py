"""Bounded-staleness asynchronous training (`trainer.max_staleness`): the version rule, the
producer's order, the off-policy correction, and whole runs whose bits hold across reruns,
replica and worker counts, a killed replica and a killed driver.

The end-to-end runs are the tiny setup of tests/small_run.py, 4 steps, a checkpoint each
step and a validation at steps 2 and 4 (a validation job of the producer)."""

import contextlib
import doctest
import importlib
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from reprorl import algos, cli
from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.protocol import Batch
from reprorl.actors.supervision import KILL_ENV
from reprorl.trainer import async_rollouts
from reprorl.trainer.async_rollouts import AsyncRollouts, behaviour_version
from reprorl.trainer.fit import TEST_KILL_AT_STEP_ENV
from reprorl.trainer.generation import ScoredBatch, Validation
from reprorl.trainer.log_probs import actor_batch, old_log_probs_from_rollout
from reprorl.records.resume_guard import check_resume_config, flat_config
from small_run import small_run_overrides


def test_doctests():
    assert doctest.testmod(async_rollouts).failed == 0
    assert doctest.testmod(importlib.import_module("reprorl.algos.rollout_correction")).failed == 0


def test_the_version_rule_is_the_synchronous_loop_at_zero_and_lags_by_k():
    assert [behaviour_version(s, 0) for s in range(1, 5)] == [0, 1, 2, 3]  # step s: the weights after s - 1
    assert [behaviour_version(s, 2) for s in range(1, 7)] == [0, 0, 0, 1, 2, 3]
    for k in range(4):
        for s in range(1, 20):
            assert 0 <= s - 1 - behaviour_version(s, k) <= k  # never more than k versions stale


# ---------------------------------------------------------------------- the producer, on fakes


class FakePool:
    """Records what version each push gave; `version` is what the replicas serve."""

    def __init__(self, version=0):
        self.version, self.pushes = version, []

    def update_weights(self, weights, version):
        self.pushes.append((version, weights))
        self.version = version


class FakeGenerator:
    """A batch per step that records the pool's version when it was made, after a random delay."""

    def __init__(self, pool, seed):
        self.pool, self.rng, self.made, self.sampler_pos = pool, random.Random(seed), [], 0

    def generate(self, step):
        assert threading.current_thread() is not threading.main_thread()
        time.sleep(self.rng.random() * 0.01)
        self.sampler_pos += 1
        self.made.append(("gen", step, self.pool.version))
        batch = Batch({"x": torch.tensor([float(step)])})
        return ScoredBatch(step, batch, torch.tensor([float(self.pool.version)]), None, {"timing/gen_s": 0.0})

    def validate(self, version):
        self.made.append(("val", version, self.pool.version))
        return Validation({"val/version": float(self.pool.version)}, None)


def drive(k, total, seed, validate_at=(), start=0, restored=()):
    """The trainer's side of a run on fakes: batch, (train), publish, validate; returns
    (the jobs in the order made, {step: version trained on}, the pool)."""
    pool = FakePool(version=start)
    gen = FakeGenerator(pool, seed)
    rollouts = AsyncRollouts(gen, pool, k, total, start)
    rollouts.restore(list(restored), start)
    versions = {}
    for step in range(start + 1, total + 1):
        scored, metrics = rollouts.batch(step)
        assert scored.step == step
        assert metrics["async/staleness"] == step - 1 - behaviour_version(step, k)
        versions[step] = int(scored.scores.item())
        time.sleep(random.Random(seed + step).random() * 0.01)  # the update
        rollouts.publish(step, f"weights {step}")
        if step in validate_at:
            assert rollouts.validate(step).result().metrics == {"val/version": float(step)}
    rollouts.close()
    return gen.made, versions, pool


@pytest.mark.parametrize("k", [1, 2, 3])
def test_each_batch_is_made_with_the_rule_s_version_whatever_the_timing(k):
    runs = [drive(k, 8, seed, validate_at=(3, 8)) for seed in range(4)]
    made, versions, pool = runs[0]
    assert versions == {s: behaviour_version(s, k) for s in range(1, 9)}
    assert all(run[0] == made and run[1] == versions for run in runs[1:])  # the same order, every timing
    # Each version is pushed once, in order, when the first job that needs it starts.
    pushed = [v for v, _ in pool.pushes]
    assert pushed == sorted(set(pushed)) and all(w == f"weights {v}" for v, w in pool.pushes)
    # The validation of version t runs after step t + k's batch, before step t + k + 1's.
    val = made.index(("val", 3, 3))
    assert made[val - 1] == ("gen", 3 + k, behaviour_version(3 + k, k)) and made[val + 1][:2] == ("gen", 4 + k)


def test_a_resume_takes_back_the_batches_made_ahead_and_refuses_a_gap():
    _, whole, _ = drive(2, 8, seed=0)
    ahead = [ScoredBatch(s, Batch({"x": torch.tensor([float(s)])}), torch.tensor([float(behaviour_version(s, 2))]),
                         None, {}) for s in (5, 6)]
    _, resumed, pool = drive(2, 8, seed=1, start=4, restored=ahead)
    assert resumed == {s: v for s, v in whole.items() if s > 4}
    assert pool.pushes[0][0] == 5  # step 7's version: steps 5 and 6 came from the checkpoint
    with pytest.raises(ConfigError, match=r"^trainer.total_steps=8: the checkpoint of step 4 holds the batches of "
                                          r"steps \[5\], and with trainer.max_staleness=2 steps \[5, 6\] need"):
        drive(2, 8, seed=0, start=4, restored=ahead[:1])


def test_an_error_in_the_producer_reaches_the_trainer_at_that_step():
    pool = FakePool()
    gen = FakeGenerator(pool, 0)
    real = gen.generate
    gen.generate = lambda step: (_ for _ in ()).throw(RuntimeError("replica died")) if step == 2 else real(step)
    rollouts = AsyncRollouts(gen, pool, 1, 4, 0)
    assert rollouts.batch(1)[0].step == 1
    rollouts.publish(1, "weights 1")
    with pytest.raises(RuntimeError, match="replica died"):
        rollouts.batch(2)
    rollouts.close()


# ---------------------------------------------------------------------- the correction


def test_tis_truncates_the_weight_and_mis_drops_tokens_outside_the_band():
    prox = torch.tensor([[-1.0, -2.0, -0.5, 0.0], [-1.0, -1.0, 0.0, 0.0]])
    behav = torch.tensor([[-2.0, -1.0, -0.5, 0.0], [-1.5, -1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])
    e = torch.exp
    tis = algos.rollout_correction(prox, behav, mask, "tis", is_threshold=2.0)
    assert torch.equal(tis.weights, torch.tensor([[2.0, e(torch.tensor(-1.0)).item(), 1.0, 0.0],
                                                  [e(torch.tensor(0.5)).item(), 1.0, 0.0, 0.0]]))
    assert torch.equal(tis.mask, mask.float())
    assert tis.metrics["rollout_corr/is_truncated_fraction"] == pytest.approx(1 / 5)
    assert tis.metrics["rollout_corr/log_prob_gap_max"] == 1.0
    mis = algos.rollout_correction(prox, behav, mask, "mis", rs_threshold=1.5)
    assert mis.mask.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]  # e^1, e^-1 and e^0.5 leave [1/1.5, 1.5]
    assert mis.weights.tolist() == [[0.0, 0.0, 1.0, 0.0], [0.0, 1.0, 0.0, 0.0]]
    assert mis.metrics["rollout_corr/rs_rejected_fraction"] == pytest.approx(3 / 5)
    lower = algos.rollout_correction(prox, behav, mask, "mis", rs_threshold=3.0, rs_threshold_lower=0.1)
    assert lower.mask.tolist() == mask.float().tolist()


def test_no_gap_gives_weights_of_one_exactly():
    lp = torch.randn(3, 5)
    c = algos.rollout_correction(lp, lp.clone(), torch.ones(3, 5), "tis")
    assert torch.equal(c.weights, torch.ones(3, 5)) and c.metrics["rollout_corr/log_prob_gap_max"] == 0.0


def test_the_actor_batch_weights_advantages_and_drops_rejected_tokens():
    batch = Batch({"response_mask": torch.tensor([[1, 1, 0]]), "advantages": torch.tensor([[1.0, -2.0, 0.0]])},
                  {"finish_reason": ["stop"]})
    cfg = SimpleNamespace(actor=SimpleNamespace(mask_truncated=False))
    correction = algos.Correction(torch.tensor([[0.5, 2.0, 0.0]]), torch.tensor([[1.0, 0.0, 0.0]]), {})
    out = actor_batch(cfg, batch, correction)
    assert out["advantages"].tolist() == [[0.5, -4.0, 0.0]] and out["response_mask"].tolist() == [[1, 0, 0]]
    assert batch["advantages"].tolist() == [[1.0, -2.0, 0.0]]  # the step's own batch is unchanged
    assert actor_batch(cfg, batch, None) is batch


# ---------------------------------------------------------------------- config


def test_old_log_probs_follow_the_staleness_and_the_correction():
    def cfg(*overrides):
        return load_config(None, list(overrides))

    assert old_log_probs_from_rollout(cfg())  # the built-in engine under full determinism: exact
    assert old_log_probs_from_rollout(cfg("trainer.max_staleness=1", "full_determinism=false"))  # behaviour's
    assert not old_log_probs_from_rollout(cfg("full_determinism=false"))
    assert not old_log_probs_from_rollout(cfg("trainer.max_staleness=1", "actor.off_policy_correction=tis"))


@pytest.mark.parametrize("overrides, message", [
    (["trainer.max_staleness=-1"], r"^trainer.max_staleness: expected an integer >= 0, got -1$"),
    (["actor.off_policy_correction=tis", "actor.old_log_probs=rollout"],
     r"^actor.off_policy_correction=tis with actor.old_log_probs=rollout: the correction weighs"),
    (["actor.off_policy_correction=mis", "actor.policy_loss=clip_cov"],
     r"^actor.off_policy_correction=mis with actor.policy_loss=clip_cov: "),
    (["actor.off_policy_correction=mis", "actor.rollout_rs_threshold=2.0", "actor.rollout_rs_threshold_lower=2.0"],
     r"^actor.rollout_rs_threshold_lower=2.0 must be below actor.rollout_rs_threshold=2.0"),
    (["actor.off_policy_correction=is"], r"^actor.off_policy_correction: expected one of none, tis, mis"),
])
def test_bad_settings_stop_with_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message) as err:
        load_config(None, overrides)
    assert "\n" not in str(err.value)


def test_a_resume_refuses_a_changed_staleness_even_when_allowed():
    saved = flat_config(load_config(None, ["trainer.max_staleness=1"]))
    with pytest.raises(ConfigError, match=r"^trainer.resume: trainer.max_staleness 1 -> 2 since checkpoint 'c'"):
        check_resume_config(saved, load_config(None, ["trainer.max_staleness=2",
                                                      "trainer.allow_changed_keys=[trainer.max_staleness]"]), "c")
    assert check_resume_config(saved, load_config(None, ["trainer.max_staleness=1"]), "c") == {}


def test_config_help_explains_the_staleness(capsys):
    assert cli.main(["config"]) == 0
    out = capsys.readouterr().out
    assert "max_staleness: 0" in out and "max(0, s - 1 - k)" in out and "off_policy_correction: none" in out


# ---------------------------------------------------------------------- whole runs


COMMON = ("trainer.total_steps=4", "trainer.save_freq=1", "trainer.test_freq=2")


def train(assets, run_dir, *overrides, env=None):
    for key, value in (env or {}).items():
        os.environ[key] = value
    try:
        assert cli.main(["train", *small_run_overrides(assets, run_dir, *COMMON, *overrides)]) == 0
    finally:
        for key in env or {}:
            os.environ.pop(key, None)
    return run_dir


def records(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def async_run(assets, tmp_path_factory):
    """`async_run(k)`: the k-stale run every other is compared with, trained once a module."""
    root = tmp_path_factory.mktemp("async")
    made = {}

    def get(k):
        if k not in made:
            made[k] = train(assets, root / f"k{k}", f"trainer.max_staleness={k}")
        return made[k]

    return get


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_stale_runs_are_bitwise_identical_on_rerun(assets, tmp_path, async_run, assert_bitwise_identical, k):
    first = async_run(k)
    assert [r.get("async/staleness") for r in records(first) if r["step"] > 0] == [min(s - 1, k) for s in range(1, 5)]
    assert [r["step"] for r in records(first) if "val/accuracy" in r] == [2, 4]
    assert_bitwise_identical(first, train(assets, tmp_path / "again", f"trainer.max_staleness={k}"), steps=4)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_stale_run_has_the_same_bits_on_2_replicas_and_2_workers(assets, tmp_path, async_run,
                                                                   assert_bitwise_identical):
    run = train(assets, tmp_path / "wide", "trainer.max_staleness=1", "rollout.num_replicas=2",
                "rollout.num_agent_workers=2", "trainer.num_workers=2")
    assert_bitwise_identical(async_run(1), run, steps=4)


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_stale_run_differs_from_the_synchronous_one_from_its_second_step(assets, tmp_path, async_run):
    from reprorl.compare import compare_runs

    sync = train(assets, tmp_path / "sync", "trainer.max_staleness=0")
    result = compare_runs(sync, async_run(1))
    assert not result.identical and result.divergence.step == 2, result  # step 1: version 0 in both


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_replica_killed_in_a_stale_run_changes_no_bit(assets, tmp_path, async_run, assert_bitwise_identical):
    run = train(assets, tmp_path / "killed", "trainer.max_staleness=1", "rollout.num_replicas=2",
                env={KILL_ENV: "rollout replica 1@train/3/#1"})
    assert_bitwise_identical(async_run(1), run, steps=4)
    assert {r["step"]: r["rollout/replica_restarts"] for r in records(run) if r.get("rollout/replica_restarts")} \
        == {2: 1.0}  # step 3's batch is made while step 2 trains: its restart is counted there


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_stale_run_killed_and_resumed_equals_the_uninterrupted_one(assets, tmp_path, async_run,
                                                                    assert_bitwise_identical):
    """SIGKILL of the driver right after step 2's checkpoint, which holds step 3's batch
    (made with the weights of step 1); the resumed run trains in this process."""
    args = small_run_overrides(assets, tmp_path / "killed", *COMMON, "trainer.max_staleness=1")
    killed = subprocess.Popen([sys.executable, "-m", "reprorl.cli", "train", *args], start_new_session=True,
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, TEST_KILL_AT_STEP_ENV: "2"})
    returncode = killed.wait(timeout=600)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)
    assert returncode == -signal.SIGKILL, killed.stderr.read()
    assert sorted(p.name for p in (tmp_path / "killed/checkpoints/step_2/in_flight").iterdir()) == ["step_3.pt"]
    train(assets, tmp_path / "killed", "trainer.max_staleness=1")
    assert_bitwise_identical(async_run(1), tmp_path / "killed", steps=4)
