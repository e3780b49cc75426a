"""Faults (issue 17): a part of a run dies mid-step and the run still gives the same bits.

Each test trains tiny GRPO runs through the CLI entry point (`reprorl.cli.main`, in this
process, on the module's one Ray), with the test hook `REPRORL_TEST_KILL`
(`reprorl.actors.supervision.KILL_ENV`) making one part SIGKILL its own process at a
fixed point: "rollout replica 1@train/3/#1" = replica 1, on the first request of step 3
it receives, so requests of that rollout are in flight on it and on the other replica.
`reprorl compare` with a run nobody killed must say "bitwise identical". Replacements get
new ids (the first replacement of a 2-replica pool is replica 2), which the chaos test
uses to kill replacements too.
"""

import json
import os
from pathlib import Path

import pytest

from reprorl import cli
from reprorl.determinism_report import TEXT_FILE
from reprorl.actors.supervision import HANG_ENV, KILL_ENV
from small_run import WITH_KL, small_run_overrides

# One Ray for the module (ray_local): the runs leave a caller's Ray up.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

COMMON = ("rollout.num_replicas=2", "rollout.num_agent_workers=2")
# The runs that fail and resume have no KL term (small_run's default), so no reference group:
# the faults are the rollout's, the reward model's and the agent loop's; the reference computes
# from the batch they make, whose bits the comparison with the run nobody killed checks anyway.
# (The two start-up tests at the end add the reference: they check the groups started beside it.)


def train(assets, run_dir: Path, *overrides: str, kill: str | None = None, hang: str | None = None) -> Path:
    """`reprorl train` on the tiny setup (2 prompts x n=2, 8 tokens) with 2 replicas and 2 workers;
    `kill` / `hang`: `KILL_ENV` / `HANG_ENV` rules (SIGKILL / SIGSTOP a part)."""
    hooks = {KILL_ENV: kill, HANG_ENV: hang}
    os.environ.update({env: rule for env, rule in hooks.items() if rule is not None})
    try:
        assert cli.main(["train", *small_run_overrides(assets, run_dir, *COMMON, *overrides)]) == 0
    finally:
        for env in hooks:
            os.environ.pop(env, None)
    return run_dir


@pytest.fixture(scope="module")
def unfailed(assets, tmp_path_factory):
    """`unfailed(*overrides)`: the run nobody killed, trained once per module for each setting."""
    root = tmp_path_factory.mktemp("unfailed")
    made: dict[tuple[str, ...], Path] = {}

    def get(*overrides: str) -> Path:
        if overrides not in made:
            made[overrides] = train(assets, root / str(len(made)), *overrides)
        return made[overrides]

    return get


def restarts(run_dir: Path, metric: str) -> dict[int, float]:
    """{step: replacements that step} for the steps with any."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r[metric] for r in records if r[metric]}


def report_parts(run_dir: Path) -> list[str]:
    text = (run_dir / TEXT_FILE).read_text()
    assert text.startswith("determinism: full determinism: on, all parts agree"), text
    return json.loads((run_dir / "determinism.json").read_text())["parts"]


def test_a_rollout_replica_killed_mid_rollout(assets, unfailed, tmp_path, assert_bitwise_identical):
    run = train(assets, tmp_path / "killed", "trainer.total_steps=6", kill="rollout replica 1@train/3/#1")
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)
    assert restarts(run, "rollout/replica_restarts") == {3: 1.0}
    # The report, rewritten after the restart, checked the replacement like the first replicas.
    parts = report_parts(run)
    assert "rollout replica 2" in parts and "rollout replica 1" not in parts


def test_a_rollout_replica_that_hangs_mid_rollout(assets, unfailed, tmp_path, assert_bitwise_identical):
    """Replica 1 SIGSTOPs itself on its first request of step 2: alive to Ray, silent. Its
    requests are retried on replica 0 past their limit (trainer.part_timeout_s, small here),
    and the weight push after the rollout finds it hung and replaces it."""
    run = train(assets, tmp_path / "hung", "trainer.total_steps=6", "trainer.part_timeout_s=8",
                hang="rollout replica 1@train/2/#1")
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)
    assert restarts(run, "rollout/replica_restarts") == {2: 1.0}
    parts = report_parts(run)
    assert "rollout replica 2" in parts and "rollout replica 1" not in parts


def test_the_only_rollout_replica_killed(assets, unfailed, tmp_path, assert_bitwise_identical):
    """Every replica of the pool dead mid-rollout: the chunks rerun once the pool replaced it."""
    run = train(assets, tmp_path / "killed", "trainer.total_steps=6", "rollout.num_replicas=1",
                kill="rollout replica 0@train/3/#1")
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)
    assert restarts(run, "rollout/replica_restarts") == {3: 1.0}
    assert "rollout replica 1" in report_parts(run)


def test_a_reward_model_replica_killed_mid_scoring(assets, unfailed, tmp_path, assert_bitwise_identical):
    # Each RM replica scores one chunk a step: its third score call is step 3's.
    rm = (f"reward.model_path={assets['reward']}", "reward.num_replicas=2", "reward.model_weight=0.5")
    run = train(assets, tmp_path / "killed", "trainer.total_steps=6", *rm, kill="reward replica 1@score#3")
    assert_bitwise_identical(unfailed("trainer.total_steps=6", *rm), run, steps=6)
    assert restarts(run, "reward/replica_restarts") == {3: 1.0}
    assert "reward replica 2" in report_parts(run)


def test_an_agent_loop_worker_killed_mid_rollout(assets, unfailed, tmp_path, assert_bitwise_identical):
    # Worker 0 runs 2 of step 3's 4 samples: it dies sending the second, the first in flight.
    run = train(assets, tmp_path / "killed", "trainer.total_steps=6", kill="agent-loop worker 0@train/3/#2")
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)
    assert restarts(run, "agent_loop/worker_restarts") == {3: 1.0}
    assert "agent-loop worker 2" in report_parts(run)


def test_chaos_a_replica_killed_at_each_of_four_steps(assets, unfailed, tmp_path, assert_bitwise_identical):
    """Replicas 0 and 1, then their replacements 2 and 3, each at its first request of steps 2
    to 5: four restarts, the default limit; step 6 runs on replicas 4 and 5. (Six steps, so it
    compares with the same run nobody killed as the other tests.)"""
    kills = ",".join(f"rollout replica {victim}@train/{step}/#1" for victim, step in ((0, 2), (1, 3), (2, 4), (3, 5)))
    run = train(assets, tmp_path / "chaos", "trainer.total_steps=6", kill=kills)
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)
    assert restarts(run, "rollout/replica_restarts") == {2: 1.0, 3: 1.0, 4: 1.0, 5: 1.0}
    assert {"rollout replica 4", "rollout replica 5"} <= set(report_parts(run))


def test_max_restarts_exceeded_stops_naming_the_part_and_resumes_bitwise(assets, unfailed, tmp_path, capsys,
                                                                       assert_bitwise_identical):
    run = tmp_path / "stopped"
    overrides = small_run_overrides(assets, run, *COMMON, "trainer.total_steps=6", "trainer.save_freq=1",
                                    "trainer.max_restarts=0")
    os.environ[KILL_ENV] = "rollout replica 1@train/3/#1"
    capsys.readouterr()
    assert cli.main(["train", *overrides]) == 2
    del os.environ[KILL_ENV]
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("error: step 3: rollout replica 1 died (noticed in update_weights to version 3 at "), err
    assert "no replacement is left: trainer.max_restarts=0" in err
    assert err.endswith(f"The newest checkpoint, '{run / 'checkpoints' / 'step_2'}', is unchanged; "
                        "trainer.resume=auto continues from it."), err
    assert sorted(p.name for p in (run / "checkpoints").glob("step_*")) == ["step_1", "step_2"]

    assert cli.main(["train", *overrides]) == 0  # trainer.resume=auto: from step 2, nobody killed
    assert_bitwise_identical(unfailed("trainer.total_steps=6"), run, steps=6)


def test_a_part_that_fails_to_start_stops_the_parts_started_with_it(assets, tmp_path, monkeypatch):
    """The trainer starts every part at once: when the rollout replicas fail to start, the
    error is theirs, and the actor and reference processes (ready by then) are stopped too."""
    import time

    import ray

    from reprorl.config import load_config
    from reprorl.trainer import fit, parts

    groups = []

    class RecordedGroup(parts.WorkerGroup):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            groups.append(self)

    monkeypatch.setattr(parts, "WorkerGroup", RecordedGroup)
    # A rule no part can parse: each rollout replica raises it in its constructor.
    monkeypatch.setenv(KILL_ENV, "rollout replica 0@x#0")
    cfg = load_config(None, small_run_overrides(assets, tmp_path / "run", *COMMON, *WITH_KL))
    with pytest.raises(ray.exceptions.RayActorError, match=r"RolloutReplica[\s\S]*REPRORL_TEST_KILL: rule"):
        fit.Trainer(cfg)
    assert [g.role for g in groups] == ["actor", "ref"]
    pids = [pid for g in groups for pid in g.pids.values()]
    assert len(pids) == 2 and all(g.workers == [] for g in groups)
    deadline = time.monotonic() + 30
    while (alive := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert alive == [], f"worker processes {alive} still run after the failed start"


def test_a_group_whose_constructor_raises_leaves_the_groups_before_it_stopped(assets, tmp_path, monkeypatch):
    """The worker groups are made one after another, started and not waited for: when the
    reference's constructor raises, the actor group made before it is stopped too."""
    from reprorl.config import load_config
    from reprorl.trainer import fit, parts

    groups = []

    class RecordedGroup(parts.WorkerGroup):
        def __init__(self, role, *args, **kwargs):
            if role == "ref":
                raise RuntimeError("the reference cannot start")
            super().__init__(role, *args, **kwargs)
            groups.append(self)

    monkeypatch.setattr(parts, "WorkerGroup", RecordedGroup)
    cfg = load_config(None, small_run_overrides(assets, tmp_path / "run", *COMMON, *WITH_KL))
    with pytest.raises(RuntimeError, match="the reference cannot start"):
        fit.Trainer(cfg)
    assert [g.role for g in groups] == ["actor"] and groups[0].workers == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True
