"""`reprorl compare`: synthetic runs made with the fingerprint writer, compared through compare_main."""

import itertools
import re
import struct

import pytest
import torch

from reprorl.compare import (
    _END,
    compare_main,
    compare_runs,
    first_bitwise_difference,
    first_list_difference,
    format_steps,
    format_value,
)
from reprorl.errors import ReproRLError
from reprorl.fingerprint import FINGERPRINTS_FILE, FingerprintWriter, load_raw
from reprorl.records.tracking import Tracker

B, T = 4, 8


def make_run(run_dir, steps=range(1, 6), *, keep_tensors=False, tweak=None, metrics=True):
    """A run dir with fingerprints (and metrics.jsonl) of synthetic steps, a pure function of step.

    `tweak(step, fields, params)` may change the values in place before they are written.
    """
    tracker = Tracker(run_dir, ["jsonl"]) if metrics else None
    with FingerprintWriter(run_dir, keep_tensors=keep_tensors) as writer:
        for step in steps:
            g = torch.Generator().manual_seed(1000 + step)
            fields = {  # pipeline order; "advantages" sorts first but is computed late
                "prompts": [[1 + step, 2, 3], [4, 5], [6], [7, 8]],
                "responses": torch.randint(3, 128, (B, T), generator=g),
                "rollout_log_probs": -torch.rand(B, T, generator=g),
                "rewards": torch.rand(B, generator=g),
                "advantages": torch.randn(B, generator=g),
                "actor_losses": torch.randn(2, generator=g),
            }
            params = {"w": torch.randn(3, 2, generator=g), "b": torch.randn(3, generator=g)}
            if tweak is not None:
                tweak(step, fields, params)
            writer.write(step, fields, list(params.items()))
            if tracker is not None:
                tracker.log(step, {"reward/mean": fields["rewards"].mean(), "val/accuracy": step / 10})
    if tracker is not None:
        tracker.close()
    return run_dir


@pytest.fixture
def plot_path(tmp_path):
    return str(tmp_path / "plots" / "overlay.png")


def test_identical_runs(tmp_path, plot_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    assert compare_main(str(a), str(b), plot=plot_path) == 0
    out = capsys.readouterr().out
    # 5 steps x (6 fields + 2 parameters)
    assert out.startswith("bitwise identical over 5 steps (40 digests of fields and parameters;")
    assert compare_runs(a, b).identical


def _change_responses(step, fields, params):
    if step >= 3:  # from step 3 on, like a real divergence
        fields["responses"][1, 4] += 1
        fields["advantages"][0] += 1.0  # later in the pipeline, earlier in the alphabet
        params["b"][0] += 1.0


def test_response_difference_with_raw_tensors_names_sample_and_token(tmp_path, plot_path, capsys):
    a = make_run(tmp_path / "a", keep_tensors=True)
    b = make_run(tmp_path / "b", keep_tensors=True, tweak=_change_responses)
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    result = compare_runs(a, b)
    d = result.divergence
    assert (d.step, d.kind, d.name, d.detail) == (3, "field", "responses", "differs")
    assert d.element.index == (1, 4) and d.element.shape == (B, T) and d.element.dtype == "torch.int64"
    value_a = int(load_raw(a, 3)["fields"]["responses"][1, 4])
    assert (d.element.value_a, d.element.value_b) == (str(value_a), str(value_a + 1))
    assert "runs differ: first divergence at step 3, field 'responses' (differs)" in out
    assert f"first differing element: sample 1, token 4, index (1, 4) of shape [{B}, {T}], torch.int64" in out
    assert f"    run_a: {d.element.value_a}\n    run_b: {d.element.value_b}\n" in out
    assert result.common_steps == [1, 2, 3, 4, 5] and result.digests_compared == 2 * 8 + 1


def test_response_difference_without_raw_tensors_still_names_step_and_field(tmp_path, plot_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", tweak=_change_responses)
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 3, field 'responses' (differs)" in out
    assert "no raw tensors of step 3 in" in out and "keep_tensors" in out


def test_one_ulp_in_a_float_shows_both_bit_patterns(tmp_path, plot_path, capsys):
    def nudge(step, fields, params):
        if step == 2:
            x = fields["rollout_log_probs"]
            x[2, 5] = torch.nextafter(x[2, 5], torch.tensor(0.0))

    a = make_run(tmp_path / "a", keep_tensors=True)
    b = make_run(tmp_path / "b", keep_tensors=True, tweak=nudge)
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    e = compare_runs(a, b).divergence.element
    assert e.index == (2, 5)
    bits_a = int(re.search(r"bits 0x([0-9a-f]{8})", e.value_a).group(1), 16)
    bits_b = int(re.search(r"bits 0x([0-9a-f]{8})", e.value_b).group(1), 16)
    assert abs(bits_a - bits_b) == 1  # one ulp, visible in the bits
    assert "step 2, field 'rollout_log_probs'" in out and "sample 2, token 5" in out


def test_parameter_difference(tmp_path, plot_path, capsys):
    def bump(step, fields, params):
        if step == 2:
            params["b"][1] = params["b"][1] * 2

    a = make_run(tmp_path / "a", keep_tensors=True)
    b = make_run(tmp_path / "b", keep_tensors=True, tweak=bump)
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    assert "first divergence at step 2, parameter 'b' (differs)" in out
    assert "first differing element: index (1,) of shape [3], torch.float32" in out


def test_field_in_one_run_only(tmp_path, plot_path, capsys):
    def add_values(step, fields, params):
        fields["values"] = torch.zeros(B, T)

    a = make_run(tmp_path / "a", tweak=add_values)
    b = make_run(tmp_path / "b")
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    assert "first divergence at step 1, field 'values' (only in run_a)" in capsys.readouterr().out
    assert compare_main(str(b), str(a), plot=plot_path) == 1
    assert "field 'values' (only in run_b)" in capsys.readouterr().out


def test_different_steps(tmp_path, plot_path, capsys):
    a = make_run(tmp_path / "a", steps=range(1, 8))
    b = make_run(tmp_path / "b", steps=[1, 2, 3, 6])
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    assert f"steps only in run_a ({a}): 4-5, 7\n" in out
    assert f"steps only in run_b ({b}): none\n" in out
    assert "the 4 common steps are bitwise identical" in out


def test_different_steps_and_a_divergence_report_both(tmp_path, plot_path, capsys):
    a = make_run(tmp_path / "a", steps=range(1, 6))
    b = make_run(tmp_path / "b", steps=range(1, 4), tweak=_change_responses)
    assert compare_main(str(a), str(b), plot=plot_path) == 1
    out = capsys.readouterr().out
    assert "steps only in run_a" in out and "first divergence at step 3, field 'responses'" in out


def test_missing_or_unreadable_runs_are_one_line_errors(tmp_path, plot_path):
    good = make_run(tmp_path / "good")
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    cases = {
        tmp_path / "absent": "no such run directory",
        tmp_path / "a_file": "not a directory",
        tmp_path / "empty": f"{FINGERPRINTS_FILE}: no such file",
    }
    for path, message in cases.items():
        for args in ((path, good), (good, path)):
            with pytest.raises(ReproRLError, match=re.escape(message)) as err:
                compare_main(str(args[0]), str(args[1]), plot=plot_path)
            assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_unreadable_json_line_names_file_and_line(tmp_path, plot_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    lines = (b / FINGERPRINTS_FILE).read_text().splitlines(keepends=True)
    lines[1] = lines[1][:40] + "\n"
    (b / FINGERPRINTS_FILE).write_text("".join(lines))
    with pytest.raises(ReproRLError, match=re.escape(f"{b / FINGERPRINTS_FILE}: line 2 is not a fingerprint record")):
        compare_main(str(a), str(b), plot=plot_path)


def _tear_last_line(run):
    """What a run killed while writing its last record leaves: half a line, no newline."""
    text = (run / FINGERPRINTS_FILE).read_text()
    (run / FINGERPRINTS_FILE).write_text(text[: text.rstrip("\n").rfind("\n") + 60])


def test_a_torn_last_line_compares_the_complete_steps_and_says_so(tmp_path, plot_path, capsys):
    """A crashed run (its last record half written) used to be refused as unreadable."""
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    _tear_last_line(b)
    assert compare_main(str(a), str(b)) == 1
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "runs differ: they recorded different steps"
    assert out[1].endswith(": 5") and out[2].endswith(": none")
    assert out[3] == "the 4 common steps are bitwise identical"
    assert out[4] == (f"  {b}: line 5 of {FINGERPRINTS_FILE} is torn (the run stopped while writing it): "
                      "compared its complete steps")
    _tear_last_line(a)  # both stopped at the same point: their complete steps are the verdict
    assert compare_main(str(a), str(b)) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("bitwise identical over 4 steps") and len(out) == 3
    assert out[1].startswith(f"  {a}: line 5 of {FINGERPRINTS_FILE} is torn")


def test_no_recorded_steps_is_an_error_not_identical(tmp_path, plot_path):
    a = make_run(tmp_path / "a")
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / FINGERPRINTS_FILE).write_text("")
    with pytest.raises(ReproRLError, match="records no steps"):
        compare_main(str(a), str(tmp_path / "b"), plot=plot_path)


# ------------------------------------------------------------------------------ plot


def test_overlay_plot_is_written(tmp_path, plot_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    compare_main(str(a), str(b), plot=plot_path)
    assert f"plot: {plot_path}\n" in capsys.readouterr().out
    with open(plot_path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_no_plot_is_written_unless_asked(tmp_path, monkeypatch, capsys):
    """Every call used to write ./compare_A_vs_B.png into the working directory."""
    a, b = make_run(tmp_path / "runs" / "a"), make_run(tmp_path / "runs" / "b")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = {p: sorted(p.rglob("*")) for p in (a, b)}
    assert compare_main(str(a), str(b)) == 0
    assert list(work.iterdir()) == []
    assert "plot:" not in capsys.readouterr().out
    assert {p: sorted(p.rglob("*")) for p in (a, b)} == before


def test_plot_path_must_be_png(tmp_path):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b")
    with pytest.raises(ReproRLError, match="expected a path ending in .png"):
        compare_main(str(a), str(b), plot=str(a / FINGERPRINTS_FILE))


def test_missing_metrics_skips_only_the_plot(tmp_path, plot_path, capsys):
    a, b = make_run(tmp_path / "a"), make_run(tmp_path / "b", metrics=False)
    assert compare_main(str(a), str(b), plot=plot_path) == 0
    out = capsys.readouterr().out
    assert out.startswith("bitwise identical over 5 steps")
    assert f"no plot: {b / 'metrics.jsonl'}: no such file" in out


# ------------------------------------------------------------------------------ helpers


def _first_difference_reference(a: torch.Tensor, b: torch.Tensor) -> int | None:
    """The plain way: element by element, comparing the packed bytes of each value."""
    fmt = {torch.float32: "<f", torch.float64: "<d", torch.int64: "<q", torch.bool: "<?"}[a.dtype]
    for i, (x, y) in enumerate(zip(a.reshape(-1).tolist(), b.reshape(-1).tolist())):
        if struct.pack(fmt, x) != struct.pack(fmt, y):
            return i
    return None


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.int64, torch.bool])
def test_first_bitwise_difference_matches_a_plain_loop(dtype):
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        a = (torch.randn(3, 5, generator=g) * 4).to(dtype)
        b = a.clone()
        for _ in range(trial % 3):  # 0, 1 or 2 changed elements
            i, j = (int(v) for v in torch.randint(0, 5, (2,), generator=g))
            b[i % 3, j] = ~b[i % 3, j] if dtype == torch.bool else b[i % 3, j] + 1
        assert first_bitwise_difference(a, b) == _first_difference_reference(a, b)


def test_first_bitwise_difference_sees_bits_not_values():
    a = torch.tensor([1.0, float("nan"), 0.0])
    assert first_bitwise_difference(a, a.clone()) is None  # the same NaN matches itself
    assert first_bitwise_difference(a, torch.tensor([1.0, float("nan"), -0.0])) == 2  # 0.0 == -0.0 but differs
    nan_other_payload = torch.tensor([0x7FC00001], dtype=torch.int32).view(torch.float32)
    assert first_bitwise_difference(a[1:2], nan_other_payload) == 0
    assert first_bitwise_difference(torch.zeros(0), torch.zeros(0)) is None
    bf = torch.tensor([1.0, 2.0], dtype=torch.bfloat16)
    assert first_bitwise_difference(bf, torch.tensor([1.0, 2.015625], dtype=torch.bfloat16)) == 1  # one bf16 ulp


def test_first_list_difference_literal_examples():
    assert first_list_difference([[1, 2], [3, 4]], [[1, 2], [3, 4]]) is None
    assert first_list_difference([[1, 2], [3, 4]], [[1, 2], [3, 5]]) == ((1, 1), 4, 5)
    assert first_list_difference([[1, 2], [3]], [[1, 2], [3, 7]]) == ((1, 1), _END, 7)
    assert first_list_difference([0.0], [-0.0]) == ((0,), 0.0, -0.0)
    assert first_list_difference([1], [1.0]) == ((0,), 1, 1.0)
    assert first_list_difference("abc", "abd") == ((), "abc", "abd")


def test_format_value_shows_exact_bits():
    assert format_value(torch.tensor(1 + 2**-23)) == "1.0000001192092896 (bits 0x3f800001)"
    assert format_value(torch.tensor(-0.0)) == "-0.0 (bits 0x80000000)"
    assert format_value(torch.tensor(1.5, dtype=torch.bfloat16)) == "1.5 (bits 0x3fc0)"
    assert format_value(torch.tensor(17)) == "17"
    assert format_value(0.1) == "0.1 (0x1.999999999999ap-4)"
    assert format_value(_END) == "<end>"


def test_format_steps():
    assert format_steps([]) == "none"
    assert format_steps([4]) == "4"
    assert format_steps([1, 2, 3, 7, 9, 10]) == "1-3, 7, 9-10"
    assert format_steps(list(itertools.chain(range(0, 3), range(5, 6)))) == "0-2, 5"


def test_compare_subcommand_through_the_cli(tmp_path, capsys):
    """`reprorl compare` is wired to compare_main: exit 0 on identical runs, 2 on a missing one."""
    from reprorl.cli import main
    from reprorl.fingerprint import FingerprintWriter

    for name in ("a", "b"):
        with FingerprintWriter(tmp_path / name) as writer:
            writer.write(1, {"responses": torch.tensor([[1, 2, 3]])})
    plot = tmp_path / "overlay.png"
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--plot", str(plot)]) == 0
    assert "bitwise identical over 1 steps" in capsys.readouterr().out
    assert main(["compare", str(tmp_path / "a"), str(tmp_path / "missing")]) == 2
    assert "missing" in capsys.readouterr().err
