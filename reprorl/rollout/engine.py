"""reprorl's built-in inference engine: continuous batching on the CPU (GPU later).

`Engine` serves `generate` calls from many asyncio tasks. A background step loop batches
them: each step packs one decode token for every running sequence, then prefill chunks
of sequences still reading their prompt, then prompts of newly admitted requests, within
`max_num_seqs` sequences and `max_num_batched_tokens` tokens. Requests join and leave
between steps. Keys and values live in one preallocated `KVCache` with a slot per running
sequence (`_SlotPool`), freed for the next request when a sequence finishes.

The forward pass is the model's own `forward_packed` (`reprorl.models.transformer`, every
op from `reprorl.kernels`): all decode tokens of a step share one batched attention
call, prefill chunks another, and in batch-invariant mode both give the same bits as the
trainer's padded forward (tested).

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
import os
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import Tensor

from reprorl.kernels import KEY_BLOCK, select_kernels, verify_batch_invariance
from reprorl.models.transformer import KVCache
from reprorl.rollout.sampling import SamplingParams, draw_uniforms, make_generator, sample_batch

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


class _SlotPool:
    """The KV cache of every running sequence (the model's `KVCache`, one slot per sequence)
    and which slots are free. Slots are taken lowest first, so running ones stay dense and
    a decode step reads them as one view. The cache grows (copying) to the longest sequence
    admitted, in whole `KEY_BLOCK`s."""

    def __init__(self, args, num_slots: int, dtype: torch.dtype, device: torch.device):
        self.cache = KVCache.for_model(args, KEY_BLOCK, num_slots, dtype, device)
        self.free = list(range(num_slots))  # a heap

    def alloc(self, capacity: int) -> int:
        self.cache.grow(-(-capacity // KEY_BLOCK) * KEY_BLOCK)
        slot = heapq.heappop(self.free)
        self.cache.lengths[slot] = 0
        return slot

    def release(self, slot: int) -> None:
        heapq.heappush(self.free, slot)


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
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.kernels = select_kernels(self.device, batch_invariant)
        model.kernels = self.kernels
        verify_batch_invariance(self.kernels, self.args, self.dtype, self.device)

        self.weight_version = 0
        self.asleep = False
        self._kv: _SlotPool | None = None  # made on first admission, dropped by sleep()
        self._waiting: list[tuple[int, int, _Sequence]] = []  # heap of (priority, arrival, seq)
        self._running: list[_Sequence] = []  # admission order
        self._by_id: dict[str, _Sequence] = {}
        self._arrivals = itertools.count()
        self._stats = {"steps": 0, "tokens_generated": 0, "prompt_tokens": 0, "finished": 0, "aborted": 0}
        self.num_threads = num_threads or torch.get_num_threads()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task | None = None
        self._wakeup: asyncio.Event | None = None
        self._step_lock: asyncio.Lock | None = None

    @classmethod
    def from_path(cls, path: str, *, batch_invariant: bool, dtype: torch.dtype | None = None, **kwargs) -> Engine:
        """Load an HF model directory; eos comes from its generation/model config unless given."""
        from reprorl.models.hf_io import load_model

        model, _ = load_model(path, kind="causal_lm", dtype=dtype)
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

    async def sleep(self) -> None:
        """Free the KV store while idle (and, on an accelerator, move weights to the host)."""
        async with self._lock():
            if self._by_id:
                raise RuntimeError(f"sleep: {len(self._by_id)} requests in flight; wait for or abort them first")
            self._kv = None
            if self.device.type != "cpu":
                self.model.to("cpu")
                getattr(torch, self.device.type).empty_cache()
            self.asleep = True

    async def wake_up(self) -> None:
        """Undo `sleep` (the KV store is rebuilt on the next admission)."""
        async with self._lock():
            if self.device.type != "cpu":
                self.model.to(self.device)
            self.asleep = False

    def stats(self) -> dict:
        """Counters: running/waiting requests, steps, tokens generated, weight version..."""
        return {
            "running": len(self._running),
            "waiting": len(self._waiting),
            "weight_version": self.weight_version,
            "asleep": self.asleep,
            "kv_capacity": self._kv.cache.capacity if self._kv is not None else 0,
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
            while self._by_id:
                async with self._step_lock:
                    self._reap_aborted()
                    try:
                        chunks = self._schedule()
                        if not chunks:
                            break
                        tokens, log_probs = self._run_step(chunks)
                    except Exception as exc:  # an engine or model error fails every request in flight
                        for seq in list(self._by_id.values()):
                            self._drop(seq)
                            if not seq.future.done():
                                seq.future.set_exception(exc)
                        break
                    self._apply(chunks, tokens, log_probs)
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
        for seq in self._running:  # prompts still being read, in admission order
            if seq.num_computed < len(seq.prompt_ids) and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= len(chunks[-1].token_ids)
        self._promote_starved()
        while self._waiting and len(self._running) < self.max_num_seqs and budget > 0:
            _, _, seq = heapq.heappop(self._waiting)
            if self._kv is None:
                self._kv = _SlotPool(self.args, self.max_num_seqs, self.dtype, self.device)
            seq.slot = self._kv.alloc(seq.capacity)
            seq.weight_version = self.weight_version
            self._running.append(seq)
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= len(chunks[-1].token_ids)
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

    def _apply(self, chunks: list[_Chunk], tokens: Tensor, log_probs: Tensor) -> None:
        """Record the step's new tokens and finish the sequences that are done."""
        self._stats["steps"] += 1
        tokens, log_probs = tokens.tolist(), log_probs.tolist()
        i = 0
        for c in chunks:
            seq = c.seq
            seq.num_computed += len(c.token_ids)
            if not c.is_decode:
                self._stats["prompt_tokens"] += len(c.token_ids)
            if not c.sample:
                continue
            tok, lp = tokens[i], log_probs[i]
            i += 1
            seq.output_ids.append(tok)
            seq.log_probs.append(lp)
            self._stats["tokens_generated"] += 1
            p = seq.params
            if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
                self._finish(seq, "stop")
            elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= seq.capacity:
                self._finish(seq, "length")

    def _drop(self, seq: _Sequence) -> None:
        """Forget a sequence and give its KV slot back."""
        self._by_id.pop(seq.request_id, None)
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

    def _run_step(self, chunks: list[_Chunk]) -> tuple[Tensor, Tensor]:
        """One forward pass over the packed chunks, then sampling at their last tokens."""
        caller_threads = torch.get_num_threads()
        if caller_threads != self.num_threads:
            torch.set_num_threads(self.num_threads)
        try:
            return self._forward_and_sample(chunks)
        finally:
            if caller_threads != self.num_threads:
                torch.set_num_threads(caller_threads)

    def _forward_and_sample(self, chunks: list[_Chunk]) -> tuple[Tensor, Tensor]:
        ends = list(itertools.accumulate(len(c.token_ids) for c in chunks))
        rows = [end - 1 for c, end in zip(chunks, ends) if c.sample]
        sampled = [c.seq for c in chunks if c.sample]
        with torch.inference_mode():
            hidden = self._forward(chunks)  # [N, H]
            if not rows:
                return torch.empty(0, dtype=torch.long), torch.empty(0)
            if len(rows) < hidden.shape[0]:  # prefill chunks: only their last tokens sample
                hidden = hidden[torch.tensor(rows, device=self.device)]
            logits = self.model.logits(hidden)  # [S, V]
            return sample_batch(logits, [s.params for s in sampled], [s.next_uniform() for s in sampled],
                                self.kernels.log_softmax)

    def _forward(self, chunks: list[_Chunk]) -> Tensor:
        """The model's `forward_packed` over the chunks, each in its sequence's slot. -> hidden [N, H]."""
        ids = torch.tensor([t for c in chunks for t in c.token_ids], device=self.device)  # [N]
        return self.model.forward_packed(ids, [len(c.token_ids) for c in chunks], self._kv.cache, [c.slot for c in chunks])


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
