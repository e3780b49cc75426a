"""Checkpoints of a run: atomic writes, keep-last-K, a `latest` pointer, RNG states.

Layout under the run directory:

    run_dir/checkpoints/step_<N>/<component>.pt   one file per top-level key of the state
    run_dir/checkpoints/step_<N>/<name>/          directories others fill (a worker group's shards)
    run_dir/checkpoints/step_<N>/meta.json        step, component names, the size and SHA-256 of
                                                  every other file, the caller's extras; written last
    run_dir/checkpoints/latest                    "step_<N>": the newest complete checkpoint

A checkpoint is written into a temp directory beside the others (`.tmp-step_<N>-*`), every
file and the directory fsynced, then renamed to `step_<N>` in one `os.rename`: a crash
leaves either no `step_<N>` or a complete one, never half of one. `latest` is updated
afterwards with `reprorl.io.atomic_write`, so it always names a complete
checkpoint. A checkpoint that goes (keep-last-K, a step saved again) is first renamed to a
temp name, then deleted, so a crash mid-delete never leaves a `step_<N>` with files
missing. Temp directories left by a crash are ignored when loading and removed by the
next save (one writer per run directory: reprorl/records/run_dir.py).

Loading checks each file against the sizes and digests in `meta.json` first (a file
truncated or changed on disk after the save): `load_checkpoint` and
`find_valid_checkpoint` skip a damaged checkpoint with a warning naming it and take the
newest intact one.

The state is a dict of components (e.g. {"actor": ..., "critic": ..., "rng": ...,
"trainer": ...}), each a nested structure of tensors and plain Python values (dict, list,
tuple, str, int, float, bool, None). It is saved with `torch.save` and loaded with
`weights_only=True`, so loading a checkpoint never unpickles code; `save_checkpoint`
refuses anything else up front, naming where it sits in the state.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import random
import re
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprorl.errors import CheckpointError, ReproRLError
from reprorl.io import TMP_PREFIX, atomic_write, fsync_dir

logger = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
LATEST = "latest"
META = "meta.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")
_PLAIN_LEAVES = (type(None), bool, int, float, str, torch.Tensor, torch.dtype, torch.device)


class CheckpointNotFoundError(ReproRLError, FileNotFoundError):
    """A path that holds no checkpoint (also a FileNotFoundError, for callers that probe)."""


# ------------------------------------------------------------------------------ save


def save_checkpoint(run_dir: str | os.PathLike, step: int, state: dict[str, Any],
                    *, max_to_keep: int | None = None, write_dirs: dict[str, Callable[[Path], None]] | None = None,
                    meta: dict[str, Any] | None = None) -> Path:
    """Write `state` as `run_dir/checkpoints/step_<step>/`, atomically; return that path.

    `write_dirs` maps a directory name to a function that fills it (other processes may
    write there: a worker group's shard files); each is created inside the temp directory
    and fsynced with it, so it is renamed into place with the rest or not at all.

    Then point `latest` at it and delete the oldest checkpoints beyond `max_to_keep`
    (None = keep all; the one just written is always kept). Saving a step that already
    has a checkpoint replaces it. `meta`: JSON values stored in `meta.json` besides the
    step, components and file digests (`read_meta` returns them).
    """
    if step < 0:
        raise ValueError(f"checkpoint step must be >= 0, got {step}")
    if max_to_keep is not None and max_to_keep < 1:
        raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}")
    for name, value in state.items():
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]*", name):
            raise ValueError(f"checkpoint component name {name!r}: use letters, digits, '_', '.', '-'")
        _check_plain(value, f"state[{name!r}]")
    root = Path(run_dir) / CHECKPOINTS_DIR
    root.mkdir(parents=True, exist_ok=True)
    _remove_temp_dirs(root)

    final = root / f"step_{step}"
    tmp = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}step_{step}-", dir=root))
    old = None
    try:
        for name, value in state.items():
            _write_file(tmp / f"{name}.pt", lambda f, v=value: torch.save(v, f))
        for name, fill in (write_dirs or {}).items():
            (tmp / name).mkdir()
            fill(tmp / name)
            fsync_dir(tmp / name)
        record = {**(meta or {}), "step": step, "components": list(state), "files": _file_digests(tmp)}
        _write_file(tmp / META, lambda f: f.write(json.dumps(record, indent=1).encode()))
        fsync_dir(tmp)
        # Re-saving a step (after a resume): move the old one out of the way first. A crash
        # between the renames leaves no step_<N>; `latest` then names a missing directory
        # and loading falls back to the newest complete one.
        old = _move_aside(root, final.name) if final.exists() else None
        os.rename(tmp, final)
        fsync_dir(root)
        if old is not None:
            shutil.rmtree(old)
    except BaseException:
        if old is not None and not final.exists():
            os.rename(old / final.name, final)  # the new one did not take its place: the old one stays
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    with atomic_write(root / LATEST) as tmp:
        tmp.write_bytes(final.name.encode())
    if max_to_keep is not None:
        for old_step in _complete_steps(root)[:-max_to_keep]:
            if old_step != step:
                shutil.rmtree(_move_aside(root, f"step_{old_step}"))
    return final


def _move_aside(root: Path, name: str) -> Path:
    """Rename `root/name` to a temp directory (removed by the next save if a crash
    interrupts its deletion) and return that: a step directory goes in one rename."""
    aside = Path(tempfile.mkdtemp(prefix=f"{TMP_PREFIX}old-{name}-", dir=root))
    os.rename(root / name, aside / name)
    fsync_dir(root)
    return aside


def _file_digests(ckpt: Path) -> dict[str, dict[str, Any]]:
    """{relative path: {"size", "sha256"}} of every file under `ckpt` but `meta.json`."""
    return {p.relative_to(ckpt).as_posix(): {"size": p.stat().st_size, "sha256": _sha256(p)}
            for p in sorted(ckpt.rglob("*")) if p.is_file() and p.name != META}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _check_plain(value: Any, where: str) -> None:
    """Refuse what `torch.load(weights_only=True)` could not load back, naming its place."""
    if isinstance(value, dict):
        for k, v in value.items():
            if not isinstance(k, (str, int)):
                raise TypeError(f"{where}: key {k!r} is a {type(k).__name__}; checkpoint keys must be str or int")
            _check_plain(v, f"{where}[{k!r}]")
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _check_plain(v, f"{where}[{i}]")
    elif type(value) not in _PLAIN_LEAVES and not isinstance(value, torch.Tensor):
        raise TypeError(f"{where} is a {type(value).__name__}; a checkpoint holds only tensors, dict, list, "
                        "tuple, str, int, float, bool and None (convert numpy values to tensors or lists)")


def _write_file(path: Path, write) -> None:
    """A durable write into the checkpoint's temp directory, whose rename makes it atomic."""
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _remove_temp_dirs(root: Path) -> None:
    """Remove what a crashed save left behind (one writer per run directory)."""
    for p in root.iterdir():
        if p.name.startswith(TMP_PREFIX):
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


def _complete_steps(root: Path) -> list[int]:
    """Steps with a complete checkpoint directory under `root`, ascending."""
    steps = []
    for p in root.iterdir() if root.is_dir() else []:
        m = _STEP_DIR.match(p.name)
        if m and (p / META).is_file():
            steps.append(int(m.group(1)))
    return sorted(steps)


# ------------------------------------------------------------------------------ load


def find_checkpoint(path: str | os.PathLike) -> Path | None:
    """The checkpoint directory `path` names, or None when a run has none yet; unverified.

    `path` may be a run directory (its `checkpoints/` is searched), a `checkpoints/`
    directory, or one `step_<N>` directory (returned as it is). In a run, the checkpoint
    `latest` names is taken; if `latest` is missing or names a directory that is gone
    (a crash between the writes), the complete checkpoint with the highest step.
    """
    candidates = _candidates(Path(path))
    return candidates[0] if candidates else None


def find_valid_checkpoint(path: str | os.PathLike) -> Path | None:
    """As `find_checkpoint`, but the newest checkpoint whose files match their digests.

    A damaged one is skipped with a warning naming it and what is wrong; when every
    checkpoint there is damaged, raises `CheckpointError` naming each. None: no checkpoint.
    """
    candidates = _candidates(Path(path))
    damaged = []
    for ckpt in candidates:
        problem = checkpoint_problem(ckpt)
        if problem is None:
            for bad, why in damaged:
                logger.warning("checkpoint %s is damaged (%s): skipped; using %s, the newest intact one",
                               bad, why, ckpt)
            return ckpt
        damaged.append((ckpt, problem))
    if damaged:
        listed = "; ".join(f"{str(bad)!r}: {why}" for bad, why in damaged)
        raise CheckpointError(f"no intact checkpoint under {str(path)!r} ({listed}): restore them from a copy, "
                              "or move them away to train from the start")
    return None


def _candidates(path: Path) -> list[Path]:
    """The complete checkpoints `path` holds, the one to load first: `path` itself if it is
    one, else the one `latest` names, then the others by step, newest first."""
    if (path / META).is_file():
        return [path]
    root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
    if not root.is_dir():
        return []
    ckpts = [root / f"step_{step}" for step in reversed(_complete_steps(root))]
    latest = root / LATEST
    name = latest.read_text().strip() if latest.is_file() else ""
    if root / name in ckpts:
        ckpts.remove(root / name)
        ckpts.insert(0, root / name)
    return ckpts


def checkpoint_problem(ckpt: str | os.PathLike) -> str | None:
    """What is wrong with checkpoint directory `ckpt` (a file missing, of another size or
    digest than `meta.json` recorded at save time), or None when it is intact."""
    ckpt = Path(ckpt)
    try:
        meta = read_meta(ckpt)
    except CheckpointError as err:
        return str(err)
    for rel, saved in meta.get("files", {}).items():  # no "files": saved before digests were kept
        file = ckpt / rel
        if not file.is_file():
            return f"{rel} is missing"
        size = file.stat().st_size
        if size != saved["size"]:
            return f"{rel} has {size} bytes, {saved['size']} when saved"
        if _sha256(file) != saved["sha256"]:
            return f"{rel} differs from the file saved (SHA-256)"
    return None


def read_meta(ckpt: str | os.PathLike) -> dict[str, Any]:
    """The `meta.json` of checkpoint directory `ckpt`: step, components, files, the extras."""
    path = Path(ckpt) / META
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise CheckpointError(f"cannot read {str(path)!r}: {err}") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("step"), int) or "components" not in meta:
        raise CheckpointError(f"{str(path)!r} is not a checkpoint's {META}")
    return meta


def load_checkpoint(path: str | os.PathLike, which: str | int = "auto", *, verify: bool = True,
                    ) -> tuple[int, dict[str, Any]]:
    """Read a checkpoint back: `(step, state)` with `state` as it was saved.

    `which="auto"`: the checkpoint `find_valid_checkpoint(path)` picks (the newest intact
    one of a run, or `path` itself if it is a checkpoint directory); an int: that step of
    the run at `path`. Raises `CheckpointNotFoundError` (a FileNotFoundError) naming the
    path when there is none, `CheckpointError` naming the checkpoint when it is damaged.
    `verify=False` skips reading the files against their digests (a caller that just did).
    """
    path = Path(path)
    if which == "auto":
        ckpt = find_valid_checkpoint(path) if verify else find_checkpoint(path)
        if ckpt is None:
            raise CheckpointNotFoundError(f"no checkpoint at {str(path)!r}: expected a run directory with "
                                  f"{CHECKPOINTS_DIR}/step_<N>/ or a step_<N> directory with {META}")
    else:
        root = path / CHECKPOINTS_DIR if (path / CHECKPOINTS_DIR).is_dir() else path
        ckpt = root / f"step_{int(which)}"
        if not (ckpt / META).is_file():
            raise CheckpointNotFoundError(f"no checkpoint for step {which} under {str(root)!r}; "
                                  f"complete steps there: {_complete_steps(root)}")
    if which != "auto" and verify:  # "auto" took an intact one
        problem = checkpoint_problem(ckpt)
        if problem is not None:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} is damaged: {problem}")
    meta = read_meta(ckpt)
    state = {}
    for name in meta["components"]:
        file = ckpt / f"{name}.pt"
        try:
            state[name] = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - re-raised with the file named
            raise CheckpointError(f"cannot read checkpoint file {str(file)!r}: {type(e).__name__}: {e}") from e
    return int(meta["step"]), state


# ------------------------------------------------------------------------------ RNG


def capture_rng_state() -> dict[str, Any]:
    """The states of Python's, numpy's and torch's global generators (CUDA too, if up),
    as plain values and tensors a checkpoint can hold."""
    version, internal, gauss = random.getstate()
    np_state = np.random.get_state(legacy=False)
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),  # uint32 -> int64, exact
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    """Put back the generators' states from `capture_rng_state`."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["internal"]), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state({
        "bit_generator": npy["bit_generator"],
        "state": {"key": npy["key"].numpy().astype(np.uint32), "pos": npy["pos"]},
        "has_gauss": npy["has_gauss"],
        "gauss": npy["gauss"],
    })
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
