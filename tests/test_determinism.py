"""Tests for reprorl.determinism: stable hashing, request seeds, the run's environment."""

import json
import os
import random
import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch

from reprorl.determinism import (
    CUBLAS_WORKSPACE_CONFIG,
    check_worker_env,
    determinism_env,
    encode,
    is_full_determinism,
    ray_runtime_env,
    request_seed,
    stable_digest,
    stable_hash,
    tensor_digest,
)
from reprorl.errors import ConfigError

# Values and their hashes, pinned: if one of these changes, every seed of every run
# changes with it. Change the encoding only on purpose, with a new version tag.
PINNED = [
    (0, 2559274362392116682),
    (1, 6569478194433626454),
    (-1, 3147953700348158128),
    (2**64 + 3, 6204756491195566373),
    (-(2**70), 1307206475803384496),
    ("reprorl", 7706063257489109232),
    ("", 9012080385394461237),
    ("é", 8868126362622752633),
    (0.1, 12149964726914350924),
    (-0.0, 3362194279860918335),
    (None, 1918551003743268233),
    (True, 17334634538307213679),
    (b"\x00\xff", 9264555169585182880),
    ((1, ("a", (2.5, None))), 4323877940993953727),
    (["x", 1], 4769750643969442871),
    ({"b": 2, "a": [1, 2], 3: None}, 3952413649186267172),
]


def _clean_env(**extra: str) -> dict[str, str]:
    """This process's environment without any determinism variable, plus `extra`."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("REPRORL_", "NCCL_")) and k not in ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG")
    }
    env.update(extra)
    return env


def _run_python(code: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _result(proc: subprocess.Popen):
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


# --- encoding and stable_hash -----------------------------------------------------------


def test_encoding_literals():
    # tag, 8-byte big-endian length, payload
    assert encode(1) == b"I" + b"\x00" * 7 + b"\x01" + b"\x01"
    assert encode(-1) == b"I" + b"\x00" * 7 + b"\x01" + b"\xff"
    assert encode(128) == b"I" + b"\x00" * 7 + b"\x02" + b"\x00\x80"  # room for the sign bit
    assert encode("ab") == b"S" + b"\x00" * 7 + b"\x02" + b"ab"
    assert encode(b"ab") == b"Y" + b"\x00" * 7 + b"\x02" + b"ab"
    assert encode(1.0) == b"F" + bytes.fromhex("3ff0000000000000")
    assert encode(None) == b"N"
    assert encode(False) == b"B\x00"
    assert encode(("a", None)) == b"T" + b"\x00" * 7 + b"\x02" + encode("a") + b"N"
    assert encode({"k": 1}) == b"D" + b"\x00" * 7 + b"\x01" + encode("k") + encode(1)


def test_stable_hash_pinned_values():
    for value, expected in PINNED:
        assert stable_hash(value) == expected, value
    assert stable_hash(42, 0, "uid-0", 0, 0) == 14590461383344004681
    assert stable_digest("a", 1) == "1f95d4ce14eee4442eadcc4438325a9f"


def test_stable_hash_same_in_fresh_interpreters_with_different_hash_seeds():
    # The dict is built by iterating a set of strings, so its insertion order differs
    # between the two interpreters; its hash must not.
    code = f"""
        import json
        from reprorl.determinism import stable_hash
        values = {[v for v, _ in PINNED]!r}
        values.append({{k: len(k) for k in {{"alpha", "beta", "gamma", "delta", "epsilon"}}}})
        order = list({{"alpha", "beta", "gamma", "delta", "epsilon"}})
        print(json.dumps([[stable_hash(v) for v in values], order]))
    """
    procs = [_run_python(code, _clean_env(PYTHONHASHSEED=seed)) for seed in ("1", "2")]
    (hashes_1, order_1), (hashes_2, order_2) = [_result(p) for p in procs]
    lengths = {"alpha": 5, "beta": 4, "gamma": 5, "delta": 5, "epsilon": 7}
    expected = [h for _, h in PINNED] + [stable_hash(lengths)]
    assert hashes_1 == expected
    assert hashes_2 == expected
    assert order_1 != order_2  # the two interpreters really did differ in set order


def test_stable_hash_is_64_bit_non_negative():
    for value, _ in PINNED:
        assert 0 <= stable_hash(value) < 2**64


@pytest.mark.parametrize(
    "a, b",
    [
        (("ab", "c"), ("a", "bc")),
        ((1,), ("1",)),
        ((1,), (1.0,)),
        ((1,), (True,)),
        (("1",), (1.0,)),
        ((0,), (False,)),
        ((0,), (None,)),
        ((0.0,), (-0.0,)),
        (("",), (b"",)),
        (("ab",), (b"ab",)),
        (((),), ((None,),)),
        (([1, 2],), ([[1], 2],)),
        (({"a": 1},), ((("a", 1),),)),
        (({"a": 1},), ({"a": "1"},)),
        ((2**64,), (2**64 + 1,)),
        ((2**64,), (-(2**64),)),
        ((1, 2), ((1, 2),)),  # two parts differ from one tuple part
    ],
)
def test_stable_hash_distinguishes(a, b):
    assert stable_hash(*a) != stable_hash(*b)


def test_stable_hash_equalities():
    # dict order never matters
    assert stable_hash({"a": 1, "b": [2, 3]}) == stable_hash({"b": [2, 3], "a": 1})
    # tuples and lists encode alike (JSON/YAML round trips turn tuples into lists)
    assert stable_hash((1, "a")) == stable_hash([1, "a"])
    # numpy scalars hash as the Python value
    assert stable_hash(np.int64(5)) == stable_hash(5)
    assert stable_hash(np.uint8(200)) == stable_hash(200)
    assert stable_hash(np.float32(0.5)) == stable_hash(0.5)
    assert stable_hash(np.float32(0.1)) == stable_hash(float(np.float32(0.1)))
    assert stable_hash(np.bool_(True)) == stable_hash(True)


@pytest.mark.parametrize(
    "value, type_name",
    [
        ({1, 2}, "set"),
        (object(), "object"),
        (torch.zeros(2), "Tensor"),
        (np.zeros(2), "ndarray"),
        (1j, "complex"),
    ],
)
def test_stable_hash_rejects_unsupported_types(value, type_name):
    with pytest.raises(TypeError, match=type_name):
        stable_hash(value)
    with pytest.raises(TypeError, match=type_name):
        stable_hash({"nested": [value]})


# --- tensor_digest ------------------------------------------------------------------------


def _reference_tensor_digest(t: torch.Tensor) -> str:
    """The plain version: the same digest through stable_digest and an explicit byte copy."""
    c = t.detach().contiguous()
    raw = c.reshape(-1).view(torch.uint8).numpy().tobytes()
    return stable_digest("torch.Tensor", str(t.dtype), tuple(t.shape), raw)


@pytest.mark.parametrize(
    "t",
    [
        torch.arange(12, dtype=torch.float32).reshape(3, 4),
        torch.arange(12, dtype=torch.float32).reshape(3, 4).T,  # non-contiguous
        torch.arange(6, dtype=torch.bfloat16),
        torch.tensor([True, False, True]),
        torch.tensor([-(2**62), 7], dtype=torch.int64),
        torch.tensor(3.5),  # 0-dim
        torch.empty(0, 4),
        torch.ones(2, 2, requires_grad=True),
    ],
)
def test_tensor_digest_matches_reference(t):
    assert tensor_digest(t) == _reference_tensor_digest(t)


def test_tensor_digest_literal_and_distinctions():
    t = torch.tensor([[1.5, -2.0], [0.0, 3.25]])
    assert tensor_digest(t) == "4869461197164d11d3b8259702297204"
    assert tensor_digest(t.clone()) == tensor_digest(t)
    assert tensor_digest(t.reshape(4)) != tensor_digest(t)  # same bytes, other shape
    assert tensor_digest(t.view(torch.int32)) != tensor_digest(t)  # same bytes, other dtype
    assert tensor_digest(torch.tensor([0.0])) != tensor_digest(torch.tensor([-0.0]))  # torch.equal would agree
    nan = torch.tensor([float("nan")])
    assert tensor_digest(nan) == tensor_digest(nan.clone())  # torch.equal would not
    u = t.clone()
    u[1, 1] = torch.nextafter(u[1, 1], torch.tensor(10.0))  # one ulp
    assert tensor_digest(u) != tensor_digest(t)


# --- request_seed -----------------------------------------------------------------------


def test_request_seed_pinned():
    assert [request_seed(42, 3, "prompt-17", r) for r in range(3)] == [
        900748276018095806,
        5585334608910070152,
        9047610850822686234,
    ]
    assert request_seed(42, 3, "prompt-17", 0, phase="val") == 9133837030556554681


def test_request_seed_copies_of_a_prompt_differ():
    n = 64
    seeds = [request_seed(7, 10, "uid-3", r) for r in range(n)]
    assert len(set(seeds)) == n
    assert all(0 <= s < 2**63 for s in seeds)


def test_request_seed_same_identity_same_seed():
    assert request_seed(7, 10, "uid-3", 2, 1) == request_seed(7, 10, "uid-3", 2, 1)
    assert request_seed(7, 10, np.int64(5), 2) == request_seed(7, 10, 5, 2)


def test_request_seed_each_component_matters():
    base = dict(run_seed=7, step=10, sample_uid="uid-3", repeat_index=2, turn=1)
    changed = [
        dict(base, run_seed=8),
        dict(base, step=11),
        dict(base, step=-1),
        dict(base, sample_uid="uid-4"),
        dict(base, sample_uid=3),
        dict(base, repeat_index=3),
        dict(base, turn=0),
    ]
    seeds = {request_seed(**base)} | {request_seed(**c) for c in changed}
    seeds.add(request_seed(**base, phase="val"))
    assert len(seeds) == len(changed) + 2
    # an int uid and its string spelling are different identities
    assert request_seed(1, 0, 7, 0) != request_seed(1, 0, "7", 0)


def test_request_seed_rejects_bad_arguments():
    with pytest.raises(TypeError, match="step"):
        request_seed(1, 0.0, "u", 0)
    with pytest.raises(TypeError, match="run_seed"):
        request_seed(True, 0, "u", 0)
    with pytest.raises(TypeError, match="sample_uid"):
        request_seed(1, 0, ("u",), 0)
    with pytest.raises(ValueError, match="repeat_index"):
        request_seed(1, 0, "u", -1)
    with pytest.raises(TypeError, match="phase"):
        request_seed(1, 0, "u", 0, phase="")


# --- enable_full_determinism ------------------------------------------------------------


def test_enable_full_determinism_in_subprocess():
    code = """
        import json, os, random
        import numpy as np
        import torch
        from reprorl.determinism import enable_full_determinism, is_full_determinism

        # CUDA already up without the cuBLAS config: must refuse, and change nothing.
        real = torch.cuda.is_initialized
        torch.cuda.is_initialized = lambda: True
        try:
            enable_full_determinism(1234)
            refused = None
        except RuntimeError as e:
            refused = str(e)
        torch.cuda.is_initialized = real
        untouched = not torch.are_deterministic_algorithms_enabled() and "REPRORL_SEED" not in os.environ

        draws = []
        for _ in range(2):  # idempotent: a second call leaves the same state
            enable_full_determinism(1234)
            draws.append([random.random(), float(np.random.rand()), torch.rand(1).item()])
        b = torch.backends
        print(json.dumps(dict(
            refused=refused, untouched=untouched, draws=draws,
            deterministic=torch.are_deterministic_algorithms_enabled(),
            warn_only=torch.is_deterministic_algorithms_warn_only_enabled(),
            cudnn_deterministic=b.cudnn.deterministic, cudnn_benchmark=b.cudnn.benchmark,
            matmul_tf32=b.cuda.matmul.allow_tf32, cudnn_tf32=b.cudnn.allow_tf32,
            initial_seed=torch.initial_seed(), full=is_full_determinism(),
            env={k: v for k, v in os.environ.items()
                 if k.startswith(("REPRORL_", "NCCL_", "CUBLAS_", "ATEN_")) or k == "PYTHONHASHSEED"},
            cpu_capability=torch.backends.cpu.get_cpu_capability(),
        )))
    """
    r = _result(_run_python(code, _clean_env()))
    assert r["refused"] is not None and "CUBLAS_WORKSPACE_CONFIG" in r["refused"]
    assert r["untouched"]
    g = torch.Generator().manual_seed(1234)
    expected = [
        random.Random(1234).random(),
        float(np.random.RandomState(1234).rand()),
        torch.rand(1, generator=g).item(),
    ]
    assert r["draws"] == [expected, expected]
    assert r["deterministic"] is True
    assert r["warn_only"] is False
    assert r["cudnn_deterministic"] is True
    assert r["cudnn_benchmark"] is False
    assert r["matmul_tf32"] is False
    assert r["cudnn_tf32"] is False
    assert r["initial_seed"] == 1234
    assert r["full"] is True
    assert r["env"] == determinism_env(1234, full_determinism=True)
    assert r["env"]["CUBLAS_WORKSPACE_CONFIG"] == CUBLAS_WORKSPACE_CONFIG
    assert r["cpu_capability"] == "DEFAULT"


def test_pin_cpu_kernels_refuses_a_process_already_on_vector_kernels():
    """torch picks its CPU kernels' build at its first kernel: a process that ran one on
    its AVX2 (or AVX-512) build cannot be pinned any more, and says how to start instead."""
    code = """
        import json, os
        os.environ.pop("ATEN_CPU_CAPABILITY", None)
        import torch
        torch.ones(3).exp().sum()
        running = torch.backends.cpu.get_cpu_capability()
        from reprorl.determinism import pin_cpu_kernels
        try:
            pin_cpu_kernels()
            error = None
        except RuntimeError as e:
            error = str(e)
        print(json.dumps(dict(running=running, error=error)))
    """
    r = _result(_run_python(code, _clean_env()))
    if r["running"] == "DEFAULT":
        pytest.skip("this CPU has no vector build of torch's kernels to refuse")
    assert r["error"] is not None and "ATEN_CPU_CAPABILITY=default" in r["error"] and r["running"] in r["error"]


# --- the run's environment --------------------------------------------------------------


def test_determinism_env():
    assert determinism_env(7, full_determinism=False) == {
        "PYTHONHASHSEED": "0",
        "REPRORL_FULL_DETERMINISM": "0",
        "REPRORL_SEED": "7",
    }
    assert determinism_env(2**40, full_determinism=True) == {
        "PYTHONHASHSEED": "0",
        "REPRORL_FULL_DETERMINISM": "1",
        "REPRORL_SEED": "1099511627776",
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8",
        "ATEN_CPU_CAPABILITY": "default",
        "NCCL_ALGO": "Ring",
        "NCCL_NVLS_ENABLE": "0",
        "NCCL_COLLNET_ENABLE": "0",
    }


def test_ray_runtime_env_merges():
    env = {"REPRORL_SEED": "7", "PYTHONHASHSEED": "0"}
    assert ray_runtime_env(env) == {"env_vars": env}
    base = {"working_dir": "/src", "pip": ["x"], "env_vars": {"OMP_NUM_THREADS": "1", "REPRORL_SEED": "7"}}
    merged = ray_runtime_env(env, base)
    assert merged == {
        "working_dir": "/src",
        "pip": ["x"],
        "env_vars": {"OMP_NUM_THREADS": "1", "REPRORL_SEED": "7", "PYTHONHASHSEED": "0"},
    }
    assert base["env_vars"] == {"OMP_NUM_THREADS": "1", "REPRORL_SEED": "7"}  # not mutated


def test_ray_runtime_env_conflict_names_every_variable():
    base = {"env_vars": {"PYTHONHASHSEED": "1", "REPRORL_SEED": "8", "OTHER": "x"}}
    with pytest.raises(ConfigError) as info:
        ray_runtime_env({"PYTHONHASHSEED": "0", "REPRORL_SEED": "7", "OTHER": "x"}, base)
    message = str(info.value)
    assert "PYTHONHASHSEED='1'" in message and "'0'" in message
    assert "REPRORL_SEED='8'" in message and "'7'" in message
    assert "OTHER" not in message
    with pytest.raises(TypeError, match="REPRORL_SEED"):
        ray_runtime_env({"REPRORL_SEED": 7})


def test_check_worker_env():
    expected = determinism_env(7, full_determinism=True)
    check_worker_env(expected, "trainer", environ={**expected, "HOME": "/root"})  # extras are fine
    found = {k: v for k, v in expected.items() if k not in ("PYTHONHASHSEED", "NCCL_ALGO")}
    found["REPRORL_SEED"] = "8"
    with pytest.raises(RuntimeError) as info:
        check_worker_env(expected, "rollout replica 2", environ=found)
    message = str(info.value)
    assert message.startswith("rollout replica 2: ")
    assert "PYTHONHASHSEED is missing (expected '0')" in message
    assert "NCCL_ALGO is missing (expected 'Ring')" in message
    assert "REPRORL_SEED='8' (expected '7')" in message
    assert "CUBLAS" not in message and "\n" not in message


def test_is_full_determinism():
    assert is_full_determinism({"REPRORL_FULL_DETERMINISM": "1"}) is True
    assert is_full_determinism({"REPRORL_FULL_DETERMINISM": "0"}) is False
    assert is_full_determinism({}) is False
    with pytest.raises(RuntimeError, match="'true'"):
        is_full_determinism({"REPRORL_FULL_DETERMINISM": "true"})


@pytest.mark.slow  # a real local Ray (conftest's ray_local): about 15 s on the 2-core CI machine
def test_ray_actor_env_travels_and_is_checked(ray_local):
    ray = ray_local

    class Worker:
        def __init__(self, expected: dict[str, str]):
            from reprorl.determinism import check_worker_env

            check_worker_env(expected, "test worker")

        def python_hash(self, s: str) -> int:
            return hash(s)

    expected = determinism_env(987654321, full_determinism=True)
    actor = ray.remote(Worker)
    good = actor.options(num_cpus=0, runtime_env=ray_runtime_env(expected)).remote(expected)
    try:
        worker_hash = ray.get(good.python_hash.remote("reprorl"), timeout=120)
        bad = actor.options(num_cpus=0).remote(expected)
        with pytest.raises(ray.exceptions.RayActorError) as info:
            ray.get(bad.python_hash.remote("reprorl"), timeout=120)
        assert "test worker" in str(info.value)
        assert "REPRORL_SEED is missing (expected '987654321')" in str(info.value)
    finally:
        ray.kill(good)
    # PYTHONHASHSEED reached the worker's interpreter at start-up, not just os.environ.
    code = 'import json; print(json.dumps(hash("reprorl")))'
    assert worker_hash == _result(_run_python(code, _clean_env(PYTHONHASHSEED="0")))


def test_deterministic_algorithms_without_loading_inductor():
    """`use_deterministic_algorithms` sets torch's flag without importing torch._inductor
    (1.5 s of start-up in every process), and inductor, loaded later, is deterministic too
    (its flag comes from the environment variable set here); off turns both off."""
    code = """
        import json, sys, torch
        from reprorl.determinism import use_deterministic_algorithms
        use_deterministic_algorithms(True)
        on = [torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
              "torch._inductor" in sys.modules]
        import torch._inductor.config as inductor
        on.append(inductor.deterministic)
        use_deterministic_algorithms(False)  # inductor is loaded now: set directly
        print(json.dumps([on, [torch.are_deterministic_algorithms_enabled(), inductor.deterministic]]))
    """
    on, off = _result(_run_python(code, _clean_env()))
    assert on == [True, False, False, True]
    assert off == [False, False]
