"""Tracker: metrics.jsonl is the record; tensorboard and the plot are views of it."""

import json
import math

import pytest
import torch

from reprorl.errors import ConfigError
from reprorl.records.tracking import (
    Tracker,
    format_console,
    generations_markdown,
    plot_curves,
    read_metrics,
    truncate_metrics,
)


def test_jsonl_records_each_step_in_order_with_plain_values(tmp_path):
    tracker = Tracker(tmp_path, ["jsonl"])
    tracker.log(1, {"reward/mean": torch.tensor(0.5), "actor/pg_loss": -0.25})
    tracker.log(2, {"reward/mean": 0.75, "val/accuracy": 1})
    tracker.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in lines] == [
        {"step": 1, "reward/mean": 0.5, "actor/pg_loss": -0.25},
        {"step": 2, "reward/mean": 0.75, "val/accuracy": 1},
    ]


def test_non_finite_values_stay_visible(tmp_path):
    tracker = Tracker(tmp_path, ["jsonl"])
    tracker.log(1, {"actor/grad_norm": math.inf, "actor/pg_loss": float("nan")})
    tracker.close()
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "actor/grad_norm": "inf", "actor/pg_loss": "nan"}]


def test_unknown_logger_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"trainer.loggers: unknown logger 'mlflow'"):
        Tracker(tmp_path, ["jsonl", "mlflow"])


def test_truncate_keeps_steps_up_to_the_checkpoint(tmp_path):
    tracker = Tracker(tmp_path, ["jsonl"])
    for step in range(1, 5):
        tracker.log(step, {"reward/mean": step / 10})
    tracker.close()
    truncate_metrics(tmp_path / "metrics.jsonl", last_step=2)
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2]
    # A resumed run appends after the kept steps.
    tracker = Tracker(tmp_path, ["jsonl"])
    tracker.log(3, {"reward/mean": 0.9})
    tracker.close()
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1, 2, 3]


def test_read_metrics_names_the_bad_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1}\nnot json\n')
    with pytest.raises(ConfigError, match=r"metrics.jsonl: line 2 is not JSON"):
        read_metrics(path)


def test_tensorboard_writes_event_files(tmp_path):
    tracker = Tracker(tmp_path, ["tensorboard"])
    tracker.log(1, {"reward/mean": 0.5})
    tracker.close()
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0


def test_generations_go_to_tensorboard_as_a_markdown_table(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    row = {"step": 2, "split": "val", "data_source": "arith", "uid": "val-0", "prompt": "1|2\n3", "response": "3",
           "reward": 0.25}
    assert generations_markdown([row]) == ("| step | split | data_source | uid | prompt | response | reward |\n"
                                           "|---|---|---|---|---|---|---|\n"
                                           "| 2 | val | arith | val-0 | 1\\|2<br>3 | 3 | 0.25 |")
    tracker = Tracker(tmp_path, ["tensorboard"])
    tracker.log_generations(2, "val", [row])
    tracker.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert "generations/val/text_summary" in events.Tags()["tensors"]


def test_console_line_shows_key_figures():
    line = format_console({"step": 3, "reward/mean": 0.123456, "val/accuracy": 0.5, "other": 1.0})
    assert line == "reward/mean=0.1235 val/accuracy=0.5"


def test_plot_curves_writes_a_png(tmp_path):
    records = [{"step": s, "reward/mean": s / 10} for s in range(1, 6)] + [{"step": 5, "val/accuracy": 0.4}]
    out = plot_curves(records, tmp_path / "curves.png", title="t")
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_truncate_drops_a_torn_last_line(tmp_path):
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "reward/mean": 0.5}\n{"step": 2, "rew')
    truncate_metrics(path, last_step=5)
    assert read_metrics(path) == [{"step": 1, "reward/mean": 0.5}]
