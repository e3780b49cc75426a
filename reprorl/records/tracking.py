"""Where a run's metrics go: metrics.jsonl, TensorBoard, the console, wandb; and curves.png.

`metrics.jsonl` is the record of a run: one JSON object per step, written and flushed as
the step ends, so a crash loses nothing that finished. The other loggers are views of it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from pathlib import Path
from typing import Any, Iterable

from reprorl.errors import ConfigError

logger = logging.getLogger(__name__)

KNOWN_LOGGERS = ("console", "jsonl", "tensorboard", "wandb")
METRICS_FILE = "metrics.jsonl"
CURVES_FILE = "curves.png"
GENERATIONS_FILE = "generations.jsonl"
"""Samples, `trainer.log_generations` of each training step and each validation."""
GENERATION_COLUMNS = ("step", "split", "data_source", "uid", "prompt", "response", "reward")

# Which metrics the console line shows, in this order, when present.
CONSOLE_KEYS = ("reward/mean", "val/accuracy", "actor/pg_loss", "actor/kl", "response_length/mean", "timing/step_s")


def _plain(value: Any) -> Any:
    """A JSON-ready Python scalar: tensors and numpy scalars become floats or ints."""
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)  # JSON has no NaN/inf; keep them visible rather than dropping the key
    return value


class Tracker:
    """Send each step's metrics to the configured loggers.

    Args:
        run_dir: the run directory (created if absent).
        loggers: names from KNOWN_LOGGERS.
        project_name / experiment_name: used by wandb.
        config: the resolved config as a plain dict, stored with wandb runs.
    """

    def __init__(
        self,
        run_dir: str | os.PathLike,
        loggers: Iterable[str],
        *,
        project_name: str = "reprorl",
        experiment_name: str = "run",
        config: dict | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loggers = list(loggers)
        for name in self.loggers:
            if name not in KNOWN_LOGGERS:
                raise ConfigError(f"trainer.loggers: unknown logger {name!r}; expected some of {list(KNOWN_LOGGERS)}")
        self._jsonl = None
        self._tb = None
        self._wandb = None
        if "jsonl" in self.loggers:
            # Append: a resumed run continues the same file (the trainer truncates it to the
            # resumed step first, see `truncate_metrics`).
            self._jsonl = open(self.run_dir / METRICS_FILE, "a", encoding="utf-8")
        if "tensorboard" in self.loggers:
            from torch.utils.tensorboard import SummaryWriter

            self._tb = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"))
        if "wandb" in self.loggers:
            try:
                import wandb
            except ImportError as err:
                raise ConfigError("trainer.loggers: 'wandb' needs the wandb package (pip install wandb)") from err
            # Offline unless the user set a mode: runs must not need a network.
            os.environ.setdefault("WANDB_MODE", "offline")
            self._wandb = wandb.init(
                project=project_name, name=experiment_name, dir=str(self.run_dir), config=config or {}
            )

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        """Record one step's metrics (a flat dict of scalars)."""
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(record, sort_keys=True) + "\n")
            self._jsonl.flush()
            os.fsync(self._jsonl.fileno())
        numeric = {k: v for k, v in record.items() if k != "step" and isinstance(v, (int, float))}
        if self._tb is not None:
            for key, value in numeric.items():
                self._tb.add_scalar(key, value, step)
            self._tb.flush()
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if "console" in self.loggers:
            logger.info("step %d: %s", step, format_console(record))

    def log_generations(self, step: int, split: str, rows: list[dict[str, Any]]) -> None:
        """A step's samples (`GENERATION_COLUMNS` each; generations.jsonl holds them) as a
        table: TensorBoard text `generations/<split>` (markdown), wandb `generations/<split>`."""
        if not rows:
            return
        if self._tb is not None:
            self._tb.add_text(f"generations/{split}", generations_markdown(rows), step)
            self._tb.flush()
        if self._wandb is not None:
            import wandb

            table = wandb.Table(columns=list(GENERATION_COLUMNS),
                                data=[[row[c] for c in GENERATION_COLUMNS] for row in rows])
            self._wandb.log({f"generations/{split}": table}, step=step)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


def generations_markdown(rows: list[dict[str, Any]]) -> str:
    """Samples as a markdown table (TensorBoard renders it), `|` and newlines escaped."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("|", "\\|").replace("\n", "<br>")

    def line(cells: Iterable[str]) -> str:
        return "| " + " | ".join(cells) + " |"

    rule = "|" + "---|" * len(GENERATION_COLUMNS)
    return "\n".join([line(GENERATION_COLUMNS), rule, *(line(cell(row[c]) for c in GENERATION_COLUMNS) for row in rows)])


def format_console(record: dict[str, Any]) -> str:
    """The few figures worth a glance, e.g. `reward/mean=0.312 val/accuracy=0.25`."""
    parts = []
    for key in CONSOLE_KEYS:
        value = record.get(key)
        if isinstance(value, float):
            parts.append(f"{key}={value:.4g}")
        elif value is not None:
            parts.append(f"{key}={value}")
    return " ".join(parts)


def read_metrics(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl file, in file order."""
    path = Path(path)
    records = []
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            line = line.strip()
            if not line:
                continue
            try:
                records.append(json.loads(line))
            except json.JSONDecodeError as err:
                raise ConfigError(f"{path}: line {line_no} is not JSON ({err.msg})") from err
    return records


def truncate_metrics(path: str | os.PathLike, last_step: int) -> None:
    """Drop records after `last_step` (a resumed run rewrites the steps after its checkpoint).

    The file is rewritten through a temporary file and `os.replace`, so a crash keeps
    either the old or the new file, never half of one.
    """
    path = Path(path)
    if not path.exists():
        return
    text = path.read_text(encoding="utf-8")
    if text and not text.endswith("\n"):
        # A crash mid-write leaves a torn last line; the step it belonged to did not finish.
        text = text[: text.rfind("\n") + 1]
        path.write_text(text, encoding="utf-8")
    kept = [r for r in read_metrics(path) if r.get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for record in kept:
            f.write(json.dumps(record, sort_keys=True) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def plot_curves(records: list[dict[str, Any]], out_path: str | os.PathLike, title: str = "") -> Path:
    """Write reward and validation curves (against step) to a PNG; returns its path."""
    import matplotlib

    matplotlib.use("Agg")  # no screen on training machines
    import matplotlib.pyplot as plt

    fig, (ax_reward, ax_val) = plt.subplots(1, 2, figsize=(10, 4))
    for key, ax in (("reward/mean", ax_reward), ("val/accuracy", ax_val), ("val/reward_mean", ax_val)):
        points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
        if points:
            steps, values = zip(*points)
            ax.plot(steps, values, marker="o" if len(points) < 30 else None, label=key)
    ax_reward.set_title("training reward")
    ax_val.set_title("validation")
    for ax in (ax_reward, ax_val):
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out_path = Path(out_path)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
