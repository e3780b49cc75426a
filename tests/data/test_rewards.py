"""Rule rewards: doctests, edge cases, dispatch."""

import doctest
import threading

import math_verify
import pytest

from reprorl.data import rewards, synthetic
from reprorl.data.rewards import (
    ANSWER_FNS,
    REWARD_FNS,
    arithmetic_answer,
    arithmetic_score,
    check_ground_truth,
    compute_score,
    gsm8k_answer,
    gsm8k_score,
    dapo_normalize,
    gsm8k_truth,
    math_answer,
    math_dapo_answer,
    math_dapo_score,
    math_score,
    score_and_answer,
)
from reprorl.errors import DataError


@pytest.mark.parametrize("module", [rewards, synthetic], ids=lambda m: m.__name__)
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0
    assert result.failed == 0


ARITHMETIC_CASES = [
    ("19", "19", 1.0),
    ("\n19\n", "19", 1.0),
    ("19<|im_end|>", "19", 1.0),
    ("19<|im_end|><|endoftext|><|endoftext|>", "19", 1.0),
    ("0", "0", 1.0),
    ("-7", "-7", 1.0),
    ("", "19", 0.0),
    ("<|im_end|>", "19", 0.0),
    ("19<|im_end|>19", "19", 0.0),
    ("1 9", "19", 0.0),
    ("+19", "19", 0.0),
    ("19.0", "19", 0.0),
    ("The answer is 19", "19", 0.0),
    ("7", "-7", 0.0),
    ("１９", "19", 0.0),  # full-width digits match \d but are not the answer
]


@pytest.mark.parametrize("response, truth, score", ARITHMETIC_CASES)
def test_arithmetic_edge_cases(response, truth, score):
    assert arithmetic_score("reprorl/arithmetic", response, truth) == score


GSM8K_CASES = [
    ("#### 72", "72", 1.0),
    ("####72", "72", 1.0),
    ("#### 1,234", "1234", 1.0),
    ("#### 1234", "1,234", 1.0),
    ("#### $5", "5", 1.0),
    ("#### 0.50", "0.5", 1.0),
    ("#### -3", "-3", 1.0),
    ("#### 72.", "72", 1.0),
    ("#### 3 then #### 4", "3", 0.0),  # the last one counts
    ("####", "72", 0.0),
    ("#### seventy-two", "72", 0.0),
    ("72", "72", 0.0),  # no fallback to the last number
    ("#### 72", "Natalia sold 48/2 = 24 clips in May.\n#### 72", 1.0),
    ("#### 72 apples", "72", 1.0),  # words after the number are not part of it
    ("#### 72<|im_end|>", "72", 1.0),
    ("#### 0.5", ".5", 1.0),
    ("#### .5", "0.5", 1.0),
    # Trailing garbage: the leading number alone must not match.
    ("#### 1.2.3", "1.2", 0.0),
    ("#### 3/4", "3", 0.0),
    ("#### 1,2,3", "123", 0.0),
    ("#### 72x", "72", 0.0),
    ("#### 7 then ####", "7", 0.0),  # the last #### has no number
]


@pytest.mark.parametrize("response, truth, score", GSM8K_CASES)
def test_gsm8k_edge_cases(response, truth, score):
    assert gsm8k_score("openai/gsm8k", response, truth) == score


@pytest.mark.parametrize("truth", ["3/4", "", "seventy-two", "1.2.3", "#### 3/4", "72 apples"])
def test_gsm8k_truth_that_is_not_a_number_is_an_error(truth):
    """It used to score by its leading number (3/4 as 3) or silently 0 for every response."""
    with pytest.raises(ValueError, match="is not a number"):
        gsm8k_score("openai/gsm8k", "#### 3", truth)
    with pytest.raises(ValueError, match="is not a number"):
        check_ground_truth("openai/gsm8k", truth)


def test_gsm8k_truth_forms():
    assert gsm8k_truth("1,000") == gsm8k_truth("$1000") == gsm8k_truth(" 1000.0 ") == gsm8k_truth("x\n#### 1000")
    assert str(gsm8k_truth(".5")) == "0.5" and str(gsm8k_truth("-3")) == "-3"


def test_check_ground_truth():
    check_ground_truth("reprorl/arithmetic", "-19")
    check_ground_truth("lighteval/MATH", "\\frac{1}{2}")  # math-verify parses it at scoring time
    with pytest.raises(ValueError, match="'19.5' is not an integer"):
        check_ground_truth("reprorl/arithmetic", "19.5")


def test_math_parser_exception_scores_zero(monkeypatch):
    def broken(*args, **kwargs):
        raise RecursionError("parser blew up")

    assert math_score("math", "\\boxed{2}", "2") == 1.0
    monkeypatch.setattr(math_verify, "parse", broken)
    assert math_score("math", "\\boxed{2}", "2") == 0.0


def test_math_edge_cases():
    assert math_score("math", "", "2") == 0.0
    assert math_score("math", "\\boxed{", "2") == 0.0
    assert math_score("math", "the answer is \\boxed{\\dfrac{3}{4}}", "\\boxed{0.75}") == 1.0
    assert math_score("math", "\\boxed{(3, \\frac{\\pi}{2})}", "\\left( 3, \\frac{\\pi}{2} \\right)") == 1.0


def test_math_off_the_main_thread_raises_instead_of_scoring_zero():
    errors = []

    def run():
        try:
            math_score("math", "\\boxed{2}", "2")
        except RuntimeError as err:
            errors.append(str(err))

    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


def test_compute_score_dispatches_on_data_source():
    assert compute_score("reprorl/arithmetic", "5", "5") == 1.0
    assert compute_score("openai/gsm8k", "#### 5", "5") == 1.0
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math"):
        assert REWARD_FNS[source] is math_score
        assert compute_score(source, "\\boxed{5}", "5") == 1.0
        assert compute_score(source, "\\boxed{6}", "5") == 0.0
    assert compute_score("openai/gsm8k", "5", "5", extra_info={"split": "test"}) == 0.0


DAPO_CASES = [
    ("Let me add: 17 + 25 = 42.\nAnswer: 42", "42", 1.0),  # correct
    ("Answer: 41", "42", -1.0),  # wrong
    ("the answer is 42", "42", -1.0),  # no "Answer:" and no \boxed{}: wrong, not 0
    ("", "42", -1.0),
    ("ANSWER :  42 ", "42", 1.0),  # any case, spaces around the colon
    ("Answer: 3\nno wait\nAnswer: 42", "42", 1.0),  # the last one counts
    ("Answer: 42\nAnswer: 3", "42", -1.0),
    ("Answer: 42\nbecause six times seven", "42", 1.0),  # up to the end of its line
    ("Answer: x = 42", "42", 1.0),  # normalisation: after the last "="
    ("Answer: $1,000$", "1000", 1.0),  # $ and thousands commas
    ("Answer: 12 inches", "12", 1.0),  # units dropped
    ("Answer: \\frac12", "\\frac{1}{2}", 1.0),  # TeX shorthand spelled out
    ("Answer: \\text{(C)}", "(C)", 1.0),
    ("Answer: 0.5", "\\frac{1}{2}", -1.0),  # strings, not values (unlike math_score)
    ("so \\boxed{\\sqrt{2}}", "\\sqrt2", 1.0),  # no "Answer:": the last \boxed{}
    ("\\boxed{42}" + "x" * 100, "42", -1.0),  # ... only in the last 100 characters
    ("Answer: 42" + "x" * 300, "42", -1.0),  # only the last 300 characters are read
]


@pytest.mark.parametrize("response, truth, score", DAPO_CASES)
def test_math_dapo_cases(response, truth, score):
    assert math_dapo_score("math_dapo", response, truth) == score


def test_dapo_normalize():
    assert dapo_normalize(" 1,234 ") == "1234"
    assert dapo_normalize("(1,2)") == "(1,2)"  # commas stay unless only digits are left
    assert dapo_normalize("\\boxed{7}") == "7"
    assert dapo_normalize("90^\\circ") == "90"
    assert dapo_normalize("\\sqrt3") == "\\sqrt{3}"


def test_math_dapo_is_registered():
    assert REWARD_FNS["math_dapo"] is math_dapo_score
    assert compute_score("math_dapo", "Answer: 7", "7") == 1.0
    assert compute_score("math_dapo", "Answer: 8", "7") == -1.0


def test_unknown_data_source_names_it_and_lists_known():
    with pytest.raises(DataError) as err:
        compute_score("my/dataset", "5", "5")
    msg = str(err.value)
    assert "'my/dataset'" in msg
    assert all(source in msg for source in REWARD_FNS)


def test_synthetic_rows_score_their_own_truth():
    for row in synthetic.make_arithmetic_rows(200, seed=0, split="train"):
        truth = row["reward_model"]["ground_truth"]
        assert compute_score(row["data_source"], truth + "<|im_end|>", truth) == 1.0
        assert compute_score(row["data_source"], str(int(truth) + 1), truth) == 0.0


def _full_credit(cases):
    return [(response, truth) for response, truth, score in cases if score == 1.0]


def test_a_right_answer_reads_as_the_truth():
    # The answer extractors read what the scorers compare: every response a scorer takes as
    # right gives the truth's answer, so right answers to a prompt are one vote.
    for response, truth in _full_credit(ARITHMETIC_CASES):
        assert arithmetic_answer(response) == truth
    for response, truth in _full_credit(GSM8K_CASES):
        assert gsm8k_answer(response) == gsm8k_answer("#### " + str(gsm8k_truth(truth)))
    for response, truth in _full_credit(DAPO_CASES):
        assert math_dapo_answer(response) == dapo_normalize(truth)


@pytest.mark.parametrize("source, response, answer", [
    ("reprorl/arithmetic", " 19<|im_end|>", "19"),
    ("reprorl/arithmetic", "19 19", None),
    ("openai/gsm8k", "#### $1,000.50.", "1000.5"),
    ("openai/gsm8k", "#### 1e3", None),
    ("openai/gsm8k", "#### -0", "0"),
    ("openai/gsm8k", "72", None),
    ("math", "so $x = \\boxed{ \\frac{1}{2} }$.", "\\frac{1}{2}"),
    ("math", "\\boxed{1} or \\boxed{2}", "2"),
    ("math", "no box", None),
    ("math_dapo", "Answer: $1,000$ dollars", "1000"),
    ("math_dapo", "I think 4", None),
])
def test_answers(source, response, answer):
    assert ANSWER_FNS[source](response) == answer


def test_every_source_has_an_answer_and_score_and_answer_gives_both():
    assert set(ANSWER_FNS) == set(REWARD_FNS)
    assert score_and_answer("math_dapo", "Answer: 5", "4") == {"score": -1.0, "pred": "5"}
    assert score_and_answer("math", "x", "4") == {"score": 0.0, "pred": None}
    assert math_answer("\\boxed{5}") == "5"
