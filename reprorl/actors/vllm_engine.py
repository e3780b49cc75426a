"""What every vLLM engine of a run shares, the rollout replicas' (`rollout.backend=vllm`)
and the reward models' (`reward.backend=vllm`): the engine arguments, the determinism mode
and the variables its processes need, the methods mixed into vLLM's worker process
(`VllmWorkerExtension`: the environment check from inside the worker, weight loading), and
the pools' hooks (GPUs per replica, the one-sequence-at-a-time warning).

Nothing here imports vLLM; torch only inside the functions that use it (the agent-loop
workers unpickle replica handles, and Ray then imports the replica's modules there).
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from reprorl.determinism import (
    ENV_FULL_DETERMINISM,
    ENV_SEED,
    check_worker_env,
    enable_full_determinism,
    is_full_determinism,
)
from reprorl.actors.vllm_invariance import invariant_residual_norm

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

# What the worker check covers: the variables reprorl owns. Under VLLM_BATCH_INVARIANT vLLM
# pins its own NCCL_* and CUBLAS_WORKSPACE_CONFIG inside its workers for its own kernels.
WORKER_ENV_KEYS = ("PYTHONHASHSEED", ENV_FULL_DETERMINISM, ENV_SEED, "VLLM_BATCH_INVARIANT",
                   "VLLM_USE_FLASHINFER_SAMPLER")
EXTENSION = "reprorl.actors.vllm_engine.VllmWorkerExtension"
GIB = 1 << 30


def vllm_mode(full_determinism: bool, max_num_seqs: int, *, cuda: bool, enforce_eager: bool = False) -> dict[str, Any]:
    """How a vLLM engine runs for this mode and platform (the determinism report records it).
    Batch invariance runs eagerly: reprorl's fix of vLLM's residual norm (vllm_invariance.py)
    reaches only kernels looked up at call time, not a compiled graph.

    >>> vllm_mode(True, 64, cuda=False)
    {'backend': 'vllm', 'batch_invariant': False, 'max_num_seqs': 1, 'prefix_caching': False, 'enforce_eager': False}
    >>> vllm_mode(True, 64, cuda=True)
    {'backend': 'vllm', 'batch_invariant': True, 'max_num_seqs': 64, 'prefix_caching': False, 'enforce_eager': True}
    """
    batch_invariant = full_determinism and cuda  # VLLM_BATCH_INVARIANT is a CUDA feature
    return {
        "backend": "vllm",
        "batch_invariant": batch_invariant,
        "max_num_seqs": 1 if full_determinism and not batch_invariant else max_num_seqs,
        "prefix_caching": not full_determinism,
        "enforce_eager": enforce_eager or batch_invariant,
    }


def warn_if_made_eager(mode: Mapping[str, Any], requested_eager: bool, where: str) -> None:
    """Log once per engine when `vllm_mode` runs it eagerly though the config asked for graphs."""
    if mode["enforce_eager"] and not requested_eager:
        logger.warning("%s: full_determinism on CUDA runs vLLM eagerly (vllm_enforce_eager=true): reprorl's fix of "
                       "its residual RMSNorm reaches no compiled graph; expect slower steps", where)


SERIALIZED_WARNING = (
    "vLLM without batch invariance (its CPU build has none): with full_determinism "
    "each replica serves ONE sequence at a time (max_num_seqs=1 instead of {n}) "
    "so that no sample shares a forward pass; expect much lower throughput"
)


def replica_gpus(share: float | None = None) -> float:
    """GPUs each vLLM replica asks Ray for: `share` (the run's placement, a fraction when the
    trainer shares one GPU: reprorl/resources/placement.py) when given; else 1 on a cluster
    with GPUs (Ray hides GPUs from an actor that asks for none), else 0.

    From vLLM's docs, and what examples/gpu_arithmetic.yaml's two vLLM replicas beside the
    trainer on one H100 showed: one vLLM engine with tensor_parallel_size=1 runs in the Ray
    actor's own process on the GPU Ray assigned it (`CUDA_VISIBLE_DEVICES`); a Ray GPU fraction does NOT cap its memory,
    so several engines and the trainer fit on one GPU only when each engine's
    `gpu_memory_utilization` (rollout.vllm_gpu_memory_utilization, the share of the
    whole GPU's memory it may take for weights, activations and KV cache) stays within its
    share and the shares add up to less than 1 with the trainer's memory. vLLM's sleep
    mode (`enable_sleep_mode=True`; `sleep(level=1)` offloads the weights to host memory
    and drops the KV cache, `wake_up()` restores them) is what frees the GPU while the
    trainer updates (the replica's sleep/wake_up).
    """
    import ray

    if share is not None:
        return share
    return 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0


def warn_if_serialized(info: Mapping[str, Any], requested_max_num_seqs: int, pool: str) -> None:
    """Log a pool's one warning when its vLLM replicas serve one sequence at a time.

    `info` is one replica's `determinism_info()`: the mode is decided inside the replica,
    where vLLM sees the platform.
    """
    if info["max_num_seqs"] < requested_max_num_seqs:
        logger.warning("%s: %s", pool, SERIALIZED_WARNING.format(n=requested_max_num_seqs))


def weights_to_bytes(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, str, list[int], bytes]]:
    """(name, dtype name, shape, raw bytes) of each tensor: what vLLM's RPC carries intact."""
    import torch

    out = []
    for name, t in named_tensors:
        t = t.detach().to("cpu").contiguous()
        out.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), t.view(torch.uint8).numpy().tobytes()))
    return out


def weights_from_bytes(payload: Iterable[tuple[str, str, list[int], bytes]]) -> list[tuple[str, torch.Tensor]]:
    import torch

    return [
        (name, torch.frombuffer(bytearray(raw), dtype=getattr(torch, dtype)).reshape(shape))
        for name, dtype, shape, raw in payload
    ]


class VllmWorkerExtension:
    """Methods mixed into vLLM's worker class (`worker_extension_cls`): they run in the worker
    process that holds the model, reached through `collective_rpc`."""

    def reprorl_init(self, expected_env: Mapping[str, str], where: str) -> dict[str, Any]:
        """Check the run's environment here, turn on deterministic algorithms where safe; returns `reprorl_info`."""
        import torch

        check_worker_env(expected_env, where=where)
        cuda = torch.cuda.is_available()
        # On CUDA, VLLM_BATCH_INVARIANT sets vLLM's own switches; enable_full_determinism
        # would fight its cuBLAS workspace setting, so only the CPU worker gets ours.
        if is_full_determinism() and not cuda:
            enable_full_determinism(int(os.environ[ENV_SEED]))
        self.reprorl_residual_norm = cuda and invariant_residual_norm()
        if cuda and os.environ.get("VLLM_BATCH_INVARIANT") == "1" and not self.reprorl_residual_norm:
            import vllm

            raise RuntimeError(f"{where}: full_determinism on CUDA needs vLLM's rms_norm_batch_invariant in "
                               f"vllm.model_executor.layers.layernorm, which vllm {vllm.__version__} lacks "
                               "(reprorl is tested with vllm 0.25.1)")
        return self.reprorl_info()

    def reprorl_info(self) -> dict[str, Any]:
        """This worker process: pid, torch's switches, threads and the determinism variables."""
        import torch

        cuda = torch.cuda.is_available()
        return {
            "pid": os.getpid(),
            "device": "cuda" if cuda else "cpu",
            "gpu": torch.cuda.get_device_name() if cuda else None,
            "num_threads": torch.get_num_threads(),
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "dtype": str(self.model_runner.model_config.dtype).removeprefix("torch."),
            "env": {k: os.environ[k] for k in WORKER_ENV_KEYS if k in os.environ},
            # reprorl's fix of vLLM's residual RMSNorm (vllm_invariance.py) is in place
            "invariant_residual_norm": getattr(self, "reprorl_residual_norm", False),
        }

    def reprorl_load_weights(self, payload: list[tuple[str, str, list[int], bytes]]) -> int:
        """Load (HF name, tensor) pairs sent by `weights_to_bytes`; returns how many."""
        weights = weights_from_bytes(payload)
        # reload_weights, not model.load_weights: vLLM's CPU linears repack their weights
        # after loading, and the reload runs that step again.
        self.model_runner.reload_weights(weights_iterator=weights, is_checkpoint_format=True)
        model = self.model_runner.model
        if getattr(self.model_runner.model_config.hf_text_config, "tie_word_embeddings", False):
            # The reload gives a tied lm_head (which gets no weights of its own) its OLD
            # tensor back: tie it to the new embedding again and repack it.
            model.lm_head.weight = model.model.embed_tokens.weight
            model.lm_head.quant_method.process_weights_after_loading(model.lm_head)
        return len(weights)


def engine_kwargs(model_path: str, *, runner: str, max_num_seqs: int, max_num_batched_tokens: int,
                  prefix_caching: bool, cuda: bool, seed: int, max_model_len: int | None = None,
                  gpu_memory_utilization: float = 0.3, kv_cache_gib: float | None = None,
                  enforce_eager: bool = False, dtype: str | None = None) -> dict[str, Any]:
    """vLLM's engine arguments for one of our engines (rollout: runner "generate"; reward: "pooling").
    `dtype`: the run's `model.dtype`, what the trainer computes in; None: the checkpoint's."""
    return dict(
        model=model_path,
        runner=runner,
        # As the built-in engine and the trainer compute (vLLM would otherwise serve a
        # float32 checkpoint in bfloat16 on its CPU build, and a bfloat16 run's in float32).
        dtype=dtype or checkpoint_dtype(model_path),
        seed=seed,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
        max_model_len=max_model_len,
        gpu_memory_utilization=gpu_memory_utilization,
        kv_cache_memory_bytes=None if kv_cache_gib is None else int(kv_cache_gib * GIB),
        enforce_eager=enforce_eager,
        enable_prefix_caching=prefix_caching,
        scheduling_policy="priority",
        logprobs_mode="processed_logprobs",
        worker_extension_cls=EXTENSION,
        enable_sleep_mode=cuda,  # vLLM's CPU worker has no sleep mode
        disable_log_stats=True,
    )


def checkpoint_dtype(model_path: str) -> str:
    """The dtype an HF directory's config.json names ("dtype" or the older "torch_dtype"); "auto" if none."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return str(config.get("dtype") or config.get("torch_dtype") or "auto")


def vllm_env(full_determinism: bool, *, cuda: bool, enforce_eager: bool = False) -> dict[str, str]:
    """The variables vLLM's processes need on top of the run's.

    On CUDA: batch invariance in determinism mode, and vLLM's own top-k/top-p sampler
    (PyTorch ops with each request's seeded generator) instead of FlashInfer's, which draws
    from FlashInfer's own generator and is not installed everywhere vLLM is (vLLM's sampler
    imports it unless told not to).

    On the CPU: `VLLM_ENABLE_V1_MULTIPROCESSING=0`. vLLM's CPU build otherwise gives its one
    worker a process of its own, for its OpenMP set-up, which wants a process that has not
    started its threads yet. With it, the rollout's async engine runs the worker inside its
    engine-core process (which always runs apart from the actor, and is such a process), and
    the reward's `LLM` runs core and worker inside the actor, which is one too (it computes
    nothing before). Each process saved cost 10-12 s of a core at start on 2 cores (vLLM
    and torch imported again); the bits are the same (`reprorl compare` on a vLLM run).
    Eager (`enforce_eager`) on the CPU also sets `TORCHDYNAMO_DISABLE=1`: no model graph is
    compiled then, but vLLM's sampler still compiled its token-rank count (an integer
    count, the same eagerly) with inductor in every engine, a C++ build and CPU probes that
    took about 4 s of each rollout engine's start.

    >>> vllm_env(True, cuda=True)
    {'VLLM_USE_FLASHINFER_SAMPLER': '0', 'VLLM_BATCH_INVARIANT': '1'}
    >>> vllm_env(True, cuda=False)
    {'VLLM_ENABLE_V1_MULTIPROCESSING': '0'}
    >>> vllm_env(True, cuda=False, enforce_eager=True)
    {'VLLM_ENABLE_V1_MULTIPROCESSING': '0', 'TORCHDYNAMO_DISABLE': '1'}
    """
    if not cuda:
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
        if enforce_eager:
            env["TORCHDYNAMO_DISABLE"] = "1"
        return env
    env = {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    if full_determinism:
        env["VLLM_BATCH_INVARIANT"] = "1"
    return env


def vllm_part_info(worker: Mapping[str, Any], mode: Mapping[str, Any]) -> dict[str, Any]:
    """A vLLM engine's `determinism_info`: this process's, with the mode (`vllm_mode`) and
    the device, dtype and threads measured in vLLM's worker (`worker`: its `reprorl_info`)."""
    from reprorl.determinism_report import model_part_info

    info = model_part_info(backend="vllm", batch_invariant=mode["batch_invariant"], dtype=worker["dtype"],
                           num_threads=worker["num_threads"])
    info.update(device=worker["device"], max_num_seqs=mode["max_num_seqs"], prefix_caching=mode["prefix_caching"],
                enforce_eager=mode["enforce_eager"], worker=dict(worker))
    if worker["gpu"] is not None:
        info["gpu"] = worker["gpu"]
    return info
