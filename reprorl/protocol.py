"""The batch container that flows through one training step.

A `Batch` holds three things:

- `tensors`: `dict[str, torch.Tensor]`, every tensor with the same leading dimension
  (the batch size, `B`): `input_ids [B, T]`, `rewards [B]`, ...
- `non_tensors`: `dict[str, np.ndarray]`, 1-D arrays of dtype object with `B` entries:
  per-sample Python values (uids, raw prompts, dicts of extra info).
- `meta`: `dict[str, Any]`, batch-level values (`step`, `validate`, timings).

Row order is part of the determinism contract (docs/design.md: "results are ordered by sample
index"): every operation below states the row order it returns, and none reorders rows
except `index`, which follows the indices it is given.

Operations return new `Batch` objects (only `pop` and `batch[key] = value` change the
batch itself). What they share with their input:

- `meta` is always shallow-copied: setting a key on a result's meta never changes the
  input's meta (a mutable value inside meta, e.g. a dict of timings, is still shared).
- views, no data copied: `slice`, `split`, `pop`. Writing into a tensor of the result
  writes into the input.
- copies: `index`, `repeat`, `concat`, `to` (to another device), `save`/`load`.
- the Python objects inside non-tensor columns (dicts, lists) are never copied, not even
  by `repeat`: treat them as read-only, or replace them rather than mutate them.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from reprorl.errors import DataError
from reprorl.io import atomic_write

_FILE_FORMAT = "reprorl.Batch"
_FILE_VERSION = 1

# What `torch.load(weights_only=True)` accepts, so a saved batch always loads without
# unpickling arbitrary code. Exact types: np.float64 is a float subclass but not loadable.
_SAVEABLE_LEAVES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device)
_SAVEABLE_CONTAINERS = (list, tuple, set)


def tensor_to(t: torch.Tensor, device: torch.device | str, non_blocking: bool = False) -> torch.Tensor:
    """`t` on `device`. `non_blocking`: a host tensor goes to a GPU through pinned memory
    without waiting for the GPU's queue (a plain copy from pageable memory waits for every
    kernel queued before it); torch's pinned allocator keeps the staging buffer until the
    copy is done. Other moves are plain copies."""
    target = torch.device(device)
    if non_blocking and target.type == "cuda" and t.device.type == "cpu":
        return t.pin_memory().to(target, non_blocking=True)
    return t.to(target)


class Batch:
    """Tensors, per-sample non-tensor values and batch-level meta, with a common batch size.

    `Batch(tensors={"input_ids": ids}, non_tensors={"uid": ["a", "b"]}, meta={"step": 3})`.
    Lists (or other iterables) given as non-tensor columns become 1-D object arrays, one
    entry per sample, even when the entries are equal-length lists. A batch with no
    columns has length 0.
    """

    def __init__(
        self,
        tensors: Mapping[str, torch.Tensor] | None = None,
        non_tensors: Mapping[str, Any] | None = None,
        meta: Mapping[str, Any] | None = None,
    ) -> None:
        self.tensors: dict[str, torch.Tensor] = dict(tensors or {})
        self.non_tensors: dict[str, np.ndarray] = {
            key: _to_object_array(key, values) for key, values in (non_tensors or {}).items()
        }
        self.meta: dict[str, Any] = dict(meta or {})
        both = sorted(set(self.tensors) & set(self.non_tensors))
        if both:
            raise ValueError(f"keys {both} are both tensor and non-tensor columns; a key names one column")
        self._check_lengths()

    def _check_lengths(self) -> None:
        first_key, n = None, None
        for key, t in self.tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"tensor column {key!r} is a {type(t).__name__}, not a torch.Tensor")
            if t.dim() == 0:
                raise ValueError(f"tensor column {key!r} is a 0-d tensor; columns need a leading batch dimension")
        lengths = [(k, t.shape[0]) for k, t in self.tensors.items()]
        lengths += [(k, len(a)) for k, a in self.non_tensors.items()]
        for key, length in lengths:
            if n is None:
                first_key, n = key, length
            elif length != n:
                raise ValueError(f"column {key!r} has {length} rows but column {first_key!r} has {n}")

    # ---- access -------------------------------------------------------------------

    def __len__(self) -> int:
        for t in self.tensors.values():
            return t.shape[0]
        for a in self.non_tensors.values():
            return len(a)
        return 0

    def keys(self) -> list[str]:
        """Column names: tensor columns first, then non-tensor columns, each in insertion order."""
        return [*self.tensors, *self.non_tensors]

    def __contains__(self, key: object) -> bool:
        return key in self.tensors or key in self.non_tensors

    def __getitem__(self, key: str) -> torch.Tensor | np.ndarray:
        """The tensor or non-tensor column named `key` (the object itself, not a copy)."""
        if not isinstance(key, str):
            # Rows are taken with explicit methods, so `batch[0]` can't silently mean a column.
            raise TypeError(f"batch[...] takes a column name, got {type(key).__name__}; "
                            "take rows with batch.index(...) or batch.slice(start, end)")
        if key in self.tensors:
            return self.tensors[key]
        if key in self.non_tensors:
            return self.non_tensors[key]
        raise KeyError(f"no column {key!r}; tensor columns {list(self.tensors)}, "
                       f"non-tensor columns {list(self.non_tensors)}")

    def __setitem__(self, key: str, value: Any) -> None:
        """Add or replace a column (tensor or non-tensor by the value's type), checking its length."""
        if isinstance(value, torch.Tensor):
            if key in self.non_tensors:
                raise ValueError(f"column {key!r} is a non-tensor column; pop it before setting a tensor")
            new = Batch({key: value})
        else:
            if key in self.tensors:
                raise ValueError(f"column {key!r} is a tensor column; pop it before setting a non-tensor")
            new = Batch(non_tensors={key: value})
        others = [k for k in self.keys() if k != key]
        if others and len(new) != len(self):
            raise ValueError(f"column {key!r} has {len(new)} rows but column {others[0]!r} has {len(self)}")
        self.tensors.update(new.tensors)
        self.non_tensors.update(new.non_tensors)

    def __repr__(self) -> str:
        tensors = ", ".join(f"{k}: {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"
                            for k, t in self.tensors.items())
        non_tensors = ", ".join(f"{k}: object[{len(a)}]" for k, a in self.non_tensors.items())
        return (f"Batch(len={len(self)}, tensors={{{tensors}}}, non_tensors={{{non_tensors}}}, "
                f"meta_keys={list(self.meta)})")

    def equal(self, other: Batch) -> bool:
        """Exact equality: same keys, same dtypes and shapes, `torch.equal` values, equal meta.

        The check for determinism tests; column order does not matter.
        """
        return (
            self.tensors.keys() == other.tensors.keys()
            and self.non_tensors.keys() == other.non_tensors.keys()
            and self.meta.keys() == other.meta.keys()
            and all(_same(t, other.tensors[k]) for k, t in self.tensors.items())
            and all(_same(a, other.non_tensors[k]) for k, a in self.non_tensors.items())
            and all(_same(v, other.meta[k]) for k, v in self.meta.items())
        )

    # ---- rows ---------------------------------------------------------------------

    def _map_rows(self, tensor_fn, array_fn) -> Batch:
        """A batch with `tensor_fn` applied to every tensor and `array_fn` to every non-tensor."""
        return Batch(
            {k: tensor_fn(t) for k, t in self.tensors.items()},
            {k: array_fn(a) for k, a in self.non_tensors.items()},
            self.meta,
        )

    def slice(self, start: int, end: int | None = None) -> Batch:
        """Rows `start .. end-1` in order (views). Needs `0 <= start <= end <= len`; no negatives."""
        n = len(self)
        end = n if end is None else end
        if not 0 <= start <= end <= n:
            raise IndexError(f"slice({start}, {end}) is out of range for a batch of {n} rows; "
                             f"need 0 <= start <= end <= {n}")
        return self._map_rows(lambda t: t[start:end], lambda a: a[start:end])

    def index(self, idx: Sequence[int] | Sequence[bool] | torch.Tensor | np.ndarray) -> Batch:
        """Rows in the order of `idx` (copies).

        `idx`: a list/tuple/range of ints, a 1-D integer tensor or array (negative values count
        from the end, repeats allowed), or a boolean mask of length `len(self)` (rows where
        True, in their original order).
        """
        rows = _row_indices(idx, len(self))  # [K] int64, CPU, each in [0, len)
        rows_np = rows.numpy()
        return self._map_rows(lambda t: t.index_select(0, rows.to(t.device)), lambda a: a[rows_np])

    def repeat(self, n: int, interleave: bool = True) -> Batch:
        """Every row `n` times (copies): interleaved `a a b b` (GRPO's n samples of a prompt
        sit together), or tiled `a b a b`."""
        if n < 1:
            raise ValueError(f"repeat needs n >= 1, got {n}")
        if interleave:
            return self._map_rows(lambda t: t.repeat_interleave(n, dim=0), lambda a: np.repeat(a, n))
        return self._map_rows(lambda t: t.repeat(n, *[1] * (t.dim() - 1)), lambda a: np.tile(a, n))

    @staticmethod
    def concat(batches: Iterable[Batch]) -> Batch:
        """The rows of `batches[0]`, then `batches[1]`, ... (copies).

        All batches need the same tensor and non-tensor keys, and each tensor the same dtype
        and trailing shape. Meta is the first batch's plus keys only later batches have; a
        key whose values differ between batches is an error.
        """
        batches = list(batches)
        if not batches:
            raise ValueError("concat needs at least one batch")
        first = batches[0]
        meta = dict(first.meta)
        for i, b in enumerate(batches[1:], start=1):
            for kind, ours, theirs in (("tensor", first.tensors, b.tensors),
                                       ("non-tensor", first.non_tensors, b.non_tensors)):
                if ours.keys() != theirs.keys():
                    raise ValueError(f"concat: batch {i} has different {kind} keys from batch 0: "
                                     f"missing {sorted(ours.keys() - theirs.keys())}, "
                                     f"extra {sorted(theirs.keys() - ours.keys())}")
            for key, t in b.tensors.items():
                t0 = first.tensors[key]
                if t.dtype != t0.dtype or t.shape[1:] != t0.shape[1:]:
                    raise ValueError(f"concat: tensor {key!r} is {t0.dtype}{list(t0.shape)} in batch 0 "
                                     f"but {t.dtype}{list(t.shape)} in batch {i}; only the first dimension may differ")
            for key, value in b.meta.items():
                if key in meta and not _same(meta[key], value):
                    raise ValueError(f"concat: meta {key!r} is {meta[key]!r} in an earlier batch "
                                     f"but {value!r} in batch {i}")
                meta.setdefault(key, value)
        return Batch(
            {k: torch.cat([b.tensors[k] for b in batches], dim=0) for k in first.tensors},
            {k: np.concatenate([b.non_tensors[k] for b in batches]) for k in first.non_tensors},
            meta,
        )

    def split(self, size: int) -> list[Batch]:
        """Consecutive parts of `size` rows, in order; the last may be smaller (views)."""
        if size < 1:
            raise ValueError(f"split needs size >= 1, got {size}")
        n = len(self)
        return [self.slice(start, min(start + size, n)) for start in range(0, n, size)]

    # ---- columns ------------------------------------------------------------------

    def pop(
        self,
        tensor_keys: Iterable[str] | None = None,
        non_tensor_keys: Iterable[str] | None = None,
        meta_keys: Iterable[str] | None = None,
    ) -> Batch:
        """Remove the named columns and meta keys from this batch and return them as a new
        batch; `None` pops nothing of that kind (as in verl). Nothing is removed on error."""
        tensor_keys = _key_list(tensor_keys, [])
        non_tensor_keys = _key_list(non_tensor_keys, [])
        meta_keys = _key_list(meta_keys, [])
        _check_keys("pop", tensor_keys, non_tensor_keys, meta_keys, self)
        return Batch(
            {k: self.tensors.pop(k) for k in tensor_keys},
            {k: self.non_tensors.pop(k) for k in non_tensor_keys},
            {k: self.meta.pop(k) for k in meta_keys},
        )

    # ---- device and files -----------------------------------------------------------

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        """The batch with every tensor on `device` (non-tensor columns are unchanged);
        `non_blocking` as `tensor_to`."""
        return self._map_rows(lambda t: tensor_to(t, device, non_blocking), lambda a: a)

    def save(self, path: str | os.PathLike) -> None:
        """Write the batch to `path` (tensors as CPU tensors, detached).

        Non-tensor values and meta must be plain Python (None, bool, int, float, complex, str,
        bytes, list, tuple, set, dict, tensors), so that `load` never has to unpickle code.
        Written with `reprorl.io.atomic_write`: a crash leaves either the old file or the
        new one, never half of one.
        """
        for key, array in self.non_tensors.items():
            for row, value in enumerate(array):
                _check_saveable(value, f"non-tensor {key!r} row {row}")
        for key, value in self.meta.items():
            _check_saveable(value, f"meta {key!r}")
        payload = {
            "format": _FILE_FORMAT,
            "version": _FILE_VERSION,
            # clone(): a view would otherwise save its parent's whole storage.
            "tensors": {k: t.detach().cpu().clone() for k, t in self.tensors.items()},
            "non_tensors": {k: list(a) for k, a in self.non_tensors.items()},
            "meta": self.meta,
        }
        with atomic_write(path) as tmp:
            torch.save(payload, tmp)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Batch:
        """A batch written by `save`, with its tensors on CPU."""
        try:
            payload = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise  # a missing file is not a bad file; say so plainly
        except Exception as e:  # noqa: BLE001 - torch raises many types for a bad file
            raise DataError(f"{os.fspath(path)}: not a readable batch file ({type(e).__name__}: "
                            f"{str(e).splitlines()[0] if str(e) else ''})") from e
        if not isinstance(payload, dict) or payload.get("format") != _FILE_FORMAT:
            raise DataError(f"{os.fspath(path)}: not a reprorl batch file (no format {_FILE_FORMAT!r})")
        if payload.get("version") != _FILE_VERSION:
            raise DataError(f"{os.fspath(path)}: batch file version {payload.get('version')!r}, "
                            f"expected {_FILE_VERSION}")
        return cls(payload["tensors"], payload["non_tensors"], payload["meta"])


# ---- helpers ---------------------------------------------------------------------------


def _to_object_array(key: str, values: Any) -> np.ndarray:
    """`values` as a 1-D object array, one entry per sample."""
    if isinstance(values, np.ndarray):
        if values.ndim != 1:
            raise ValueError(f"non-tensor column {key!r} must be 1-D (one entry per sample), "
                             f"got an array of shape {values.shape}")
        return values if values.dtype == object else values.astype(object)
    if isinstance(values, (torch.Tensor, str, bytes, Mapping)) or not isinstance(values, Iterable):
        raise TypeError(f"non-tensor column {key!r} must be a list or 1-D array of per-sample "
                        f"values, got {type(values).__name__}")
    values = list(values)
    # Filled one by one: np.array(list_of_equal_length_lists, dtype=object) would be 2-D.
    out = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        out[i] = value
    return out


def _as_index_tensor(idx: Any) -> torch.Tensor:
    """`idx` as a CPU tensor of dtype int64 or bool, refusing floats and mixed bool/int lists."""
    if isinstance(idx, torch.Tensor):
        t = idx.cpu()
    elif isinstance(idx, np.ndarray):
        t = torch.from_numpy(idx)
    elif isinstance(idx, (list, tuple, range)):
        items = list(idx)
        if items and all(isinstance(i, (bool, np.bool_)) for i in items):
            return torch.tensor(items, dtype=torch.bool)
        bad = [i for i in items if isinstance(i, (bool, np.bool_)) or not isinstance(i, (int, np.integer))]
        if bad:
            raise TypeError(f"row indices must be all ints or all bools, got {bad[0]!r} "
                            f"({type(bad[0]).__name__}) among them")
        return torch.tensor(items, dtype=torch.long)
    else:
        raise TypeError(f"row indices must be a list, tuple, range, tensor or numpy array, "
                        f"got {type(idx).__name__}")
    if t.dtype == torch.bool:
        return t
    if t.is_floating_point() or t.is_complex():
        raise TypeError(f"row indices must be integers or a boolean mask, got dtype {t.dtype}")
    return t.long()


def _row_indices(idx: Any, n: int) -> torch.Tensor:
    """`idx` as row numbers in `[0, n)`: `[K]` int64 on CPU."""
    t = _as_index_tensor(idx)
    if t.dim() != 1:
        raise ValueError(f"row indices must be 1-D, got shape {list(t.shape)}")
    if t.dtype == torch.bool:
        if t.shape[0] != n:
            raise IndexError(f"boolean mask has length {t.shape[0]} but the batch has {n} rows")
        return t.nonzero().flatten()
    out_of_range = (t < -n) | (t >= n)
    if out_of_range.any():
        bad = t[out_of_range][0].item()
        raise IndexError(f"row index {bad} is out of range for a batch of {n} rows")
    return torch.where(t < 0, t + n, t)


def _key_list(keys: Iterable[str] | None, default: Iterable[str]) -> list[str]:
    if isinstance(keys, str):
        # list("uid") would be ["u", "i", "d"]
        raise TypeError(f"pass keys as a list, e.g. [{keys!r}], not a bare string")
    return list(default if keys is None else keys)


def _check_keys(op: str, tensor_keys, non_tensor_keys, meta_keys, batch: Batch) -> None:
    for kind, keys, present in (("tensor", tensor_keys, batch.tensors),
                                ("non-tensor", non_tensor_keys, batch.non_tensors),
                                ("meta", meta_keys, batch.meta)):
        missing = [k for k in keys if k not in present]
        if missing:
            raise KeyError(f"{op}: no {kind} key(s) {missing}; {kind} keys are {list(present)}")


def _same(a: Any, b: Any) -> bool:
    """Exact equality of two column or meta values: tensors by dtype, shape and `torch.equal`;
    arrays entry by entry; anything else by type and `==`."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)
                and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)
                and a.dtype == b.dtype and a.shape == b.shape and a.tolist() == b.tolist())
    return type(a) is type(b) and bool(a == b)


def _check_saveable(value: Any, where: str) -> None:
    if type(value) in _SAVEABLE_LEAVES or isinstance(value, torch.Tensor):
        return
    if type(value) in _SAVEABLE_CONTAINERS:
        for item in value:
            _check_saveable(item, where)
    elif type(value) is dict:
        for k, v in value.items():
            _check_saveable(k, where)
            _check_saveable(v, f"{where}[{k!r}]")
    else:
        raise TypeError(f"cannot save {where}: a {type(value).__module__}.{type(value).__name__}; "
                        "batch files hold plain Python values and tensors (numpy scalars: use .item())")
