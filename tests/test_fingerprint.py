"""Fingerprint records: what a step writes, how it reads back, how a resume truncates it."""

import json
import re

import numpy as np
import pytest
import torch

from reprorl.determinism import stable_digest, tensor_digest
from reprorl.errors import ReproRLError
from reprorl.fingerprint import (
    FINGERPRINTS_FILE,
    FingerprintWriter,
    field_digest,
    load_raw,
    params_digest,
    raw_path,
    read_fingerprints,
    tensor_digests,
    truncate_fingerprints,
)


def step_values(step: int) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """Fields and parameters of a synthetic step, a pure function of `step`."""
    g = torch.Generator().manual_seed(step)
    fields = {
        "prompts": [[5, 6, 7], [8, 9]],
        "responses": torch.randint(0, 128, (2, 4), generator=g),
        "rewards": torch.rand(2, generator=g),
        "advantages": torch.randn(2, 4, generator=g),
    }
    params = [("w", torch.randn(3, 2, generator=g)), ("b", torch.randn(3, generator=g))]
    return fields, params


def write_steps(run_dir, steps, keep_tensors=False):
    with FingerprintWriter(run_dir, keep_tensors=keep_tensors) as writer:
        for step in steps:
            fields, params = step_values(step)
            writer.write(step, fields, params)


# ------------------------------------------------------------------------------ digests


def test_field_digest_by_type():
    t = torch.arange(6, dtype=torch.int64).reshape(2, 3)
    assert field_digest(t) == tensor_digest(t)
    # A numeric numpy array is the tensor it converts to; an object array is its list.
    assert field_digest(t.numpy()) == tensor_digest(t)
    column = np.empty(2, dtype=object)
    column[:] = [[1, 2], [3]]
    assert field_digest(column) == stable_digest([[1, 2], [3]]) == field_digest([[1, 2], [3]])
    assert field_digest([np.int64(1), 2.5]) == stable_digest([1, 2.5])
    # Bits matter: -0.0 and 0.0 are different fingerprints.
    assert field_digest(torch.tensor([0.0])) != field_digest(torch.tensor([-0.0]))
    with pytest.raises(TypeError, match="stack the tensors"):
        field_digest([torch.tensor(1.0), torch.tensor(2.0)])


def test_unsupported_field_names_field_and_step(tmp_path):
    with FingerprintWriter(tmp_path) as writer:
        with pytest.raises(TypeError, match="fingerprint field 'losses' of step 1: .*stack the tensors"):
            writer.write(1, {"losses": [torch.tensor(1.0)]})
        with pytest.raises(TypeError, match="fingerprint field 'obj' of step 1: stable_hash cannot encode"):
            writer.write(1, {"obj": object()})
        writer.write(1, {"ok": 1.0})  # a refused step writes nothing
    assert list(read_fingerprints(tmp_path)) == [1]


def test_params_digest_is_order_free_and_sees_every_parameter():
    digests = {"w": "aa" * 16, "b": "bb" * 16}
    assert params_digest(digests) == params_digest({"b": "bb" * 16, "w": "aa" * 16})
    assert params_digest(digests) != params_digest({**digests, "b": "bc" * 16})
    assert params_digest(digests) != params_digest({"w": "aa" * 16})
    assert params_digest(digests) != params_digest({"w": "aa" * 16, "c": "bb" * 16})  # the name counts


# ------------------------------------------------------------------------------ writing


def test_write_records_a_digest_of_every_field_and_parameter(tmp_path):
    fields, params = step_values(1)
    with FingerprintWriter(tmp_path) as writer:
        record = writer.write(1, fields, params)
        writer.write(2, {"rewards": torch.zeros(2)})
    lines = (tmp_path / FINGERPRINTS_FILE).read_text().splitlines()
    assert len(lines) == 2
    assert json.loads(lines[0]) == record
    expected_params = {"w": tensor_digest(params[0][1]), "b": tensor_digest(params[1][1])}
    assert record == {
        "step": 1,
        "fields": {
            "prompts": stable_digest([[5, 6, 7], [8, 9]]),
            "responses": tensor_digest(fields["responses"]),
            "rewards": tensor_digest(fields["rewards"]),
            "advantages": tensor_digest(fields["advantages"]),
        },
        "params": expected_params,
        "params_digest": params_digest(expected_params),
    }
    # Pipeline order is kept (advantages is not sorted first).
    assert list(json.loads(lines[0])["fields"]) == ["prompts", "responses", "rewards", "advantages"]
    assert json.loads(lines[1]) == {"step": 2, "fields": {"rewards": tensor_digest(torch.zeros(2))},
                                    "params": {}, "params_digest": None}
    assert read_fingerprints(tmp_path) == {1: record, 2: json.loads(lines[1])}


def test_tensor_digests_are_each_tensors_digest_in_order():
    g = torch.Generator().manual_seed(0)
    named = [(f"p{i}", torch.randn(64, i + 1, generator=g).to(torch.bfloat16)) for i in range(20)]
    digests = tensor_digests(named)
    assert list(digests) == [n for n, _ in named]  # the record keeps the model's order
    assert digests == {n: tensor_digest(t) for n, t in named}


def test_record_from_digests_is_the_record_from_tensors(tmp_path):
    """A record made from digests computed where the weights are (the trainer's rank 0) is
    the same line, byte for byte, as one made from the tensors shipped to the driver."""
    fields, params = step_values(1)
    with FingerprintWriter(tmp_path / "tensors") as writer:
        writer.write(1, fields, params=params)
    with FingerprintWriter(tmp_path / "digests") as writer:
        writer.write(1, fields, param_digests=tensor_digests(params))
    line = (tmp_path / "tensors" / FINGERPRINTS_FILE).read_bytes()
    assert line == (tmp_path / "digests" / FINGERPRINTS_FILE).read_bytes()
    assert json.loads(line)["params_digest"] is not None


def test_params_and_param_digests_together_or_with_keep_tensors_are_refused(tmp_path):
    fields, params = step_values(1)
    with FingerprintWriter(tmp_path / "a") as writer:
        with pytest.raises(ValueError, match="give params or param_digests, not both"):
            writer.write(1, fields, params=params, param_digests=tensor_digests(params))
    with FingerprintWriter(tmp_path / "b", keep_tensors=True) as writer:
        with pytest.raises(ValueError, match="keep_tensors saves the parameters themselves"):
            writer.write(1, fields, param_digests=tensor_digests(params))


def test_same_steps_give_the_same_bytes(tmp_path):
    write_steps(tmp_path / "a", [1, 2, 3])
    write_steps(tmp_path / "b", [1, 2, 3])
    assert (tmp_path / "a" / FINGERPRINTS_FILE).read_bytes() == (tmp_path / "b" / FINGERPRINTS_FILE).read_bytes()


def test_steps_must_increase_even_across_writers(tmp_path):
    write_steps(tmp_path, [1, 2, 3])
    with FingerprintWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="cannot write step 3, the file already has step 3.*truncate_fingerprints"):
            writer.write(3, {"x": 1.0})
        writer.write(4, {"x": 1.0})
        with pytest.raises(ValueError, match="cannot write step 2, the file already has step 4"):
            writer.write(2, {"x": 1.0})
    assert sorted(read_fingerprints(tmp_path)) == [1, 2, 3, 4]


def test_duplicate_parameter_name_is_refused(tmp_path):
    with FingerprintWriter(tmp_path) as writer:
        with pytest.raises(ValueError, match="'w' given twice"):
            writer.write(1, {}, [("w", torch.zeros(1)), ("w", torch.ones(1))])


def test_keep_tensors_saves_compact_copies(tmp_path):
    big = torch.arange(1000, dtype=torch.float32)
    view = big[10:14]  # saving the view itself would save all 1000 elements
    fields, params = step_values(1)
    with FingerprintWriter(tmp_path, keep_tensors=True) as writer:
        writer.write(1, {**fields, "slice": view}, params)
    view.add_(1.0)  # the saved copy is the value at write time
    raw = load_raw(tmp_path, 1)
    assert torch.equal(raw["fields"]["slice"], torch.arange(10, 14, dtype=torch.float32))
    assert raw["fields"]["slice"].untyped_storage().nbytes() == 4 * 4
    assert torch.equal(raw["fields"]["responses"], fields["responses"])
    assert raw["fields"]["prompts"] == [[5, 6, 7], [8, 9]]
    assert torch.equal(raw["params"]["w"], params[0][1]) and torch.equal(raw["params"]["b"], params[1][1])
    assert sorted(p.name for p in raw_path(tmp_path, 1).parent.iterdir()) == ["step_1.pt"]  # no temp files
    assert load_raw(tmp_path, 2) is None


# ------------------------------------------------------------------------------ reading


def test_read_errors_name_the_path(tmp_path):
    with pytest.raises(ReproRLError, match=re.escape(f"{tmp_path / 'nope'}: no such run directory")):
        read_fingerprints(tmp_path / "nope")
    (tmp_path / "file").write_text("x")
    with pytest.raises(ReproRLError, match="file: not a directory"):
        read_fingerprints(tmp_path / "file")
    with pytest.raises(ReproRLError, match=re.escape(f"{tmp_path / FINGERPRINTS_FILE}: no such file")):
        read_fingerprints(tmp_path)


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ("{not json", "line 2 is not a fingerprint record"),
        ('[1, 2]', "line 2 .*expected a JSON object"),
        ('{"step": "2", "fields": {}, "params": {}, "params_digest": null}', "line 2 .*'step' must be an int"),
        ('{"step": 2, "fields": {"a": 1}, "params": {}, "params_digest": null}', "line 2 .*'fields' must be"),
        ('{"step": 1, "fields": {}, "params": {}, "params_digest": null}', "line 2: step 1 appears twice"),
    ],
)
def test_bad_lines_name_file_and_line(tmp_path, bad_line, reason):
    write_steps(tmp_path, [1])
    with open(tmp_path / FINGERPRINTS_FILE, "a") as f:
        f.write(bad_line + "\n")
    with pytest.raises(ReproRLError, match=f"{FINGERPRINTS_FILE}: {reason}"):
        read_fingerprints(tmp_path)


# ------------------------------------------------------------------------------ resume


def test_truncate_keeps_earlier_steps_and_drops_later_raw_files(tmp_path):
    write_steps(tmp_path, [1, 2, 3, 4, 5], keep_tensors=True)
    before = read_fingerprints(tmp_path)
    truncate_fingerprints(tmp_path, 3)
    assert read_fingerprints(tmp_path) == {s: before[s] for s in (1, 2, 3)}
    assert sorted(p.name for p in (tmp_path / "fingerprints").iterdir()) == ["step_1.pt", "step_2.pt", "step_3.pt"]
    # The resumed run writes steps 4-5 again; with the same values the file is as before.
    with FingerprintWriter(tmp_path, keep_tensors=True) as writer:
        for step in (4, 5):
            writer.write(step, *step_values(step))
    assert read_fingerprints(tmp_path) == before


def test_truncate_drops_a_torn_last_line(tmp_path):
    write_steps(tmp_path, [1, 2])
    path = tmp_path / FINGERPRINTS_FILE
    with open(path, "a") as f:
        f.write('{"step": 3, "fiel')  # a crash mid-write
    with pytest.raises(ReproRLError, match="line 3 .*unfinished"):
        read_fingerprints(tmp_path)
    with pytest.raises(ReproRLError, match="line 3"):
        FingerprintWriter(tmp_path)
    truncate_fingerprints(tmp_path, 10)
    assert sorted(read_fingerprints(tmp_path)) == [1, 2]
    assert path.read_text().endswith("}\n")


def test_writer_refuses_to_append_to_a_line_without_newline(tmp_path):
    write_steps(tmp_path, [1])
    path = tmp_path / FINGERPRINTS_FILE
    path.write_bytes(path.read_bytes().rstrip(b"\n"))  # complete JSON, but cut before its newline
    with pytest.raises(ReproRLError, match="last line is unfinished"):
        FingerprintWriter(tmp_path)
    truncate_fingerprints(tmp_path, 1)
    with FingerprintWriter(tmp_path) as writer:
        writer.write(2, {"x": 0})
    assert sorted(read_fingerprints(tmp_path)) == [1, 2]


def test_truncate_without_fingerprints_does_nothing(tmp_path):
    truncate_fingerprints(tmp_path, 3)
    assert list(tmp_path.iterdir()) == []
