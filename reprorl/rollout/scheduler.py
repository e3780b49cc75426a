"""Which sequences an `Engine` step runs, and what its new tokens do to them. No model:
`Scheduler.schedule` plans a step as `Chunk`s, the engine runs them, `Scheduler.apply`
takes the tokens back.

A step packs one decode token for every running sequence, then prefill chunks of
sequences still reading their prompt, then prompts of newly admitted requests, within
`max_num_seqs` sequences and `max_num_batched_tokens` tokens. Requests join and leave
between steps. Keys and values live in one `KVCache` with a slot per running sequence
(`SlotPool`), freed for the next request when a sequence finishes.

Admission. Waiting requests are admitted in order of (priority, arrival): lower priority
value first, then first come first served. A request that has waited more than
`starvation_steps` steps goes ahead of every priority (in arrival order), so a stream of
high-priority work cannot starve it. Running sequences are never preempted: each decodes
one token every step (`max_num_batched_tokens >= max_num_seqs` guarantees room), and
prefill chunks go to admitted sequences in admission order before new admissions.

Prefix sharing: requests that bring the same prompt while it is being prefilled (the n
samples of a GRPO prompt, sent as n generate calls with their own seeds) are admitted as
followers of the first: the prompt is prefilled once, its keys/values are copied into
each follower's slot (a device copy, not shared blocks) and each follower samples its
first token from the leader's last logits with its own uniform. In batch-invariant mode
that is the same bits as n prefills (tested), so it changes only the work.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
from dataclasses import dataclass, field

import torch

from reprorl.kernels import KEY_BLOCK
from reprorl.models.arch import ModelArgs
from reprorl.models.kv_cache import KVCache
from reprorl.rollout.sampling import draw_uniforms
from reprorl.rollout.request import SamplingParams

# Uniforms drawn per call from a request's generator (one per token, see sampling.py).
_DRAW_BLOCK = 32


@dataclass(eq=False)
class Sequence:
    """One request in the engine, from `Scheduler.add` until it finishes."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    priority: int
    future: asyncio.Future | None  # the caller's answer (the engine sets it)
    capacity: int  # prompt + generated tokens that fit (max_tokens, max_model_len)
    arrival: int = -1  # admission tie-break (`Scheduler.add` stamps it)
    arrival_step: int = -1  # starvation clock (`Scheduler.add` stamps it)
    slot: int | None = None  # its row of the KV store while running
    num_computed: int = 0  # tokens whose keys/values are in the KV store
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    weight_version: int = -1
    aborted: bool = False
    uniforms: list[float] = field(default_factory=list)  # drawn, not yet used (reversed)
    # Prefix sharing: a follower waits for its leader (same prompt) to prefill, then takes a
    # copy of the leader's keys/values and samples its first token from the leader's logits.
    leader: Sequence | None = None
    followers: list[Sequence] = field(default_factory=list)

    def next_uniform(self) -> float:
        """The draw of the next token: the generator's next value."""
        if not self.uniforms:
            self.uniforms = draw_uniforms(self.generator, _DRAW_BLOCK)[::-1]
        return self.uniforms.pop()


@dataclass(slots=True)  # not frozen: a step makes one per sequence, and frozen init costs 3x
class Chunk:
    """Tokens of one sequence fed in one step (never changed after); `sample` if its last
    token yields a new one."""

    seq: Sequence
    slot: int
    token_ids: list[int]
    start: int  # position of token_ids[0]
    sample: bool

    @property
    def is_decode(self) -> bool:
        return self.start >= len(self.seq.prompt_ids)


def num_followers(c: Chunk) -> int:
    """Followers sampled with a chunk: those of a leader whose prompt this chunk completes."""
    return len(c.seq.followers) if c.sample and not c.is_decode else 0


def samplers(chunks: list[Chunk]) -> list[Sequence]:
    """The sequences that get a token this step, in the order of the step's logits rows."""
    return [s for c in chunks if c.sample for s in (c.seq, *(c.seq.followers if num_followers(c) else ()))]


class SlotPool:
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

    def __init__(self, args: ModelArgs, num_slots: int, dtype: torch.dtype, device: torch.device,
                 capacity: int | None = None):
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


class Scheduler:
    """The waiting queue, the running sequences and their KV slots, and prefix sharing (see
    the module doc). `kv` is made on the first admission, growing, from the cache's shape
    (`args`, `dtype`, `device`), unless the engine gave it one of fixed size (a GPU's);
    the engine drops it while asleep. `stats`: counters since construction."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype, device: torch.device, *, max_num_seqs: int,
                 max_num_batched_tokens: int, starvation_steps: int, prefix_sharing: bool,
                 eos_token_ids: frozenset[int]):
        self.args, self.dtype, self.device = args, dtype, device
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.starvation_steps = starvation_steps
        self.prefix_sharing = prefix_sharing
        self.eos_token_ids = eos_token_ids
        self.kv: SlotPool | None = None
        self.waiting: list[tuple[int, int, Sequence]] = []  # heap of (priority, arrival, seq)
        self.running: list[Sequence] = []  # admission order
        self.by_id: dict[str, Sequence] = {}
        self._sharing: dict[tuple[int, ...], Sequence] = {}  # prompt -> leader still prefilling it
        self._arrivals = itertools.count()
        self.stats = {"steps": 0, "tokens_generated": 0, "prompt_tokens": 0, "finished": 0, "aborted": 0,
                      "prefix_shared": 0}

    def add(self, seq: Sequence) -> None:
        """Queue a new request, stamped with its arrival (number and step)."""
        seq.arrival, seq.arrival_step = next(self._arrivals), self.stats["steps"]
        self.by_id[seq.request_id] = seq
        heapq.heappush(self.waiting, (seq.priority, seq.arrival, seq))

    # ---- planning a step ---------------------------------------------------------------

    def schedule(self, weight_version: int) -> list[Chunk]:
        """Plan one step: decodes, then pending prefill, then new admissions (module doc).
        Admitted sequences start at `weight_version`."""
        budget = self.max_num_batched_tokens
        chunks = []
        # Decodes first, one token each, in slot order (the forward reads their slots as one view).
        for seq in sorted(self.running, key=lambda s: s.slot):
            if seq.num_computed >= len(seq.prompt_ids):
                chunks.append(Chunk(seq, seq.slot, [seq.output_ids[-1]], seq.num_computed, True))
                budget -= 1
        for seq in self.running:  # prompts still being read, in admission order (followers wait)
            if seq.num_computed < len(seq.prompt_ids) and seq.leader is None and budget > 0:
                chunks.append(self._prefill_chunk(seq, budget))
                budget -= len(chunks[-1].token_ids)
        self._promote_starved()
        self._admit(chunks, budget, weight_version)
        return chunks

    def _admit(self, chunks: list[Chunk], budget: int, weight_version: int) -> None:
        """Admit waiting requests while sequences, slots and tokens allow; append their prefill chunks."""
        while self.waiting and len(self.running) < self.max_num_seqs:
            if self.kv is None:
                self.kv = SlotPool(self.args, self.max_num_seqs, self.dtype, self.device)
            if not self.kv.free:  # a GPU cache smaller than max_num_seqs slots: wait for one
                break
            seq = self.waiting[0][2]
            key = tuple(seq.prompt_ids)
            leader = self._sharing.get(key) if self.prefix_sharing else None
            if leader is None and budget <= 0:  # followers cost no tokens: they join past the budget
                break
            heapq.heappop(self.waiting)
            seq.slot = self.kv.alloc(seq.capacity)
            seq.weight_version = weight_version
            self.running.append(seq)
            if leader is not None:  # the same prompt is being prefilled: wait for it, no tokens spent
                seq.leader = leader
                leader.followers.append(seq)
                continue
            chunks.append(self._prefill_chunk(seq, budget))
            budget -= len(chunks[-1].token_ids)
            if self.prefix_sharing:  # until its prompt is computed (`apply`), even within this step
                self._sharing[key] = seq

    def _prefill_chunk(self, seq: Sequence, budget: int) -> Chunk:
        ids = seq.prompt_ids[seq.num_computed : seq.num_computed + budget]
        last = seq.num_computed + len(ids) == len(seq.prompt_ids)
        return Chunk(seq, seq.slot, ids, seq.num_computed, last)

    def _promote_starved(self) -> None:
        # Anyone waiting longer than starvation_steps jumps every priority (arrival order).
        cutoff = self.stats["steps"] - self.starvation_steps
        top = -(2**62)
        if any(s.arrival_step < cutoff and p != top for p, _, s in self.waiting):
            self.waiting = [((top if s.arrival_step < cutoff else p), a, s) for p, a, s in self.waiting]
            heapq.heapify(self.waiting)

    # ---- after a step ------------------------------------------------------------------

    def apply(self, chunks: list[Chunk], tokens: list[int], log_probs: list[float]) -> list[tuple[Sequence, str]]:
        """Record a step's new tokens (one per `samplers(chunks)`, in order) and drop the
        sequences that are done. -> each of those with its finish reason ("stop", "length")."""
        self.stats["steps"] += 1
        sampled = samplers(chunks)  # before the followers are handed their prompt below
        for c in chunks:
            c.seq.num_computed += len(c.token_ids)
            if not c.is_decode:
                self.stats["prompt_tokens"] += len(c.token_ids)
            if not c.sample:
                continue
            if not c.is_decode and self._sharing.get(tuple(c.seq.prompt_ids)) is c.seq:
                del self._sharing[tuple(c.seq.prompt_ids)]
            for f in c.seq.followers:  # their keys/values were copied in the step
                f.leader, f.num_computed = None, len(f.prompt_ids)
                self.stats["prefix_shared"] += 1
            c.seq.followers = []
        finished = []
        for seq, tok, lp in zip(sampled, tokens, log_probs):
            if seq.slot is None:  # it finished (or was aborted) after this lookahead step was launched
                continue
            seq.output_ids.append(tok)
            seq.log_probs.append(lp)
            self.stats["tokens_generated"] += 1
            p = seq.params
            if tok in p.stop_token_ids or (tok in self.eos_token_ids and not p.ignore_eos):
                finished.append((seq, "stop"))
            elif len(seq.output_ids) >= p.max_tokens or len(seq.prompt_ids) + len(seq.output_ids) >= seq.capacity:
                finished.append((seq, "length"))
            else:
                continue
            self.drop(seq)
            self.stats["finished"] += 1
        return finished

    def reap_aborted(self) -> list[Sequence]:
        """Drop the sequences marked `aborted`; -> them."""
        aborted = [s for s in self.by_id.values() if s.aborted]
        for seq in aborted:
            self.drop(seq)
            self.stats["aborted"] += 1
        return aborted

    def drop_all(self) -> list[Sequence]:
        """Drop every sequence in flight; -> them."""
        dropped = list(self.by_id.values())
        for seq in dropped:
            self.drop(seq)
        return dropped

    def drop(self, seq: Sequence) -> None:
        """Forget a sequence and give its KV slot back (a leader hands its followers on)."""
        self.by_id.pop(seq.request_id, None)
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
        if seq in self.running:
            self.running.remove(seq)
            self.kv.release(seq.slot)
            seq.slot = None
        else:
            self.waiting = [w for w in self.waiting if w[2] is not seq]
            heapq.heapify(self.waiting)
