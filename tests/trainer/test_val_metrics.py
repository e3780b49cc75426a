"""Validation metrics per data source (reprorl/trainer/val_metrics.py), worked by hand."""

import pytest
import torch

from reprorl.trainer.val_metrics import per_source_metrics


def test_mean_and_best_per_source():
    # source a: prompt p (rewards 1, 0, 0) and q (0, 0.5, 0); source b: r (1, 1, 0)
    sources = ["a"] * 6 + ["b"] * 3
    uids = ["p", "p", "p", "q", "q", "q", "r", "r", "r"]
    scores = torch.tensor([1.0, 0, 0, 0, 0.5, 0, 1, 1, 0])
    got = per_source_metrics(sources, uids, scores, 3, correct=scores >= 1)
    assert got == pytest.approx({
        "val/a/mean@3": 1.5 / 6, "val/a/accuracy": 1 / 6, "val/a/best@3": (1.0 + 0.5) / 2,
        "val/b/mean@3": 2 / 3, "val/b/accuracy": 2 / 3, "val/b/best@3": 1.0,
    })


def test_majority_answer_per_prompt():
    # p: answers 4, 5, 4 -> 4 wins, scored as its first sample (1.0)
    # q: answers 5, None, None -> no answer wins (a vote too, as in verl): 0.0
    # r: answers 3, 2, 9 -> a three-way tie goes to the first answer, 3: 0.5
    sources, uids = ["s"] * 9, ["p"] * 3 + ["q"] * 3 + ["r"] * 3
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5, 1.0, 0.0])
    answers = ["4", "5", "4", "5", None, None, "3", "2", "9"]
    got = per_source_metrics(sources, uids, scores, 3, answers=answers)
    assert got["val/s/maj@3"] == pytest.approx((1.0 + 0.0 + 0.5) / 3)
    assert got["val/s/best@3"] == 1.0
    assert "val/s/maj@3" not in per_source_metrics(sources, uids, scores, 3)  # no answers reported


def test_one_sample_a_prompt_gives_the_mean_alone():
    single = per_source_metrics(["s", "s"], ["p", "q"], torch.tensor([0.5, 1.0]), 1)
    assert single == {"val/s/mean@1": 0.75}


@pytest.mark.slow
@pytest.mark.usefixtures("ray_local")
def test_a_run_logs_metrics_per_source_and_its_generations(assets, tmp_path):
    import json
    from pathlib import Path

    from reprorl.config import load_config
    from small_run import run_trainer, small_run_overrides

    run = tmp_path / "run"
    run_trainer(load_config(None, small_run_overrides(
        assets, run, "trainer.test_freq=1", "rollout.val.n=2", "rollout.val.do_sample=true",
        "rollout.val.temperature=1.0", "trainer.log_generations=3",
        f"reward.fn={Path(__file__).with_name('varied_reward.py')}:digit_share_and_answer")))
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    validated = [m for m in metrics if "val/reward_mean" in m]
    assert [m["step"] for m in validated] == [1, 2]
    # a source may hold slashes ("openai/gsm8k"): the key is val/<source>/mean@2
    sources = {key[len("val/"):-len("/mean@2")] for m in validated for key in m if key.endswith("/mean@2")}
    assert sources  # the assets' data sources
    for m in validated:
        for source in sources:
            assert m[f"val/{source}/best@2"] >= m[f"val/{source}/mean@2"]
            # the reward reports each sample's answer: a majority answer per prompt
            assert m[f"val/{source}/best@2"] >= m[f"val/{source}/maj@2"]
    lines = [json.loads(line) for line in (run / "generations.jsonl").read_text().splitlines()]
    # each step's training samples, then its validation's
    assert [(g["step"], g["split"]) for g in lines] == [(s, split) for s in (1, 2) for split in ("train", "val")
                                                        for _ in range(3)]
    assert set(lines[0]) == {"step", "split", "uid", "data_source", "prompt", "response", "reward"}
    assert lines[3]["uid"] == lines[4]["uid"]  # the n = 2 validation samples of the first prompt come first
    assert lines[0]["uid"] != lines[3]["uid"] and lines[0]["response"]
