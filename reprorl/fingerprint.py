"""Per-step fingerprints of a run: a digest of every tensor of every step.

verl's end-to-end check compares one float per step (the mean reward). reprorl records a
128-bit digest of everything a step computes (prompts, responses, log-probs, rewards,
advantages, losses, ...) and of every parameter after the step's update, so
`reprorl compare` can prove two runs bitwise identical or name the first tensor that
differs.

Layout under the run directory:

    run_dir/fingerprints.jsonl            one JSON object per step, appended as the step ends
    run_dir/fingerprints/step_<N>.pt      the raw values of step N (only with keep_tensors)

A line of fingerprints.jsonl:

    {"step": 3, "fields": {"prompts": "9c1e...", "responses": "04ab...", ...},
     "params": {"model.embed.weight": "77d0...", ...}, "params_digest": "e5f2..."}

Fields keep the order the fit loop writes them in (pipeline order), so the first field
that differs in a step is the one closest to the cause. `params_digest` is one digest of
all parameter digests: equal runs are confirmed without walking every parameter.

The fit loop uses it like this:

    if resumed_from is not None:
        truncate_fingerprints(run_dir, resumed_from)
    writer = FingerprintWriter(run_dir, keep_tensors=cfg.keep_tensors)
    ...
    writer.write(step, {"prompts": ..., "responses": ..., "rewards": ...},
                 params=actor.named_parameters())  # after the step's update
    # or, without moving the weights: param_digests=tensor_digests(...) made where they are
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprorl.determinism import stable_digest, tensor_digest
from reprorl.errors import ReproRLError
from reprorl.io import TMP_PREFIX, atomic_write

FINGERPRINTS_FILE = "fingerprints.jsonl"
RAW_DIR = "fingerprints"
_RAW_FORMAT = "reprorl.fingerprint_tensors"
_RAW_VERSION = 1
_RAW_FILE = re.compile(r"^step_(\d+)\.pt$")

FieldValue = torch.Tensor | np.ndarray | list | tuple | float | int | str | None


# ------------------------------------------------------------------------------ digests


def field_digest(value: FieldValue) -> str:
    """The digest of one field: `tensor_digest` for tensors, `stable_digest` otherwise.

    A numeric numpy array counts as the tensor it converts to; an object array (a
    `Batch` non-tensor column) as the list of its entries. Lists of token-id lists,
    floats and strings go through `stable_digest`.
    """
    return _digest(_normalize(value))


def _digest(value: Any) -> str:
    """The digest of a value `_normalize` returned."""
    return tensor_digest(value) if isinstance(value, torch.Tensor) else stable_digest(value)


DIGEST_THREADS = min(8, os.cpu_count() or 1)
"""Threads that hash a model's parameters (hashlib lets go of the GIL on large buffers)."""


def tensor_digests(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> dict[str, str]:
    """{name: `tensor_digest`} of (name, tensor) pairs: a record's "params", computed where
    the tensors are (the trainer's rank 0, a replica) so that only the digests travel."""
    from concurrent.futures import ThreadPoolExecutor

    named = list(named_tensors)
    with ThreadPoolExecutor(DIGEST_THREADS) as pool:
        digests = list(pool.map(lambda item: tensor_digest(item[1]), named))
    return {name: digest for (name, _), digest in zip(named, digests)}


def params_digest(digests: Mapping[str, str]) -> str:
    """One digest of a whole parameter set, from its per-parameter digests (name -> digest).

    It does not depend on the order of `digests` (`stable_digest` sorts dict keys).
    """
    return stable_digest("params", dict(digests))


def _normalize(value: FieldValue) -> Any:
    """A tensor, or a plain value `stable_digest` (and `torch.load(weights_only=True)`) accepts."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, np.ndarray):
        if value.dtype == object:
            return _plain(value.tolist())
        return torch.from_numpy(np.ascontiguousarray(value))
    return _plain(value)


def _plain(value: Any) -> Any:
    """numpy scalars inside lists become Python scalars; tensors inside lists are refused."""
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, (torch.Tensor, np.ndarray)):
        # A list of tensors has no one digest that matches how it would be stored; the
        # caller should stack or pad it (e.g. per-micro-batch losses -> one [M] tensor).
        raise TypeError(f"a fingerprint field may be a tensor or a plain value, not a list holding a "
                        f"{type(value).__name__}; stack the tensors into one")
    return value


# ------------------------------------------------------------------------------ writing


class FingerprintWriter:
    """Append one fingerprint record per step to `run_dir/fingerprints.jsonl`.

    Each `write` is flushed and fsynced before it returns (like metrics.jsonl), so a
    crash loses no finished step. Steps must increase: a file that already holds step N
    refuses a new step <= N, because a resumed run that forgot `truncate_fingerprints`
    would otherwise record two different histories in one file.

    Args:
        run_dir: the run directory (created if absent).
        keep_tensors: also save each step's raw values to `fingerprints/step_<N>.pt`, so
            `reprorl compare` can show the first differing element. Costs a copy of the
            step's tensors and of the parameters on disk per step: for debugging.
    """

    def __init__(self, run_dir: str | os.PathLike, keep_tensors: bool = False) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.keep_tensors = keep_tensors
        self.path = self.run_dir / FINGERPRINTS_FILE
        existing = read_fingerprints(self.run_dir) if self.path.exists() else {}
        self._last_step = max(existing, default=None)
        if existing and not self.path.read_bytes().endswith(b"\n"):
            # Appending to a line cut short by a crash would glue two records together.
            raise ReproRLError(f"{self.path}: the last line is unfinished (a crash mid-write); "
                               "call truncate_fingerprints(run_dir, checkpoint_step) before resuming")
        if keep_tensors:
            (self.run_dir / RAW_DIR).mkdir(exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")

    def write(
        self,
        step: int,
        fields: Mapping[str, FieldValue],
        params: Iterable[tuple[str, torch.Tensor]] | None = None,
        param_digests: Mapping[str, str] | None = None,
    ) -> dict[str, Any]:
        """Record step `step`: a digest of each field and of each parameter; returns the record.

        `params` are the (name, tensor) pairs of the weights after this step's update
        (`model.named_parameters()`); or, instead, `param_digests` their `tensor_digests`
        made where the weights are (the record is the same bits). Neither records no
        parameters. `keep_tensors` needs the tensors themselves.
        """
        if params is not None and param_digests is not None:
            raise ValueError(f"fingerprint of step {step}: give params or param_digests, not both")
        if param_digests is not None and self.keep_tensors:
            raise ValueError(f"fingerprint of step {step}: keep_tensors saves the parameters themselves; "
                             "give params, not param_digests")
        if self._file is None:
            raise ValueError("FingerprintWriter.write after close()")
        if isinstance(step, bool) or not isinstance(step, int):
            raise TypeError(f"fingerprint step must be an int, got {type(step).__name__} {step!r}")
        if self._last_step is not None and step <= self._last_step:
            raise ValueError(
                f"{self.path}: cannot write step {step}, the file already has step {self._last_step}; steps "
                "must increase (a resumed run calls truncate_fingerprints(run_dir, checkpoint_step) first)"
            )
        values: dict[str, Any] = {}
        field_digests: dict[str, str] = {}
        for name, value in fields.items():
            try:
                values[name] = _normalize(value)
                field_digests[name] = _digest(values[name])
            except TypeError as err:
                raise TypeError(f"fingerprint field {name!r} of step {step}: {err}") from None
        param_values: dict[str, torch.Tensor] = {}
        for name, tensor in params or ():
            if name in param_values:
                raise ValueError(f"fingerprint of step {step}: parameter {name!r} given twice")
            param_values[name] = tensor

        has_params = params is not None or param_digests is not None
        digests = dict(param_digests) if param_digests is not None else tensor_digests(param_values.items())
        record = {
            "step": step,
            "fields": field_digests,
            "params": digests,
            "params_digest": params_digest(digests) if has_params else None,
        }
        if self.keep_tensors:
            # The raw file goes first: a record in the jsonl then always has its raw file.
            _save_raw(self.run_dir / RAW_DIR / f"step_{step}.pt", step, values, param_values)
        # No sort_keys: the field order is the pipeline order that `compare` walks.
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())
        self._last_step = step
        return record

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> FingerprintWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _cpu_copy(t: torch.Tensor) -> torch.Tensor:
    # clone: saving a view would save its whole storage (e.g. all of a batch tensor).
    return t.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _save_raw(path: Path, step: int, values: dict[str, Any], params: dict[str, torch.Tensor]) -> None:
    data = {
        "format": _RAW_FORMAT,
        "version": _RAW_VERSION,
        "step": step,
        "fields": {k: _cpu_copy(v) if isinstance(v, torch.Tensor) else v for k, v in values.items()},
        "params": {k: _cpu_copy(v) for k, v in params.items()},
    }
    with atomic_write(path) as tmp:
        torch.save(data, tmp)


# ------------------------------------------------------------------------------ reading


def read_fingerprints(run_dir: str | os.PathLike) -> dict[int, dict[str, Any]]:
    """The records of `run_dir/fingerprints.jsonl`, by step, in file order.

    Raises `ReproRLError` naming the path when the directory or the file is missing or
    unreadable, and the file and line number when a line is not a fingerprint record.
    """
    return _read(_fingerprints_path(run_dir), drop_torn_tail=False)[0]


def read_complete_fingerprints(run_dir: str | os.PathLike) -> tuple[dict[int, dict[str, Any]], int | None]:
    """As `read_fingerprints`, but a torn last line (a run that crashed mid-write) is left
    out: (the complete records by step, that line's number or None)."""
    return _read(_fingerprints_path(run_dir), drop_torn_tail=True)


def _fingerprints_path(run_dir: str | os.PathLike) -> Path:
    run_dir = Path(run_dir)
    if not run_dir.exists():
        raise ReproRLError(f"{run_dir}: no such run directory")
    if not run_dir.is_dir():
        raise ReproRLError(f"{run_dir}: not a directory (expected a run directory)")
    path = run_dir / FINGERPRINTS_FILE
    if not path.is_file():
        raise ReproRLError(f"{path}: no such file (was the run made with fingerprints on?)")
    return path


def _read(path: Path, *, drop_torn_tail: bool) -> tuple[dict[int, dict[str, Any]], int | None]:
    """(records by step, the number of the torn last line dropped, or None)."""
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ReproRLError(f"{path}: cannot read ({err})") from None
    lines = text.split("\n")
    records: dict[int, dict[str, Any]] = {}
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        torn = line_no == len(lines)  # the last piece has no newline: a crash mid-write
        try:
            record = json.loads(line)
            _check_record(record)
        except (json.JSONDecodeError, ValueError) as err:
            if torn and drop_torn_tail:
                return records, line_no
            hint = " (unfinished: a crash mid-write? truncate_fingerprints drops it)" if torn else ""
            raise ReproRLError(f"{path}: line {line_no} is not a fingerprint record: {err}{hint}") from None
        step = record["step"]
        if step in records:
            raise ReproRLError(f"{path}: line {line_no}: step {step} appears twice")
        records[step] = record
    return records, None


def _check_record(record: Any) -> None:
    """Raise ValueError (with a short reason) unless `record` has the writer's shape."""
    if not isinstance(record, dict):
        raise ValueError(f"expected a JSON object, got {type(record).__name__}")
    step = record.get("step")
    if isinstance(step, bool) or not isinstance(step, int):
        raise ValueError(f"'step' must be an int, got {step!r}")
    for key in ("fields", "params"):
        digests = record.get(key)
        if not isinstance(digests, dict) or not all(isinstance(v, str) for v in digests.values()):
            raise ValueError(f"{key!r} must be an object of name -> digest strings")
    if not isinstance(record.get("params_digest"), (str, type(None))):
        raise ValueError("'params_digest' must be a string or null")


def raw_path(run_dir: str | os.PathLike, step: int) -> Path:
    """Where step `step`'s raw values are (or would be) saved."""
    return Path(run_dir) / RAW_DIR / f"step_{step}.pt"


def load_raw(run_dir: str | os.PathLike, step: int) -> dict[str, Any] | None:
    """The raw values of step `step` ({"fields": {...}, "params": {...}}), or None if not kept."""
    path = raw_path(run_dir, step)
    if not path.is_file():
        return None
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # a torn or foreign file: say which one
        raise ReproRLError(f"{path}: cannot load raw fingerprint tensors ({err})") from None
    if not isinstance(data, dict) or data.get("format") != _RAW_FORMAT or data.get("step") != step:
        raise ReproRLError(f"{path}: not the raw fingerprint tensors of step {step}")
    return data


# ------------------------------------------------------------------------------ resume


def truncate_fingerprints(run_dir: str | os.PathLike, last_step: int) -> None:
    """Drop the records and raw files of steps after `last_step` (a resumed run redoes them).

    The jsonl is rewritten through a temp file and `os.replace`, so a crash keeps the old
    or the new file, never half of one. A torn last line (a crash mid-write) is dropped.
    A run directory without fingerprints is left as it is.
    """
    run_dir = Path(run_dir)
    path = run_dir / FINGERPRINTS_FILE
    if path.is_file():
        kept = [r for s, r in _read(path, drop_torn_tail=True)[0].items() if s <= last_step]
        data = "".join(json.dumps(r) + "\n" for r in kept).encode("utf-8")
        with atomic_write(path) as tmp:
            tmp.write_bytes(data)
    raw_dir = run_dir / RAW_DIR
    if raw_dir.is_dir():
        for p in raw_dir.iterdir():
            m = _RAW_FILE.match(p.name)
            if (m and int(m.group(1)) > last_step) or p.name.startswith(TMP_PREFIX):
                p.unlink()

