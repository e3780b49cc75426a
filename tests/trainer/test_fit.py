"""The fit loop end to end on tiny models: every estimator trains, runs are bitwise
reproducible, and ReMax's sampled and greedy rows share one rollout call."""

import contextlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprorl.compare import compare_runs
from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.trainer.checks import check_paths
from reprorl.trainer.fit import TEST_KILL_AT_STEP_ENV, Trainer
from small_run import WITH_KL, run_trainer, small_run_overrides

# One Ray for the module (ray_local): Trainer.close leaves a caller's Ray up.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

ESTIMATORS = ["gae", "grpo", "remax", "rloo", "reinforce_pp", "reinforce_pp_baseline"]


def small_config(assets, run_dir, *overrides):
    return load_config(None, small_run_overrides(assets, run_dir, *overrides))


def metrics(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def without_timing(records):
    return [{k: v for k, v in r.items() if not k.startswith(("timing/", "throughput/"))} for r in records]


@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_each_estimator_trains_every_parameter(assets, tmp_path, estimator):
    cfg = small_config(assets, tmp_path / "run", f"algorithm.adv_estimator={estimator}", *WITH_KL)  # actor/kl
    trainer = Trainer(cfg)
    parts = trainer.parts
    groups = {"actor": parts.actor, "critic": parts.critic} if parts.critic else {"actor": parts.actor}
    try:
        before = {name: dict(group.named_weights()) for name, group in groups.items()}
        trainer.fit()
        after = {name: dict(group.named_weights()) for name, group in groups.items()}
    finally:
        trainer.close()
    for name in groups:
        unchanged = [k for k, v in after[name].items() if torch.equal(v, before[name][k])]
        assert unchanged == [], f"{estimator}: {name} parameters that did not change: {unchanged}"
    records = metrics(cfg.trainer.run_dir)
    assert [r["step"] for r in records] == [1, 2]
    for key in ("reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/entropy",
                "actor/kl", "actor/grad_norm", "rollout/num_generate_calls", "timing/gen_s",
                "timing/reward_s", "timing/update_s", "timing/weight_sync_s", "timing/step_s", "throughput/tokens_per_s"):
        assert key in records[-1], key
    assert all(r["rollout/num_generate_calls"] == 1 for r in records)
    # Determinism mode: the engine's log-probs ARE the trainer's, bit for bit; the loss takes
    # them, and the trainer checks them at the first step and every actor.log_prob_check_freq.
    assert [r.get("rollout/log_prob_max_gap") for r in records] == [0.0, None]


def test_reruns_are_bitwise_identical(assets, tmp_path, three_step_run):
    """The rerun has other agent workers and recomputes the old log-probs each step, where
    the first run takes the engine's (actor.old_log_probs=auto): the same bits either way."""
    b = small_config(assets, tmp_path / "b", *WITH_KL, "trainer.total_steps=3", "rollout.num_agent_workers=2",
                     "actor.old_log_probs=recompute")
    run_trainer(b)
    rerun = without_timing(metrics(b.trainer.run_dir))
    assert [r.pop("rollout/log_prob_max_gap") for r in rerun] == [0.0, 0.0, 0.0]
    first = without_timing(metrics(three_step_run))
    assert [r.pop("rollout/log_prob_max_gap", None) for r in first] == [0.0, None, None]  # checked at step 1
    assert first == rerun
    result = compare_runs(three_step_run, b.trainer.run_dir)
    assert result.identical and len(result.common_steps) == 3


def test_reruns_with_a_reward_model_are_bitwise_identical(assets, tmp_path):
    extra = (f"reward.model_path={assets['reward']}", "reward.model_weight=0.5", "trainer.total_steps=3")
    a = small_config(assets, tmp_path / "a", *extra)
    b = small_config(assets, tmp_path / "b", *extra)
    run_trainer(a)
    run_trainer(b)
    records = metrics(a.trainer.run_dir)
    assert "reward/model_mean" in records[0]
    assert without_timing(records) == without_timing(metrics(b.trainer.run_dir))
    assert compare_runs(a.trainer.run_dir, b.trainer.run_dir).identical


def test_a_different_seed_diverges(assets, tmp_path, three_step_run):
    b = small_config(assets, tmp_path / "b", *WITH_KL, "trainer.total_steps=1", "seed=7")
    run_trainer(b)
    result = compare_runs(three_step_run, b.trainer.run_dir)  # step 1 in common
    assert not result.identical and result.common_steps == [1] and result.divergence.step == 1


def test_remax_one_rollout_call_greedy_baseline_never_trained_on(assets, tmp_path):
    cfg = small_config(assets, tmp_path / "run", "algorithm.adv_estimator=remax", "trainer.total_steps=1")
    trainer = Trainer(cfg)
    calls, trained = [], []
    generate, update = trainer.parts.agent.generate_sequences, trainer.parts.actor.update

    def spy_generate(batch, do_sample):
        out = generate(batch, do_sample)
        # The same prompts as greedy rows alone, at the same weights: the baseline's reference.
        baseline_only = batch.slice(len(batch) - cfg.data.train_batch_size, len(batch))
        calls.append((do_sample, out, generate(baseline_only, [False] * len(baseline_only))))
        return out

    def spy_update(batch, *args, **kwargs):
        trained.append(batch)
        return update(batch, *args, **kwargs)

    trainer.parts.agent.generate_sequences = spy_generate
    trainer.parts.actor.update = spy_update
    try:
        trainer.fit()
        assert len(calls) == 1  # sampled rows and greedy baselines: ONE rollout call
        do_sample, out, greedy_alone = calls[0]
        n, prompts = cfg.rollout.n, cfg.data.train_batch_size
        assert list(do_sample) == [True] * (prompts * n) + [False] * prompts
        # The baseline rows are greedy: the same responses as a call holding only them.
        assert torch.equal(greedy_alone["responses"], out["responses"][prompts * n:])
        # The training batch holds the sampled rows only.
        batch = trained[0]
        assert len(batch) == prompts * n
        assert torch.equal(batch["responses"], out["responses"][: prompts * n])
        # Advantages by hand: terminal reward, gamma 1, no KL in the reward -> every valid
        # token's advantage is the sample's score minus its prompt's greedy score.
        scores = trainer.parts.reward_loop.compute(batch, trainer.tokenizer)[0]
        baseline = trainer.parts.reward_loop.compute(out.slice(prompts * n, len(out)), trainer.tokenizer)[0]
        mask = batch["response_mask"].float()
        expected = (scores - baseline.repeat_interleave(n)).unsqueeze(-1) * mask
        assert torch.equal(batch["advantages"], expected)
    finally:
        trainer.close()


def test_validation_calls_the_rule_function_once_per_sample(assets, tmp_path, monkeypatch):
    """Once per sample (validation scored every rule reward twice), and never for a run
    scored by a reward model alone (rule_weight 0), which then has no val/accuracy."""
    counting_fn = f"{Path(__file__).parent / 'counting_reward.py'}:count_calls"
    model_only = (f"reward.model_path={assets['reward']}", "reward.rule_weight=0")
    for name, extra, expected_calls in (("rule", (), 8), ("model", model_only, 0)):  # 8 validation prompts, n=1
        calls = tmp_path / f"{name}-calls.txt"
        calls.touch()
        monkeypatch.setenv("REPRORL_TEST_CALLS_FILE", str(calls))
        trainer = Trainer(small_config(assets, tmp_path / name, f"reward.fn={counting_fn}", *extra))
        try:
            val = trainer.validate(0)
        finally:
            trainer.close()
        assert len(calls.read_text().splitlines()) == expected_calls, name
        assert ("val/accuracy" in val) == (name == "rule")


def test_missing_model_path_names_the_key(assets, tmp_path):
    cfg = small_config(assets, tmp_path / "run", f"model.path={tmp_path / 'nope'}", f"model.ref_path={tmp_path / 'nope'}")
    with pytest.raises(ConfigError, match=r"model.path: '.*nope' does not exist"):
        check_paths(cfg)


def _train_process(args, **env):
    # Its own session: a SIGKILL to the group takes down whatever the driver started.
    return subprocess.Popen([sys.executable, "-m", "reprorl.cli", "train", *args], start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env={**os.environ, **env})


def test_killed_and_resumed_run_equals_the_uninterrupted_one(assets, tmp_path, three_step_run):
    """SIGKILL right after step 2's checkpoint of 3, resume: fingerprints equal a run never
    stopped (conftest.py's 3-step run, trained in this process).

    The run kills itself at that point (TEST_KILL_AT_STEP_ENV), so the test cannot race it.
    The resumed run trains in this process, on the module's Ray: another process and Ray
    start would prove nothing more."""
    common = (*WITH_KL, "trainer.total_steps=3", "trainer.save_freq=1")
    killed = _train_process(small_run_overrides(assets, tmp_path / "killed", *common), **{TEST_KILL_AT_STEP_ENV: "2"})
    returncode = killed.wait(timeout=600)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(killed.pid, signal.SIGKILL)  # what the driver started and left behind, if anything
    assert returncode == -signal.SIGKILL, killed.stderr.read()
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir()) == ["latest", "step_1", "step_2"]
    assert [r["step"] for r in metrics(tmp_path / "killed")] == [1, 2]

    run_trainer(small_config(assets, tmp_path / "killed", *common, "trainer.resume=auto"))
    result = compare_runs(three_step_run, tmp_path / "killed")
    assert result.identical and result.common_steps == [1, 2, 3], result
    assert [r["step"] for r in metrics(tmp_path / "killed")] == [1, 2, 3]


def test_no_validation_files_means_no_validation(assets, tmp_path):
    """`data.val_files=[]` (the documented "no validation") trains, and validates nothing."""
    trainer = run_trainer(small_config(assets, tmp_path / "run", "data.val_files=[]", "trainer.val_before_train=true",
                                       "trainer.test_freq=1"))
    assert trainer.val_set is None
    records = metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert not any(k.startswith("val/") for r in records for k in r)


def test_a_log_prob_gap_under_full_determinism_stops_the_run():
    """The engine's log-probs equal the trainer's by construction with the built-in engine
    under full determinism; a gap stops the run naming the step. vLLM's gap is reported only."""
    from types import SimpleNamespace

    from reprorl.errors import DeterminismError

    from reprorl.trainer.log_probs import check_log_prob_gap

    def trainer(full_determinism, backend):
        return SimpleNamespace(full_determinism=full_determinism, rollout=SimpleNamespace(backend=backend))

    def check(cfg, gap, rollout=(-1.0,), trainer_log_probs=(-1.0,), exact=False):
        check_log_prob_gap(cfg, 3, gap, torch.tensor(rollout), torch.tensor(trainer_log_probs), exact)

    check(trainer(True, "native"), 0.0)
    with pytest.raises(DeterminismError, match=r"^step 3: the engine's log-probs differ from the trainer's by up to "
                                               r"0\.25 \(rollout/log_prob_max_gap\)"):
        check(trainer(True, "native"), 0.25)
    check(trainer(True, "native"), float("nan"))  # non-finite log-probs: named after
    check(trainer(True, "vllm"), 0.25)
    check(trainer(False, "native"), 0.25)
    # Taking the engine's log-probs for the loss needs every bit: -0.0 against 0.0 is no gap,
    # but not the same bits either.
    check(trainer(True, "native"), 0.0, (0.0,), (-0.0,))
    with pytest.raises(DeterminismError, match=r"^step 3: the engine's log-probs equal the trainer's in value but not "
                                               r"in every bit"):
        check(trainer(True, "native"), 0.0, (0.0,), (-0.0,), exact=True)
