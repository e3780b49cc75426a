"""Tools for the multi-turn loop: the built-in ones, the user's, and the tool-call format.

A tool is a function of keyword arguments that returns a string (what the model reads
back). `TOOLS` maps the name the model writes to a built-in function; a run's tool loop
may call the tools its config names (`rollout.tools`, see `select_tools`: built-ins by
name, the user's own functions by module or file; null = every built-in of `TOOLS`; the
`python` tool, which runs programs in the sandbox, only when named: `NAMED_TOOLS`). A tool
with state per trajectory has a session class in `SESSIONS` (`session_tools`), and the chat
template lists their schemas in the prompt (`tool_schemas`). Tool calls use the
Qwen/Hermes format, one JSON object per call between markers (single tokens in the
project's tokenizer):

    <tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>

A malformed call (bad JSON, unknown tool, wrong arguments) becomes an error string for
the model to read, never an exception: a policy that writes garbage must not crash a run.
"""

from __future__ import annotations

import ast
import inspect
import json
import math
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from reprorl.agent_loop.python_tool import PythonSession, python

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"
TOOL_RESPONSE_START = "<tool_response>"
TOOL_RESPONSE_END = "</tool_response>"

# --- calculator -----------------------------------------------------------------------

_MAX_EXPRESSION_CHARS = 200  # also bounds the AST depth (and so the recursion below)
_MAX_EXPONENT = 64
_MAX_INT_BITS = 256  # a bigger intermediate is refused: huge ints are slow to build and print

_BINARY_OPS: dict[type, Callable[[Any, Any], Any]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv,
    ast.Mod: operator.mod,
    ast.Pow: operator.pow,
}
_UNARY_OPS: dict[type, Callable[[Any], Any]] = {ast.USub: operator.neg, ast.UAdd: operator.pos}


class _CalcError(Exception):
    pass


def _check_size(value: int | float) -> int | float:
    if isinstance(value, int) and value.bit_length() > _MAX_INT_BITS:
        raise _CalcError("result too large")
    if isinstance(value, float) and not math.isfinite(value):
        raise _CalcError("result is not finite")
    return value


def _eval_node(node: ast.AST) -> int | float:
    if isinstance(node, ast.Expression):
        return _eval_node(node.body)
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):  # not bool, not complex
        return _check_size(node.value)
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY_OPS:
        return _UNARY_OPS[type(node.op)](_eval_node(node.operand))
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY_OPS:
        left, right = _eval_node(node.left), _eval_node(node.right)
        if isinstance(node.op, ast.Pow) and abs(right) > _MAX_EXPONENT:
            raise _CalcError(f"exponent {right} is larger than {_MAX_EXPONENT}")
        try:
            result = _BINARY_OPS[type(node.op)](left, right)
        except ZeroDivisionError:
            raise _CalcError("division by zero") from None
        except OverflowError:
            raise _CalcError("result too large") from None
        if isinstance(result, complex):  # (-8) ** 0.5
            raise _CalcError("result is not a real number")
        return _check_size(result)
    raise _CalcError(f"unsupported syntax: {type(node).__name__}")


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression safely (no `eval`): numbers, + - * / // % **, (), unary -.

    Exponents are bounded (|e| <= 64) and integers to 256 bits; anything else is an
    error string, never an exception.

    Args:
        expression: the arithmetic expression, e.g. "3*(4+5)"
    """
    if not isinstance(expression, str):
        return f"error: expression must be a string, got {type(expression).__name__}"
    if len(expression) > _MAX_EXPRESSION_CHARS:
        return f"error: expression longer than {_MAX_EXPRESSION_CHARS} characters"
    try:
        tree = ast.parse(expression.strip(), mode="eval")
    except SyntaxError:
        return "error: invalid expression"
    try:
        return repr(_eval_node(tree))
    except _CalcError as err:
        return f"error: {err}"


TOOLS: dict[str, Callable[..., str]] = {"calculator": calculator}
NAMED_TOOLS: dict[str, Callable[..., str]] = {"python": python}
"""Built-ins that `rollout.tools` must name (null leaves them out): they run the sandbox."""
SESSIONS: dict[Callable[..., str], type] = {python: PythonSession}
"""tool -> the class of its per-trajectory state; the tool loop makes one per trajectory."""


def session_tools(tools: dict[str, Callable[..., str]]) -> dict[str, Callable[..., str]]:
    """`tools` for one trajectory: each tool with state (`SESSIONS`) bound to a fresh session.

    >>> fresh = session_tools({"python": python, "calculator": calculator})
    >>> fresh["calculator"] is calculator, fresh["python"] is python
    (True, False)
    """
    return {name: SESSIONS[fn]().run if fn in SESSIONS else fn for name, fn in tools.items()}


def select_tools(entries: list[str] | None) -> dict[str, Callable[..., str]]:
    """The tools `rollout.tools` names, in that order; None = every built-in tool (`TOOLS`).

    An entry is a built-in tool's name, `package.module:function`, `path/to/file.py:function`,
    or `path/to/file.py` (every public function defined in that file). A user tool is a
    plain function whose parameters have type hints and whose docstring says what it does
    and, under `Args:`, what each parameter is: its JSON schema (`tool_schemas`) is derived
    from them, as TRL derives its tools'. A bad entry raises ValueError naming it.

    >>> list(select_tools(["calculator"])), select_tools(None) == TOOLS
    (['calculator'], True)
    """
    if entries is None:
        return dict(TOOLS)
    tools: dict[str, Callable[..., str]] = {}
    for entry in entries:
        for fn in _resolve(entry):
            if fn.__name__ in tools:
                raise ValueError(f"{entry!r}: a second tool named {fn.__name__!r}")
            tool_schema(fn, entry)  # the schema can be derived, or the one-line error now
            tools[fn.__name__] = fn
    return tools


def tool_schemas(tools: dict[str, Callable[..., str]]) -> list[dict[str, Any]]:
    """The tools' JSON schemas in order: what the chat template lists for the model."""
    return [tool_schema(fn) for fn in tools.values()]


def tool_schema(fn: Callable[..., str], entry: str | None = None) -> dict[str, Any]:
    """`fn`'s JSON schema (OpenAI's function format) from its type hints and docstring."""
    from transformers.utils import get_json_schema

    try:
        return get_json_schema(fn)
    except Exception as err:  # transformers' own errors say which hint or description is missing
        where = f"{entry!r}: " if entry else ""
        raise ValueError(f"{where}tool {fn.__name__!r}: {str(err).splitlines()[0]}") from None


def _resolve(entry: str) -> list[Callable[..., str]]:
    """The functions one `rollout.tools` entry names (`select_tools`)."""
    if entry in TOOLS or entry in NAMED_TOOLS:
        return [TOOLS.get(entry) or NAMED_TOOLS[entry]]
    source, _, name = entry.rpartition(":") if ":" in entry else (entry, "", "")
    if not source.endswith(".py") and not name:
        builtins = ", ".join(sorted({**TOOLS, **NAMED_TOOLS}))
        raise ValueError(f"unknown tool {entry!r}; expected a built-in ({builtins}), "
                         "package.module:function, path/to/file.py:function or path/to/file.py")
    module = _load_file(source, entry) if source.endswith(".py") else _import(source, entry)
    if name:
        fn = getattr(module, name, None)
        if not inspect.isfunction(fn):
            raise ValueError(f"{entry!r}: {source} has no function {name!r}")
        return [fn]
    found = [fn for fn_name, fn in vars(module).items() if inspect.isfunction(fn) and not fn_name.startswith("_")
             and fn.__module__ == module.__name__]
    if not found:
        raise ValueError(f"{entry!r}: the file defines no public function")
    return found


def _load_file(path: str, entry: str) -> Any:
    import importlib.util
    from pathlib import Path

    file = Path(path)
    if not file.is_file():
        raise ValueError(f"{entry!r}: no file {path}")
    spec = importlib.util.spec_from_file_location(f"reprorl_user_tools_{file.stem}", file)
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as err:
        raise ValueError(f"{entry!r}: importing {path} failed: {type(err).__name__}: {err}") from None
    return module


def _import(name: str, entry: str) -> Any:
    import importlib

    try:
        return importlib.import_module(name)
    except Exception as err:
        raise ValueError(f"{entry!r}: importing {name} failed: {type(err).__name__}: {err}") from None


# --- the tool-call format -------------------------------------------------------------


@dataclass(frozen=True)
class ToolCall:
    """One parsed call; `error` is set (and name/arguments may be empty) when it was malformed."""

    name: str
    arguments: dict[str, Any]
    error: str | None = None


_CALL_RE = re.compile(re.escape(TOOL_CALL_START) + r"(.*?)" + re.escape(TOOL_CALL_END), re.DOTALL)


def _parse_one(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as err:
        return ToolCall("", {}, f"error: tool call is not valid JSON ({err.msg} at char {err.pos})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ToolCall("", {}, 'error: tool call must be a JSON object with a string "name"')
    arguments = obj.get("arguments", {})
    if isinstance(arguments, str):  # some models write the arguments as a JSON string
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(obj["name"], {}, 'error: tool call "arguments" must be a JSON object')
    return ToolCall(obj["name"], arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls in a model response, in order; malformed ones carry an `error`.

    An opening marker without its closing one is reported as a malformed call.

    >>> parse_tool_calls('x <tool_call>{"name": "calculator", "arguments": {"expression": "1+1"}}</tool_call>')
    [ToolCall(name='calculator', arguments={'expression': '1+1'}, error=None)]
    >>> parse_tool_calls("no call here")
    []
    """
    calls = [_parse_one(m.group(1).strip()) for m in _CALL_RE.finditer(text)]
    if text.count(TOOL_CALL_START) > len(calls):
        calls.append(ToolCall("", {}, f"error: {TOOL_CALL_START} without {TOOL_CALL_END}"))
    return calls


def run_tool_call(call: ToolCall, tools: dict[str, Callable[..., str]] = TOOLS) -> str:
    """The string the model reads back for `call`: the tool's output or an error message.

    Arguments are checked against the tool's signature before the call, so a bad call
    is an error string while a bug inside a tool still raises.
    """
    if call.error is not None:
        return call.error
    fn = tools.get(call.name)
    if fn is None:
        return f"error: unknown tool {call.name!r}; available: {', '.join(sorted(tools))}"
    try:
        inspect.signature(fn).bind(**call.arguments)
    except TypeError as err:
        return f"error: bad arguments for {call.name}: {err}"
    return str(fn(**call.arguments))
