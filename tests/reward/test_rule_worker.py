"""reward.timeout_s: rule functions in a child process, cut off at the limit."""

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from reprorl.errors import ReproRLError
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardLoop, RewardTimeoutError
from reprorl.reward.rule_worker import RuleWorker
from reprorl.reward.user_fn import resolve_reward_fn

HANGING = resolve_reward_fn(f"{Path(__file__).parent / 'hanging_reward.py'}:hang_or_length")
LIMIT_S = 1.0  # far above a call's few milliseconds, so a loaded machine cannot time out the others


def _batch(tok, responses):
    """Responses as text, one data source per row ("s0", "s1", ...)."""
    ids = torch.full((len(responses), 8), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(responses), 8), dtype=torch.long)
    for i, text in enumerate(responses):
        row = tok(text, add_special_tokens=False)["input_ids"]
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    n = len(responses)
    return Batch({"responses": ids, "response_mask": mask},
                 {"data_source": [f"s{i}" for i in range(n)], "ground_truth": ["g"] * n})


def _gone(pid, within_s=10.0):
    """True once process `pid` has exited (a zombie counts as gone)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            return True
        if state == "Z":
            return True
        time.sleep(0.05)
    return False


def test_without_determinism_a_timed_out_sample_scores_zero_and_is_counted(char_tokenizer, caplog):
    loop = RewardLoop(HANGING, timeout_s=LIMIT_S, timeout_is_error=False)
    try:
        with caplog.at_level(logging.WARNING, logger="reprorl.reward.loop"):
            scores, rule, metrics, *_ = loop.compute(_batch(char_tokenizer, ["ab", "hang", "boom", "hang", "abc"]),
                                                 char_tokenizer)
        # The calls after each timeout ran in a fresh process; the raising one is an error.
        assert torch.equal(scores, torch.tensor([2.0, 0.0, 0.0, 0.0, 3.0]))
        assert metrics["reward/fn_timeouts"] == 2.0 and metrics["reward/fn_errors"] == 1.0
        messages = [r.getMessage() for r in caplog.records if r.name == "reprorl.reward.loop"]
        assert len(messages) == 2  # the first timeout and the first error, once each
        assert "reward.timeout_s=1 s on sample 1 (data_source='s1')" in messages[0]
        assert "ValueError: boom" in messages[1]
    finally:
        loop.close()


def test_with_determinism_a_timeout_is_an_error_naming_sample_source_and_limit(char_tokenizer):
    loop = RewardLoop(HANGING, timeout_s=LIMIT_S, timeout_is_error=True)
    try:
        with pytest.raises(RewardTimeoutError, match=r"within reward.timeout_s=1 s on sample 2 "
                                                     r"\(data_source='s2'\); with full_determinism"):
            loop.compute(_batch(char_tokenizer, ["ab", "cd", "hang", "ef"]), char_tokenizer)
        assert loop.compute(_batch(char_tokenizer, ["xyz"]), char_tokenizer).scores.tolist() == [3.0]
    finally:
        loop.close()


def test_the_child_scores_as_the_trainer_process_does(char_tokenizer, caplog):
    batch = _batch(char_tokenizer, ["ab", "boom", "abcd"])
    here = RewardLoop(HANGING).compute(batch, char_tokenizer)
    child_loop = RewardLoop(HANGING, timeout_s=LIMIT_S)
    try:
        child = child_loop.compute(batch, char_tokenizer)
    finally:
        child_loop.close()
    assert torch.equal(here.scores, child.scores) and here.metrics == child.metrics


def test_a_killed_loop_leaves_no_process_behind():
    worker = RuleWorker(HANGING)
    call = {"data_source": "s", "solution_str": "ab", "ground_truth": "g", "extra_info": None}
    assert [o.score for o in worker.run([call], LIMIT_S, stop_at_timeout=True)] == [2.0]
    pid = worker.pid
    worker.close()
    assert worker.pid is None and _gone(pid)


def test_the_child_dies_with_its_parent(tmp_path):
    """A run killed with SIGKILL mid-call (no close()) must not leave its rule function spinning."""
    script = f"""
import sys
sys.path[:0] = {sys.path!r}
from reprorl.reward.rule_worker import RuleWorker
from reprorl.reward.user_fn import resolve_reward_fn
worker = RuleWorker(resolve_reward_fn({str(Path(__file__).parent / 'hanging_reward.py') + ':hang_or_length'!r}))
call = {{"data_source": "s", "solution_str": "ab", "ground_truth": "g", "extra_info": None}}
worker.run([call], 60.0, stop_at_timeout=True)
print(worker.pid, flush=True)
worker.run([dict(call, solution_str="hang")], 600.0, stop_at_timeout=True)
"""
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    time.sleep(0.5)  # the child is in the hanging call
    os.kill(parent.pid, signal.SIGKILL)
    parent.wait(timeout=30)
    assert _gone(child)


def test_a_function_that_cannot_be_sent_is_a_clear_error():
    lock = threading.Lock()

    def holds_a_lock(data_source, solution_str, ground_truth, extra_info=None):
        with lock:
            return 1.0

    with pytest.raises(ReproRLError, match="cannot be sent to a rule-reward process.*reward.timeout_s=null"):
        RewardLoop(holds_a_lock, timeout_s=LIMIT_S)
