"""Rule reward functions: the default one, or the user's, named by a spec string.

Every rule reward has verl's `compute_score` signature, and is called with keywords:

    fn(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float

so a reward function written for verl works unchanged; with `reward.reward_manager=batch`
it takes verl's batch names instead, lists of one entry per sample:

    fn(data_sources=[...], solution_strs=[...], ground_truths=[...], extra_infos=[...]) -> list[float]

The config's `reward.fn` (or each `fn` of `reward.fns`) names it:

    None                          reprorl.data.rewards.score_and_answer (compute_score by each
                                  row's data_source, and the answer it read: validation's maj@n)
    "package.module:function"     imported
    "path/to/file.py:function"    loaded from that file
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
from collections.abc import Callable
from pathlib import Path

from reprorl.errors import ReproRLError

# The keywords the reward loop calls a rule function with (verl's names).
REWARD_FN_ARGS = ("data_source", "solution_str", "ground_truth", "extra_info")
REWARD_BATCH_FN_ARGS = ("data_sources", "solution_strs", "ground_truths", "extra_infos")  # reward_manager=batch


def resolve_reward_fn(spec: str | None, batch: bool = False) -> Callable[..., float]:
    """The rule reward function `spec` names (see the module docstring); with `batch`, one
    that takes verl's batch keywords (`REWARD_BATCH_FN_ARGS`).

    The part after the LAST colon is the function name, so a file path may itself hold
    a colon. A path (it ends in `.py` or holds a `/`) is loaded as a file, relative to
    the working directory; anything else is imported as a module. A bad spec (no colon,
    no such module or file, no such attribute, not callable, a signature that cannot
    take the four keywords) is a `ReproRLError` naming the spec and what failed.
    """
    if spec is None:
        from reprorl.data.rewards import score_and_answer

        return score_and_answer
    if not isinstance(spec, str) or ":" not in spec:
        raise ReproRLError(f"reward.fn={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    where, _, name = spec.rpartition(":")
    if not where or not name:
        raise ReproRLError(f"reward.fn={spec!r}: expected 'package.module:function' or 'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or "\\" in where:
        module = _load_file(spec, Path(where))
    else:
        try:
            module = importlib.import_module(where)
        except ImportError as err:
            raise ReproRLError(f"reward.fn={spec!r}: cannot import module {where!r} ({err})") from err
    fn = getattr(module, name, None)
    if fn is None:
        raise ReproRLError(f"reward.fn={spec!r}: {where!r} has no attribute {name!r}")
    if not callable(fn):
        raise ReproRLError(f"reward.fn={spec!r}: {name!r} is a {type(fn).__name__}, not a function")
    _check_signature(spec, fn, REWARD_BATCH_FN_ARGS if batch else REWARD_FN_ARGS)
    return fn


def _load_file(spec: str, path: Path):
    if not path.is_file():
        raise ReproRLError(f"reward.fn={spec!r}: no such file {str(path)!r}")
    # Not put in sys.modules: the module is private to this loader, and cloudpickle then
    # ships the function by value to a Ray worker that could not import it by name.
    module_spec = importlib.util.spec_from_file_location(f"reprorl_user_reward_{path.stem}", path)
    if module_spec is None or module_spec.loader is None:
        raise ReproRLError(f"reward.fn={spec!r}: cannot load {str(path)!r} as a Python file")
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as err:  # the user's file failed at import: say which and why
        raise ReproRLError(f"reward.fn={spec!r}: loading {str(path)!r} raised {type(err).__name__}: {err}") from err
    return module


def _check_signature(spec: str, fn: Callable, args: tuple[str, ...]) -> None:
    """Fail now, not at the first sample, if `fn` cannot take the four keywords `args`."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return  # some builtins have no signature: nothing to check
    try:
        signature.bind(**dict.fromkeys(args))
    except TypeError as err:
        raise ReproRLError(
            f"reward.fn={spec!r}: signature {signature} cannot be called as "
            f"fn({', '.join(a + '=...' for a in args)}) ({err})"
        ) from err
