"""The python tool: sandboxed, with state per trajectory, and the same output every run."""

from reprorl.agent_loop.python_tool import PythonSession, python
from reprorl.agent_loop.tools import ToolCall, run_tool_call, select_tools, session_tools, tool_schema
from reprorl.sandbox import Limits


def test_a_session_keeps_its_cells_state_and_shows_only_the_new_output():
    session = PythonSession()
    assert session.run("x = 6 * 7\nprint('set')") == "set"
    assert session.run("print(x + 1)") == "43"
    assert python("print(x)") == "NameError: name 'x' is not defined"  # a fresh session each call


def test_a_cell_past_its_limit_is_not_kept():
    session = PythonSession(Limits(cpu_s=1))
    session.run("y = 1")
    assert session.run("while True:\n    pass") == "error: the code ran past its CPU limit (1 s)"
    assert session.run("print(y)") == "1"


def test_errors_and_bad_calls_are_strings_for_the_model():
    assert python("1 / 0") == "ZeroDivisionError: division by zero"
    assert python("pass") == "(no output)"
    assert python(3) == "error: code must be a string, got int"
    assert run_tool_call(ToolCall("python", {"cell": "1"}), {"python": python}).startswith("error: bad arguments")


def test_each_trajectory_gets_its_own_session_and_the_output_repeats():
    tools = select_tools(["calculator", "python"])
    first, second = session_tools(tools), session_tools(tools)
    program = "import random\nprint(random.randint(0, 10**9), {'apple', 'pear', 'fig'})"
    assert first["python"](code="z = 1\n" + program) == second["python"](code=program)
    assert first["python"](code="print(z)") == "1" and second["python"](code="print(z)").startswith("NameError")


def test_python_is_named_not_a_default_and_has_a_schema():
    assert "python" not in select_tools(None)
    assert tool_schema(python)["function"]["parameters"]["required"] == ["code"]
