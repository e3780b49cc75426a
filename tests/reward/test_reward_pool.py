"""reward.num_workers: a batch's code rewards scored by several processes side by side give
the scores of one, and so does a pool whose worker is killed mid-batch."""

import json
import logging

import torch

from reprorl.actors.supervision import KILL_ENV
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardLoop
from reprorl.reward.user_fn import resolve_reward_fn

TRUTH = json.dumps({"inputs": ["2\n"], "outputs": ["4\n"]})
RESPONSES = ["print(4)", "print(5)", "```python\nprint(int(input())*2)\n```", "1/0",
             "print(2+2)", "x", "print(int(input())**2)", "import os\nprint(4)"]


def _batch(tok) -> Batch:
    rows = [tok(text, add_special_tokens=False)["input_ids"] for text in RESPONSES]
    width = max(map(len, rows))
    ids = torch.full((len(rows), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    n = len(rows)
    return Batch({"responses": ids, "response_mask": mask},
                 {"data_source": ["reprorl/code"] * n, "ground_truth": [TRUTH] * n})


def _scores(tok, num_workers: int) -> list[float]:
    loop = RewardLoop(resolve_reward_fn(None), timeout_s=60.0, num_workers=num_workers)
    try:
        return loop.compute(_batch(tok), tok).scores.tolist()
    finally:
        loop.close()


def test_one_and_four_workers_give_the_same_scores(char_tokenizer):
    expected = [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert _scores(char_tokenizer, 1) == expected
    assert _scores(char_tokenizer, 4) == expected


def test_a_worker_killed_mid_batch_is_replaced_and_the_scores_stay(char_tokenizer, monkeypatch, caplog):
    monkeypatch.setenv(KILL_ENV, "rule-reward worker 1@score#2")  # worker 1's second call: sample 3 of 4 workers
    with caplog.at_level(logging.WARNING, logger="reprorl.reward.rule_worker"):
        assert _scores(char_tokenizer, 4) == [1.0, 0.0, 1.0, 0.0, 1.0, 0.0, 1.0, 1.0]
    assert any("rule-reward worker 1 died" in r.getMessage() for r in caplog.records)
