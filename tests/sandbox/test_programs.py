"""Every kind of program the issue names gets its score in the sandbox, and leaves nothing
behind: no process, no directory or cgroup of the sandbox, no file outside it."""

import os
import signal
import tempfile
from pathlib import Path

import pytest

from reprorl.data.code import Tests, code_score, passes
from reprorl.sandbox import Limits, run_python
from reprorl.sandbox.runner import CGROUP_DIR

FAST = Limits(cpu_s=1)  # the looping programs spend their whole CPU limit: keep it short
ESCAPE = Path(tempfile.gettempdir()) / "reprorl-escaped-file"
TESTS = Tests(inputs=["2 3\n"], outputs=["5\n"])  # stdin "2 3" -> their sum

PROGRAMS = {
    "correct": ("a, b = map(int, input().split())\nprint(a + b)", True),
    "wrong": ("a, b = map(int, input().split())\nprint(a * b + 1)", False),
    "crashing": ("raise SystemExit(3)", False),
    "slow": ("while True:\n    pass", False),
    "memory-hungry": ("x = bytearray(4 << 30)\nprint(5)", False),
    "fork-bomb": ("import os\nwhile True:\n    os.fork()\n", False),
    # Prints the right answer only if it reached the network.
    "network-using": ("import socket\nsocket.create_connection(('1.1.1.1', 53), timeout=2)\nprint(5)", False),
    # Prints the right answer only after writing outside its directory.
    "file-writing-outside": (f"open({str(ESCAPE)!r}, 'w').write('x')\nprint(5)", False),
    # Prints the right answer only if it cannot see the caller's secret.
    "environment-reading": ("import os\nprint(5 if 'REPRORL_SECRET' not in os.environ else 0)", True),
}


def _our_processes() -> list[str]:
    """Command lines of live processes that belong to a sandboxed program of this process (its
    paths name the sandbox and this process: other test processes may run programs meanwhile)."""
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().decode(errors="replace")
        except OSError:
            continue
        if proc.name.isdigit() and f"reprorl-sandbox-{os.getpid()}-" in cmdline:
            found.append(cmdline)
    return found


def _leftovers() -> dict[str, list]:
    cgroups = Path("/sys/fs/cgroup/pids") / CGROUP_DIR
    return {"processes": _our_processes(),
            "directories": sorted(Path(tempfile.gettempdir()).glob(f"reprorl-sandbox-{os.getpid()}-*")),
            "cgroups": sorted(p.name for p in cgroups.glob(f"{os.getpid()}-*")) if cgroups.is_dir() else [],
            "escaped": [ESCAPE] if ESCAPE.exists() else []}


@pytest.mark.parametrize("kind", PROGRAMS)
def test_each_kind_of_program_scores_right_and_leaves_nothing(kind, monkeypatch):
    monkeypatch.setenv("REPRORL_SECRET", "hunter2")
    before = _leftovers()
    program, expected = PROGRAMS[kind]
    assert passes(program, TESTS, 0, FAST) is expected
    assert _leftovers() == before == {"processes": [], "directories": [], "cgroups": [], "escaped": []}


def test_verdicts_name_what_happened():
    looped = run_python("while True:\n    pass", limits=FAST)
    assert looped.status == "timeout", looped
    assert run_python("print('x' * 5_000_000)", limits=FAST).status == "output_limit"
    crashed = run_python("raise ValueError('boom')", limits=FAST)
    assert crashed.status == "error" and crashed.exit_code == 1 and 'File "main.py"' in crashed.stderr


def test_a_program_killed_from_outside_runs_once_more(caplog, monkeypatch):
    """A SIGKILL below the CPU limit came from outside the sandbox (PID 1 of a namespace
    cannot be SIGKILLed from inside it): the program runs again; ended so twice, an error."""
    from reprorl.sandbox import runner

    real = runner._run_once
    for plan in (["killed", "real"], ["killed", "killed"]):
        ends = list(plan)

        def planned(*args):
            if ends.pop(0) == "killed":
                return runner.Result("error", "", "", None, signal.SIGKILL, 0.3)
            return real(*args)

        monkeypatch.setattr(runner, "_run_once", planned)
        with caplog.at_level("WARNING", logger="reprorl.sandbox.runner"):
            result = run_python("print(6 * 7)", limits=FAST)
        assert ends == [] and [r.getMessage().split("; ")[1] for r in caplog.records] == ["it runs once more"]
        caplog.clear()
        if plan[1] == "real":
            assert (result.status, result.stdout) == ("ok", "42\n")
        else:  # killed twice: the second end is the verdict
            assert (result.status, result.signal) == ("error", signal.SIGKILL)
    assert _leftovers() == {"processes": [], "directories": [], "cgroups": [], "escaped": []}


def test_pid_1_of_the_sandbox_cannot_sigkill_itself():
    """Why an early SIGKILL is taken for one from outside: the program's own is ignored."""
    result = run_python("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)\nprint('alive')", limits=FAST)
    assert (result.status, result.stdout) == ("ok", "alive\n")


def test_the_program_sees_a_clean_environment_and_writes_only_its_directory(monkeypatch):
    monkeypatch.setenv("REPRORL_SECRET", "hunter2")
    result = run_python("import os\nopen('mine.txt', 'w').write('ok')\nprint(sorted(os.environ), open('mine.txt').read())")
    assert result.stdout.strip() == "['HOME', 'LANG', 'PATH', 'PYTHONHASHSEED', 'PYTHONIOENCODING'] ok"


def test_unseeded_randomness_and_set_order_repeat():
    program = "import random\nprint(random.random(), {'apple', 'pear', 'fig', 'kiwi'})"
    assert run_python(program).stdout == run_python(program).stdout


def test_call_tests_take_a_function_or_a_solution_method():
    truth = '{"fn_name": "add", "inputs": [[1, 2], [5, 5]], "outputs": [[3], 10]}'
    assert code_score("apps", "def add(a, b):\n    return a + b", truth) == 1.0
    assert code_score("apps", "class Solution:\n    def add(self, a, b):\n        return a + b", truth) == 1.0
    assert code_score("apps", "def add(a, b):\n    return (a + b, 0)", truth) == 0.0
