"""reprorl's built-in inference engine: continuous batching on the CPU or a CUDA GPU.

`Engine` serves `generate` calls from many asyncio tasks. A background step loop batches
them: which sequences run in each step, and what their new tokens do to them, is the
`Scheduler`'s (`scheduler.py`: admission by priority, prefill chunking, prefix sharing,
the KV cache slots); the engine runs the planned steps on the model and answers the
callers. On a GPU the KV cache is allocated once, from a share of the free memory
(`gpu_memory_utilization`). The options are `EngineOptions`, given as `Engine`'s keywords.

On a GPU, decode-only steps are replayed from CUDA graphs (`cuda_graphs.py`) and sampling
runs on the device for the whole batch (`sampling.sample_on_device`; one fused Triton launch
for the rows that sample from the full distribution): the host ships the step's uniforms
and parameters in one copy and reads the new tokens and log-probs back in one copy. With
`lookahead`, a decode step is launched from the step before's tokens still on the device
while those are copied back (`lookahead.py`).

The forward pass is the model's own `forward_packed` (`reprorl.models.transformer`, every
op from `reprorl.kernels`): all decode tokens of a step share one batched attention
call, prefill chunks another, and in batch-invariant mode both give the same bits as the
trainer's padded forward (tested).

Determinism (docs/design.md): a sample is a pure function of (weights, prompt ids, sampling
params, seed). The engine keeps it by (1) giving each request a private generator seeded
from its `seed` and drawn once per token (`sampling.py`), and (2) with
`batch_invariant=True`, running the model on batch-invariant kernels (`reprorl.kernels`),
with which a token's logits do not depend on what else is packed with it, nor on how its
prompt was cut into prefill chunks, nor on the thread count (checked on this machine when
the engine is made: `kernels.verify_batch_invariance`). Which requests share a step, and
when, then only changes speed. With `batch_invariant=False` the fastest kernels run and
results may differ in the last bits between batch compositions and thread counts.

Threading. The step loop is an asyncio task on the caller's event loop, and each step
runs on that same thread: requests, aborts and weight updates that arrive during a step
are taken in between steps (the step loop yields after each one), which is when the
scheduler could use them anyway. One thread on purpose: torch's CPU parallelism is
OpenMP (libgomp), which keeps a team of worker threads per calling thread; once two
threads of a process have run parallel ops (the one that loaded the model, and a step
thread), the teams oversubscribe the cores and libgomp throttles its spin-waits, so
every op pays a futex wake-up (a decode step then takes 1.2-2x as long: docs/performance.md).
A Ray async actor runs its constructor and its methods on one event-loop thread,
so a replica's loading, weight updates and steps all share one team. `num_threads` is
set for the duration of each step and restored after.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from collections.abc import Iterable

import torch
from torch import Tensor

from reprorl.kernels import select_kernels, verify_batch_invariance
from reprorl.rollout.cuda_graphs import DecodeGraphs
from reprorl.rollout.engine_options import EngineOptions, gpu_cache_shape
from reprorl.rollout.lookahead import Launched, Lookahead, can_launch
from reprorl.rollout.request import GenerateOutput, SamplingParams, check_prompt
from reprorl.rollout.sampling import (
    any_filter,
    join_tokens_and_log_probs,
    make_generator,
    pack_step_params,
    sample_batch,
    sample_on_device,
)
from reprorl.rollout.scheduler import Chunk, Scheduler, Sequence, SlotPool, num_followers, samplers

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching generation on a `reprorl.models` `CausalLM` (see the module doc).
    Keywords: the fields of `EngineOptions` (`batch_invariant` and `eos_token_id` required).

    `scheduler` holds the requests in flight; `lookahead` (from the options) may be switched
    between steps, and so may `scheduler.prefix_sharing` and `scheduler.eos_token_ids`.
    """

    def __init__(self, model: torch.nn.Module, **options):
        if not hasattr(model, "logits") or not hasattr(getattr(model, "model", None), "layers"):
            raise TypeError(f"Engine needs a reprorl.models.transformer.CausalLM, got {type(model).__name__}")
        self.options = opts = EngineOptions(**options)
        self.model = model.eval()
        self.args = model.args
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        # Derived from the options, the model and the machine, once.
        rope_len = model.model.rope_cos.shape[0]
        self.max_model_len = opts.max_model_len or min(rope_len, 4096)
        if self.max_model_len > rope_len:
            raise ValueError(f"max_model_len={self.max_model_len}: the model has rope positions for {rope_len}")
        self.num_threads = opts.num_threads or torch.get_num_threads()
        self.cuda_graphs = opts.cuda_graphs and self.device.type == "cuda"
        self.lookahead = opts.lookahead
        self.kernels = select_kernels(self.device, opts.batch_invariant)
        model.kernels = self.kernels
        verify_batch_invariance(self.kernels, self.args, self.dtype, self.device)

        self.scheduler = Scheduler(self.args, self.dtype, self.device, max_num_seqs=opts.max_num_seqs,
                                   max_num_batched_tokens=opts.max_num_batched_tokens,
                                   starvation_steps=opts.starvation_steps, prefix_sharing=opts.prefix_sharing,
                                   eos_token_ids=opts.eos_token_ids)
        self.weight_version = 0
        self.asleep = False
        self._graphs: DecodeGraphs | None = None  # over the GPU cache, when cuda_graphs
        self.graph_error: str | None = None  # why graph capture failed, if it did (then eager)
        self._ahead_path = Lookahead(self.device, self._sample_on_device)
        self._stats = {"graph_steps": 0, "lookahead_steps": 0, "gpu_busy_s": 0.0, "step_wall_s": 0.0}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._device_sampling = self.device.type == "cuda"  # else sample_batch: the host path's bits
        if self.device.type == "cuda":
            self._init_gpu()

    def _init_gpu(self) -> None:
        from reprorl.kernels.gpu.attention import batched_attention as triton_attention
        from reprorl.kernels.gpu.sampling import row_cumsum, sample_rows

        # In both modes: the fused sampler's log-probs are the Triton log-softmax's bits.
        self._cumsum, self._full_sampler = row_cumsum, sample_rows
        # Graph replays need an attention that reads nothing on the host: the Triton one.
        self._graph_attention = self.kernels.batched_attention if self.options.batch_invariant else triton_attention
        self._make_gpu_pool()

    def _make_gpu_pool(self) -> None:
        opts = self.options
        slots, capacity = gpu_cache_shape(self.args, self.dtype, self.device, opts.max_num_seqs,
                                          self.max_model_len, opts.gpu_memory_utilization)
        self.scheduler.kv = SlotPool(self.args, slots, self.dtype, self.device, capacity)
        if self.cuda_graphs:
            self._graphs = DecodeGraphs(self.model, self.scheduler.kv.cache, self._graph_attention, slots)

    @classmethod
    def from_path(cls, path: str, *, batch_invariant: bool, dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu", **kwargs) -> Engine:
        """Load an HF model directory onto `device` ("cuda": the GPU engine); eos comes from
        its generation/model config unless given."""
        from reprorl.models.hf_io import eos_ids_from_dir, load_model

        model, _ = load_model(path, kind="causal_lm", dtype=dtype)
        model = model.to(device)
        if "eos_token_id" not in kwargs:
            kwargs["eos_token_id"] = eos_ids_from_dir(str(path))
        return cls(model, batch_invariant=batch_invariant, **kwargs)

    # ---- public API -------------------------------------------------------------------

    async def generate(
        self,
        request_id: str,
        prompt_ids: list[int],
        sampling_params: SamplingParams,
        seed: int,
        priority: int = 0,
    ) -> GenerateOutput:
        """Generate for one request; concurrent calls are batched by the step loop."""
        self._ensure_loop()
        if self.asleep:
            raise RuntimeError(f"generate({request_id!r}): the engine is asleep; call wake_up() first")
        if request_id in self.scheduler.by_id:
            raise ValueError(f"generate: request_id {request_id!r} is already in flight")
        check_prompt(request_id, prompt_ids, self.max_model_len, self.args.vocab_size)
        need = min(len(prompt_ids) + sampling_params.max_tokens, self.max_model_len)
        kv = self.scheduler.kv
        if kv is not None and kv.fixed and need > kv.cache.capacity:
            raise ValueError(
                f"generate({request_id!r}): prompt + max_tokens = {need} tokens; a KV cache slot holds "
                f"{kv.cache.capacity} (gpu_memory_utilization={self.options.gpu_memory_utilization}); raise it, "
                "or lower max_tokens or max_model_len"
            )
        seq = Sequence(request_id=request_id, prompt_ids=list(prompt_ids), params=sampling_params,
                       generator=make_generator(seed), priority=priority, future=self._loop.create_future(),
                       capacity=need)
        self.scheduler.add(seq)
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the caller gave up: stop spending steps on it
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight (its generate returns finish_reason "abort"); False if unknown."""
        seq = self.scheduler.by_id.get(request_id)
        if seq is None:
            return False
        seq.aborted = True
        if self._wakeup is not None:
            self._wakeup.set()
        return True

    async def update_weights(self, named_tensors: Iterable[tuple[str, Tensor]], version: int) -> None:
        """Copy new weights in (HF names; a subset is fine), between steps.

        `version` must exceed the current `weight_version`. Requests in flight continue
        with the new weights (their `weight_version` stays the one they started with); the
        trainer updates between rollouts. The tensors are streamed: an unknown name or a
        wrong shape raises after the ones before it were copied, and the version stays.
        """
        if version <= self.weight_version:
            raise ValueError(
                f"update_weights: version {version} must be greater than the current {self.weight_version}"
            )
        async with self._lock():
            params = dict(self.model.named_parameters())
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if name not in params:
                        raise KeyError(f"update_weights: the model has no parameter {name!r}")
                    got, expected = tuple(tensor.shape), tuple(params[name].shape)
                    if got != expected:
                        raise ValueError(f"update_weights: {name!r} has shape {got}, expected {expected}")
                    params[name].copy_(tensor)
            self.weight_version = version

    async def sleep(self, keep_weights: bool = False) -> None:
        """Free the KV store while idle and, on an accelerator, move the weights to the host
        unless `keep_weights` (they then stay where a device-to-device push can reach them)."""
        async with self._lock():
            if self.scheduler.by_id:
                raise RuntimeError(f"sleep: {len(self.scheduler.by_id)} requests in flight; wait for or abort them first")
            self.scheduler.kv = self._graphs = None  # graphs hold the cache's and the weights' addresses
            if self.device.type != "cpu":
                if not keep_weights:
                    self.model.to("cpu")
                getattr(torch, self.device.type).empty_cache()  # the cache's memory back to the device, for the trainer
            self.asleep = True

    async def wake_up(self) -> None:
        """Undo `sleep` (the KV store is rebuilt: on a GPU now, else on the next admission)."""
        async with self._lock():
            if self.device.type != "cpu":
                self.model.to(self.device)
            if self.device.type == "cuda" and self.scheduler.kv is None:
                self._make_gpu_pool()
            self.asleep = False

    def stats(self) -> dict:
        """Counters: running/waiting requests, steps, tokens generated, weight version..."""
        kv = self.scheduler.kv
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "weight_version": self.weight_version,
            "asleep": self.asleep,
            "kv_capacity": kv.cache.capacity if kv is not None else 0,
            "kv_slots": kv.num_slots if kv is not None else 0,
            "graph_error": self.graph_error,
            **self.scheduler.stats,
            **self._stats,
        }

    def shutdown(self) -> None:
        """Stop the step loop."""
        if self._task is not None:
            self._task.cancel()

    # ---- the step loop (event loop side) ----------------------------------------------

    def _ensure_loop(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is loop and self._task is not None and not self._task.done():
            return
        # First call, or a new event loop (e.g. a second asyncio.run): requests left from a
        # closed loop can no longer be answered, so they are dropped.
        self._loop = loop
        self._ahead_path.ahead = None
        self.scheduler.drop_all()
        self._wakeup = asyncio.Event()
        self._step_lock = asyncio.Lock()
        self._task = loop.create_task(self._step_loop())

    def _lock(self) -> asyncio.Lock:
        self._ensure_loop()
        return self._step_lock

    async def _step_loop(self) -> None:
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self.scheduler.by_id or self._ahead_path.ahead is not None:
                async with self._step_lock:
                    wall = time.perf_counter()
                    try:
                        step = self._step()
                    except Exception as exc:  # an engine or model error fails every request in flight
                        self._ahead_path.ahead = None
                        for seq in self.scheduler.drop_all():
                            if not seq.future.done():
                                seq.future.set_exception(exc)
                        break
                    if step is None:
                        break
                    self._apply(*step)
                    self._stats["step_wall_s"] += time.perf_counter() - wall
                # Let new requests, aborts and weight updates in. Twice: a call that arrived
                # from another thread during the step (a Ray actor call) becomes a task on the
                # first pass and reaches generate() on the second, in time for the next step.
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    def _step(self) -> tuple[list[Chunk], list[int], list[float]] | None:
        """Run one step: read the one launched ahead, else plan one and run it.
        -> (chunks, new tokens, their log-probs); None when there is nothing to run."""
        if self._ahead_path.ahead is not None:  # launched last step: read it (the next one may go first)
            launched, self._ahead_path.ahead = self._ahead_path.ahead, None
            return launched.chunks, *self._read_launched(launched)
        for seq in self.scheduler.reap_aborted():
            self._answer(seq, "abort")
        chunks = self.scheduler.schedule(self.weight_version)
        if not chunks:
            return None
        if self.lookahead and can_launch(chunks, self._graphs):
            launched = self._ahead_path.launch(self._graphs, chunks)
            self._stats["graph_steps"] += 1
            return chunks, *self._read_launched(launched)
        return chunks, *self._timed_step(chunks)

    def _apply(self, chunks: list[Chunk], tokens: list[int], log_probs: list[float]) -> None:
        """Record the step's new tokens and answer the requests that are done."""
        for seq, reason in self.scheduler.apply(chunks, tokens, log_probs):
            self._answer(seq, reason)

    def _answer(self, seq: Sequence, reason: str) -> None:
        if not seq.future.done():  # the caller may have been cancelled
            seq.future.set_result(
                GenerateOutput(
                    request_id=seq.request_id,
                    token_ids=seq.output_ids,
                    log_probs=seq.log_probs if seq.params.logprobs else None,
                    finish_reason=reason,
                    num_prompt_tokens=len(seq.prompt_ids),
                    weight_version=seq.weight_version,
                )
            )

    # ---- one step ------------------------------------------------------------------------

    def _timed_step(self, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        """`_run_step`; on a GPU also adds its device span to `gpu_busy_s`: CUDA events from
        before its first launch to after its one sync. The span counts launch gaps inside the
        step as busy (an upper bound; a graph replay has none), so `gpu_busy_s / step_wall_s`
        (the step loop's time, scheduling included) shows the host time around the steps."""
        if self.device.type != "cuda":
            return self._run_step(chunks)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self._run_step(chunks)
        end.record()
        end.synchronize()
        self._stats["gpu_busy_s"] += start.elapsed_time(end) / 1e3
        return out

    def _run_step(self, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        """One forward pass over the packed chunks, then sampling at their last tokens."""
        caller_threads = torch.get_num_threads()
        if caller_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            return self._forward_and_sample(chunks)
        finally:
            if caller_threads != self.num_threads:
                torch.set_num_threads(caller_threads)

    def _read_launched(self, launched: Launched) -> tuple[list[int], list[float]]:
        """A step launched on the lookahead path, read back; the step after it is launched
        first when it can go ahead (`lookahead.py`). Adds the device span to `gpu_busy_s`."""
        behind = None
        if not self.scheduler.waiting:  # admissions come first: the chain ends and the next step is planned
            behind = self._ahead_path.launch_after(launched, self._graphs)
            if behind is not None:
                self._stats["graph_steps"] += 1
                self._stats["lookahead_steps"] += 1
        tokens, log_probs, busy_s = self._ahead_path.read(launched, behind)
        self._stats["gpu_busy_s"] += busy_s
        return tokens, log_probs

    def _forward_and_sample(self, chunks: list[Chunk]) -> tuple[list[int], list[float]]:
        sampled = samplers(chunks)
        with torch.inference_mode():
            logits = self._logits(chunks)  # [S, V]
            if logits is None:
                return [], []
            self._copy_shared_prefixes(chunks)
            if self._device_sampling:
                return join_tokens_and_log_probs(*self._sample_on_device(logits, sampled))
            params = [s.params for s in sampled]
            uniforms = [s.next_uniform() for s in sampled]
            tokens, log_probs = sample_batch(logits, params, uniforms, self.kernels.log_softmax)
            return tokens.tolist(), log_probs.tolist()

    def _sample_on_device(self, logits: Tensor, seqs: list[Sequence]) -> tuple[Tensor, Tensor]:
        """Each sequence's next token from its row of `logits` [B, V], and its log-prob, both
        [B] and left on the device: the step's params and uniforms go there in one copy."""
        params = [s.params for s in seqs]
        uniforms = [s.next_uniform() for s in seqs]
        packed = pack_step_params(params, uniforms, logits.shape[1]).pin_memory().to(self.device, non_blocking=True)
        return sample_on_device(logits, packed, any_filter(params), self.kernels.softmax, self._cumsum,
                                self._full_sampler)

    def _logits(self, chunks: list[Chunk]) -> Tensor | None:
        """Logits [S, V] at each sampling row (a prefix leader's row once more per follower):
        from a CUDA graph when every chunk is a decode token, else the eager packed forward."""
        graphs = self._graphs
        if graphs is not None and len(chunks) <= graphs.max_batch and all(c.is_decode for c in chunks):
            if graphs.bucket(len(chunks)) not in graphs.graphs:
                try:  # a capture that fails leaves the engine eager, and says why (stats, log)
                    graphs.capture(graphs.bucket(len(chunks)))
                except Exception as e:
                    self.graph_error = f"{type(e).__name__}: {e}"
                    logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", self.graph_error)
                    self._graphs = None
                    torch.cuda.synchronize()
            if self._graphs is not None:
                self._stats["graph_steps"] += 1
                return graphs.run([c.token_ids[0] for c in chunks], [c.slot for c in chunks],
                                  [c.start for c in chunks])
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
        rows = [end - 1 for c, end in zip(chunks, ends) if c.sample for _ in range(1 + num_followers(c))]
        hidden = self._forward(chunks)  # [N, H]
        if not rows:
            return None
        if rows != list(range(hidden.shape[0])):  # prefill chunks: only their last tokens sample
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.logits(hidden)

    def _copy_shared_prefixes(self, chunks: list[Chunk]) -> None:
        """Give each follower of a leader whose prompt completed this step a copy of its keys/values."""
        self.scheduler.kv.cache.copy_prefixes([(c.slot, [f.slot for f in c.seq.followers], len(c.seq.prompt_ids))
                                               for c in chunks if num_followers(c)])

    def _forward(self, chunks: list[Chunk]) -> Tensor:
        """The model's `forward_packed` over the chunks, each in its sequence's slot. -> hidden [N, H]."""
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)  # [N]
        return self.model.forward_packed(ids, [len(c.token_ids) for c in chunks], self.scheduler.kv.cache,
                                         [c.slot for c in chunks])
