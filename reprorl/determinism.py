"""Determinism core: stable hashing, seeds from identity, and the run's environment.

The contract (docs/design.md) is that a generated sample is a pure function of
(weights, prompt ids, sampling params, request seed). This module supplies the pieces
every other part builds on:

- `stable_hash` / `stable_digest`: hashes of a canonical, type-tagged encoding of plain
  values, the same in every process and under every `PYTHONHASHSEED` (unlike `hash()`).
- `request_seed`: the seed of one sampled sequence, derived from its identity only.
- `tensor_digest`: a fingerprint of a tensor's dtype, shape and exact bytes.
- `enable_full_determinism`: seeds and torch/cuDNN/cuBLAS/NCCL switches for one process.
- `determinism_env` / `ray_runtime_env` / `check_worker_env`: the variables every process
  of a run needs, how they travel to Ray actors, and the check each actor runs first.

A Ray actor starts like this:

    def __init__(self, expected_env: dict[str, str], ...):
        check_worker_env(expected_env, where="rollout replica 2")
        if is_full_determinism():
            enable_full_determinism(int(os.environ[ENV_SEED]))
"""

from __future__ import annotations

import hashlib
import os
import random
import struct
import sys
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np

from reprorl.errors import ConfigError

# torch is imported inside the two functions that need it, so hashing and seeds stay
# cheap to import (data tools, the CLI, subprocess checks).
if TYPE_CHECKING:
    import torch

ENV_FULL_DETERMINISM = "REPRORL_FULL_DETERMINISM"
ENV_SEED = "REPRORL_SEED"

# cuBLAS picks its reduction split from the workspace it is given; a fixed workspace
# config makes it deterministic. cuBLAS reads this when PyTorch first creates a handle,
# so it must be in the environment BEFORE CUDA initialises in the process.
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

# NCCL picks the all-reduce algorithm (ring, tree, NVLS, CollNet) from message size and
# topology, and each sums in its own order; NVLS and CollNet reduce inside the switch or
# network. Pinning the ring and turning in-network reduction off gives one fixed order.
NCCL_DETERMINISM_ENV = {
    "NCCL_ALGO": "Ring",
    "NCCL_NVLS_ENABLE": "0",
    "NCCL_COLLNET_ENABLE": "0",
}

# torch runs each CPU kernel in the vector code of the machine (AVX-512 on one CPU, AVX2 on
# another): a sum's order of additions and its exp/log routines follow, so an AMD and an
# Intel CPU gave different bits. Its portable build ("default") is the same code on every
# x86-64 CPU. torch reads the variable at its first CPU kernel: it must be in the
# environment before then (`reprorl train` and every actor of a run have it from the start).
ATEN_CPU_CAPABILITY = "default"

# blake2b's personalisation separates reprorl's hashes from any other blake2b use.
# Changing it (or the encoding below) changes every seed: bump the version if you must.
_PERSON = b"reprorl.hash.v1"
_REQUEST_SEED_DOMAIN = "reprorl.request_seed.v1"


# --- canonical encoding -------------------------------------------------------------
#
# Every value is a one-byte type tag followed by a payload; variable-size payloads carry
# an 8-byte length first, so the concatenation of two encodings is never the encoding of
# something else: ("ab", "c") != ("a", "bc"), and 1, "1", 1.0 and True all differ.


def _length(n: int) -> bytes:
    return struct.pack(">Q", n)


def _encode(value: Any, out: list[bytes]) -> None:
    """Append the canonical encoding of `value` to `out` (pieces, to avoid copying bytes)."""
    if value is None:
        out.append(b"N")
    elif isinstance(value, (bool, np.bool_)):  # before int: bool is an int subclass
        out.append(b"B\x01" if value else b"B\x00")
    elif isinstance(value, (int, np.integer)):
        n = int(value)
        # Two's complement, big-endian, just wide enough for the sign bit: any size works.
        payload = n.to_bytes(n.bit_length() // 8 + 1, "big", signed=True)
        out += [b"I", _length(len(payload)), payload]
    elif isinstance(value, (float, np.floating)):
        out += [b"F", struct.pack(">d", float(value))]  # the exact IEEE-754 bits
    elif isinstance(value, str):
        payload = value.encode("utf-8")
        out += [b"S", _length(len(payload)), payload]
    elif isinstance(value, (bytes, bytearray)):
        out += [b"Y", _length(len(value)), bytes(value)]
    elif isinstance(value, (tuple, list)):
        # Tuples and lists encode alike: a value read back from JSON/YAML is a list.
        out += [b"T", _length(len(value))]
        for item in value:
            _encode(item, out)
    elif isinstance(value, dict):
        # Sorted by the key's encoding, so insertion order never matters.
        items = sorted((encode(k), encode(v)) for k, v in value.items())
        out += [b"D", _length(len(items))]
        for k, v in items:
            out += [k, v]
    else:
        raise TypeError(
            f"stable_hash cannot encode a value of type {type(value).__module__}."
            f"{type(value).__qualname__}; supported: None, bool, int, float, str, bytes, "
            "tuple, list, dict and numpy integer/floating scalars"
        )


def encode(value: Any) -> bytes:
    """The canonical byte encoding of `value` (what `stable_hash` hashes)."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def stable_hash(*parts: Any) -> int:
    """A 64-bit non-negative integer hash of `parts`, the same in every process.

    `stable_hash(a, b)` hashes the tuple `(a, b)`. Python's `hash()` changes with
    `PYTHONHASHSEED` and must never feed a seed or a routing decision; this does not.
    """
    h = hashlib.blake2b(encode(parts), digest_size=8, person=_PERSON)
    return int.from_bytes(h.digest(), "big")


def stable_digest(*parts: Any) -> str:
    """A 128-bit hex digest of `parts` (the same encoding as `stable_hash`), for fingerprints."""
    return hashlib.blake2b(encode(parts), digest_size=16, person=_PERSON).hexdigest()


def tensor_digest(t: torch.Tensor) -> str:
    """A hex digest of a tensor's dtype, shape and exact bytes (128 bits).

    Equal digests mean bitwise-equal tensors, which is not quite `torch.equal`: 0.0 and
    -0.0 differ, and a NaN matches the same NaN.

    It equals `stable_digest("torch.Tensor", str(t.dtype), tuple(t.shape), raw_bytes)`,
    computed without copying the bytes again. The device is not part of it, so a GPU
    tensor and its CPU copy agree. Bytes are in the machine's order (little-endian on
    every platform reprorl runs on).
    """
    import torch

    cpu = t.detach().to("cpu").resolve_conj().resolve_neg().contiguous()
    raw = cpu.reshape(-1).view(torch.uint8).numpy()  # [numel * itemsize]
    header: list[bytes] = [b"T", _length(4)]
    for part in ("torch.Tensor", str(t.dtype), tuple(t.shape)):
        _encode(part, header)
    h = hashlib.blake2b(digest_size=16, person=_PERSON)
    for piece in header:
        h.update(piece)
    h.update(b"Y" + _length(raw.nbytes))
    h.update(raw.data)
    return h.hexdigest()


# --- seeds ----------------------------------------------------------------------------


def request_seed(
    run_seed: int,
    step: int,
    sample_uid: str | int,
    repeat_index: int,
    turn: int = 0,
    *,
    phase: str = "train",
) -> int:
    """The seed of one sampled sequence, in [0, 2**63), from its identity alone.

    Identity is (phase, run_seed, step, sample_uid, repeat_index, turn): never the
    replica, worker, batch position or time, so any routing gives the same sample.
    The n copies of a prompt (GRPO) differ by `repeat_index` and get different seeds;
    each turn of a multi-turn loop gets its own seed.

    Validation passes `phase="val"`, which keeps its seeds apart from training's even
    when a validation uid equals a training uid, and the training step at which it runs
    (a fixed step instead reuses the same draws every round). `sample_uid`'s type is
    part of the identity: 7 and "7" give different seeds.

    The range is 63 bits so the seed fits a signed int64 (tensors, Arrow, JSON readers).
    """
    ints = {"run_seed": run_seed, "step": step, "repeat_index": repeat_index, "turn": turn}
    for name, value in ints.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"request_seed: {name} must be an int, got {type(value).__name__} {value!r}")
    if isinstance(sample_uid, bool) or not isinstance(sample_uid, (str, int, np.integer)):
        raise TypeError(f"request_seed: sample_uid must be a str or int, got {type(sample_uid).__name__}")
    if not isinstance(phase, str) or not phase:
        raise TypeError(f"request_seed: phase must be a non-empty str, got {phase!r}")
    if repeat_index < 0 or turn < 0:
        raise ValueError(f"request_seed: repeat_index and turn must be >= 0, got {repeat_index} and {turn}")
    h = stable_hash(_REQUEST_SEED_DOMAIN, phase, run_seed, step, sample_uid, repeat_index, turn)
    return h >> 1


def enable_full_determinism(seed: int) -> None:
    """Make this process deterministic: seeded global RNGs, deterministic kernels only.

    Seeds `random`, numpy and torch (all devices); turns on torch's deterministic
    algorithms (errors, not warnings, on a nondeterministic op; without their NaN fill of
    new tensors: `use_deterministic_algorithms`), cuDNN deterministic with benchmarking
    off, TF32 off for matmul and cuDNN; sets `CUBLAS_WORKSPACE_CONFIG`, the NCCL
    variables and the reprorl variables in `os.environ` (NCCL reads its variables when a
    communicator is created, so call this before `init_process_group`); pins torch's
    CPU kernels to their portable build (`pin_cpu_kernels`). Calling it again with the same seed leaves the same state.

    `CUBLAS_WORKSPACE_CONFIG` only works if set before CUDA initialises: if CUDA is
    already up without it, this raises rather than pretend. Put it in the environment
    from the start (`determinism_env` through `ray_runtime_env` does).
    """
    import torch

    current = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if current != CUBLAS_WORKSPACE_CONFIG and torch.cuda.is_initialized():
        raise RuntimeError(
            f"enable_full_determinism: CUDA was initialised with CUBLAS_WORKSPACE_CONFIG="
            f"{current!r}, expected {CUBLAS_WORKSPACE_CONFIG!r}; cuBLAS reads it only at "
            "start-up, so set it in the environment before anything touches CUDA"
        )
    # PYTHONHASHSEED acts only at interpreter start-up: here it reaches child processes
    # (a local Ray started after this call), not this one.
    os.environ.update(determinism_env(seed, full_determinism=True))
    pin_cpu_kernels()

    random.seed(seed)
    np.random.seed(seed % 2**32)  # numpy's legacy seed must fit 32 bits
    torch.manual_seed(seed)  # seeds every CUDA device too
    use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False


def use_deterministic_algorithms(enabled: bool) -> None:
    """torch's deterministic algorithms on (errors, not warnings, on a nondeterministic op)
    or off, as a part of the run sets them; never their NaN fill of new tensors.

    With the algorithms on, torch fills every new tensor (torch.empty) with NaN, so that a
    kernel reading memory it never wrote reads the same bits each run. reprorl's kernels
    write every element they return (the KV cache and the CUDA graphs' buffers start as
    zeros), and that fill was 1,200 kernel launches and 13 ms of GPU time in each update
    micro-batch of 16 on the H200 (bench/train_step.py --profile); the GPU rerun tests
    check the bits without it.
    """
    import torch

    _set_deterministic_algorithms(torch, enabled)
    torch.utils.deterministic.fill_uninitialized_memory = False


def _set_deterministic_algorithms(torch: Any, enabled: bool) -> None:
    """`torch.use_deterministic_algorithms(enabled)` without importing torch._inductor.

    torch's function imports `torch._inductor.config` to set its `deterministic` (for
    torch.compile), which imports dynamo: 1.5 s of one core in every process of a run,
    which compiles nothing. Its other half, the flag every eager op reads, is set here the
    same way; inductor's flag is set where inductor is loaded already, and otherwise left
    to its environment variable, which it reads when it loads (vLLM's compiled graphs)."""
    os.environ["TORCHINDUCTOR_DETERMINISTIC"] = "1" if enabled else "0"
    inductor = sys.modules.get("torch._inductor.config")
    set_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if inductor is not None or set_flag is None:
        torch.use_deterministic_algorithms(enabled, warn_only=False)
        return
    set_flag(enabled, warn_only=False)


# --- the run's environment ------------------------------------------------------------


def determinism_env(seed: int, full_determinism: bool) -> dict[str, str]:
    """Every environment variable every process of the run needs, as strings.

    PYTHONHASHSEED is a fixed "0", not the run seed: results must not depend on it at all
    (seeds come from `stable_hash`), so it is only a safety net for third-party code that
    iterates sets; it must be in [0, 2**32) while run seeds need not be; and one fixed
    value keeps every process of every run alike.
    """
    env = {
        "PYTHONHASHSEED": "0",
        ENV_FULL_DETERMINISM: "1" if full_determinism else "0",
        ENV_SEED: str(int(seed)),
    }
    if full_determinism:
        env["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        env["ATEN_CPU_CAPABILITY"] = ATEN_CPU_CAPABILITY
        env.update(NCCL_DETERMINISM_ENV)
    return env


def pin_cpu_kernels() -> None:
    """Pin torch's CPU kernels to their portable build (`ATEN_CPU_CAPABILITY`), and the
    host-side exp, softmax, log-softmax, sin, cos, pow and sqrt to
    `reprorl.kernels.pinned`'s (torch's differ between an AMD and an Intel machine), in
    this process; raise if torch already runs another build here (it chose at its first
    CPU kernel, and never changes)."""
    import torch

    from reprorl.kernels import pinned

    os.environ["ATEN_CPU_CAPABILITY"] = ATEN_CPU_CAPABILITY
    running = torch.backends.cpu.get_cpu_capability()
    if running.lower() != ATEN_CPU_CAPABILITY:
        raise RuntimeError(
            f"full_determinism: torch already runs its {running} CPU kernels in this process, whose bits differ "
            f"between CPUs; set ATEN_CPU_CAPABILITY={ATEN_CPU_CAPABILITY} in the environment before python starts "
            "(`reprorl train` sets it itself)"
        )
    pinned.pin()


def ray_runtime_env(env: Mapping[str, str], base: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """A Ray `runtime_env` that sets `env` in every actor it is given to.

    `base` (e.g. the user's runtime_env) keeps all its keys; its `env_vars` are merged
    with `env`. A variable that `base` already sets to a different value is a
    `ConfigError` naming it: a silent override would hide a broken run.
    """
    for key, value in env.items():
        if not isinstance(value, str):
            raise TypeError(f"ray_runtime_env: {key} must be a str, got {type(value).__name__} {value!r}")
    runtime_env = dict(base or {})
    env_vars = dict(runtime_env.get("env_vars") or {})
    conflicts = [
        f"{key}={env_vars[key]!r} (reprorl needs {value!r})"
        for key, value in sorted(env.items())
        if key in env_vars and env_vars[key] != value
    ]
    if conflicts:
        raise ConfigError(
            "runtime_env.env_vars conflicts with the determinism environment: " + "; ".join(conflicts)
        )
    env_vars.update(env)
    runtime_env["env_vars"] = env_vars
    return runtime_env


def check_worker_env(
    expected: Mapping[str, str], where: str, environ: Mapping[str, str] = os.environ
) -> None:
    """Raise a `RuntimeError` naming every variable of `expected` missing or different in `environ`.

    Every Ray actor calls this first in `__init__`, so a worker started without the
    run's environment fails at once and says which variables and where.
    """
    problems = []
    for key in sorted(expected):
        if key not in environ:
            problems.append(f"{key} is missing (expected {expected[key]!r})")
        elif environ[key] != expected[key]:
            problems.append(f"{key}={environ[key]!r} (expected {expected[key]!r})")
    if problems:
        raise RuntimeError(
            f"{where}: determinism environment not set: " + "; ".join(problems)
            + " (pass ray_runtime_env(determinism_env(...)) when creating the actor)"
        )


def is_full_determinism(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether this process runs in full-determinism mode (`REPRORL_FULL_DETERMINISM=1`)."""
    value = environ.get(ENV_FULL_DETERMINISM, "0")
    if value not in ("0", "1"):
        raise RuntimeError(f"{ENV_FULL_DETERMINISM}={value!r}: expected '0' or '1'")
    return value == "1"
