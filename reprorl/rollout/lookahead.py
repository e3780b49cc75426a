"""The engine's lookahead path (`lookahead=True`, a GPU with CUDA graphs).

The host's work between two steps (reading the tokens, finishing sequences, planning the
next step) leaves the GPU idle. While every running sequence decodes and none waits for
admission, the engine launches step t+1's graph from step t's tokens still on the device,
then copies step t's tokens to the host on a side stream while the GPU runs t+1. It
assumes no sequence stops at step t (one that reaches max_tokens or its capacity is known
ahead and ends the chain). A sequence that did stop has run one extra decode row: its
token is dropped when step t+1 is read (`Scheduler.apply` skips a sequence without a
slot), its KV write lands past its end in a slot it no longer holds (the next holder
writes every position before it reads it), and the uniform it drew is one of its own
generator's, which no one draws again; every other sequence's step t+1 is the row it
would have had anyway (same graph, same inputs, its own next uniform), so the bits do not
change.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from reprorl.rollout.cuda_graphs import DecodeGraphs
from reprorl.rollout.scheduler import Chunk, Sequence


@dataclass(slots=True)
class Launched:
    """A graphed decode step on its way: its chunks, its new tokens on the device, tokens
    and log-prob bits joined for the one copy back, and CUDA events around it."""

    chunks: list[Chunk]
    tokens: Tensor
    joined: Tensor
    start: torch.cuda.Event
    end: torch.cuda.Event


def can_launch(chunks: list[Chunk], graphs: DecodeGraphs | None) -> bool:
    """Whether a step can go the lookahead way: decodes only, through a captured graph."""
    return (graphs is not None and len(chunks) <= graphs.max_batch and graphs.bucket(len(chunks)) in graphs.graphs
            and all(c.is_decode for c in chunks))


def chunks_after(chunks: list[Chunk]) -> list[Chunk] | None:
    """The decode step after `chunks`, planned before their tokens are known: None unless
    every sequence decodes again whatever its token but a stop token. Token ids are -1:
    they are on the device."""
    for c in chunks:
        seq, n = c.seq, len(c.seq.output_ids) + 1  # its output length after this step's token
        if seq.slot is None or seq.aborted or n >= seq.params.max_tokens or len(seq.prompt_ids) + n >= seq.capacity:
            return None
    return [Chunk(c.seq, c.slot, [-1], c.start + 1, True) for c in chunks]


class Lookahead:
    """The steps of the lookahead path and its state: `ahead`, the step launched from the
    last one's device tokens; a side stream for the copies back; the end of the last step
    read. `sample(logits [B, V], sequences)`: their tokens and log-probs [B] on the device,
    reading nothing back."""

    def __init__(self, device: torch.device, sample: Callable[[Tensor, list[Sequence]], tuple[Tensor, Tensor]]):
        self.device = device
        self.sample = sample
        self.ahead: Launched | None = None
        self._last_end: torch.cuda.Event | None = None  # the end of the last step read
        self._copy_stream: torch.cuda.Stream | None = None

    def launch(self, graphs: DecodeGraphs, chunks: list[Chunk], device_ids: Tensor | None = None) -> Launched:
        """Launch a graphed decode step and its sampling, reading nothing back. `device_ids`:
        the token ids on the device (the step before's tokens), else the chunks' own."""
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        with torch.inference_mode():
            ids = None if device_ids is not None else [c.token_ids[0] for c in chunks]
            logits = graphs.run(ids, [c.slot for c in chunks], [c.start for c in chunks], device_ids)
            tokens, log_probs = self.sample(logits, [c.seq for c in chunks])
            joined = torch.cat([tokens.to(torch.int32), log_probs.float().view(torch.int32)])
        end.record()
        return Launched(chunks, tokens, joined, start, end)

    def launch_after(self, cur: Launched, graphs: DecodeGraphs) -> Launched | None:
        """Launch the step after `cur` from its device tokens (into `ahead`) when
        `chunks_after` allows; the caller checks first that no request waits."""
        nxt = chunks_after(cur.chunks)
        if nxt is None:
            return None
        self.ahead = self.launch(graphs, nxt, cur.tokens)
        return self.ahead

    def read(self, launched: Launched, behind: Launched | None) -> tuple[list[int], list[float], float]:
        """A launched step's tokens and log-probs on the host, and its device span in
        seconds, less any overlap with the step read before. With a step launched `behind`
        it, the copy goes on a side stream, so that step runs meanwhile."""
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
        n = launched.tokens.shape[0]
        return host[:n].tolist(), host[n:].view(torch.float32).tolist(), span / 1e3
