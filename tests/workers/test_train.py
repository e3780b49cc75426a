"""World-size gates: real `reprorl train` runs with 1, 2, 4 and 8 workers per group, compared
by `reprorl compare`; checkpoints saved with one worker count and resumed with another; a
worker killed in an update; a disallowed count.

Each run is 3 steps of the tiny setup (2 prompts x n=2: 4 samples, micro-batches of 1, so
4 micro-batches per mini-batch, laid on a tree of 4 leaves), a checkpoint after
every step. On this 2-core machine a 4-worker PPO run starts 12 worker processes: most of
a run's time is start-up.
"""

import hashlib
import os
import signal
from pathlib import Path

import pytest

from reprorl import cli
from reprorl.compare import compare_runs
from reprorl.config import load_config
from reprorl.trainer import saving
from reprorl.trainer.fit import Trainer
from reprorl.workers.group import WorkerError
from small_run import WITH_KL, run_trainer, small_run_overrides

# One Ray for the module (ray_local): the runs leave a caller's Ray up.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

ALGOS = {
    "grpo": ("algorithm.adv_estimator=grpo",),
    "ppo": ("algorithm.adv_estimator=gae",),  # with a critic group, and the reference for the KL loss
}


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """The module's run directories (the runs below are trained once, shared by the tests)."""
    return tmp_path_factory.mktemp("dp")


def overrides(assets, run_dir, algo, num_workers, *extra):
    return small_run_overrides(
        assets, run_dir, *ALGOS[algo], *WITH_KL, "actor.ppo_micro_batch_size=1",
        "critic.ppo_micro_batch_size=1", "trainer.total_steps=3", "trainer.save_freq=1",
        f"trainer.num_workers={num_workers}", *extra,
    )


_RUNS: dict = {}


def run(assets, root, algo, num_workers) -> Path:
    """The module's one run of `algo` with `num_workers` workers (trained on first use)."""
    key = (algo, num_workers)
    if key not in _RUNS:
        run_dir = root / f"{algo}-{num_workers}"
        assert cli.main(["train", *overrides(assets, run_dir, algo, num_workers)]) == 0
        _RUNS[key] = run_dir
    return _RUNS[key]


@pytest.mark.parametrize("algo", list(ALGOS))
def test_one_two_and_four_workers_train_the_same_bits(assets, root, assert_bitwise_identical, algo):
    runs = {n: run(assets, root, algo, n) for n in (1, 2, 4)}
    for a, b in ((1, 2), (1, 4), (2, 4)):
        assert_bitwise_identical(runs[a], runs[b], steps=3)
    report = (runs[4] / "determinism.txt").read_text()
    assert report.startswith("determinism: full determinism: on, all parts agree"), report
    groups = ("actor", "ref", "critic") if algo == "ppo" else ("actor", "ref")
    for group in groups:
        assert all(f"{group} worker {rank}" in report for rank in range(4)), report


def test_a_token_budget_trains_the_same_bits_on_one_and_two_workers(assets, root, assert_bitwise_identical):
    """PPO with micro-batches by token budget (72: the widest sample, 64 + 8) for the actor,
    the reference and the critic: whatever count of micro-batches the lengths make, 1 and 2
    workers give the same bits."""
    runs = {}
    for n in (1, 2):
        runs[n] = root / f"ppo-budget-{n}"
        assert cli.main(["train", *overrides(assets, runs[n], "ppo", n,
                                             "actor.ppo_max_token_len_per_micro_batch=72")]) == 0
    assert_bitwise_identical(runs[1], runs[2], steps=3)


@pytest.mark.parametrize("algo", list(ALGOS))
def test_eight_workers_give_one_workers_bits_past_the_micro_batch_count(assets, root, assert_bitwise_identical,
                                                                       algo):
    """1 and 8 workers: GRPO with micro-batches of one sample, PPO with its critic with a token
    budget of 72 tokens (the widest sample). Either way 4 micro-batches a mini-batch, laid on
    a tree of 4 leaves that 8 workers extend with empty ones (flat.py), so workers 4-7
    compute nothing and send -0.0; the bits are one worker's (GRPO: with the parameters
    sharded at rest too, workers 4-7 replaying the collectives). Then the 8 workers' step-1
    checkpoint resumed on 2 workers: steps 2 and 3 are those bits too. Without a KL term: no
    reference group (8 or 16 processes)."""
    cut = () if algo == "grpo" else ("actor.ppo_max_token_len_per_micro_batch=72",)

    def no_kl_overrides(run_dir, n, *extra):
        return overrides(assets, run_dir, algo, n, *cut, "actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false",
                         *extra)

    runs = {}
    for n in (1, 8):
        runs[n] = root / f"{algo}-no-kl-{n}"
        assert cli.main(["train", *no_kl_overrides(runs[n], n)]) == 0
    assert_bitwise_identical(runs[1], runs[8], steps=3)
    if algo == "grpo":  # and with parameters sharded at rest: workers 4-7 replay every round's collectives
        sharded = root / f"{algo}-no-kl-8-sharded"
        assert cli.main(["train", *no_kl_overrides(sharded, 8, "model.shard_params=true")]) == 0
        assert_bitwise_identical(runs[1], sharded, steps=3)
    report = (runs[8] / "determinism.txt").read_text()
    groups = ("actor", "critic") if algo == "ppo" else ("actor",)
    assert all(f"{group} worker {rank}" in report for group in groups for rank in range(8)), report
    assert "ref worker" not in report, report
    resumed = root / f"{algo}-no-kl-8-then-2"
    run_trainer(load_config(None, no_kl_overrides(resumed, 2, f"trainer.resume={runs[8] / 'checkpoints' / 'step_1'}")))
    result = compare_runs(runs[1], resumed)  # the resumed run has no step 1 of its own
    assert result.divergence is None and result.common_steps == [2, 3] and result.only_in_b == [], result


@pytest.mark.parametrize(("saved_with", "resumed_with"), [(2, 1), (1, 4)])
def test_a_checkpoint_resumes_bitwise_with_another_worker_count(assets, root, saved_with, resumed_with):
    """Step 1's checkpoint of the PPO run with `saved_with` workers, resumed in a new run
    directory with `resumed_with`: steps 2 and 3 are the bits of the uninterrupted runs."""
    saved = run(assets, root, "ppo", saved_with) / "checkpoints" / "step_1"
    resumed = root / f"ppo-{saved_with}-then-{resumed_with}"
    cfg = load_config(None, overrides(assets, resumed, "ppo", resumed_with, f"trainer.resume={saved}"))
    run_trainer(cfg)
    for uninterrupted in (run(assets, root, "ppo", saved_with), run(assets, root, "ppo", 1)):
        result = compare_runs(uninterrupted, resumed)  # the resumed run has no step 1 of its own
        assert result.divergence is None and result.common_steps == [2, 3] and result.only_in_b == [], result


def test_parameters_sharded_at_rest_train_the_same_bits_and_resume_with_whole_ones(assets, root):
    """PPO (actor, critic, reference) on 4 workers with `model.shard_params=true`: each keeps
    a quarter of the actor's and critic's weights and gathers a layer at a time; the bits of
    1 worker with whole weights. Its step-1 checkpoint resumed on 2 workers with whole weights:
    steps 2 and 3 are those bits too (the shard files do not depend on it)."""
    sharded = root / "ppo-4-sharded"
    assert cli.main(["train", *overrides(assets, sharded, "ppo", 4, "model.shard_params=true")]) == 0
    result = compare_runs(run(assets, root, "ppo", 1), sharded)
    assert result.identical and result.common_steps == [1, 2, 3], result
    resumed = root / "ppo-4-sharded-then-2"
    run_trainer(load_config(None, overrides(assets, resumed, "ppo", 2,
                                            f"trainer.resume={sharded / 'checkpoints' / 'step_1'}")))
    result = compare_runs(run(assets, root, "ppo", 1), resumed)
    assert result.divergence is None and result.common_steps == [2, 3] and result.only_in_b == [], result


def _digests(directory: Path) -> dict[str, str]:
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def test_a_worker_killed_in_an_update_stops_the_run_naming_it_and_the_run_resumes_bitwise(assets, root, monkeypatch):
    """GRPO with 2 workers; at step 2, actor worker 1 gets SIGKILL as the actor update
    starts (rank 0 then runs its half and waits for it in the reduction)."""
    run_dir = root / "grpo-killed"
    trainer = Trainer(load_config(None, overrides(assets, run_dir, "grpo", 2)))
    saved = {}
    actor = trainer.parts.actor
    real_save, real_update = saving.save, actor.update

    def save_and_digest(where, step, *args, **kwargs):
        path = real_save(where, step, *args, **kwargs)
        saved[step] = _digests(path)
        return path

    def kill_worker_1_at_step_2(batch, **kwargs):
        if trainer.step == 2:
            os.kill(actor.pids[1], signal.SIGKILL)
        return real_update(batch, **kwargs)

    monkeypatch.setattr(saving, "save", save_and_digest)
    monkeypatch.setattr(actor, "update", kill_worker_1_at_step_2)
    pid = actor.pids[1]
    try:
        with pytest.raises(WorkerError) as info:
            trainer.fit()
    finally:
        trainer.close()
    step_1 = run_dir / "checkpoints" / "step_1"
    assert str(info.value) == (
        f"step 2: actor worker 1 (pid {pid}) died during update; the actor group is stopped; the run stopped. "
        f"The newest checkpoint, {str(step_1)!r}, is unchanged; trainer.resume=auto continues from it."
    )
    assert list(saved) == [1] and _digests(step_1) == saved[1]
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1"]

    monkeypatch.undo()
    run_trainer(load_config(None, overrides(assets, run_dir, "grpo", 2)))  # trainer.resume=auto
    result = compare_runs(run(assets, root, "grpo", 1), run_dir)
    assert result.identical and result.common_steps == [1, 2, 3], result


def test_a_disallowed_worker_count_is_a_one_line_error_naming_the_key(assets, root, capsys):
    run_dir = root / "three"
    assert cli.main(["train", *overrides(assets, run_dir, "grpo", 3)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: trainer.num_workers=3: expected a power of two (1, 2, 4, 8, ...), so that every allowed count gives "
        "the same bits (reprorl/workers/flat.py)"
    ]
    assert not run_dir.exists()  # refused before anything started
