"""The determinism report's verdict on hand-made part infos (no Ray; the real parts are in test_gates.py)."""

import json

import pytest

from reprorl.determinism import determinism_env
from reprorl.determinism_report import (
    REPORT_FILE,
    TEXT_FILE,
    build_report,
    format_report,
    model_part_info,
    process_info,
    visible_env,
    write_report,
)

SEED = 42


def model_part(batch_invariant=True, deterministic=True, threads=1, dtype="float32", env=None, backend="reprorl"):
    return {"backend": backend, "batch_invariant": batch_invariant, "deterministic_algorithms": deterministic,
            "num_threads": threads, "dtype": dtype, "env": dict(env or determinism_env(SEED, True))}


def run_parts(changes=None):
    """A full-determinism run: actor, two rollout replicas, one worker; `changes` (name -> info) replace parts."""
    parts = {
        "actor": model_part(threads=2, backend="torch"),
        "rollout replica 0": model_part(),
        "rollout replica 1": model_part(),
        "agent-loop worker 0": {"deterministic_algorithms": False, "env": determinism_env(SEED, True)},
    }
    parts.update(changes or {})
    return parts


def test_all_parts_agree():
    report = build_report(run_parts(), full_determinism=True, seed=SEED)
    assert report["verdict"] == "full determinism: on, all parts agree"
    assert report["problems"] == []
    assert report["expected"]["env"] == determinism_env(SEED, True)
    # Thread counts may differ where every replica is batch-invariant; workers run no model.
    assert list(report["parts"]) == ["actor", "rollout replica 0", "rollout replica 1", "agent-loop worker 0"]


def test_a_replica_without_batch_invariance_is_named():
    report = build_report(run_parts({"rollout replica 1": model_part(batch_invariant=False)}), full_determinism=True,
                          seed=SEED)
    assert report["verdict"] == "full determinism: on, but 1 part(s) differ: rollout replica 1"
    assert report["problems"] == ["rollout replica 1: batch_invariant off (expected on, as full_determinism=true)"]


def test_a_replica_serving_one_sequence_at_a_time_is_accepted_and_only_then():
    # vLLM's CPU build is not batch-invariant; determinism mode runs it with max_num_seqs=1.
    serial = {**model_part(batch_invariant=False, backend="vllm"), "max_num_seqs": 1}
    report = build_report(run_parts({"rollout replica 0": serial, "rollout replica 1": serial}),
                          full_determinism=True, seed=SEED)
    assert report["problems"] == []
    batched = {**serial, "max_num_seqs": 2}
    report = build_report(run_parts({"rollout replica 0": serial, "rollout replica 1": batched}),
                          full_determinism=True, seed=SEED)
    assert report["problems"] == ["rollout replica 1: batch_invariant off (expected on, as full_determinism=true)"]


def test_thread_counts_matter_only_without_batch_invariance():
    off = determinism_env(SEED, False)
    parts = run_parts({
        "actor": model_part(batch_invariant=False, deterministic=False, env=off),
        "rollout replica 0": model_part(batch_invariant=False, deterministic=False, threads=1, env=off),
        "rollout replica 1": model_part(batch_invariant=False, deterministic=False, threads=2, env=off),
        "agent-loop worker 0": {"deterministic_algorithms": False, "env": off},
    })
    report = build_report(parts, full_determinism=False, seed=SEED)
    assert report["verdict"].startswith("full determinism: off")
    assert report["problems"] == [
        "rollout replicas differ in num_threads without batch invariance (0: 1, 1: 2): "
        "a result depends on which one served it"
    ]
    parts["rollout replica 1"]["num_threads"] = 1
    assert build_report(parts, full_determinism=False, seed=SEED)["problems"] == []


def test_environment_and_mode_mismatches_name_the_variable_and_the_part():
    env = determinism_env(SEED, True)
    bad_env = {k: v for k, v in env.items() if k != "CUBLAS_WORKSPACE_CONFIG"} | {"PYTHONHASHSEED": "123"}
    parts = run_parts({
        "agent-loop worker 0": {"deterministic_algorithms": False, "env": bad_env},
        "actor": model_part(deterministic=False, backend="torch"),
        "rollout replica 1": model_part(dtype="bfloat16"),
    })
    problems = build_report(parts, full_determinism=True, seed=SEED)["problems"]
    assert problems == [
        "actor: deterministic_algorithms off (expected on, as full_determinism=true)",
        "agent-loop worker 0: PYTHONHASHSEED='123' (expected '0')",
        "agent-loop worker 0: CUBLAS_WORKSPACE_CONFIG is not set (expected ':4096:8')",
        "rollout replicas differ in dtype (0: float32, 1: bfloat16): a result depends on which one served it",
    ]


def test_a_part_missing_keys_is_named():
    part = model_part()
    del part["num_threads"]
    problems = build_report(run_parts({"rollout replica 0": part}), full_determinism=True, seed=SEED)["problems"]
    assert problems[0] == "rollout replica 0: its determinism info lacks num_threads"


def test_this_process_info(monkeypatch):
    monkeypatch.setenv("REPRORL_SEED", "7")
    monkeypatch.setenv("NCCL_ALGO", "Ring")
    monkeypatch.setenv("HOME_UNRELATED", "x")
    env = visible_env()
    assert env["REPRORL_SEED"] == "7" and env["NCCL_ALGO"] == "Ring" and "HOME_UNRELATED" not in env
    info = model_part_info(backend="torch", batch_invariant=True, dtype="torch.bfloat16", num_threads=3)
    assert info["dtype"] == "bfloat16" and info["num_threads"] == 3 and info["batch_invariant"] is True
    assert set(process_info()) <= set(info)


def test_written_files(tmp_path):
    report = build_report(run_parts(), full_determinism=True, seed=SEED)
    path = write_report(tmp_path, report)
    assert path == tmp_path / REPORT_FILE and json.loads(path.read_text()) == report
    text = (tmp_path / TEXT_FILE).read_text()
    assert text == format_report(report) + "\n"
    lines = text.splitlines()
    assert lines[0] == "determinism: full determinism: on, all parts agree"
    assert [" ".join(line.split()) for line in lines[1:5]] == [
        "actor torch, batch-invariant on, deterministic algorithms on, 2 thread(s), float32",
        "rollout replica 0 reprorl, batch-invariant on, deterministic algorithms on, 1 thread(s), float32",
        "rollout replica 1 reprorl, batch-invariant on, deterministic algorithms on, 1 thread(s), float32",
        "agent-loop worker 0 no model (environment only)",
    ]
    assert "REPRORL_SEED=42" in text


@pytest.mark.parametrize("full", [True, False])
def test_verdict_states_the_mode(full):
    env = determinism_env(SEED, full)
    parts = {"actor": model_part(batch_invariant=full, deterministic=full, env=env)}
    assert build_report(parts, full_determinism=full, seed=SEED)["verdict"].startswith(
        f"full determinism: {'on' if full else 'off'}")


def worker_part(rank, world_size=2, threads=1):
    return {**model_part(threads=threads, backend="torch"), "rank": rank, "world_size": world_size, "device": "cpu",
            "dist_backend": "gloo"}


def test_every_worker_of_a_group_is_named_with_its_rank_and_the_group_must_agree():
    parts = run_parts({"actor worker 0": worker_part(0), "actor worker 1": worker_part(1)})
    report = build_report(parts, full_determinism=True, seed=SEED)
    assert report["problems"] == []
    text = format_report(report)
    assert "  actor worker 1       torch, batch-invariant on, deterministic algorithms on, 1 thread(s), float32, " \
           "rank 1 of 2 on cpu (gloo)" in text
    parts["actor worker 1"] = worker_part(1, world_size=4)
    assert build_report(parts, full_determinism=True, seed=SEED)["problems"] == [
        "actor workers differ in world_size (0: 2, 1: 4): a result depends on which one served it"
    ]


def gpu_part(**cuda_changes):
    cuda = {"cuda_version": "13.0", "triton_version": "3.6.0", "cudnn_version": 91000, "nccl_version": "2.27.7",
            "bf16_reduced_precision_reduction": True, "fp16_reduced_precision_reduction": True,
            "tf32_matmul": False, "tf32_cudnn": False, "cublas_workspace_config": ":4096:8", "nccl_env": {}}
    return {**model_part(dtype="bfloat16"), "kernels": "triton", "device": "cuda:0", "gpu": "NVIDIA H200",
            "cuda": {**cuda, **cuda_changes}}


def test_gpu_parts_agree_and_show_their_cuda_settings():
    parts = run_parts({"actor": gpu_part(), "rollout replica 0": gpu_part(), "rollout replica 1": gpu_part()})
    report = build_report(parts, full_determinism=True, seed=SEED)
    report["placement"] = {"device": "cuda", "worker_gpus": 0.7, "rollout_gpus": 0.15}
    assert report["problems"] == [] and report["verdict"] == "full determinism: on, all parts agree"
    text = format_report(report)
    assert "placement: device cuda, worker_gpus 0.7, rollout_gpus 0.15" in text
    assert ("NVIDIA H200, CUDA 13.0, NCCL 2.27.7, Triton 3.6.0, CUBLAS_WORKSPACE_CONFIG=:4096:8, "
            "off: tf32_matmul tf32_cudnn") in text


def test_tf32_on_a_gpu_part_is_a_problem_with_full_determinism():
    parts = run_parts({"actor": gpu_part(), "rollout replica 0": gpu_part(tf32_matmul=True),
                       "rollout replica 1": gpu_part()})
    report = build_report(parts, full_determinism=True, seed=SEED)
    assert report["problems"] == ["rollout replica 0: CUDA tf32_matmul on (expected off, as full_determinism=true)"]


@pytest.mark.parametrize("value,flagged", [("1", True), ("true", True), ("0", False), ("", False)])
def test_triton_forced_off_fp_fusion_is_a_problem_with_full_determinism(value, flagged):
    """The kernels pin FP fusion on; only TRITON_FORCE_DISABLE_FP_FUSION overrides that."""
    env = {**determinism_env(SEED, True), "TRITON_FORCE_DISABLE_FP_FUSION": value}
    parts = run_parts({"actor": gpu_part(), "rollout replica 0": {**gpu_part(), "env": env},
                       "rollout replica 1": gpu_part()})
    problems = build_report(parts, full_determinism=True, seed=SEED)["problems"]
    expected = [f"rollout replica 0: TRITON_FORCE_DISABLE_FP_FUSION={value} changes the Triton kernels' bits "
                "(they pin FP fusion on); unset it"]
    assert problems == (expected if flagged else [])
    assert "TRITON_FORCE_DISABLE_FP_FUSION" in visible_env(env)


def test_policy_parts_on_different_devices_are_a_problem():
    parts = run_parts({"rollout replica 0": gpu_part(), "rollout replica 1": gpu_part()})  # the actor on the CPU
    problems = build_report(parts, full_determinism=True, seed=SEED)["problems"]
    expected = "model parts run on different devices (actor: cpu, rollout replica 0: cuda"
    assert any(p.startswith(expected) for p in problems), problems
