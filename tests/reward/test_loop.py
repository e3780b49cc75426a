"""RewardLoop: decoding, rule scores in sample order, raising functions, weights, metrics."""

import logging
import time

import pytest
import torch

from reprorl.data.rewards import compute_score
from reprorl.errors import DataError
from reprorl.protocol import Batch
from reprorl.reward.loop import (
    RewardFnError,
    RewardLoop,
    WeightedFn,
    decode_responses,
    overlong_penalty,
    weighted_sum,
)

R = 12  # response length of the test batches


def _batch(tok, responses, *, data_sources=None, ground_truths=None, masks=None, extra_infos=None):
    """A rollout-like batch: `responses` are strings (each may end in <|im_end|>), right-padded."""
    ids = torch.full((len(responses), R), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(responses), R), dtype=torch.long)
    for i, text in enumerate(responses):
        row = tok(text, add_special_tokens=False)["input_ids"]
        ids[i, : len(row)] = torch.tensor(row)
        mask[i, : len(row)] = torch.tensor(masks[i] if masks else [1] * len(row))
    n = len(responses)
    non_tensors = {
        "data_source": data_sources or ["reprorl/arithmetic"] * n,
        "ground_truth": ground_truths or ["7"] * n,
        "raw_prompt": [[{"role": "user", "content": f"q{i}"}] for i in range(n)],
    }
    if extra_infos is not None:
        non_tensors["extra_info"] = extra_infos
    return Batch({"responses": ids, "response_mask": mask}, non_tensors)


def _answer_is_the_digits(data_source, solution_str, ground_truth, extra_info=None):
    digits = "".join(c for c in solution_str if c.isdigit())
    return {"score": float(digits == ground_truth), "pred": digits or None}


def _batch_answers(data_sources, solution_strs, ground_truths, extra_infos):
    return [_answer_is_the_digits(*row) for row in zip(data_sources, solution_strs, ground_truths, extra_infos)]


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["here", "child-process"])
@pytest.mark.parametrize("batch", [False, True], ids=["per-sample", "batch"])
def test_the_answers_a_function_reports_come_back_in_sample_order(char_tokenizer, timeout_s, batch):
    loop = RewardLoop(_batch_answers if batch else _answer_is_the_digits, batch=batch, timeout_s=timeout_s)
    try:
        rewards = loop.compute(_batch(char_tokenizer, ["a7", "x", "12"]), char_tokenizer)
    finally:
        loop.close()
    assert rewards.answers == ["7", None, "12"]
    assert rewards.scores.tolist() == [1.0, 0.0, 0.0]


def test_the_builtin_rewards_report_answers_and_floats_report_none(char_tokenizer):
    from reprorl.data.rewards import score_and_answer

    batch = _batch(char_tokenizer, ["7<|im_end|>", "8", "#### 1,000"], data_sources=["reprorl/arithmetic"] * 2 +
                   ["openai/gsm8k"], ground_truths=["7", "7", "1000"])
    assert RewardLoop(score_and_answer).compute(batch, char_tokenizer).answers == ["7", "8", "1000"]
    assert RewardLoop(compute_score).compute(batch, char_tokenizer).answers is None
    weighted = RewardLoop([WeightedFn("plain", compute_score, 1.0), WeightedFn("voted", score_and_answer, 1.0)])
    assert weighted.compute(batch, char_tokenizer).answers == ["7", "8", "1000"]  # the first that reports


def test_decode_keeps_model_tokens_only(char_tokenizer):
    tok = char_tokenizer
    # Row 0: "12<|im_end|>" then pad. Row 1: a tool turn, "ab" is tool output (mask 0).
    batch = _batch(tok, ["12<|im_end|>", "<tool_call>xab<|im_end|>y"],
                   masks=[[1, 1, 1], [1, 1, 0, 0, 1, 1]])
    assert decode_responses(batch["responses"], batch["response_mask"], tok) == ["12", "<tool_call>xy"]


def test_rule_scores_in_sample_order(char_tokenizer):
    batch = _batch(char_tokenizer, ["7<|im_end|>", "8<|im_end|>", " 7", "#### 7"],
                   data_sources=["reprorl/arithmetic"] * 3 + ["openai/gsm8k"],
                   extra_infos=[{"index": i} for i in range(4)])
    scores, _, metrics, *_ = RewardLoop(compute_score).compute(batch, char_tokenizer)
    assert scores.dtype == torch.float32
    assert torch.equal(scores, torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert metrics == {"reward/fn_errors": 0.0, "reward/fn_timeouts": 0.0, "reward/rule_mean": 0.75,
                       "reward/mean": 0.75}


def test_rule_fn_gets_its_row(char_tokenizer):
    seen = []

    def record(data_source, solution_str, ground_truth, extra_info):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return {"score": len(solution_str), "note": "verl-style dict"}

    batch = _batch(char_tokenizer, ["ab", "cde"], data_sources=["s0", "s1"], ground_truths=["g0", "g1"],
                   extra_infos=[{"i": 0}, None])
    scores, *_ = RewardLoop(record).compute(batch, char_tokenizer)
    assert seen == [("s0", "ab", "g0", {"i": 0}), ("s1", "cde", "g1", None)]
    assert torch.equal(scores, torch.tensor([2.0, 3.0]))
    # Without an extra_info column the function gets None.
    seen.clear()
    RewardLoop(record).compute(_batch(char_tokenizer, ["x"]), char_tokenizer)
    assert seen[0][3] is None


def test_raising_fn_scores_zero_counted_and_logged_once(char_tokenizer, caplog):
    def flaky(data_source, solution_str, ground_truth, extra_info=None):
        if solution_str.startswith("bad"):
            raise ValueError(f"cannot score {solution_str!r}")
        return 1.0

    loop = RewardLoop(flaky)
    batch = _batch(char_tokenizer, ["ok", "bad1", "ok", "bad2"])
    with caplog.at_level(logging.ERROR, logger="reprorl.reward.loop"):
        scores, _, metrics, *_ = loop.compute(batch, char_tokenizer)
        scores2, _, metrics2, *_ = loop.compute(batch, char_tokenizer)  # the same run, a later step
    assert torch.equal(scores, torch.tensor([1.0, 0.0, 1.0, 0.0]))
    assert torch.equal(scores2, scores)
    assert metrics["reward/fn_errors"] == 2.0 and metrics2["reward/fn_errors"] == 2.0
    assert metrics["reward/rule_mean"] == 0.5
    assert loop.fn_errors_total == 4
    records = [r for r in caplog.records if r.name == "reprorl.reward.loop"]
    assert len(records) == 1  # the first traceback of the run only
    assert "sample 1" in records[0].getMessage()
    assert "ValueError: cannot score 'bad1'" in records[0].getMessage()  # with its traceback


def test_unknown_data_source_counts_as_an_error(char_tokenizer):
    batch = _batch(char_tokenizer, ["7", "7"], data_sources=["reprorl/arithmetic", "nobody/knows"])
    scores, _, metrics, *_ = RewardLoop(compute_score).compute(batch, char_tokenizer)
    assert torch.equal(scores, torch.tensor([1.0, 0.0]))
    assert metrics["reward/fn_errors"] == 1.0


def _fails_on_bad(data_source, solution_str, ground_truth, extra_info=None):
    if solution_str.startswith("bad"):
        raise ValueError(f"cannot score {solution_str!r}\n(a second line)")
    return float("nan") if solution_str == "nan" else 1.0


def test_failing_on_more_than_max_error_rate_stops_naming_the_function_and_first_error(char_tokenizer):
    batch = _batch(char_tokenizer, ["ok", "ok", "bad1", "ok", "nan", "ok", "ok", "ok"],
                   data_sources=[f"s{i}" for i in range(8)])
    for rate in (None, 1.0, 0.25):  # 2 of 8 fail: at most a quarter is allowed
        scores, _, metrics, *_ = RewardLoop(_fails_on_bad, max_error_rate=rate).compute(batch, char_tokenizer)
        assert metrics["reward/fn_errors"] == 2.0 and scores.tolist() == [1, 1, 0, 1, 0, 1, 1, 1]
    with pytest.raises(RewardFnError) as info:
        RewardLoop(_fails_on_bad, max_error_rate=0.2).compute(batch, char_tokenizer)
    assert str(info.value) == (
        "the reward function '_fails_on_bad' failed on 2 of 8 samples, more than reward.max_error_rate=0.2; the "
        "first, sample 2 (data_source='s2'): ValueError: cannot score 'bad1' (a second line)")
    with pytest.raises(RewardFnError, match=r"failed on 1 of 1 samples, more than reward.max_error_rate=0; the first, "
                                            r"sample 0 \(data_source='reprorl/arithmetic'\): ValueError: reward "
                                            r"function returned nan; expected a finite number$"):
        RewardLoop(_fails_on_bad, max_error_rate=0.0).compute(_batch(char_tokenizer, ["nan"]), char_tokenizer)


def test_a_source_the_builtin_rules_do_not_know_stops_the_run(char_tokenizer):
    """A data_source no built-in scorer knows (gsm8k, not openai/gsm8k) scored 0 on every sample."""
    batch = _batch(char_tokenizer, ["#### 7"] * 4, data_sources=["gsm8k"] * 4)
    with pytest.raises(RewardFnError, match=r"^the reward function 'compute_score' failed on 4 of 4 samples, more "
                                            r"than reward.max_error_rate=0.1; the first, sample 0 \(data_source="
                                            r"'gsm8k'\): reprorl.errors.DataError: data_source 'gsm8k' has no rule "
                                            r"reward; known: reprorl/arithmetic, openai/gsm8k, "):
        RewardLoop(compute_score, max_error_rate=0.1).compute(batch, char_tokenizer)


def test_failures_in_the_rule_process_count_alike(char_tokenizer):
    def fails_on_bad(data_source, solution_str, ground_truth, extra_info=None):
        # Local: sent by value, so the child does not import this module (and torch).
        if solution_str.startswith("bad"):
            raise ValueError(f"cannot score {solution_str!r}\n(a second line)")
        return 1.0

    batch = _batch(char_tokenizer, ["ok", "bad1", "bad2"])
    loop = RewardLoop(fails_on_bad, timeout_s=30.0, max_error_rate=0.5)
    try:
        with pytest.raises(RewardFnError, match=r"failed on 2 of 3 samples, more than reward.max_error_rate=0.5; "
                                                r"the first, sample 1 \(data_source='reprorl/arithmetic'\): "
                                                r"ValueError: cannot score 'bad1' \(a second line\)$"):
            loop.compute(batch, char_tokenizer)
        assert loop.compute(_batch(char_tokenizer, ["ok", "bad"]), char_tokenizer).scores.tolist() == [1.0, 0.0]
    finally:
        loop.close()


def test_timeouts_count_as_failures(char_tokenizer):
    def hangs(data_source, solution_str, ground_truth, extra_info=None):
        while solution_str == "hang":
            time.sleep(1)
        return 1.0

    loop = RewardLoop(hangs, timeout_s=0.5, timeout_is_error=False, max_error_rate=0.4)
    try:
        with pytest.raises(RewardFnError, match=r"failed on 1 of 2 samples, more than reward.max_error_rate=0.4; "
                                                r"the first, sample 1 \(data_source='reprorl/arithmetic'\): timed "
                                                r"out \(reward.timeout_s=0.5 s\)$"):
            loop.compute(_batch(char_tokenizer, ["ok", "hang"]), char_tokenizer)
    finally:
        loop.close()


class FixedModel:
    """A stand-in reward model: fixed scores, and a record of what it was asked."""

    def __init__(self, scores):
        self.scores = torch.tensor(scores, dtype=torch.float32)
        self.calls = []

    def score(self, prompts, responses):
        self.calls.append((prompts, responses))
        return self.scores


def test_weights_combine(char_tokenizer):
    batch = _batch(char_tokenizer, ["7", "8", "7<|im_end|>"])
    model = FixedModel([0.5, -2.0, 0.25])
    scores, rule, metrics, *_ = RewardLoop(compute_score, model, rule_weight=2.0, model_weight=0.5).compute(
        batch, char_tokenizer)
    # rule [1, 0, 1] * 2 + model [0.5, -2, 0.25] * 0.5 (all exact in float32)
    assert torch.equal(scores, torch.tensor([2.25, -1.0, 2.125]))
    assert torch.equal(rule, torch.tensor([1.0, 0.0, 1.0]))  # unweighted
    assert metrics == {"reward/fn_errors": 0.0, "reward/fn_timeouts": 0.0, "reward/rule_mean": 2 / 3,
                       "reward/model_mean": -1.25 / 3, "reward/mean": 3.375 / 3}
    prompts, responses = model.calls[0]
    assert responses == ["7", "8", "7"]
    assert prompts == [[{"role": "user", "content": f"q{i}"}] for i in range(3)]


def test_model_only_skips_the_rule_fn(char_tokenizer):
    def never(**kwargs):
        raise AssertionError("the rule function must not run with rule_weight=0")

    batch = _batch(char_tokenizer, ["a", "b"], ground_truths=[None, None])
    scores, rule, metrics, *_ = RewardLoop(never, FixedModel([3.0, 4.0]), rule_weight=0.0).compute(batch, char_tokenizer)
    assert torch.equal(scores, torch.tensor([3.0, 4.0]))
    assert rule is None
    assert "reward/rule_mean" not in metrics and metrics["reward/model_mean"] == 3.5


def test_missing_columns(char_tokenizer):
    batch = _batch(char_tokenizer, ["7"])
    batch.pop(non_tensor_keys=["ground_truth"])
    with pytest.raises(DataError, match="no non-tensor column 'ground_truth'"):
        RewardLoop(compute_score).compute(batch, char_tokenizer)
    batch = _batch(char_tokenizer, ["7"])
    batch.pop(tensor_keys=["response_mask"])
    with pytest.raises(DataError, match="no tensor 'response_mask'"):
        RewardLoop(compute_score).compute(batch, char_tokenizer)
    batch = _batch(char_tokenizer, ["7"])
    batch.pop(non_tensor_keys=["raw_prompt"])
    with pytest.raises(DataError, match="needs the non-tensor column 'raw_prompt'"):
        RewardLoop(compute_score, FixedModel([1.0])).compute(batch, char_tokenizer)


# ---------------------------------------------------------------- several functions, batch functions, overlong


def _digits(data_source, solution_str, ground_truth, extra_info):
    return float(sum(c.isdigit() for c in solution_str))


def _length(data_source, solution_str, ground_truth, extra_info):
    return float(len(solution_str))


def test_weighted_sum_by_hand():
    assert weighted_sum([[1.0, 0.0, 2.0]], [0.5]) == [0.5, 0.0, 1.0]
    assert weighted_sum([[1.0, 0.0, 2.0], [3.0, 4.0, 0.25]], [0.5, -1.0]) == [-2.5, -4.0, 0.75]
    # Added left to right: (1e16 + 1) - 1e16 is 0 in float64, (1e16 - 1e16) + 1 would be 1.
    assert weighted_sum([[1e16], [1.0], [1e16]], [1.0, 1.0, -1.0]) == [0.0]


def test_weighted_functions_sum_in_order_and_log_each(char_tokenizer):
    batch = _batch(char_tokenizer, ["7<|im_end|>", "12ab", "x"])
    loop = RewardLoop([WeightedFn("digits", _digits, 1.0), WeightedFn("length", _length, -0.5)])
    scores, rule, metrics, *_ = loop.compute(batch, char_tokenizer)
    # digits [1, 2, 0], lengths [1, 4, 1] ("7" without its end token): 1 - 0.5, 2 - 2, 0 - 0.5
    assert torch.equal(scores, torch.tensor([0.5, 0.0, -0.5]))
    assert torch.equal(rule, scores)
    assert metrics["reward/digits/mean"] == 1.0
    assert metrics["reward/length/mean"] == 2.0
    assert metrics["reward/rule_mean"] == 0.0


def test_one_function_alone_logs_no_name(char_tokenizer):
    _, _, metrics, *_ = RewardLoop(_digits).compute(_batch(char_tokenizer, ["7"]), char_tokenizer)
    assert not any(key.count("/") > 1 for key in metrics)


def test_each_weighted_function_is_checked_on_its_own(char_tokenizer):
    def broken(data_source, solution_str, ground_truth, extra_info):
        raise ValueError("no")

    loop = RewardLoop([WeightedFn("digits", _digits, 1.0), WeightedFn("broken", broken, 1.0)], max_error_rate=0.5)
    with pytest.raises(RewardFnError, match="'broken' failed on 2 of 2 samples"):
        loop.compute(_batch(char_tokenizer, ["7", "8"]), char_tokenizer)


def _batch_digits(data_sources, solution_strs, ground_truths, extra_infos):
    assert len(data_sources) == len(ground_truths) == len(extra_infos) == len(solution_strs)
    return [float(sum(c.isdigit() for c in s)) for s in solution_strs]


@pytest.mark.parametrize("timeout_s", [None, 30.0], ids=["here", "child-process"])
def test_batch_function_is_called_once_with_lists(char_tokenizer, timeout_s):
    calls = []

    def recorded(**kwargs):  # in this process only: a child process's calls are its own
        calls.append(kwargs["solution_strs"])
        return _batch_digits(**kwargs)

    batch = _batch(char_tokenizer, ["7<|im_end|>", "12ab", "x"], extra_infos=[{"i": 0}, {"i": 1}, {"i": 2}])
    fn = recorded if timeout_s is None else _batch_digits
    loop = RewardLoop([WeightedFn("digits", fn, 2.0)], batch=True, timeout_s=timeout_s)
    try:
        scores, _, metrics, *_ = loop.compute(batch, char_tokenizer)
    finally:
        loop.close()
    assert torch.equal(scores, torch.tensor([2.0, 4.0, 0.0]))
    assert metrics["reward/digits/mean"] == 1.0
    if timeout_s is None:
        assert calls == [["7", "12ab", "x"]]


def test_batch_function_with_a_wrong_count_fails_the_batch(char_tokenizer):
    def too_few(data_sources, solution_strs, ground_truths, extra_infos):
        return [1.0]

    with pytest.raises(RewardFnError, match="failed on 2 of 2 samples.*returned 1 scores; expected a list of 2"):
        RewardLoop(too_few, batch=True, max_error_rate=0.0).compute(_batch(char_tokenizer, ["7", "8"]),
                                                                     char_tokenizer)


def test_overlong_penalty_by_hand():
    lengths = torch.tensor([2, 4, 5, 6, 7, 8])
    # M = 8, B = 4: no penalty up to 4 tokens, then -(L - 4) / 4 * factor
    assert overlong_penalty(lengths, 8, 4, 1.0).tolist() == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]
    assert overlong_penalty(lengths, 8, 4, 0.5).tolist() == [0.0, 0.0, -0.125, -0.25, -0.375, -0.5]
    # M = 8, B = 3: (7 - 5) / 3 = 2/3, computed in float64 and rounded once to float32
    assert torch.equal(overlong_penalty(lengths, 8, 3, 1.0),
                       torch.tensor([0.0, 0.0, 0.0, -1 / 3, -2 / 3, -1.0], dtype=torch.float64).float())


def test_overlong_penalty_is_added_to_the_score(char_tokenizer):
    batch = _batch(char_tokenizer, ["7<|im_end|>", "7abcdefg", "8"])
    P = 3
    prompt_mask = torch.ones(len(batch), P, dtype=torch.long)
    batch["prompts"] = torch.zeros(len(batch), P, dtype=torch.long)
    batch["attention_mask"] = torch.cat([prompt_mask, batch["response_mask"]], dim=1)  # lengths 2, 8, 1
    loop = RewardLoop(compute_score, overlong_buffer=4, overlong_penalty_factor=1.0, max_length=8)
    scores, rule, metrics, *_ = loop.compute(batch, char_tokenizer)
    assert torch.equal(rule, torch.tensor([1.0, 0.0, 0.0]))
    assert torch.equal(scores, torch.tensor([1.0, -1.0, 0.0]))  # 8 tokens of 8: -(8 - 4) / 4
    assert metrics["reward/overlong_penalty_mean"] == pytest.approx(-1 / 3)
    with pytest.raises(ValueError, match="overlong_buffer=9"):
        RewardLoop(compute_score, overlong_buffer=9, max_length=8)


def test_components_are_the_terms_of_the_score_each_with_its_weight(char_tokenizer):
    # GDPO's input: each rule function's score, the model's and the overlong penalty as columns
    batch = _batch(char_tokenizer, ["7<|im_end|>", "12abcdef", "x"])
    batch["prompts"] = torch.zeros(len(batch), 3, dtype=torch.long)
    batch["attention_mask"] = torch.cat([torch.ones(len(batch), 3, dtype=torch.long), batch["response_mask"]], dim=1)
    loop = RewardLoop([WeightedFn("digits", _digits, 1.0), WeightedFn("length", _length, -0.5)],
                      FixedModel([0.5, -2.0, 0.25]), rule_weight=2.0, model_weight=0.5, overlong_buffer=4,
                      overlong_penalty_factor=1.0, max_length=8)
    rewards = loop.compute(batch, char_tokenizer)
    # digits [1, 2, 0], lengths [1, 8, 1], model [0.5, -2, 0.25], penalty of 2, 8, 1 tokens [0, -1, 0]
    assert torch.equal(rewards.components, torch.tensor([[1.0, 1, 0.5, 0], [2, 8, -2, -1], [0, 1, 0.25, 0]]))
    assert loop.component_weights == (2.0, -1.0, 0.5, 1.0)  # rule_weight times each function's
    # the score is their weighted sum: 2 - 1 + 0.25, 4 - 8 - 1 - 1, 0 - 1 + 0.125
    assert torch.equal(rewards.scores, torch.tensor([1.25, -6.0, -0.875]))
    # a reward model alone (rule_weight 0: no rule function runs): its score is the one term
    model_only = RewardLoop(_digits, FixedModel([3.0, 4.0]), rule_weight=0.0, model_weight=2.0)
    assert torch.equal(model_only.compute(_batch(char_tokenizer, ["a", "b"]), char_tokenizer).components,
                       torch.tensor([[3.0], [4.0]]))
    assert model_only.component_weights == (2.0,)
