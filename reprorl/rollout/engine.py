"""reprorl's built-in inference engine: continuous batching on the CPU or a CUDA GPU.

`Engine` serves `generate` calls from many asyncio tasks. A background step loop batches
them: each step packs one decode token for every running sequence, then prefill chunks
of sequences still reading their prompt, then prompts of newly admitted requests, within
`max_num_seqs` sequences and `max_num_batched_tokens` tokens. Requests join and leave
between steps. Keys and values live in one `KVCache` with a slot per running sequence
(`_SlotPool`), freed for the next request when a sequence finishes; on a GPU it is
allocated once, from a share of the free memory (`gpu_memory_utilization`).

Prefix sharing: requests that bring the same prompt while it is being prefilled (the n
samples of a GRPO prompt, sent as n generate calls with their own seeds) are admitted as
followers of the first: the prompt is prefilled once, its keys/values are copied into
each follower's slot (a device copy, not shared blocks) and each follower samples its
first token from the leader's last logits with its own uniform. In batch-invariant mode
that is the same bits as n prefills (tested), so it changes only the work.

On a GPU, decode-only steps are replayed from CUDA graphs (`cuda_graphs.py`) and sampling
runs on the device for the whole batch (`sampling.sample_on_device`; one fused Triton launch
for the rows that sample from the full distribution): the host ships the step's uniforms
and parameters in one copy and reads the new tokens and log-probs back in one copy.

The forward pass is the model's own `forward_packed` (`reprorl.models.transformer`, every
op from `reprorl.kernels`): all decode tokens of a step share one batched attention
call, prefill chunks another, and in batch-invariant mode both give the same bits as the
trainer's padded forward (tested).

Lookahead (`lookahead=True`, GPU): the host's work between two steps (reading the tokens,
finishing sequences, planning the next step) leaves the GPU idle. While every running
sequence decodes and none waits for admission, the engine launches step t+1's graph from
step t's tokens still on the device, then copies step t's tokens to the host on a side
stream while the GPU runs t+1. It assumes no sequence stops at step t (one that reaches
max_tokens or its capacity is known ahead and ends the chain). A sequence that did stop has
run one extra decode row: its token is dropped when step t+1 is read, its KV write lands past
its end in a slot it no longer holds (the next holder writes every position before it
reads it), and the uniform it drew is one of its own generator's, which no one draws again;
every other sequence's step t+1 is the row it would have had anyway (same graph, same
inputs, its own next uniform), so the bits do not change.

Determinism (DESIGN.md): a sample is a pure function of (weights, prompt ids, sampling
params, seed). The engine keeps it by (1) giving each request a private generator seeded
from its `seed` and drawn once per token (`sampling.py`), and (2) with
`batch_invariant=True`, running the model on batch-invariant kernels (`reprorl.kernels`),
with which a token's logits do not depend on what else is packed with it, nor on how its
prompt was cut into prefill chunks, nor on the thread count (checked on this machine when
the engine is made: `kernels.verify_batch_invariance`). Which requests share a step, and
when, then only changes speed. With `batch_invariant=False` the fastest kernels run and
results may differ in the last bits between batch compositions and thread counts.

Scheduling. Waiting requests are admitted in order of (priority, arrival): lower
priority value first, then first come first served. A request that has waited more than
`starvation_steps` steps goes ahead of every priority (in arrival order), so a stream of
high-priority work cannot starve it. Running sequences are never preempted: each decodes
one token every step (`max_num_batched_tokens >= max_num_seqs` guarantees room), and
prefill chunks go to admitted sequences in admission order before new admissions.

Threading. The step loop is an asyncio task on the caller's event loop, and each step
runs on that same thread: requests, aborts and weight updates that arrive during a step
are taken in between steps (the step loop yields after each one), which is when the
scheduler could use them anyway. One thread on purpose: torch's CPU parallelism is
OpenMP (libgomp), which keeps a team of worker threads per calling thread; once two
threads of a process have run parallel ops (the one that loaded the model, and a step
thread), the teams oversubscribe the cores and libgomp throttles its spin-waits, so
every op pays a futex wake-up. Measured on this 2-core machine: a batch-64 decode step
took 23.4 ms instead of 19.0 (width 512) and 6.6 ms instead of 3.1 (tiny) on a second
thread. A Ray async actor runs its constructor and its methods on one event-loop thread,
so a replica's loading, weight updates and steps all share one team. `num_threads` is
set for the duration of each step and restored after.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import os
import time
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reprorl.kernels import KEY_BLOCK, select_kernels, verify_batch_invariance
from reprorl.models.transformer import KVCache
from reprorl.rollout.sampling import (
    SamplingParams,
    any_filter,
    draw_uniforms,
    join_tokens_and_log_probs,
    make_generator,
    pack_step_params,
    sample_batch,
    sample_on_device,
)

logger = logging.getLogger(__name__)

# Uniforms drawn per call from a request's generator (one per token, see sampling.py).
_DRAW_BLOCK = 32


@dataclass
class GenerateOutput:
    """One finished request."""

    request_id: str
    token_ids: list[int]
    """Generated tokens (a stop/eos token that ended generation is included)."""
    log_probs: list[float] | None
    """Per generated token, `log_softmax(logits / T)` at it (see sampling.py); None if not asked."""
    finish_reason: str
    """"stop" (eos or a stop token), "length" (max_tokens or the context is full) or "abort"."""
    num_prompt_tokens: int
    weight_version: int
    """The weight version of the engine when the request's first forward pass ran."""


@dataclass(eq=False)
class _Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    priority: int
    arrival: int  # admission tie-break
    arrival_step: int  # starvation clock
    future: asyncio.Future
    capacity: int  # prompt + generated tokens that fit (max_tokens, max_model_len)
    slot: int | None = None  # its row of the KV store while running
    num_computed: int = 0  # tokens whose keys/values are in the KV store
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_version: int = -1
    aborted: bool = False
    uniforms: list[float] = field(default_factory=list)  # drawn, not yet used (reversed)
    # Prefix sharing: a follower waits for its leader (same prompt) to prefill, then takes a
    # copy of the leader's keys/values and samples its first token from the leader's logits.
    leader: _Sequence | None = None
    followers: list[_Sequence] = field(default_factory=list)

    def next_uniform(self) -> float:
        """The draw of the next token: the generator's next value."""
        if not self.uniforms:
            self.uniforms = draw_uniforms(self.generator, _DRAW_BLOCK)[::-1]
        return self.uniforms.pop()


@dataclass(slots=True)  # not frozen: a step makes one per sequence, and frozen init costs 3x
class _Chunk:
    """Tokens of one sequence fed in one step (never changed after); `sample` if its last
    token yields a new one."""

    seq: _Sequence
    slot: int
    token_ids: list[int]
    start: int  # position of token_ids[0]
    sample: bool

    @property
    def is_decode(self) -> bool:
        return self.start >= len(self.seq.prompt_ids)


@dataclass(slots=True)
class _Launched:
    """A graphed decode step on its way (lookahead): its chunks, its new tokens on the device,
    tokens and log-prob bits joined for the one copy back, and CUDA events around it."""

    chunks: list[_Chunk]
    tokens: Tensor
    joined: Tensor
    start: torch.cuda.Event
    end: torch.cuda.Event


class _SlotPool:
    """The KV cache of every running sequence (the model's `KVCache`, one slot per sequence)
    and which slots are free. Slots are taken lowest first, so running ones stay dense and
    a decode step reads them as one view.

    Slots rather than pages: every attention kernel reads a sequence's keys as one range of
    its slot (`batched_attention`), so slots need no new kernel, and a decode step reads the
    running slots as one view. The cost is memory: a slot holds `capacity` tokens whatever
    its sequence uses. On the CPU (`capacity` None) the cache starts at one `KEY_BLOCK`
    and grows (copying) to the longest sequence admitted. On a GPU it is allocated once, at
    a fixed capacity, with one spare slot past `num_slots` for the padding rows of CUDA
    graphs (`cuda_graphs.py`); admission waits while no slot is free."""

    def __init__(self, args, num_slots: int, dtype: torch.dtype, device: torch.device, capacity: int | None = None):
        self.fixed = capacity is not None
        spare = 1 if self.fixed else 0
        self.cache = KVCache.for_model(args, capacity or KEY_BLOCK, num_slots + spare, dtype, device)
        self.num_slots = num_slots
        self.free = list(range(num_slots))  # a heap

    def alloc(self, capacity: int) -> int:
        if not self.fixed:
            self.cache.grow(-(-capacity // KEY_BLOCK) * KEY_BLOCK)
        slot = heapq.heappop(self.free)
        self.cache.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)


def gpu_cache_shape(args, dtype: torch.dtype, device: torch.device, max_num_seqs: int, max_model_len: int,
                    gpu_memory_utilization: float) -> tuple[int, int]:
    """(slots, tokens per slot) of a GPU KV cache within `gpu_memory_utilization` of the
    device's free memory: max_num_seqs slots of max_model_len tokens if they fit, else as
    many whole slots as fit (admission then waits for a free one), else one shorter slot.
    Raises ValueError when not even one KEY_BLOCK fits."""
    per_token = 2 * args.num_hidden_layers * args.num_key_value_heads * args.head_dim * dtype.itemsize
    free, _ = torch.cuda.mem_get_info(device)
    budget = int(gpu_memory_utilization * free)
    capacity = -(-max_model_len // KEY_BLOCK) * KEY_BLOCK
    slots = min(max_num_seqs, budget // (capacity * per_token) - 1)  # - 1: the spare slot
    if slots >= 1:
        return slots, capacity
    capacity = budget // (2 * per_token) // KEY_BLOCK * KEY_BLOCK
    if capacity < KEY_BLOCK:
        raise ValueError(
            f"gpu_memory_utilization={gpu_memory_utilization}: {budget / 2**20:.0f} MiB of the GPU's "
            f"{free / 2**20:.0f} MiB free hold no KV cache slot of {KEY_BLOCK} tokens ({per_token} bytes a token); "
            "raise gpu_memory_utilization or free GPU memory"
        )
    return 1, capacity


def check_prompt(request_id: str, prompt_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """Refuse a prompt no engine can serve: empty, no room for one new token, or an id
    outside the vocabulary (ValueError naming the request). Every backend's generate calls it."""
    n = len(prompt_ids)
    if n == 0:
        raise ValueError(f"generate({request_id!r}): empty prompt")
    if n >= max_model_len:
        raise ValueError(f"generate({request_id!r}): prompt of {n} tokens leaves no room in max_model_len={max_model_len}")
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:
        raise ValueError(f"generate({request_id!r}): prompt token ids must lie in [0, {vocab_size})")


class Engine:
    """Continuous-batching generation on a `reprorl.models` `CausalLM` (see the module doc).

    `batch_invariant`: run the model on its device's batch-invariant kernels (the determinism
    contract; `reprorl.kernels.select_kernels`) or on the fastest ones. `eos_token_id`: one id, several, or None. `max_model_len`: prompt
    plus generation, at most the model's rope table (default min(that, 4096)).
    `num_threads`: torch threads of a step (default: the constructing thread's count).

    On a GPU: the KV cache is allocated when the engine is made (and again on wake_up),
    within `gpu_memory_utilization` of the free device memory (`gpu_cache_shape`);
    `cuda_graphs` replays decode steps from CUDA graphs (`cuda_graphs.py`; False: eager);
    sampling runs on the device (`sampling.sample_on_device`). Everywhere:
    `prefix_sharing` prefills a prompt once for the requests that bring it together (the n
    samples of a GRPO prompt) and copies its keys/values into the others' slots.
    `lookahead` (GPU, with graphs): while every running
    sequence decodes and none waits, launch step t+1 from step t's tokens on the device before
    copying them to the host (see "Lookahead" in the module doc).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        batch_invariant: bool,
        eos_token_id: int | Iterable[int] | None,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = 2048,
        max_model_len: int | None = None,
        starvation_steps: int = 256,
        num_threads: int | None = None,
        gpu_memory_utilization: float = 0.5,
        cuda_graphs: bool = True,
        prefix_sharing: bool = True,
        lookahead: bool = True,
    ):
        if not hasattr(model, "logits") or not hasattr(getattr(model, "model", None), "layers"):
            raise TypeError(f"Engine needs a reprorl.models.transformer.CausalLM, got {type(model).__name__}")
        if max_num_seqs < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}: expected >= 1")
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens={max_num_batched_tokens}: expected >= max_num_seqs "
                f"({max_num_seqs}), so every running sequence can decode each step"
            )
        self.model = model.eval()
        self.args = model.args
        self.batch_invariant = batch_invariant
        if eos_token_id is None:
            self.eos_token_ids: frozenset[int] = frozenset()
        elif isinstance(eos_token_id, int):
            self.eos_token_ids = frozenset([eos_token_id])
        else:
            self.eos_token_ids = frozenset(eos_token_id)
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        rope_len = model.model.rope_cos.shape[0]
        self.max_model_len = max_model_len or min(rope_len, 4096)
        if self.max_model_len > rope_len:
            raise ValueError(f"max_model_len={self.max_model_len}: the model has rope positions for {rope_len}")
        self.starvation_steps = starvation_steps
        if not 0 < gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={gpu_memory_utilization}: expected a share in (0, 1]")
        self.gpu_memory_utilization = gpu_memory_utilization
        self.prefix_sharing = prefix_sharing
        self.lookahead = lookahead
        self._ahead: _Launched | None = None  # a decode step launched from the last one's device tokens
        self._last_end: torch.cuda.Event | None = None  # the end of the last lookahead-path step
        self._copy_stream: torch.cuda.Stream | None = None
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kernels = select_kernels(self.device, batch_invariant)
        model.kernels = self.kernels
        verify_batch_invariance(self.kernels, self.args, self.dtype, self.device)

        self.weight_version = 0
        self.asleep = False
        self._kv: _SlotPool | None = None  # made on first admission (GPU: now), dropped by sleep()
        self._graphs = None  # DecodeGraphs over the GPU cache, when cuda_graphs
        self.graph_error: str | None = None  # why graph capture failed, if it did (then eager)
        self.cuda_graphs = cuda_graphs and self.device.type == "cuda"
        self._sharing: dict[tuple[int, ...], _Sequence] = {}  # prompt -> leader still prefilling it
        self._waiting: list[tuple[int, int, _Sequence]] = []  # heap of (priority, arrival, seq)
        self._running: list[_Sequence] = []  # admission order
        self._by_id: dict[str, _Sequence] = {}
        self._arrivals = itertools.count()
        self._stats = {"steps": 0, "tokens_generated": 0, "prompt_tokens": 0, "finished": 0, "aborted": 0,
                       "prefix_shared": 0, "graph_steps": 0, "lookahead_steps": 0, "gpu_busy_s": 0.0,
                       "step_wall_s": 0.0}
        self.num_threads = num_threads or torch.get_num_threads()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None
        self._sample_on_device = self.device.type == "cuda"  # else sample_batch: the host path's bits
        if self.device.type == "cuda":
            from reprorl.kernels.gpu.attention import batched_attention as triton_attention
            from reprorl.kernels.gpu.sampling import row_cumsum, sample_rows

            # In both modes: the fused sampler's log-probs are the Triton log-softmax's bits.
            self._cumsum, self._full_sampler = row_cumsum, sample_rows
            # Graph replays need an attention that reads nothing on the host: the Triton one.
            self._graph_attention = self.kernels.batched_attention if batch_invariant else triton_attention
            self._make_gpu_pool()

    def _make_gpu_pool(self) -> None:
        slots, capacity = gpu_cache_shape(self.args, self.dtype, self.device, self.max_num_seqs,
                                          self.max_model_len, self.gpu_memory_utilization)
        self._kv = _SlotPool(self.args, slots, self.dtype, self.device, capacity)
        if self.cuda_graphs:
            from reprorl.rollout.cuda_graphs import DecodeGraphs

            self._graphs = DecodeGraphs(self.model, self._kv.cache, self._graph_attention, slots)

    @classmethod
    def from_path(cls, path: str, *, batch_invariant: bool, dtype: torch.dtype | None = None,
                  device: torch.device | str = "cpu", **kwargs) -> Engine:
        """Load an HF model directory onto `device` ("cuda": the GPU engine); eos comes from
        its generation/model config unless given."""
        from reprorl.models.hf_io import load_model

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
        if request_id in self._by_id:
            raise ValueError(f"generate: request_id {request_id!r} is already in flight")
        check_prompt(request_id, prompt_ids, self.max_model_len, self.args.vocab_size)
        n = len(prompt_ids)
        need = min(n + sampling_params.max_tokens, self.max_model_len)
        if self._kv is not None and self._kv.fixed and need > self._kv.cache.capacity:
            raise ValueError(
                f"generate({request_id!r}): prompt + max_tokens = {need} tokens; a KV cache slot holds "
                f"{self._kv.cache.capacity} (gpu_memory_utilization={self.gpu_memory_utilization}); raise it, "
                "or lower max_tokens or max_model_len"
            )
        seq = _Sequence(
            request_id=request_id,
            prompt_ids=list(prompt_ids),
            params=sampling_params,
            generator=make_generator(seed),
            priority=priority,
            arrival=next(self._arrivals),
            arrival_step=self._stats["steps"],
            future=self._loop.create_future(),
            capacity=min(n + sampling_params.max_tokens, self.max_model_len),
        )
        self._by_id[request_id] = seq
        heapq.heappush(self._waiting, (priority, seq.arrival, seq))
        self._wakeup.set()
        try:
            return await seq.future
        except asyncio.CancelledError:  # the caller gave up: stop spending steps on it
            self.abort(request_id)
            raise

    def abort(self, request_id: str) -> bool:
        """Abort a request in flight (its generate returns finish_reason "abort"); False if unknown."""
        seq = self._by_id.get(request_id)
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
            if self._by_id:
                raise RuntimeError(f"sleep: {len(self._by_id)} requests in flight; wait for or abort them first")
            self._kv = self._graphs = None  # graphs hold the cache's and the weights' addresses
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
            if self.device.type == "cuda" and self._kv is None:
                self._make_gpu_pool()
            self.asleep = False

    def stats(self) -> dict:
        """Counters: running/waiting requests, steps, tokens generated, weight version..."""
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "weight_version": self.weight_version,
            "asleep": self.asleep,
            "kv_capacity": self._kv.cache.capacity if self._kv is not None else 0,
            "kv_slots": self._kv.num_slots if self._kv is not None else 0,
            "graph_error": self.graph_error,
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
        self._ahead = None
        for seq in list(self._by_id.values()):
            self._drop(seq)
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
            while self._by_id or self._ahead is not None:
                async with self._step_lock:
                    wall = time.perf_counter()
                    try:
                        if self._ahead is not None:  # launched last step: read it (the next one may go first)
                            launched, self._ahead = self._ahead, None
                            chunks = launched.chunks
                            tokens, log_probs = self._read_launched(launched, self._launch_ahead(launched))
                        else:
                            self._reap_aborted()
                            chunks = self._schedule()
                            if not chunks:
                                break
                            if self._can_launch(chunks):
                                launched = self._launch_decode(chunks)
                                tokens, log_probs = self._read_launched(launched, self._launch_ahead(launched))
                            else:
                                tokens, log_probs = self._timed_step(chunks)
                    except Exception as exc:  # an engine or model error fails every request in flight
                        self._ahead = None
                        for seq in list(self._by_id.values()):
                            self._drop(seq)
                            if not seq.future.done():
                                seq.future.set_exception(exc)
                        break
                    self._apply(chunks, tokens, log_probs)
                    self._stats["step_wall_s"] += time.perf_counter() - wall
                # Let new requests, aborts and weight updates in. Twice: a call that arrived
                # from another thread during the step (a Ray actor call) becomes a task on the
                # first pass and reaches generate() on the second, in time for the next step.
                await asyncio.sleep(0)
                await asyncio.sleep(0)

    def _reap_aborted(self) -> None:
        for seq in [s for s in self._by_id.values() if s.aborted]:
            self._finish(seq, "abort")
            self._stats["aborted"] += 1

    def _schedule(self) -> list[_Chunk]:
        """Plan one step: decodes, then pending prefill, then new admissions (module doc)."""
        budget = self.max_num_batched_tokens
        chunks = []
        # Decodes first, one token each, in slot order (the forward reads their slots as one view).
        for seq in sorted(self._running, key=lambda s: s.slot):
            if seq.num_computed >= len(seq.prompt_ids):
                chunks.append(_Chunk(seq, seq.slot, [seq.output_ids[-1]], seq.num_computed, True))
                budget -= 1
        for seq in self._running:  # prompts still being read, in admission order (followers wait)
            if seq.num_computed < len(seq.prompt_ids) and seq.leader is None and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= len(chunks[-1].token_ids)
        self._promote_starved()
        while self._waiting and len(self._running) < self.max_num_seqs:
            if self._kv is None:
                self._kv = _SlotPool(self.args, self.max_num_seqs, self.dtype, self.device)
            if not self._kv.free:  # a GPU cache smaller than max_num_seqs slots: wait for one
                break
            seq = self._waiting[0][2]
            key = tuple(seq.prompt_ids)
            leader = self._sharing.get(key) if self.prefix_sharing else None
            if leader is None and budget <= 0:  # followers cost no tokens: they join past the budget
                break
            heapq.heappop(self._waiting)
            seq.slot = self._kv.alloc(seq.capacity)
            seq.weight_version = self.weight_version
            self._running.append(seq)
            if leader is not None:  # the same prompt is being prefilled: wait for it, no tokens spent
                seq.leader = leader
                leader.followers.append(seq)
                continue
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= len(chunks[-1].token_ids)
            if self.prefix_sharing:  # until its prompt is computed (`_apply`), even within this step
                self._sharing[key] = seq
        return chunks

    def _prefill_chunk(self, seq: _Sequence, budget: int) -> _Chunk:
        ids = seq.prompt_ids[seq.num_computed : seq.num_computed + budget]
        last = seq.num_computed + len(ids) == len(seq.prompt_ids)
        return _Chunk(seq, seq.slot, ids, seq.num_computed, last)

    def _promote_starved(self) -> None:
        # Anyone waiting longer than starvation_steps jumps every priority (arrival order).
        cutoff = self._stats["steps"] - self.starvation_steps
        top = -(2**62)
        if any(s.arrival_step < cutoff and p != top for p, _, s in self._waiting):
            self._waiting = [((top if s.arrival_step < cutoff else p), a, s) for p, a, s in self._waiting]
            heapq.heapify(self._waiting)

    def _apply(self, chunks: list[_Chunk], tokens: list[int], log_probs: list[float]) -> None:
        """Record the step's new tokens and finish the sequences that are done."""
        self._stats["steps"] += 1
        samplers = iter(_samplers(chunks))
        for c in chunks:
            c.seq.num_computed += len(c.token_ids)
            if not c.is_decode:
                self._stats["prompt_tokens"] += len(c.token_ids)
            if not c.sample:
                continue
            if not c.is_decode and self._sharing.get(tuple(c.seq.prompt_ids)) is c.seq:
                del self._sharing[tuple(c.seq.prompt_ids)]
            for f in c.seq.followers:  # their keys/values were copied in the step
                f.leader, f.num_computed = None, len(f.prompt_ids)
                self._stats["prefix_shared"] += 1
            c.seq.followers = []
        for seq, tok, lp in zip(samplers, tokens, log_probs):
            if seq.slot is None:  # it finished (or was aborted) after this lookahead step was launched
                continue
            seq.output_ids.append(tok)
            seq.log_probs.append(lp)
            self._stats["tokens_generated"] += 1
            p = seq.params
            if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= seq.capacity:
                self._finish(seq, "length")

    def _drop(self, seq: _Sequence) -> None:
        """Forget a sequence and give its KV slot back (a leader hands its followers on)."""
        self._by_id.pop(seq.request_id, None)
        key = tuple(seq.prompt_ids)
        if self._sharing.get(key) is seq:
            del self._sharing[key]
        if seq.leader is not None:
            seq.leader.followers.remove(seq)
            seq.leader = None
        if seq.followers:  # the first follower prefills the prompt itself; the others wait for it
            new, *rest = seq.followers
            new.leader, new.followers, seq.followers = None, rest, []
            for f in rest:
                f.leader = new
            self._sharing[key] = new
        if seq in self._running:
            self._running.remove(seq)
            self._kv.release(seq.slot)
            seq.slot = None
        else:
            self._waiting = [w for w in self._waiting if w[2] is not seq]
            heapq.heapify(self._waiting)

    def _finish(self, seq: _Sequence, reason: str) -> None:
        self._drop(seq)
        if reason != "abort":
            self._stats["finished"] += 1
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

    def _timed_step(self, chunks: list[_Chunk]) -> tuple[list[int], list[float]]:
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

    def _run_step(self, chunks: list[_Chunk]) -> tuple[list[int], list[float]]:
        """One forward pass over the packed chunks, then sampling at their last tokens."""
        caller_threads = torch.get_num_threads()
        if caller_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            return self._forward_and_sample(chunks)
        finally:
            if caller_threads != self.num_threads:
                torch.set_num_threads(caller_threads)

    # ---- the lookahead path (GPU graphs; module doc, Lookahead) -------------------------------

    def _can_launch(self, chunks: list[_Chunk]) -> bool:
        """Whether a step goes the lookahead way: decodes only, through a captured graph."""
        g = self._graphs
        return (self.lookahead and g is not None and len(chunks) <= g.max_batch and g.bucket(len(chunks)) in g.graphs
                and all(c.is_decode for c in chunks))

    def _launch_decode(self, chunks: list[_Chunk], device_ids: Tensor | None = None) -> _Launched:
        """Launch a graphed decode step and its sampling, reading nothing back. `device_ids`:
        the token ids on the device (the step before's tokens), else the chunks' own."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            ids = None if device_ids is not None else [c.token_ids[0] for c in chunks]
            logits = self._graphs.run(ids, [c.slot for c in chunks], [c.start for c in chunks], device_ids)
            self._stats["graph_steps"] += 1
            params = [c.seq.params for c in chunks]
            uniforms = [c.seq.next_uniform() for c in chunks]
            packed = pack_step_params(params, uniforms, logits.shape[1]).pin_memory().to(self.device, non_blocking=True)
            tokens, log_probs = sample_on_device(logits, packed, any_filter(params), self.kernels.softmax,
                                                 self._cumsum, self._full_sampler)
            joined = torch.cat([tokens.to(torch.int32), log_probs.float().view(torch.int32)])
        end.record()
        return _Launched(chunks, tokens, joined, start, end)

    def _launch_ahead(self, cur: _Launched) -> _Launched | None:
        """Launch the step after `cur` from its device tokens (into `_ahead`) when every
        sequence of `cur` decodes again whatever its token but a stop token, and none waits."""
        if self._waiting:  # admissions come first: the chain ends and the next step is planned
            return None
        for c in cur.chunks:
            seq, n = c.seq, len(c.seq.output_ids) + 1  # its output length after cur's token
            if seq.slot is None or seq.aborted or n >= seq.params.max_tokens or len(seq.prompt_ids) + n >= seq.capacity:
                return None
        nxt = [_Chunk(c.seq, c.slot, [-1], c.start + 1, True) for c in cur.chunks]  # ids: on the device
        self._ahead = self._launch_decode(nxt, cur.tokens)
        self._stats["lookahead_steps"] += 1
        return self._ahead

    def _read_launched(self, launched: _Launched, behind: _Launched | None) -> tuple[list[int], list[float]]:
        """A launched step's tokens and log-probs on the host. With a step launched `behind`
        it, the copy goes on a side stream, so that step runs meanwhile. Adds the step's
        device span to `gpu_busy_s`, less any overlap with the step before."""
        if behind is None:
            host = launched.joined.cpu()
        else:
            if self._copy_stream is None:
                self._copy_stream = torch.cuda.Stream(self.device)
            side = self._copy_stream
            side.wait_event(launched.end)
            with torch.cuda.stream(side):
                host = torch.empty(launched.joined.shape, dtype=torch.int32, pin_memory=True)
                host.copy_(launched.joined, non_blocking=True)
                launched.joined.record_stream(side)
                done = torch.cuda.Event()
                done.record(side)
            done.synchronize()
        span = launched.start.elapsed_time(launched.end)
        if self._last_end is not None:
            span = min(span, self._last_end.elapsed_time(launched.end))
        self._last_end = launched.end
        self._stats["gpu_busy_s"] += span / 1e3
        n = launched.tokens.shape[0]
        return host[:n].tolist(), host[n:].view(torch.float32).tolist()

    def _forward_and_sample(self, chunks: list[_Chunk]) -> tuple[list[int], list[float]]:
        sampled = _samplers(chunks)
        with torch.inference_mode():
            logits = self._logits(chunks)  # [S, V]
            if logits is None:
                return [], []
            self._copy_shared_prefixes(chunks)
            params = [s.params for s in sampled]
            uniforms = [s.next_uniform() for s in sampled]
            if not self._sample_on_device:
                tokens, log_probs = sample_batch(logits, params, uniforms, self.kernels.log_softmax)
                return tokens.tolist(), log_probs.tolist()
            packed = pack_step_params(params, uniforms, logits.shape[1]).pin_memory().to(self.device, non_blocking=True)
            tokens, log_probs = sample_on_device(logits, packed, any_filter(params), self.kernels.softmax,
                                                 self._cumsum, self._full_sampler)
            return join_tokens_and_log_probs(tokens, log_probs)

    def _logits(self, chunks: list[_Chunk]) -> Tensor | None:
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
        rows = [end - 1 for c, end in zip(chunks, ends) if c.sample for _ in range(1 + _num_followers(c))]
        hidden = self._forward(chunks)  # [N, H]
        if not rows:
            return None
        if rows != list(range(hidden.shape[0])):  # prefill chunks: only their last tokens sample
            hidden = hidden[torch.tensor(rows, device=self.device)]
        return self.model.logits(hidden)

    def _copy_shared_prefixes(self, chunks: list[_Chunk]) -> None:
        """Give each follower of a leader whose prompt completed this step a copy of its keys/values."""
        self._kv.cache.copy_prefixes([(c.slot, [f.slot for f in c.seq.followers], len(c.seq.prompt_ids))
                                      for c in chunks if _num_followers(c)])

    def _forward(self, chunks: list[_Chunk]) -> Tensor:
        """The model's `forward_packed` over the chunks, each in its sequence's slot. -> hidden [N, H]."""
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)  # [N]
        return self.model.forward_packed(ids, [len(c.token_ids) for c in chunks], self._kv.cache, [c.slot for c in chunks])


def _num_followers(c: _Chunk) -> int:
    """Followers sampled with a chunk: those of a leader whose prompt this chunk completes."""
    return len(c.seq.followers) if c.sample and not c.is_decode else 0


def _samplers(chunks: list[_Chunk]) -> list[_Sequence]:
    """The sequences that get a token this step, in the order of the step's logits rows."""
    return [s for c in chunks if c.sample for s in (c.seq, *(c.seq.followers if _num_followers(c) else ()))]


def eos_ids_from_dir(path: str) -> int | list[int] | None:
    """eos_token_id from generation_config.json, else config.json (HF's own precedence)."""
    for name in ("generation_config.json", "config.json"):
        f = os.path.join(path, name)
        if os.path.exists(f):
            with open(f) as fh:
                eos = json.load(fh).get("eos_token_id")
            if eos is not None:
                return eos
    return None
