"""Loading prompt files in verl's schema: formats, bad rows, overlong prompts."""

import copy
import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from reprorl.data.dataset import PromptDataset, read_rows
from reprorl.errors import ConfigError, DataError


def _row(content="12+7=", truth="19", **extra):
    row = {
        "data_source": "reprorl/arithmetic",
        "prompt": [{"role": "user", "content": content}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": truth},
        "extra_info": {"split": "train", "index": 0},
    }
    row.update(extra)
    return row


def _write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _write_parquet(path, rows):
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def _template_ids(tok, content):
    messages = [{"role": "user", "content": content}]
    return list(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"])


@pytest.mark.parametrize("write", [_write_jsonl, _write_parquet], ids=["jsonl", "parquet"])
def test_loads_both_formats(tmp_path, char_tokenizer, write):
    rows = [
        _row("1+1=", "2"),
        _row(
            "hi",
            "x",
            prompt=[{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+3="}],
            data_source="openai/gsm8k",
            ability="math",
        ),
    ]
    path = write(tmp_path / f"d.{'jsonl' if write is _write_jsonl else 'parquet'}", rows)
    ds = PromptDataset(path, char_tokenizer, max_prompt_length=64)

    assert len(ds) == 2
    assert ds.stats == {"rows": 2, "kept": 2, "overlong": 0, "filtered": 0, "truncated": 0}
    r0, r1 = ds[0], ds[1]
    assert (r0.index, r1.index) == (0, 1)
    assert r0.messages == [{"role": "user", "content": "1+1="}]
    assert r0.data_source == "reprorl/arithmetic" and r1.data_source == "openai/gsm8k"
    assert (r0.ability, r0.reward_style, r0.ground_truth) == ("arithmetic", "rule", "2")
    assert r0.extra_info == {"split": "train", "index": 0}
    # The ChatML prompt, one token per character: 19 tokens of template around "1+1=".
    assert len(r0.prompt_ids) == 19 + 4
    assert char_tokenizer.decode(r0.prompt_ids) == "<|im_start|>user\n1+1=<|im_end|>\n<|im_start|>assistant\n"
    assert char_tokenizer.decode(r1.prompt_ids) == (
        "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n2+3=<|im_end|>\n<|im_start|>assistant\n"
    )


def test_files_concatenate_in_order_with_stable_index(tmp_path, char_tokenizer):
    a = _write_jsonl(tmp_path / "a.jsonl", [_row("a"), _row("b")])
    b = _write_parquet(tmp_path / "b.parquet", [_row("c")])
    ds = PromptDataset([b, a], char_tokenizer, max_prompt_length=None)
    assert [r.messages[0]["content"] for r in ds.rows] == ["c", "a", "b"]
    assert [r.index for r in ds.rows] == [0, 1, 2]


def test_missing_extra_info_and_model_style_without_truth(tmp_path, char_tokenizer):
    row = _row()
    del row["extra_info"]
    row["reward_model"] = {"style": "model"}
    ds = PromptDataset(_write_jsonl(tmp_path / "d.jsonl", [row]), char_tokenizer, max_prompt_length=None)
    assert ds[0].extra_info == {}
    assert (ds[0].reward_style, ds[0].ground_truth) == ("model", None)


def test_custom_prompt_key(tmp_path, char_tokenizer):
    row = _row()
    row["messages"] = row.pop("prompt")
    path = _write_jsonl(tmp_path / "d.jsonl", [row])
    assert PromptDataset(path, char_tokenizer, None, prompt_key="messages")[0].messages == row["messages"]
    with pytest.raises(DataError, match="row 0: missing field 'prompt'"):
        PromptDataset(path, char_tokenizer, None)


def _del(keys):
    def edit(row):
        target = row
        for k in keys[:-1]:
            target = target[k]
        del target[keys[-1]]

    return edit


def _set(keys, value):
    def edit(row):
        target = row
        for k in keys[:-1]:
            target = target[k]
        target[keys[-1]] = value

    return edit


BAD_ROWS = {
    "missing data_source": (_del(["data_source"]), "missing field 'data_source'"),
    "data_source not str": (_set(["data_source"], 3), "field 'data_source': expected a non-empty string, got 3"),
    "empty data_source": (_set(["data_source"], ""), "field 'data_source': expected a non-empty string"),
    "missing prompt": (_del(["prompt"]), "missing field 'prompt'"),
    "empty prompt": (_set(["prompt"], []), "field 'prompt': expected a non-empty list of chat messages, got []"),
    "prompt is a string": (_set(["prompt"], "12+7="), "field 'prompt': expected a non-empty list"),
    "message not a dict": (_set(["prompt", 0], "hi"), "field 'prompt[0]': expected a message"),
    "message without role": (_del(["prompt", 0, "role"]), "field 'prompt[0].role': missing"),
    "message without content": (_del(["prompt", 0, "content"]), "field 'prompt[0].content': missing"),
    "content not str": (_set(["prompt", 0, "content"], ["x"]), "field 'prompt[0].content': expected a string"),
    "empty role": (_set(["prompt", 0, "role"], ""), "field 'prompt[0].role': expected a non-empty string"),
    "missing ability": (_del(["ability"]), "missing field 'ability'"),
    "ability not str": (_set(["ability"], 1), "field 'ability': expected a string, got 1"),
    "missing reward_model": (_del(["reward_model"]), "missing field 'reward_model'"),
    "reward_model not dict": (_set(["reward_model"], "19"), "field 'reward_model': expected"),
    "bad style": (_set(["reward_model", "style"], "human"), "field 'reward_model.style': expected one of"),
    "rule without truth": (_del(["reward_model", "ground_truth"]), "field 'reward_model.ground_truth'"),
    "truth not str": (_set(["reward_model", "ground_truth"], 19), "field 'reward_model.ground_truth': expected a str"),
    "extra_info not dict": (_set(["extra_info"], [1]), "field 'extra_info': expected a dict or absent, got [1]"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_bad_row_names_file_row_and_field(tmp_path, char_tokenizer, case):
    edit, expected = BAD_ROWS[case]
    bad = copy.deepcopy(_row())
    edit(bad)
    path = _write_jsonl(tmp_path / "bad.jsonl", [_row(), bad, _row()])
    with pytest.raises(DataError) as err:
        PromptDataset(path, char_tokenizer, max_prompt_length=None)
    msg = str(err.value)
    assert msg.startswith(f"{path}: row 1: "), msg
    assert expected in msg, msg
    assert "\n" not in msg


def test_bad_row_in_parquet_and_second_file(tmp_path, char_tokenizer):
    good = _write_jsonl(tmp_path / "good.jsonl", [_row(), _row()])
    bad = _row()
    bad["prompt"] = []
    path = _write_parquet(tmp_path / "bad.parquet", [_row(), _row(), bad])
    with pytest.raises(DataError, match=r"bad\.parquet: row 2: field 'prompt': expected a non-empty list"):
        PromptDataset([good, path], char_tokenizer, max_prompt_length=None)


def test_ground_truth_check_names_file_and_row(tmp_path, char_tokenizer):
    from reprorl.data.rewards import check_ground_truth

    rows = [_row(), _row(data_source="openai/gsm8k", truth="3/4"),
            _row(truth=None, reward_model={"style": "model", "ground_truth": None})]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"d.jsonl: row 1: field 'reward_model.ground_truth': GSM8K ground truth "
                                        r"'3/4' is not a number"):
        PromptDataset(path, char_tokenizer, 64, check_ground_truth=check_ground_truth)
    assert len(PromptDataset(path, char_tokenizer, 64)) == 3  # unchecked without the check (a user's reward.fn)


def test_a_source_the_builtin_rules_do_not_know_names_file_row_and_the_known_ones(tmp_path, char_tokenizer):
    from reprorl.data.rewards import REWARD_FNS

    rows = [_row(), _row(data_source="openai/gsm8k"), _row(data_source="gsm8k")]
    path = _write_jsonl(tmp_path / "d.jsonl", rows)
    with pytest.raises(DataError) as info:
        PromptDataset(path, char_tokenizer, 64, known_sources=REWARD_FNS)
    assert str(info.value) == (
        f"{path}: row 2: field 'data_source': no built-in rule reward scores 'gsm8k' (reward.fn=null picks one by "
        f"data_source); known: {', '.join(REWARD_FNS)}; or set reward.fn to a function of yours")
    assert len(PromptDataset(path, char_tokenizer, 64)) == 3  # any source without the check (a user's reward.fn)


def test_file_errors(tmp_path, char_tokenizer):
    unknown = r"d\.csv: unknown dataset extension '\.csv'; expected one of \.parquet, \.jsonl"
    with pytest.raises(DataError, match=unknown):
        read_rows(tmp_path / "d.csv")
    with pytest.raises(DataError, match=r"nope\.jsonl: no such dataset file"):
        read_rows(tmp_path / "nope.jsonl")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable parquet file"):
        read_rows(tmp_path / "broken.parquet")
    (tmp_path / "j.jsonl").write_text(json.dumps(_row()) + "\n\n{oops\n")
    with pytest.raises(DataError, match=r"j\.jsonl: row 1 \(line 3\): not valid JSON"):
        read_rows(tmp_path / "j.jsonl")
    (tmp_path / "k.jsonl").write_text("[1, 2]\n")
    with pytest.raises(DataError, match=r"k\.jsonl: row 0 \(line 1\): expected a JSON object, got \[1, 2\]"):
        read_rows(tmp_path / "k.jsonl")
    with pytest.raises(DataError, match="no dataset files given"):
        PromptDataset([], char_tokenizer, None)


def test_jsonl_that_is_not_utf8_names_file_and_line(tmp_path):
    good = json.dumps(_row()).encode()
    latin1 = json.dumps(_row(content="caf\u00e9 12+7=")).encode().replace(b"\\u00e9", b"\xe9")  # Latin-1 e-acute
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(good + b"\r\n" + good + b"\r\n" + latin1 + b"\r\n")
    with pytest.raises(DataError) as info:
        read_rows(path)
    column = latin1.index(b"\xe9") + 1
    assert str(info.value) == (f"{path}: line 3: not valid UTF-8 (byte 0xe9 at byte {column} of the line); "
                               "expected a UTF-8 text file")
    path.write_bytes(good + b"\r\n\n" + json.dumps(_row(content="caf\u00e9"), ensure_ascii=False).encode())
    assert [r["prompt"][0]["content"] for r in read_rows(path)] == ["12+7=", "caf\u00e9"]  # UTF-8, CRLF: read


def test_bad_arguments(tmp_path, char_tokenizer):
    path = _write_jsonl(tmp_path / "d.jsonl", [_row()])
    with pytest.raises(ConfigError, match="overlong='drop': expected one of error, filter, truncate_left"):
        PromptDataset(path, char_tokenizer, 10, overlong="drop")
    with pytest.raises(ConfigError, match="max_prompt_length=0"):
        PromptDataset(path, char_tokenizer, 0)


# Prompt lengths: 19 template tokens + one per character of the user message.
LENGTHS = {"abc": 22, "abcde": 24, "abcdef": 25, "abcdefghijk": 30}


def _overlong_files(tmp_path):
    a = _write_jsonl(tmp_path / "a.jsonl", [_row("abc"), _row("abcdef")])
    b = _write_jsonl(tmp_path / "b.jsonl", [_row("abcdefghijk"), _row("abcde")])
    return [a, b]


def test_template_lengths_are_as_assumed(char_tokenizer):
    assert {c: len(_template_ids(char_tokenizer, c)) for c in LENGTHS} == LENGTHS


def test_overlong_error_names_file_row_and_lengths(tmp_path, char_tokenizer):
    paths = _overlong_files(tmp_path)
    with pytest.raises(DataError) as err:
        PromptDataset(paths, char_tokenizer, max_prompt_length=24, overlong="error")
    assert str(err.value).startswith(f"{paths[0]}: row 1: prompt is 25 tokens, over max_prompt_length=24")
    # At exactly the limit nothing is overlong.
    ds = PromptDataset(paths, char_tokenizer, max_prompt_length=30, overlong="error")
    assert ds.stats == {"rows": 4, "kept": 4, "overlong": 0, "filtered": 0, "truncated": 0}


def test_overlong_filter_keeps_stable_index(tmp_path, char_tokenizer, caplog):
    with caplog.at_level(logging.INFO, logger="reprorl.data.dataset"):
        ds = PromptDataset(_overlong_files(tmp_path), char_tokenizer, max_prompt_length=24, overlong="filter")
    assert ds.stats == {"rows": 4, "kept": 2, "overlong": 2, "filtered": 2, "truncated": 0}
    assert [r.index for r in ds.rows] == [0, 3]
    assert [r.messages[0]["content"] for r in ds.rows] == ["abc", "abcde"]
    lines = [rec.getMessage() for rec in caplog.records if rec.name == "reprorl.data.dataset"]
    assert len(lines) == 1
    assert "4 rows, 2 over max_prompt_length=24 (filter), 2 filtered, 0 truncated, 2 kept" in lines[0]


def test_overlong_truncate_left_and_right(tmp_path, char_tokenizer):
    paths = _overlong_files(tmp_path)
    full = _template_ids(char_tokenizer, "abcdef")  # 25 tokens
    left = PromptDataset(paths, char_tokenizer, max_prompt_length=24, overlong="truncate_left")
    right = PromptDataset(paths, char_tokenizer, max_prompt_length=24, overlong="truncate_right")
    for ds in (left, right):
        assert ds.stats == {"rows": 4, "kept": 4, "overlong": 2, "filtered": 0, "truncated": 2}
        assert [len(r.prompt_ids) for r in ds.rows] == [22, 24, 24, 24]
        assert [r.index for r in ds.rows] == [0, 1, 2, 3]
        assert ds[1].messages == [{"role": "user", "content": "abcdef"}]  # messages stay whole
    # Left keeps the end (drops <|im_start|>, id 1); right keeps the start (drops the final "\n", id 8).
    assert full[0] == 1 and full[-1] == 8
    assert left[1].prompt_ids == full[1:]
    assert right[1].prompt_ids == full[:-1]
    # 30 tokens -> 24: left drops the 6 of "<|im_start|>user\n", right the 6 of "stant\n".
    assert char_tokenizer.decode(left[2].prompt_ids) == "abcdefghijk<|im_end|>\n<|im_start|>assistant\n"
    assert char_tokenizer.decode(right[2].prompt_ids) == "<|im_start|>user\nabcdefghijk<|im_end|>\n<|im_start|>assi"


def test_everything_filtered_is_an_error(tmp_path, char_tokenizer):
    with pytest.raises(DataError, match="no rows left"):
        PromptDataset(_overlong_files(tmp_path), char_tokenizer, max_prompt_length=5, overlong="filter")
