"""The determinism report: what determinism mode every part of a run is in, and a verdict.

Two runs of one config can still differ if some part of the run is not in the mode the
config asks for (a replica started without batch invariance, an actor missing a variable,
a different thread count where results depend on it). At start, `reprorl train` asks
every part what it runs with and writes the answers to the run directory:

    run_dir/determinism.json   {"verdict", "full_determinism", "seed", "expected",
                                "problems", "parts": {name: info}}
    run_dir/determinism.txt    the same as a short block of text (also logged)

Parts, by name: `actor worker <r>`, `ref worker <r>`, `critic worker <r>` (rank r of
each of the trainer's worker groups, reprorl/workers; their info adds `rank`,
`world_size`, `device` and `dist_backend`), `rollout replica <i>`, `reward replica <i>` (each answers its own `determinism_info()`,
whose keys are documented in `reprorl.rollout.replica`), `agent-loop worker <i>` (only
its environment: it tokenizes and routes, it runs no model).

A part on a GPU adds `gpu` and `cuda` (`cuda_info()`: CUDA/cuDNN/NCCL versions, the
reduced-precision and TF32 switches, and the cuBLAS and NCCL variables; TF32 must be off
with full determinism); actor, reference and rollout parts on different kinds of device
are a problem with full determinism (the trainer's log-probs could not equal the engine's).
The run's `placement` (reprorl/resources/placement.py) is recorded beside the parts.

Every part's info holds `process_info()` (the torch switches and the determinism
variables its process sees) plus, for parts that run a model, `backend`,
`batch_invariant`, `num_threads` and `dtype`. `build_report` compares each part with
what the config expects and the parts of one pool with each other; each mismatch is a
one-line problem naming the part, the value and what was expected.
"""

from __future__ import annotations

import json
import os
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from reprorl.determinism import determinism_env

REPORT_FILE = "determinism.json"
TEXT_FILE = "determinism.txt"

# What a process's results can depend on, besides its inputs: reprorl's own variables,
# the hash seed, cuBLAS/NCCL reduction settings, torch's CPU kernel build, thread counts, vLLM's invariance switch,
# and the one Triton switch that overrides the kernels' pinned FP fusion
# (`reprorl.kernels.gpu.launch`).
TRITON_NO_FUSION = "TRITON_FORCE_DISABLE_FP_FUSION"
ENV_KEYS = ("PYTHONHASHSEED", "CUBLAS_WORKSPACE_CONFIG", "ATEN_CPU_CAPABILITY", "OMP_NUM_THREADS", "MKL_NUM_THREADS",
            TRITON_NO_FUSION)
ENV_PREFIXES = ("REPRORL_", "NCCL_", "VLLM_BATCH_INVARIANT")

# Keys every model-serving part's info has (see `reprorl.rollout.replica`).
MODEL_KEYS = ("backend", "batch_invariant", "num_threads", "dtype")
PROCESS_KEYS = ("deterministic_algorithms", "env")


def visible_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The determinism-relevant variables of `environ`, sorted by name."""
    return {
        k: environ[k] for k in sorted(environ) if k in ENV_KEYS or k.startswith(ENV_PREFIXES)
    }


def process_info() -> dict[str, Any]:
    """This process's determinism switches: torch's flags, threads and visible variables.

    `python_hash_randomization` is whether `PYTHONHASHSEED` was unset (or "random") when
    this interpreter started: the variable acts only at start-up, so a driver that sets it
    later shows it in `env` but still hashes randomly (harmless: no seed uses `hash()`).
    In a process that has not imported torch (an agent-loop worker: it computes nothing
    with it), torch's keys are None rather than an import of torch just to read them.
    """
    torch = sys.modules.get("torch")
    return {
        "pid": os.getpid(),
        "host": socket.gethostname(),
        **{key: None if torch is None else read(torch) for key, read in _TORCH_SWITCHES.items()},
        "python_hash_randomization": bool(sys.flags.hash_randomization),
        "env": visible_env(),
    }


_TORCH_SWITCHES = {
    "torch_version": lambda torch: torch.__version__,
    "deterministic_algorithms": lambda torch: torch.are_deterministic_algorithms_enabled(),
    "cudnn_deterministic": lambda torch: torch.backends.cudnn.deterministic,
    "cudnn_benchmark": lambda torch: torch.backends.cudnn.benchmark,
    "tf32_matmul": lambda torch: torch.backends.cuda.matmul.allow_tf32,
    "num_threads": lambda torch: torch.get_num_threads(),
}


def model_part_info(*, backend: str, batch_invariant: bool, dtype: Any, num_threads: int | None = None,
                    kernels: str | None = None, device: Any = None) -> dict[str, Any]:
    """A model-running part's info in this process: `process_info()` plus the model's mode:
    its backend, kernels (`reprorl.kernels` backend name; None for vLLM) and device."""
    info = process_info()
    info.update(
        backend=backend,
        batch_invariant=bool(batch_invariant),
        num_threads=info["num_threads"] if num_threads is None else int(num_threads),
        dtype=str(dtype).removeprefix("torch."),
        kernels=kernels,
        device=None if device is None else str(device),
    )
    if device is not None and str(device).startswith("cuda"):
        import torch

        info["gpu"] = torch.cuda.get_device_name(torch.device(device))
        info["cuda"] = cuda_info()
    return info


def cuda_info() -> dict[str, Any]:
    """The CUDA switches a GPU part's bits can depend on (its `cuda` key): library versions,
    the reduced-precision reductions and TF32 (all must be off in determinism mode), and the
    cuBLAS workspace and NCCL variables it sees."""
    import torch

    nccl = torch.cuda.nccl.version() if torch.distributed.is_nccl_available() else None
    return {
        "cuda_version": torch.version.cuda,
        "triton_version": _triton_version(),
        "cudnn_version": torch.backends.cudnn.version(),
        "nccl_version": ".".join(map(str, nccl)) if isinstance(nccl, tuple) else nccl,
        "bf16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction,
        "fp16_reduced_precision_reduction": torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction,
        "tf32_matmul": torch.backends.cuda.matmul.allow_tf32,
        "tf32_cudnn": torch.backends.cudnn.allow_tf32,
        "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
        "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("NCCL_")},
    }


def _triton_version() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return triton.__version__


# A GPU part in determinism mode must have these off (`enable_full_determinism` turns them
# off): TF32 rounds matmul inputs in a way cuBLAS/cuDNN choose per shape. The
# reduced-precision reduction flags are reported, not required: the batch-invariant
# kernels do not run their matmuls through cuBLAS.
CUDA_MUST_BE_OFF = ("tf32_matmul", "tf32_cudnn")


def _on(value: Any) -> str:
    return {True: "on", False: "off"}.get(value, repr(value))


def _pool(name: str) -> str:
    """'rollout replica 2' -> 'rollout replica'; 'actor' -> 'actor'."""
    head, _, tail = name.rpartition(" ")
    return head if tail.isdigit() else name


def find_problems(parts: Mapping[str, Mapping[str, Any]], *, full_determinism: bool, seed: int) -> list[str]:
    """One line per way a part differs from the mode the config asks for, or from its pool.

    Checked for every part: each variable of `determinism_env(seed, full_determinism)`;
    for model-running parts: batch invariance and torch's deterministic algorithms equal
    `full_determinism`; within a pool (all `rollout replica *`, all `reward replica *`):
    the same backend and dtype, and, where batch invariance is off, the same thread count
    (results then depend on it, so on which replica served a request).
    """
    expected_env = determinism_env(seed, full_determinism)
    problems: list[str] = []
    for name, info in parts.items():
        is_model = "backend" in info
        missing = [k for k in (*PROCESS_KEYS, *(MODEL_KEYS if is_model else ())) if k not in info]
        if missing:
            problems.append(f"{name}: its determinism info lacks {', '.join(missing)}")
            continue
        env = info["env"]
        for key, value in expected_env.items():
            if key not in env:
                problems.append(f"{name}: {key} is not set (expected {value!r})")
            elif env[key] != value:
                problems.append(f"{name}: {key}={env[key]!r} (expected {value!r})")
        if not is_model:
            continue
        if full_determinism and "cuda" in info:
            for key in CUDA_MUST_BE_OFF:
                if info["cuda"].get(key):
                    problems.append(f"{name}: CUDA {key} on (expected off, as full_determinism=true)")
            if env.get(TRITON_NO_FUSION, "").lower() in ("1", "true", "on", "yes", "y"):
                problems.append(f"{name}: {TRITON_NO_FUSION}={env[TRITON_NO_FUSION]} changes the Triton kernels' "
                                "bits (they pin FP fusion on); unset it")
        for key in ("batch_invariant", "deterministic_algorithms"):
            # A part that runs one sequence per forward (vLLM's CPU build in determinism
            # mode, `max_num_seqs` 1) has no batch for a row to depend on.
            serialized = key == "batch_invariant" and full_determinism and info.get("max_num_seqs") == 1
            if info[key] != full_determinism and not serialized:
                problems.append(f"{name}: {key} {_on(info[key])} (expected {_on(full_determinism)}, "
                                f"as full_determinism={str(full_determinism).lower()})")

    # The trainer's log-probs equal the engine's only when the policy's parts (actor,
    # reference, rollout) run on the same kind of device.
    kinds = {n: str(parts[n].get("device") or "cpu").split(":")[0] for n in parts
             if "backend" in parts[n] and n.startswith(("actor", "ref", "rollout"))}
    if full_determinism and len(set(kinds.values())) > 1:
        seen = ", ".join(f"{n}: {k}" for n, k in kinds.items())
        problems.append(f"model parts run on different devices ({seen}): their log-probs cannot match bit for bit")

    pools: dict[str, list[str]] = {}
    for name in parts:
        if name != _pool(name) and "backend" in parts[name]:
            pools.setdefault(_pool(name), []).append(name)
    for pool, names in pools.items():
        keys = ["backend", "dtype"] + [k for k in ("world_size", "dist_backend") if k in parts[names[0]]]
        if not all(parts[n].get("batch_invariant") is True for n in names):
            keys.append("num_threads")
        for key in keys:
            values = {n: parts[n].get(key) for n in names}
            if len(set(map(repr, values.values()))) > 1:
                seen = ", ".join(f"{n.rpartition(' ')[2]}: {v}" for n, v in values.items())
                why = " without batch invariance" if key == "num_threads" else ""
                problems.append(f"{pool}s differ in {key}{why} ({seen}): a result depends on which one served it")
    return problems


def build_report(parts: Mapping[str, Mapping[str, Any]], *, full_determinism: bool, seed: int) -> dict[str, Any]:
    """The report of a run whose parts answered `parts` (name -> info), with its verdict."""
    problems = find_problems(parts, full_determinism=full_determinism, seed=seed)
    if not full_determinism:
        verdict = "full determinism: off (full_determinism=false): reruns are not expected to be bitwise identical"
    elif not problems:
        verdict = "full determinism: on, all parts agree"
    else:
        named = sorted({p.split(":", 1)[0] for p in problems})
        verdict = f"full determinism: on, but {len(named)} part(s) differ: {'; '.join(named)}"
    return {
        "verdict": verdict,
        "full_determinism": full_determinism,
        "seed": seed,
        "expected": {
            "batch_invariant": full_determinism,
            "deterministic_algorithms": full_determinism,
            "env": determinism_env(seed, full_determinism),
        },
        "problems": problems,
        "parts": {name: dict(info) for name, info in parts.items()},
    }


def format_report(report: Mapping[str, Any]) -> str:
    """A short human-readable block: the verdict, one line per part, the problems."""
    lines = [f"determinism: {report['verdict']}"]
    if "placement" in report:  # added by the trainer (reprorl/resources/placement.py)
        lines.append("  placement: " + ", ".join(f"{k} {v}" for k, v in report["placement"].items()))
    parts = report["parts"]
    width = max((len(n) for n in parts), default=0)
    for name, info in parts.items():
        if "backend" in info:
            kernels = f" ({info['kernels']} kernels on {info.get('device') or 'cpu'})" if info.get("kernels") else ""
            mode = (f"{info['backend']}{kernels}, batch-invariant {_on(info['batch_invariant'])}, deterministic "
                    f"algorithms {_on(info['deterministic_algorithms'])}, {info['num_threads']} thread(s), {info['dtype']}")
            if "rank" in info:
                mode += f", rank {info['rank']} of {info['world_size']} on {info['device']} ({info['dist_backend']})"
            if "cuda" in info:
                cuda = info["cuda"]
                off = [k for k in CUDA_MUST_BE_OFF if not cuda.get(k)]
                triton = f", Triton {cuda['triton_version']}" if cuda.get("triton_version") else ""
                mode += (f", {info.get('gpu')}, CUDA {cuda['cuda_version']}, NCCL {cuda['nccl_version']}{triton}, "
                         f"CUBLAS_WORKSPACE_CONFIG={cuda['cublas_workspace_config']}, off: {' '.join(off) or 'none'}")
        else:
            mode = "no model (environment only)"
        lines.append(f"  {name:<{width}}  {mode}")
    expected_env = report["expected"]["env"]
    lines.append("  environment checked in every part: " + " ".join(f"{k}={v}" for k, v in expected_env.items()))
    lines += [f"  problem: {p}" for p in report["problems"]]
    return "\n".join(lines)


def write_report(run_dir: str | Path, report: Mapping[str, Any]) -> Path:
    """Write `determinism.json` and `determinism.txt` into `run_dir`; returns the JSON path."""
    run_dir = Path(run_dir)
    path = run_dir / REPORT_FILE
    path.write_text(json.dumps(report, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    (run_dir / TEXT_FILE).write_text(format_report(report) + "\n", encoding="utf-8")
    return path
