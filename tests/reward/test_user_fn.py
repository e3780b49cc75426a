"""resolve_reward_fn: the default, a module function, a file function, and every bad spec."""

import textwrap

import pytest

from reprorl.data.rewards import score_and_answer
from reprorl.errors import ReproRLError
from reprorl.reward.user_fn import resolve_reward_fn


def _write(path, source):
    path.write_text(textwrap.dedent(source))
    return path


def test_none_is_the_data_source_dispatch_with_its_answer():
    assert resolve_reward_fn(None) is score_and_answer


def test_module_function():
    fn = resolve_reward_fn("reprorl.data.rewards:gsm8k_score")
    assert fn(data_source="openai/gsm8k", solution_str="#### 7", ground_truth="7", extra_info=None) == 1.0
    assert fn(data_source="openai/gsm8k", solution_str="#### 8", ground_truth="7", extra_info=None) == 0.0


def test_file_function(tmp_path):
    path = _write(tmp_path / "my_reward.py", """
        def length_reward(data_source, solution_str, ground_truth, extra_info=None):
            return float(len(solution_str)) + (0.5 if extra_info else 0.0)
    """)
    fn = resolve_reward_fn(f"{path}:length_reward")
    assert fn(data_source="x", solution_str="abcd", ground_truth="", extra_info={"a": 1}) == 4.5
    # A relative path works too, from the working directory.
    (tmp_path / "sub").mkdir()
    _write(tmp_path / "sub" / "r.py", "def f(data_source, solution_str, ground_truth, extra_info): return 2.0\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.chdir(tmp_path)
        assert resolve_reward_fn("sub/r.py:f")(data_source="", solution_str="", ground_truth="", extra_info=None) == 2.0


def test_kwargs_signature_is_accepted(tmp_path):
    path = _write(tmp_path / "r.py", "def f(**kwargs): return 1.0\n")
    assert resolve_reward_fn(f"{path}:f")(data_source="", solution_str="", ground_truth="", extra_info=None) == 1.0


def test_batch_function_takes_verls_batch_names(tmp_path):
    path = _write(tmp_path / "r.py", """
        def lengths(data_sources, solution_strs, ground_truths, extra_infos):
            return [float(len(s)) for s in solution_strs]
    """)
    fn = resolve_reward_fn(f"{path}:lengths", batch=True)
    lists = {"data_sources": ["a", "b"], "solution_strs": ["x", "yz"], "ground_truths": ["", ""],
             "extra_infos": [None, None]}
    assert fn(**lists) == [1.0, 2.0]
    with pytest.raises(ReproRLError, match=r"cannot be called as fn\(data_source=\.\.\."):
        resolve_reward_fn(f"{path}:lengths")
    with pytest.raises(ReproRLError, match=r"cannot be called as fn\(data_sources=\.\.\."):
        resolve_reward_fn("reprorl.data.rewards:gsm8k_score", batch=True)


@pytest.mark.parametrize(
    "spec, message",
    [
        ("reprorl.data.rewards", "expected 'package.module:function'"),
        (":compute_score", "expected 'package.module:function'"),
        ("reprorl.data.rewards:", "expected 'package.module:function'"),
        ("reprorl.no_such_module:f", "cannot import module 'reprorl.no_such_module'"),
        ("reprorl.data.rewards:no_such_fn", "'reprorl.data.rewards' has no attribute 'no_such_fn'"),
        ("reprorl.data.rewards:REWARD_FNS", "'REWARD_FNS' is a dict, not a function"),
        ("reprorl.data.rewards:_gsm8k_number", "cannot be called as fn(data_source=..."),
        ("missing/file.py:f", "no such file 'missing/file.py'"),
    ],
)
def test_bad_spec(spec, message):
    with pytest.raises(ReproRLError) as err:
        resolve_reward_fn(spec)
    assert f"reward.fn={spec!r}" in str(err.value)
    assert message in str(err.value)


def test_bad_file_contents(tmp_path):
    broken = _write(tmp_path / "broken.py", "raise ValueError('boom at import')\n")
    with pytest.raises(ReproRLError, match="raised ValueError: boom at import"):
        resolve_reward_fn(f"{broken}:f")
    positional = _write(tmp_path / "two_args.py", "def f(solution, truth): return 0.0\n")
    with pytest.raises(ReproRLError, match=r"signature \(solution, truth\) cannot be called"):
        resolve_reward_fn(f"{positional}:f")
    attribute = _write(tmp_path / "attr.py", "x = 3\n")
    with pytest.raises(ReproRLError, match="has no attribute 'f'"):
        resolve_reward_fn(f"{attribute}:f")
