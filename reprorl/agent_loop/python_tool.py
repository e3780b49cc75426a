"""The `python` tool: a code interpreter for multi-turn rollouts, on the sandbox.

    <tool_call>{"name": "python", "arguments": {"code": "x = 6 * 7\\nprint(x)"}}</tool_call>
    -> 42

A trajectory keeps its state across calls: each call runs the trajectory's earlier cells
again, silently, then the new one, whose stdout (and its exception's last line) the model
reads back. Replaying instead of keeping an interpreter alive keeps a call a pure function
of the cells (nothing of a live process, such as timing, leaks between calls), and leaves
no process between calls: each run is a fresh sandboxed program (`reprorl.sandbox`) that
is gone when the call returns. A cell whose run did not end normally (its CPU limit, too
much output) is not kept, so it does not fail every call after it. `random` is seeded, so
a cell that draws prints the same every run; what reads the clock or os.urandom does not.
"""

from __future__ import annotations

import json

from reprorl.sandbox import Limits, python_argv, run

TOOL_LIMITS = Limits(cpu_s=2, memory_bytes=512 << 20)
"""Per call (all the trajectory's cells replayed): far above what a rollout's cells need."""
MAX_OUTPUT_CHARS = 1000  # what the model reads back; the rest is cut, saying so

# Runs the cells of stdin's JSON list in one namespace; only the last one's output shows.
_DRIVER = """\
import contextlib, io, json, sys, traceback
cells = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
namespace = {"__name__": "__main__", "__builtins__": __builtins__}
for i, cell in enumerate(cells):
    last = i == len(cells) - 1
    sink = sys.stdout if last else io.StringIO()
    with contextlib.redirect_stdout(sink), contextlib.redirect_stderr(sink):
        try:
            exec(compile(cell, f"<cell {i}>", "exec"), namespace)
        except BaseException as err:
            if last:
                print("".join(traceback.format_exception_only(type(err), err)).strip())
        sys.stdout.flush()
"""


class PythonSession:
    """One trajectory's interpreter: the cells it ran; `run(code)` is the tool call."""

    def __init__(self, limits: Limits = TOOL_LIMITS) -> None:
        self.cells: list[str] = []
        self.limits = limits

    def run(self, code: str) -> str:
        """Run Python code in a sandbox and return what it prints (variables of earlier calls persist).

        Args:
            code: Python source; print what you want to see
        """
        if not isinstance(code, str):
            return f"error: code must be a string, got {type(code).__name__}"
        cells = [*self.cells, code]
        result = run({"driver.py": _DRIVER}, python_argv("{dir}/driver.py"), json.dumps(cells), self.limits)
        if result.status == "timeout":
            return f"error: the code ran past its CPU limit ({self.limits.cpu_s} s)"
        if result.status == "output_limit":
            return f"error: the code printed more than {self.limits.output_bytes} bytes"
        if result.status != "ok":  # the interpreter itself died (memory, a signal)
            tail = result.stderr.strip().splitlines()[-1:] or [f"exit code {result.exit_code}"]
            return f"error: the code crashed ({tail[0][:200]})"
        self.cells = cells
        out = result.stdout.strip()
        if len(out) > MAX_OUTPUT_CHARS:
            out = out[:MAX_OUTPUT_CHARS] + f"\n... ({len(out) - MAX_OUTPUT_CHARS} more characters cut)"
        return out or "(no output)"


def python(code: str) -> str:
    """Run Python code in a sandbox (no network, no files kept, 2 s of CPU) and return what it prints.

    Args:
        code: Python source; print what you want to see
    """
    return PythonSession().run(code)
