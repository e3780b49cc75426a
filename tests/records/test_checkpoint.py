"""Checkpoints: round trip, atomic writes under a crash, keep-last-K, `latest`, RNG states."""

import hashlib
import json
import logging
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch

from reprorl.records import checkpoint as ckpt
from reprorl.records.checkpoint import (
    CheckpointError,
    CheckpointNotFoundError,
    capture_rng_state,
    checkpoint_problem,
    find_checkpoint,
    find_valid_checkpoint,
    load_checkpoint,
    read_meta,
    restore_rng_state,
    save_checkpoint,
)


def _state(step: int) -> dict:
    return {
        "actor": {"model": {"w": torch.full((2, 3), float(step)), "b": torch.arange(3)},
                  "scheduler": {"step": step}},
        "trainer": {"step": step, "name": "run", "betas": (0.9, 0.999), "none": None, "flags": [True, 1.5]},
    }


def _assert_state_equal(a, b):
    assert type(a) is type(b)
    if isinstance(a, dict):
        assert list(a) == list(b)
        for k in a:
            _assert_state_equal(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _assert_state_equal(x, y)
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b)
    else:
        assert a == b


def test_round_trip_and_layout(tmp_path):
    path = save_checkpoint(tmp_path, 3, _state(3))
    assert path == tmp_path / "checkpoints" / "step_3"
    assert sorted(p.name for p in path.iterdir()) == ["actor.pt", "meta.json", "trainer.pt"]
    meta = json.loads((path / "meta.json").read_text())
    assert {k: meta[k] for k in ("step", "components")} == {"step": 3, "components": ["actor", "trainer"]}
    assert meta["files"]["actor.pt"] == {"size": (path / "actor.pt").stat().st_size,
                                         "sha256": hashlib.sha256((path / "actor.pt").read_bytes()).hexdigest()}
    assert (tmp_path / "checkpoints" / "latest").read_text() == "step_3"
    step, state = load_checkpoint(tmp_path)
    assert step == 3
    _assert_state_equal(state, _state(3))
    # The step directory itself and an explicit step load the same.
    _assert_state_equal(load_checkpoint(path)[1], _state(3))
    _assert_state_equal(load_checkpoint(tmp_path, 3)[1], _state(3))


def test_latest_and_keep_last_k(tmp_path):
    for step in (1, 2, 10, 11):  # 10 after 2: steps sort as numbers, not strings
        save_checkpoint(tmp_path, step, _state(step), max_to_keep=2)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_10", "step_11"]
    assert load_checkpoint(tmp_path)[0] == 11
    with pytest.raises(CheckpointNotFoundError, match=r"no checkpoint for step 2 .* complete steps there: \[10, 11\]"):
        load_checkpoint(tmp_path, 2)


def test_resave_same_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 5, _state(5))
    save_checkpoint(tmp_path, 5, _state(6))
    _assert_state_equal(load_checkpoint(tmp_path)[1], _state(6))
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["latest", "step_5"]


def test_failure_mid_save_keeps_previous(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, _state(1))
    real_save, calls = torch.save, []

    def failing_save(obj, f):
        calls.append(1)
        if len(calls) == 2:  # the first component is written, the second fails
            raise OSError("disk full (simulated)")
        real_save(obj, f)

    monkeypatch.setattr(ckpt.torch, "save", failing_save)
    with pytest.raises(OSError, match="simulated"):
        save_checkpoint(tmp_path, 2, _state(2))
    root = tmp_path / "checkpoints"
    assert (root / "latest").read_text() == "step_1"
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1"]  # the temp dir was removed
    step, state = load_checkpoint(tmp_path)
    assert step == 1
    _assert_state_equal(state, _state(1))


def test_killed_writer_leaves_previous_loadable(tmp_path):
    """A real crash: the writing process dies (os._exit, no cleanup) after one file."""
    save_checkpoint(tmp_path, 1, _state(1))
    script = textwrap.dedent(f"""
        import os, torch
        from reprorl.records import checkpoint as ckpt
        real_save, calls = torch.save, []
        def dying_save(obj, f):
            calls.append(1)
            if len(calls) == 2:
                f.flush(); os._exit(9)
            real_save(obj, f)
        ckpt.torch.save = dying_save
        ckpt.save_checkpoint({str(tmp_path)!r}, 2, {{"a": torch.ones(2), "b": torch.zeros(2)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 9, proc.stderr
    root = tmp_path / "checkpoints"
    leftovers = [p for p in root.iterdir() if p.name.startswith(".tmp-")]
    assert len(leftovers) == 1 and (leftovers[0] / "a.pt").is_file()  # half-written, as a crash leaves it
    assert (root / "latest").read_text() == "step_1"
    assert find_checkpoint(tmp_path) == root / "step_1"
    _assert_state_equal(load_checkpoint(tmp_path)[1], _state(1))
    # The next save cleans the leftover.
    save_checkpoint(tmp_path, 2, _state(2))
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_1", "step_2"]


def test_latest_naming_a_missing_dir_falls_back(tmp_path):
    save_checkpoint(tmp_path, 1, _state(1))
    save_checkpoint(tmp_path, 4, _state(4))
    (tmp_path / "checkpoints" / "latest").write_text("step_9")  # a crash between the renames
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_4"
    (tmp_path / "checkpoints" / "latest").unlink()
    assert load_checkpoint(tmp_path)[0] == 4


def test_no_checkpoint(tmp_path):
    assert find_checkpoint(tmp_path) is None
    assert find_checkpoint(tmp_path / "missing") is None
    with pytest.raises(CheckpointNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError):  # what a caller probing for a checkpoint catches
        load_checkpoint(tmp_path / "missing")


def test_refuses_what_cannot_load_safely(tmp_path):
    with pytest.raises(TypeError, match=r"state\['trainer'\]\['x'\] is a float64"):
        save_checkpoint(tmp_path, 1, {"trainer": {"x": np.float64(1.0)}})
    with pytest.raises(TypeError, match=r"state\['a'\]\[0\] is a ndarray"):
        save_checkpoint(tmp_path, 1, {"a": [np.zeros(2)]})
    with pytest.raises(ValueError, match="component name"):
        save_checkpoint(tmp_path, 1, {"../x": 1})
    assert find_checkpoint(tmp_path) is None


def test_rng_round_trip_through_a_checkpoint(tmp_path):
    random.seed(1), np.random.seed(2), torch.manual_seed(3)
    random.random(), np.random.normal(), torch.rand(1)  # numpy's normal leaves a cached gaussian
    save_checkpoint(tmp_path, 1, {"rng": capture_rng_state()})
    expected = (random.random(), np.random.normal(), np.random.rand(), torch.rand(4))
    random.seed(7), np.random.seed(7), torch.manual_seed(7)  # move everything elsewhere
    restore_rng_state(load_checkpoint(tmp_path)[1]["rng"])
    got = (random.random(), np.random.normal(), np.random.rand(), torch.rand(4))
    assert got[:3] == expected[:3]
    assert torch.equal(got[3], expected[3])


def test_files_are_fsynced(tmp_path, monkeypatch):
    """Every file is fsynced before the rename publishes the directory."""
    synced, real_fsync = [], os.fsync
    monkeypatch.setattr(ckpt.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                     real_fsync(fd)))
    save_checkpoint(tmp_path, 1, _state(1))
    names = [os.path.basename(p) for p in synced]
    assert {"actor.pt", "trainer.pt", "meta.json"} <= set(names)
    assert any(n.startswith(".tmp-latest") for n in names)


# ------------------------------------------------------------------------------ damaged checkpoints


def _save_with_shards(run_dir, step):
    def fill(d):
        for rank in range(2):
            torch.save({"w": torch.full((64,), float(step + rank))}, d / f"rank_{rank}.pt")
    return save_checkpoint(run_dir, step, _state(step), write_dirs={"actor.shards": fill}, meta={"note": "extra"})


def _truncate(path, keep=10):
    path.write_bytes(path.read_bytes()[:keep])


def test_shard_files_are_listed_and_extras_kept(tmp_path):
    path = _save_with_shards(tmp_path, 1)
    meta = read_meta(path)
    assert sorted(meta["files"]) == ["actor.pt", "actor.shards/rank_0.pt", "actor.shards/rank_1.pt", "trainer.pt"]
    assert meta["note"] == "extra" and meta["step"] == 1


def test_a_truncated_shard_of_the_newest_falls_back_to_the_previous(tmp_path, caplog):
    """A shard file cut short after the save (a full disk, a bad copy): the newest intact
    checkpoint is taken, with a warning naming the damaged one, not a torch.load error."""
    _save_with_shards(tmp_path, 1)
    newest = _save_with_shards(tmp_path, 2)
    _truncate(newest / "actor.shards" / "rank_1.pt")
    with caplog.at_level(logging.WARNING, logger="reprorl.records.checkpoint"):
        assert find_valid_checkpoint(tmp_path) == tmp_path / "checkpoints" / "step_1"
        step, state = load_checkpoint(tmp_path)
    assert step == 1
    _assert_state_equal(state, _state(1))
    assert f"checkpoint {newest} is damaged (actor.shards/rank_1.pt has 10 bytes, " in caplog.text
    assert find_checkpoint(tmp_path) == newest  # the cheap lookup does not read the files


def test_same_size_corruption_and_missing_files_are_found(tmp_path):
    first = _save_with_shards(tmp_path, 1)
    second = _save_with_shards(tmp_path, 2)
    data = bytearray((second / "actor.pt").read_bytes())
    data[-20] ^= 1  # one bit, same size
    (second / "actor.pt").write_bytes(bytes(data))
    (first / "actor.shards" / "rank_0.pt").unlink()
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(tmp_path)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"no intact checkpoint under {str(tmp_path)!r} (")
    assert f"{str(second)!r}: actor.pt differs from the file saved (SHA-256)" in message
    assert f"{str(first)!r}: actor.shards/rank_0.pt is missing" in message
    assert "restore them from a copy, or move them away to train from the start" in message
    # A step asked for by number, or a step directory itself, is checked too.
    with pytest.raises(CheckpointError, match=r"checkpoint .*step_2' is damaged: actor.pt differs"):
        load_checkpoint(tmp_path, 2)
    with pytest.raises(CheckpointError, match=r"step_2'.*actor.pt differs"):
        load_checkpoint(second)


def test_checkpoints_without_digests_still_load(tmp_path):
    """Checkpoints saved before digests were kept have nothing to check against."""
    path = save_checkpoint(tmp_path, 1, _state(1))
    meta = json.loads((path / "meta.json").read_text())
    del meta["files"]
    (path / "meta.json").write_text(json.dumps(meta))
    _assert_state_equal(load_checkpoint(tmp_path)[1], _state(1))


@pytest.mark.parametrize("when", ["rotation", "resave"])
def test_a_crash_mid_delete_leaves_no_half_checkpoint(tmp_path, monkeypatch, when):
    """Deleting a checkpoint (keep-last-K, or the old copy of a step saved again) dies half
    way: what is left is never a step_<N> that counts as complete."""
    save_checkpoint(tmp_path, 1, _state(1))
    save_checkpoint(tmp_path, 2, _state(2))
    real_rmtree = ckpt.shutil.rmtree

    def dying_rmtree(path, *args, **kwargs):
        for p in sorted(Path(path).rglob("*.pt")):  # the files go first, the meta stays: a crash here
            p.unlink()
        raise KeyboardInterrupt("killed mid-delete (simulated)")

    monkeypatch.setattr(ckpt.shutil, "rmtree", dying_rmtree)
    with pytest.raises(KeyboardInterrupt):
        if when == "rotation":
            save_checkpoint(tmp_path, 3, _state(3), max_to_keep=2)
        else:
            save_checkpoint(tmp_path, 2, _state(20))
    monkeypatch.setattr(ckpt.shutil, "rmtree", real_rmtree)
    root = tmp_path / "checkpoints"
    steps = sorted(p.name for p in root.iterdir() if p.name.startswith("step_"))
    assert steps == (["step_2", "step_3"] if when == "rotation" else ["step_1", "step_2"])
    for name in steps:  # every step directory left is whole
        assert checkpoint_problem(root / name) is None
    _assert_state_equal(load_checkpoint(tmp_path)[1], _state(3) if when == "rotation" else _state(20))
