"""`reprorl compare RUN_A RUN_B`: are two runs bitwise identical, and if not, where first?

Two runs are identical when they recorded the same steps and every digest of every step
matches (fingerprint.py: every field the step computed and every parameter after its
update). Otherwise the report names the FIRST divergence: the earliest step, and within
it the first field in pipeline order (then the parameters), since everything after it
usually differs only as a consequence. When both runs kept raw tensors for that step, it
also names the first differing element (sample and token for a `[B, T]` field) and both
values with their exact bits.

A run that crashed while writing a step leaves a torn last line in fingerprints.jsonl:
its complete steps are compared and the report says which line was torn.

Exit codes (`compare_main`): 0 identical, 1 different; a missing or unreadable run is a
`ReproRLError` (the CLI prints `error: ...` and exits 2).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from reprorl.determinism import encode
from reprorl.errors import ReproRLError
from reprorl.fingerprint import FINGERPRINTS_FILE, load_raw, read_complete_fingerprints
from reprorl.records.tracking import METRICS_FILE, read_metrics

# Curves of the overlay plot; a panel is drawn when either run has the metric.
PLOT_KEYS = ("reward/mean", "val/accuracy")


@dataclass(frozen=True)
class ElementDiff:
    """The first differing element of a field or parameter that both runs kept raw."""

    index: tuple[int, ...]  # unravelled over the tensor's shape, or the path into nested lists
    value_a: str  # formatted with its exact bits, see `format_value`
    value_b: str
    shape: tuple[int, ...] | None = None  # None for a list field
    dtype: str | None = None


@dataclass(frozen=True)
class Divergence:
    """The first place two runs differ."""

    step: int
    kind: str  # "field" or "parameter"
    name: str
    detail: str  # "differs", "only in run_a", "only in run_b"
    digest_a: str | None
    digest_b: str | None
    element: ElementDiff | None = None
    note: str = ""  # why no element was located, when it was not


@dataclass(frozen=True)
class CompareResult:
    run_a: Path
    run_b: Path
    common_steps: list[int]
    only_in_a: list[int]
    only_in_b: list[int]
    divergence: Divergence | None  # first divergence over the common steps
    digests_compared: int  # digests found equal, up to the divergence if any
    torn_line_a: int | None = None  # the line number of run_a's torn last record (a crash mid-write), if any
    torn_line_b: int | None = None

    @property
    def identical(self) -> bool:
        return not self.only_in_a and not self.only_in_b and self.divergence is None


# ------------------------------------------------------------------------------ compare


def compare_runs(run_a: str | Path, run_b: str | Path) -> CompareResult:
    """Compare the fingerprints of two run directories, step by step."""
    run_a, run_b = Path(run_a), Path(run_b)
    (records_a, torn_a), (records_b, torn_b) = read_complete_fingerprints(run_a), read_complete_fingerprints(run_b)
    for run, records in ((run_a, records_a), (run_b, records_b)):
        if not records:  # nothing recorded proves nothing: never report "identical over 0 steps"
            raise ReproRLError(f"{run}: fingerprints.jsonl records no steps")
    common = sorted(set(records_a) & set(records_b))
    compared = 0
    divergence = None
    for step in common:
        found, equal = _first_difference(records_a[step], records_b[step])
        compared += equal
        if found is not None:
            kind, name, digest_a, digest_b = found
            detail = "differs" if digest_a and digest_b else ("only in run_a" if digest_a else "only in run_b")
            element, note = None, ""
            if detail == "differs":
                element, note = _locate(run_a, run_b, step, kind, name)
            divergence = Divergence(step, kind, name, detail, digest_a, digest_b, element, note)
            break
    return CompareResult(
        run_a=run_a,
        run_b=run_b,
        common_steps=common,
        only_in_a=sorted(set(records_a) - set(records_b)),
        only_in_b=sorted(set(records_b) - set(records_a)),
        divergence=divergence,
        digests_compared=compared,
        torn_line_a=torn_a,
        torn_line_b=torn_b,
    )


def _first_difference(rec_a: dict, rec_b: dict) -> tuple[tuple[str, str, str | None, str | None] | None, int]:
    """((kind, name, digest_a, digest_b) of the first mismatch or None, number of equal digests)."""
    equal = 0
    fields_a, fields_b = rec_a["fields"], rec_b["fields"]
    for name in _ordered_names(fields_a, fields_b):
        if fields_a.get(name) != fields_b.get(name):
            return ("field", name, fields_a.get(name), fields_b.get(name)), equal
        equal += 1
    params_a, params_b = rec_a["params"], rec_b["params"]
    if rec_a["params_digest"] is not None and rec_a["params_digest"] == rec_b["params_digest"]:
        return None, equal + len(params_a)  # the cheap path: one digest covers them all
    for name in _ordered_names(params_a, params_b):
        if params_a.get(name) != params_b.get(name):
            return ("parameter", name, params_a.get(name), params_b.get(name)), equal
        equal += 1
    return None, equal


def _ordered_names(a: dict, b: dict) -> list[str]:
    """Run a's names in its (pipeline) order, then names only run b has, in b's order."""
    return list(a) + [name for name in b if name not in a]


def _locate(run_a: Path, run_b: Path, step: int, kind: str, name: str) -> tuple[ElementDiff | None, str]:
    """The first differing element from both runs' raw files, or None and the reason."""
    try:
        raw_a, raw_b = load_raw(run_a, step), load_raw(run_b, step)
    except ReproRLError as err:  # a damaged debug file must not hide the verdict
        return None, str(err)
    missing = [str(run) for run, raw in ((run_a, raw_a), (run_b, raw_b)) if raw is None]
    if missing:
        return None, (f"no raw tensors of step {step} in {' and '.join(missing)} "
                      "(run with fingerprint keep_tensors on to locate the element)")
    section = "fields" if kind == "field" else "params"
    if name not in raw_a[section] or name not in raw_b[section]:
        return None, f"the raw files of step {step} do not hold {kind} {name!r}"
    a, b = raw_a[section][name], raw_b[section][name]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        if a.dtype != b.dtype or a.shape != b.shape:
            return None, f"dtype {a.dtype} vs {b.dtype}, shape {list(a.shape)} vs {list(b.shape)}"
        flat = first_bitwise_difference(a, b)
        if flat is None:
            return None, "the raw tensors are bitwise equal although the digests differ (raw files of another run?)"
        index = tuple(int(i) for i in np.unravel_index(flat, tuple(a.shape)))
        a_flat, b_flat = a.reshape(-1), b.reshape(-1)
        return ElementDiff(index, format_value(a_flat[flat]), format_value(b_flat[flat]),
                           tuple(a.shape), str(a.dtype)), ""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return None, f"a {type(a).__name__} in run_a, a {type(b).__name__} in run_b"
    found = first_list_difference(a, b)
    if found is None:
        return None, "the raw values are equal although the digests differ (raw files of another run?)"
    path, va, vb = found
    return ElementDiff(path, format_value(va), format_value(vb)), ""


def first_bitwise_difference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The flat (row-major) index of the first element whose bytes differ, or None.

    `a` and `b` have the same dtype and shape. Bytes, not `!=`: 0.0 and -0.0 differ, and
    a NaN equals the same NaN, exactly as `tensor_digest` sees them.
    """
    if a.numel() == 0:
        return None
    bytes_a = a.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(a.numel(), -1)  # [N, itemsize]
    bytes_b = b.detach().cpu().contiguous().reshape(-1).view(torch.uint8).reshape(b.numel(), -1)
    differs = (bytes_a != bytes_b).any(dim=1).nonzero()
    return int(differs[0, 0]) if len(differs) else None


_END = object()  # stands for "past the end of a shorter list"


def first_list_difference(a: Any, b: Any, path: tuple[int, ...] = ()) -> tuple[tuple[int, ...], Any, Any] | None:
    """(index path, value in a, value in b) of the first difference between nested lists.

    Leaves are compared by their canonical encoding, so 1 != 1.0 and 0.0 != -0.0, as in
    the digests. Where one list is shorter, its value is reported as `<end>`.
    """
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        for i in range(max(len(a), len(b))):
            va = a[i] if i < len(a) else _END
            vb = b[i] if i < len(b) else _END
            if va is _END or vb is _END:
                return (*path, i), va, vb
            found = first_list_difference(va, vb, (*path, i))
            if found is not None:
                return found
        return None
    if isinstance(a, (list, tuple)) or isinstance(b, (list, tuple)) or encode(a) != encode(b):
        return path, a, b
    return None


def format_value(x: Any) -> str:
    """A value precise enough to see its bits: a float's shortest exact repr plus its bits.

    float32 tensor element 1 + 2**-23 -> `1.0000001192092896 (bits 0x3f800001)`; a Python
    float -> `0.1 (0x1.999999999999ap-4)`; anything else -> `repr`.
    """
    if x is _END:
        return "<end>"
    if isinstance(x, torch.Tensor):
        if x.dtype.is_floating_point or x.dtype.is_complex:
            raw = x.detach().cpu().reshape(1).view(torch.uint8).numpy().tobytes()
            bits = int.from_bytes(raw, sys.byteorder)  # tensors hold bytes in machine order
            # .item() widens to a Python float (or complex) exactly, so repr shows the value.
            return f"{x.item()!r} (bits 0x{bits:0{2 * len(raw)}x})"
        return repr(x.item())
    if isinstance(x, float):
        return f"{x!r} ({x.hex()})"
    return repr(x)


# ------------------------------------------------------------------------------ report


def format_steps(steps: list[int]) -> str:
    """`[1, 2, 3, 7]` -> `"1-3, 7"`."""
    parts, i = [], 0
    while i < len(steps):
        j = i
        while j + 1 < len(steps) and steps[j + 1] == steps[j] + 1:
            j += 1
        parts.append(str(steps[i]) if i == j else f"{steps[i]}-{steps[j]}")
        i = j + 1
    return ", ".join(parts) if parts else "none"


def format_result(result: CompareResult) -> str:
    """The text `reprorl compare` prints."""
    torn = [f"  {run}: line {line} of {FINGERPRINTS_FILE} is torn (the run stopped while writing it): "
            "compared its complete steps" for run, line in ((result.run_a, result.torn_line_a),
                                                            (result.run_b, result.torn_line_b)) if line is not None]
    return "\n".join([_verdict(result), *torn])


def _verdict(result: CompareResult) -> str:
    a, b = result.run_a, result.run_b
    if result.identical:
        return (f"bitwise identical over {len(result.common_steps)} steps "
                f"({result.digests_compared} digests of fields and parameters; {a} vs {b})")
    lines = []
    if result.only_in_a or result.only_in_b:
        lines.append("runs differ: they recorded different steps")
        lines.append(f"  steps only in run_a ({a}): {format_steps(result.only_in_a)}")
        lines.append(f"  steps only in run_b ({b}): {format_steps(result.only_in_b)}")
    d = result.divergence
    if d is None:
        lines.append(f"the {len(result.common_steps)} common steps are bitwise identical")
        return "\n".join(lines)
    lines.append(f"runs differ: first divergence at step {d.step}, {d.kind} {d.name!r} ({d.detail})")
    lines.append(f"  run_a: {a} (digest {d.digest_a})")
    lines.append(f"  run_b: {b} (digest {d.digest_b})")
    if d.element is not None:
        e = d.element
        where = f"{_describe_index(e.index) if d.kind == 'field' else ''}index {e.index}"
        of = f" of shape {list(e.shape)}, {e.dtype}" if e.shape is not None else ""
        lines.append(f"  first differing element: {where}{of}")
        lines.append(f"    run_a: {e.value_a}")
        lines.append(f"    run_b: {e.value_b}")
    elif d.note:
        lines.append(f"  {d.note}")
    return "\n".join(lines)


def _describe_index(index: tuple[int, ...]) -> str:
    """Fields are [B] or [B, T] (or lists of per-sample lists): name the sample and token."""
    if len(index) == 1:
        return f"sample {index[0]}, "
    if len(index) == 2:
        return f"sample {index[0]}, token {index[1]}, "
    return ""


# ------------------------------------------------------------------------------ plot


def plot_overlay(run_a: str | Path, run_b: str | Path, out_path: str | Path, *,
                 divergence_step: int | None = None) -> Path:
    """Overlay the two runs' PLOT_KEYS curves from their metrics.jsonl; returns the path.

    `divergence_step`, when given, is marked with a vertical line on every panel.
    """
    runs = [Path(run_a), Path(run_b)]
    for run in runs:
        if not (run / METRICS_FILE).is_file():
            raise ReproRLError(f"{run / METRICS_FILE}: no such file")
    records = [read_metrics(run / METRICS_FILE) for run in runs]
    # The first key always gets a panel; the others (validation) only when a run has them.
    keys = [PLOT_KEYS[0]] + [k for k in PLOT_KEYS[1:] if any(k in r for recs in records for r in recs)]

    import matplotlib

    matplotlib.use("Agg")  # no screen on training machines
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, len(keys), figsize=(5 * len(keys), 4), squeeze=False)
    for key, ax in zip(keys, axes[0]):
        # Run b dashed over run a solid: identical runs show one line with dashes on it.
        for run, recs, style in zip(runs, records, ("-", "--")):
            points = [(r["step"], r[key]) for r in recs if isinstance(r.get(key), (int, float))]
            if points:
                steps, values = zip(*points)
                ax.plot(steps, values, style, marker="o" if len(points) < 30 else None, label=str(run))
        if divergence_step is not None:
            ax.axvline(divergence_step, color="red", alpha=0.5, label=f"first divergence (step {divergence_step})")
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize="small")
    fig.tight_layout()
    out_path = Path(out_path)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path


# ------------------------------------------------------------------------------ CLI


def compare_main(run_a: str, run_b: str, *, plot: str | None = None) -> int:
    """`reprorl compare`: print the verdict; 0 identical, 1 not.

    With `plot` (a path ending in .png, `--plot`), also draw the overlay of the two runs'
    curves there and print its path; without, no file is written. A missing
    metrics.jsonl only skips the plot: the fingerprints are the verdict.
    """
    if plot is not None and Path(plot).suffix.lower() != ".png":  # never overwrite a run's files by a slip
        raise ReproRLError(f"--plot {plot}: expected a path ending in .png")
    result = compare_runs(run_a, run_b)
    print(format_result(result))
    if plot is not None:
        try:
            step = result.divergence.step if result.divergence is not None else None
            print(f"plot: {plot_overlay(run_a, run_b, plot, divergence_step=step)}")
        except (ReproRLError, OSError) as err:
            print(f"no plot: {err}")
    return 0 if result.identical else 1
