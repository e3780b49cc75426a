"""Where a run starts (`plan_resume`), decided before anything in the run directory changes:
`resume=never` on a run, a finished run with no checkpoint, config keys changed since the
checkpoint, damaged checkpoints. Synthetic run directories: no model, no Ray."""

import json
import logging

import pytest
import torch

from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.fingerprint import FINGERPRINTS_FILE
from reprorl.records.checkpoint import CheckpointError, save_checkpoint
from reprorl.records.resume_guard import SAME_BITS_KEYS, flat_config, plan_resume
from reprorl.records.tracking import METRICS_FILE


def _cfg(run_dir, *overrides):
    return load_config(None, [f"trainer.run_dir={run_dir}", *overrides])


def _save(run_dir, step, cfg, *, with_config=True):
    meta = {"config": flat_config(cfg)} if with_config else None
    return save_checkpoint(run_dir, step, {"trainer": {"step": step}, "w": torch.ones(8) * step}, meta=meta)


def _write_metrics(run_dir, steps):
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / METRICS_FILE).write_text("".join(json.dumps({"step": s, "reward/mean": 0.5}) + "\n" for s in steps))


def test_a_fresh_directory_starts_at_step_0(tmp_path):
    for mode in ("auto", "never"):
        plan = plan_resume(_cfg(tmp_path, f"trainer.resume={mode}"), tmp_path)
        assert (plan.checkpoint, plan.step, plan.changes) == (None, 0, {})


def test_never_on_a_run_is_refused(tmp_path):
    _write_metrics(tmp_path, [1])
    with pytest.raises(ConfigError, match=r"already holds a run and trainer.resume=never"):
        plan_resume(_cfg(tmp_path, "trainer.resume=never"), tmp_path)


def test_a_finished_run_without_checkpoints_is_not_trained_again(tmp_path):
    """save_freq=0: a second `reprorl train` emptied metrics.jsonl and fingerprints.jsonl
    and trained again without a word."""
    _write_metrics(tmp_path, [0, 1, 2, 3])
    (tmp_path / FINGERPRINTS_FILE).write_text("")
    with pytest.raises(ConfigError) as err:
        plan_resume(_cfg(tmp_path), tmp_path)
    assert str(err.value) == (
        f"trainer.run_dir {str(tmp_path)!r} holds 3 trained steps (up to step 3) and no checkpoint to resume from "
        f"(trainer.save_freq=0?); training again would overwrite its {METRICS_FILE} and {FINGERPRINTS_FILE}: "
        "choose another trainer.run_dir, or move those files away to train it again"
    )
    # A torn last line (a crash mid-write) does not hide the steps before it.
    with open(tmp_path / METRICS_FILE, "a") as f:
        f.write('{"step": 4, "rew')
    with pytest.raises(ConfigError, match="holds 3 trained steps"):
        plan_resume(_cfg(tmp_path), tmp_path)


def test_a_start_that_trained_no_step_may_start_over(tmp_path):
    _write_metrics(tmp_path, [0])  # validation before step 1, then a crash
    assert plan_resume(_cfg(tmp_path), tmp_path).checkpoint is None


def test_result_changing_keys_are_refused_listing_each(tmp_path):
    _save(tmp_path, 2, _cfg(tmp_path))
    changed = _cfg(tmp_path, "actor.lr=0.001", "rollout.temperature=0.7", "reward.fn=my_rewards:score")
    with pytest.raises(ConfigError) as err:
        plan_resume(changed, tmp_path)
    ckpt = str(tmp_path / "checkpoints" / "step_2")
    assert str(err.value) == (
        f"trainer.resume: the config differs from checkpoint {ckpt!r}'s in keys that change the run's results: "
        'rollout.temperature 1.0 -> 0.7, reward.fn null -> "my_rewards:score", actor.lr 5e-05 -> 0.001; '
        "set them back, or accept the change with "
        "trainer.allow_changed_keys=[rollout.temperature,reward.fn,actor.lr] (recorded in history.jsonl), "
        "or start a new run in another trainer.run_dir"
    )


def test_accepted_changes_resume_and_are_reported(tmp_path):
    _save(tmp_path, 2, _cfg(tmp_path))
    plan = plan_resume(_cfg(tmp_path, "actor.lr=0.001", "trainer.allow_changed_keys=[actor.lr]"), tmp_path)
    assert plan.step == 2 and plan.checkpoint == tmp_path / "checkpoints" / "step_2"
    assert plan.changes == {"actor.lr": [5e-05, 0.001], "trainer.allow_changed_keys": [[], ["actor.lr"]]}


def test_keys_that_cannot_change_the_bits_may_change(tmp_path):
    _save(tmp_path, 2, _cfg(tmp_path))
    free = ("rollout.num_replicas=3", "rollout.num_agent_workers=2", "reward.timeout_s=5", "trainer.loggers=[jsonl]",
            "trainer.save_freq=1", "trainer.total_steps=50", "model.gradient_checkpointing=true",
            "model.gpu_gradient_vectors=1", "trainer.experiment_name=other", "actor.log_prob_check_freq=1",
            "actor.old_log_probs=recompute", f"trainer.run_dir={tmp_path}")
    plan = plan_resume(_cfg(tmp_path, *free), tmp_path)
    assert sorted(plan.changes) == sorted(o.split("=")[0] for o in free[:-1])
    assert all(key in SAME_BITS_KEYS or key.endswith("timeout_s") or key in ("trainer.total_steps",
               "actor.old_log_probs") for key in plan.changes)


def test_old_log_probs_change_the_results_without_exact_engine_log_probs(tmp_path):
    """Under full determinism the built-in engine's log-probs are the trainer's bits, so where
    the old log-probs come from changes nothing; without it, they are other numbers."""
    _save(tmp_path, 2, _cfg(tmp_path, "full_determinism=false"))
    with pytest.raises(ConfigError, match=r"results: actor.old_log_probs \"auto\" -> \"rollout\"; "):
        plan_resume(_cfg(tmp_path, "full_determinism=false", "actor.old_log_probs=rollout"), tmp_path)


def test_total_steps_under_a_cosine_schedule_is_a_result_changing_key(tmp_path):
    """The cosine learning rate of every step depends on total_steps."""
    _save(tmp_path, 2, _cfg(tmp_path, "actor.lr_schedule=cosine"))
    with pytest.raises(ConfigError, match=r"results: trainer.total_steps 30 -> 50; "):
        plan_resume(_cfg(tmp_path, "actor.lr_schedule=cosine", "trainer.total_steps=50"), tmp_path)


def test_a_checkpoint_without_its_config_is_compared_with_the_runs_config_yaml(tmp_path):
    """Checkpoints saved before they recorded their config: the run's config.yaml stands in."""
    from reprorl.config import config_to_yaml

    cfg = _cfg(tmp_path)
    _save(tmp_path, 1, cfg, with_config=False)
    (tmp_path / "config.yaml").write_text(config_to_yaml(cfg))
    with pytest.raises(ConfigError, match=r"results: actor.lr 5e-05 -> 0.001; "):
        plan_resume(_cfg(tmp_path, "actor.lr=0.001"), tmp_path)
    (tmp_path / "config.yaml").unlink()  # nothing to compare with: resumes, saying so in the log
    assert plan_resume(_cfg(tmp_path, "actor.lr=0.001"), tmp_path).changes == {}


def test_a_damaged_newest_checkpoint_is_skipped_and_none_intact_is_an_error(tmp_path, caplog):
    cfg = _cfg(tmp_path)
    _save(tmp_path, 1, cfg)
    newest = _save(tmp_path, 2, cfg)
    (newest / "w.pt").write_bytes((newest / "w.pt").read_bytes()[:-7])
    with caplog.at_level(logging.WARNING):
        plan = plan_resume(cfg, tmp_path)
    assert plan.step == 1 and f"checkpoint {newest} is damaged (w.pt has " in caplog.text
    (tmp_path / "checkpoints" / "step_1" / "w.pt").unlink()
    with pytest.raises(CheckpointError, match=r"^no intact checkpoint under .*step_2'.*step_1': w.pt is missing"):
        plan_resume(cfg, tmp_path)


# ------------------------------------------------------------------------------ through the Trainer


def _small(assets, run_dir, *extra):
    from small_run import small_run_overrides

    return load_config(None, small_run_overrides(assets, run_dir, *extra))


def test_refused_starts_leave_the_run_directory_as_it_was(assets, tmp_path):
    """`resume=never` on a run, a changed learning rate, a finished run without checkpoints:
    each stops before any part starts, and config.yaml (rewritten first before) and the
    records stay the old run's."""
    from reprorl.config import config_to_yaml
    from reprorl.trainer.fit import Trainer

    run_dir = tmp_path / "run"
    old = _small(assets, run_dir)
    _write_metrics(run_dir, [1, 2])
    (run_dir / "config.yaml").write_text(config_to_yaml(old))
    before = {p.name: p.read_bytes() for p in run_dir.iterdir()}
    with pytest.raises(ConfigError, match="already holds a run and trainer.resume=never"):
        Trainer(_small(assets, run_dir, "trainer.resume=never", "actor.lr=0.5"))
    with pytest.raises(ConfigError, match=r"holds 2 trained steps \(up to step 2\) and no checkpoint"):
        Trainer(_small(assets, run_dir))
    _save(run_dir, 2, old)
    with pytest.raises(ConfigError, match=r"in keys that change the run's results: actor.lr 0.001 -> 0.5; "):
        Trainer(_small(assets, run_dir, "actor.lr=0.5"))
    assert {p.name: p.read_bytes() for p in run_dir.iterdir() if p.name in before} == before
    assert not (run_dir / "history.jsonl").exists()


def test_a_second_trainer_on_a_busy_run_directory_stops_naming_the_holder(assets, tmp_path):
    import subprocess
    import sys
    import textwrap

    from reprorl.trainer.fit import Trainer
    from reprorl.records.run_dir import RunDirBusyError

    script = textwrap.dedent(f"""
        import time
        from reprorl.records.run_dir import lock_run_dir
        lock = lock_run_dir({str(tmp_path / "run")!r})
        print("locked", flush=True)
        time.sleep(600)
    """)
    holder = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline() == "locked\n"
        with pytest.raises(RunDirBusyError, match=rf"is in use by another run \(pid {holder.pid} on host "):
            Trainer(_small(assets, tmp_path / "run"))
    finally:
        holder.kill()
        holder.wait(timeout=60)
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["run.lock"]  # nothing else was written


@pytest.mark.slow
def test_a_truncated_shard_resumes_from_the_previous_checkpoint_with_the_same_bits(assets, tmp_path, ray_local,
                                                                                   caplog):
    """The newest checkpoint's actor shard cut short: the run used to stop in actor worker 0
    ("PytorchStreamReader failed reading zip archive"); it now warns naming the checkpoint,
    resumes from the one before and trains the lost step again, bit for bit."""
    from reprorl.trainer.fit import Trainer
    from reprorl.records.run_dir import HISTORY_FILE, RunDirBusyError, lock_run_dir
    from small_run import run_trainer

    run_dir = tmp_path / "run"
    cfg = _small(assets, run_dir, "trainer.save_freq=1")
    trainer = Trainer(cfg)
    try:
        with pytest.raises(RunDirBusyError):  # held for the run's life
            lock_run_dir(run_dir)
        trainer.fit()
    finally:
        trainer.close()
    lock_run_dir(run_dir).release()  # and let go at close
    whole = (run_dir / FINGERPRINTS_FILE).read_text()
    shard = sorted((run_dir / "checkpoints" / "step_2" / "actor.shards").iterdir())[0]
    shard.write_bytes(shard.read_bytes()[:100])

    with caplog.at_level(logging.WARNING, logger="reprorl.records.checkpoint"):
        run_trainer(cfg)
    assert f"checkpoint {run_dir / 'checkpoints' / 'step_2'} is damaged (actor.shards/{shard.name} has 100 bytes" \
        in caplog.text
    assert (run_dir / FINGERPRINTS_FILE).read_text() == whole  # step 2 again, the same bits
    history = [json.loads(line) for line in (run_dir / HISTORY_FILE).read_text().splitlines()]
    assert [(h["event"], h["step"], h["changed"]) for h in history] == [("start", 0, {}), ("resume", 1, {})]
