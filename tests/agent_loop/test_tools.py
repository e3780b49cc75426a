"""The calculator, the tool registry and the tool-call parser (pure functions)."""

import pytest

from reprorl.agent_loop.tools import TOOLS, ToolCall, calculator, parse_tool_calls, run_tool_call


@pytest.mark.parametrize(
    "expression, expected",
    [
        ("3*(4+5)", "27"),
        ("7/2", "3.5"),
        ("8/2", "4.0"),
        ("-2**3", "-8"),  # Python precedence: -(2**3)
        ("(-2)**3", "-8"),
        ("17 // 5 % 3", "0"),
        ("-7 // 2", "-4"),
        ("2**-1", "0.5"),
        (" 1.5 + +2 ", "3.5"),
        ("2**64", "18446744073709551616"),
    ],
)
def test_calculator_values(expression, expected):
    assert calculator(expression) == expected


@pytest.mark.parametrize(
    "expression, error",
    [
        ("2**65", "error: exponent 65 is larger than 64"),
        ("1/0", "error: division by zero"),
        ("5 % 0", "error: division by zero"),
        ("0**-1", "error: division by zero"),
        ("2**64*2**64*2**64*2**64*2**64", "error: result too large"),
        ("1e300**2", "error: result too large"),
        ("1e308*10", "error: result is not finite"),
        ("(-8)**0.5", "error: result is not a real number"),
        ("True+1", "error: unsupported syntax: Constant"),
        ("'a'*3", "error: unsupported syntax: Constant"),
        ("x+1", "error: unsupported syntax: Name"),
        ("__import__('os').system('true')", "error: unsupported syntax: Call"),
        ("(1).real", "error: unsupported syntax: Attribute"),
        ("[1, 2]", "error: unsupported syntax: List"),
        ("1 < 2", "error: unsupported syntax: Compare"),
        ("import os", "error: invalid expression"),
        ("1" * 201, "error: expression longer than 200 characters"),
    ],
)
def test_calculator_refuses_everything_else(expression, error):
    assert calculator(expression) == error


def test_calculator_non_string():
    assert calculator(12) == "error: expression must be a string, got int"


def test_registry_is_a_plain_dict():
    assert TOOLS == {"calculator": calculator}


def test_parse_tool_calls_hermes_format():
    text = (
        'Let me compute. <tool_call>{"name": "calculator", "arguments": {"expression": "3*(4+5)"}}</tool_call>'
        '<tool_call>\n{"name": "calculator", "arguments": "{\\"expression\\": \\"1+1\\"}"}\n</tool_call>'
    )
    assert parse_tool_calls(text) == [
        ToolCall("calculator", {"expression": "3*(4+5)"}),
        ToolCall("calculator", {"expression": "1+1"}),  # arguments given as a JSON string
    ]
    assert parse_tool_calls("The answer is 27.") == []


def test_malformed_calls_become_error_messages():
    text = (
        "<tool_call>{bad json</tool_call>"
        '<tool_call>{"name": 3}</tool_call>'
        '<tool_call>{"name": "calculator", "arguments": [1]}</tool_call>'
        "<tool_call>{"
    )
    calls = parse_tool_calls(text)
    assert [c.error for c in calls] == [
        "error: tool call is not valid JSON (Expecting property name enclosed in double quotes at char 1)",
        'error: tool call must be a JSON object with a string "name"',
        'error: tool call "arguments" must be a JSON object',
        "error: <tool_call> without </tool_call>",
    ]
    assert [run_tool_call(c) for c in calls] == [c.error for c in calls]


def test_run_tool_call():
    assert run_tool_call(ToolCall("calculator", {"expression": "6*7"})) == "42"
    assert run_tool_call(ToolCall("search", {})) == "error: unknown tool 'search'; available: calculator"
    assert run_tool_call(ToolCall("calculator", {"expr": "1"})) == (
        "error: bad arguments for calculator: missing a required argument: 'expression'"
    )
    assert run_tool_call(ToolCall("calculator", {"expression": "1", "x": 2})) == (
        "error: bad arguments for calculator: got an unexpected keyword argument 'x'"
    )

    def broken(x):
        raise ZeroDivisionError("a bug in the tool")

    # A bug inside a tool is not the model's fault: it raises.
    with pytest.raises(ZeroDivisionError):
        run_tool_call(ToolCall("broken", {"x": 1}), {"broken": broken})


# ---------------------------------------------------------------- the user's tools

USER_TOOLS = '''
def word_count(text: str) -> str:
    """Count the words of a text.

    Args:
        text: the text whose words are counted
    """
    return str(len(text.split()))


def repeat(word: str, times: int = 2) -> str:
    """Repeat a word.

    Args:
        word: the word
        times: how many times
    """
    return " ".join([word] * times)


def _private(x: str) -> str:
    return x
'''


@pytest.fixture
def tools_file(tmp_path):
    path = tmp_path / "my_tools.py"
    path.write_text(USER_TOOLS)
    return path


def test_a_file_gives_its_public_functions_and_their_schemas(tools_file):
    from reprorl.agent_loop.tools import select_tools, tool_schemas

    tools = select_tools(["calculator", str(tools_file)])
    assert list(tools) == ["calculator", "word_count", "repeat"]
    schemas = tool_schemas(tools)
    assert schemas[2] == {"type": "function", "function": {
        "name": "repeat", "description": "Repeat a word.",
        "parameters": {"type": "object", "properties": {
            "word": {"type": "string", "description": "the word"},
            "times": {"type": "integer", "description": "how many times"}}, "required": ["word"]},
        "return": {"type": "string"}}}
    assert schemas[0]["function"]["parameters"]["required"] == ["expression"]  # the built-in's too
    call = ToolCall("repeat", {"word": "ab", "times": 3})
    assert run_tool_call(call, tools) == "ab ab ab"
    assert list(select_tools([f"{tools_file}:word_count"])) == ["word_count"]
    assert list(select_tools(["reprorl.agent_loop.tools:calculator"])) == ["calculator"]


@pytest.mark.parametrize("entry,message", [
    ("nope", "unknown tool 'nope'; expected a built-in \\(calculator, python\\), package.module:function"),
    ("{dir}/missing.py", "'{dir}/missing.py': no file {dir}/missing.py"),
    ("{file}:nothing", "'{file}:nothing': {file} has no function 'nothing'"),
    ("no_such_module_xyz:f", "'no_such_module_xyz:f': importing no_such_module_xyz failed: ModuleNotFoundError"),
    ("os.path:join", "'os.path:join': tool 'join': Argument a is missing a type hint"),
    ("calculator,calculator", "'calculator': a second tool named 'calculator'"),
])
def test_a_bad_tool_entry_is_one_line_naming_it(entry, message, tools_file):
    from reprorl.agent_loop.tools import select_tools

    fill = {"dir": str(tools_file.parent), "file": str(tools_file)}
    with pytest.raises(ValueError, match=message.format(**fill)) as err:
        select_tools(entry.format(**fill).split(","))
    assert "\n" not in str(err.value)


def test_the_prompt_lists_the_tools_as_the_chat_template_renders_them(tools_file, tmp_path):
    import json

    from reprorl.agent_loop.tools import select_tools, tool_schemas
    from reprorl.data.dataset import PromptDataset
    from reprorl.models.tokenizer import CHAT_TEMPLATE, make_char_tokenizer

    tokenizer = make_char_tokenizer()  # a template that lists the tools' names in a system turn
    tokenizer.chat_template = ("{%- if tools %}{{ '<|im_start|>system\\n' }}{%- for t in tools %}"
                               "{{ t['function']['name'] + ' ' }}{%- endfor %}{{ '<|im_end|>\\n' }}{%- endif %}"
                               + CHAT_TEMPLATE)
    row = {"data_source": "arithmetic", "prompt": [{"role": "user", "content": "hi"}], "ability": "math",
           "reward_model": {"style": "rule", "ground_truth": "1"}}
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps(row) + "\n")
    schemas = tool_schemas(select_tools(["calculator", str(tools_file)]))
    plain = PromptDataset(data, tokenizer, None)[0].prompt_ids
    with_tools = PromptDataset(data, tokenizer, None, template_kwargs={"tools": schemas})[0].prompt_ids
    assert tokenizer.decode(with_tools).startswith("<|im_start|>system\ncalculator word_count repeat <|im_end|>")
    assert with_tools[-len(plain):] == plain
