"""Next-token sampling: per-request parameters, one generator per request.

The determinism contract (docs/design.md) needs a sampled token to be a pure function of
(logits, params, request seed). Two choices make it so:

- **One private generator per request, drawn a fixed number of times per token.** Every
  token consumes exactly one float64 uniform from the request's `torch.Generator`,
  whatever the params (greedy draws too and ignores it), so the stream position of token
  t is always t and never depends on other requests or on the filter settings. The engine
  draws them in blocks (`draw_uniforms`): the same values, fewer calls.
- **Inverse-CDF sampling in vocabulary order.** The uniform `u` picks the first token
  whose cumulative (filtered) probability exceeds `u * total`. Every op involved is
  row-wise with a fixed order (softmax over the last dim, a stable sort, a serial cumsum,
  a binary search), so a row gives the same bits alone or inside any batch and with any
  thread count. We use this rather than vLLM's exponential race (V exponentials per
  token) because the race needs an elementwise `log` over `[B, V]`, whose vectorised and
  scalar-tail kernels may round differently depending on where a row falls in the
  flattened batch; the CDF walk has no such op. Sampling in vocabulary order (not sorted
  order) also makes `top_k=V` and `top_p=1` give exactly the unfiltered samples.

On a GPU the engine samples with `sample_on_device` instead: the same inverse-CDF rule and
the same log-probs, for the whole batch on the logits' device, with the uniforms (still
drawn on the host from each request's generator) shipped in with the step's parameters as
one tensor (`pack_step_params`), and one device-to-host copy of the new tokens and their
log-probs together (`join_tokens_and_log_probs`). Rows that sample from the full
distribution (and greedy rows) take one fused Triton launch that reads the logits twice and
writes nothing of size V (`reprorl.kernels.gpu.sampling.sample_rows`); rows with top-k or
top-p are sampled again by a sort, a mask and a running sum (`row_cumsum`) over the batch,
only in steps that have such rows. Which rule a row gets depends on its own params alone.
Probabilities are float32 there (the host path's are float64), so the two paths may pick a
different token at a CDF boundary: each is deterministic and batch-invariant (one program
per row, or row-wise batch-invariant kernels and exact ops: comparisons, counts, gathers, a
stable sort, argmax).

Filtering follows vLLM: top-k first, then top-p on the distribution renormalised over the
top-k set. Ties are broken by token id (lower id ranks first), via a stable sort.

The returned log-prob is that of the sampled token under `log_softmax(logits / T)` in
float32, WITHOUT top-k/top-p truncation, and with T = 1 for greedy: it is what the
trainer recomputes from the same logits (reprorl/workers/policy.py), through the same
kernels' `log_softmax` (passed in), so with a batch-invariant backend the two agree bit for
bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from reprorl.kernels import TorchKernels
from reprorl.kernels.pinned import pinned_softmax
from reprorl.rollout.request import SamplingParams


def make_generator(seed: int) -> torch.Generator:
    """The request's private CPU generator (CPU even for GPU logits: same stream everywhere)."""
    g = torch.Generator(device="cpu")
    g.manual_seed(seed)
    return g


def _draw(generator: torch.Generator) -> float:
    """The one draw a token consumes: a float64 uniform in [0, 1)."""
    return torch.rand((), dtype=torch.float64, generator=generator).item()


def draw_uniforms(generator: torch.Generator, n: int) -> list[float]:
    """The uniforms of the next n tokens, in one call: the same values as n `_draw`s
    (the CPU kernel fills a tensor one draw after another; tested)."""
    return torch.rand(n, dtype=torch.float64, generator=generator).tolist()


def _keep_mask(probs: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Which tokens survive top-k then top-p, for one row. probs: [V] float64 -> bool [V]."""
    V = probs.shape[0]
    keep = torch.ones(V, dtype=torch.bool)
    if top_k == -1 and top_p >= 1:
        return keep
    sorted_probs, order = torch.sort(probs, descending=True, stable=True)  # ties: lower id first
    k = V if top_k == -1 else min(top_k, V)
    keep_sorted = torch.arange(V) < k
    if top_p < 1:
        cum = sorted_probs.cumsum(0)  # [V]
        mass_before = torch.cat([cum.new_zeros(1), cum[:-1]])  # mass ranked above token j
        # Keep token j while the mass above it is short of top_p (of the top-k mass).
        keep_sorted &= mass_before < top_p * cum[k - 1]
    keep[order] = keep_sorted
    return keep


def _inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """First token whose cumulative probability exceeds u * total. probs: [V] float64, >= 0."""
    cdf = probs.cumsum(0)
    total = cdf[-1]
    i = int(torch.searchsorted(cdf, u * total, right=True))
    # u * total can round up to total; then take the last token with mass.
    last = int(torch.nonzero(probs > 0)[-1])
    return min(i, last)


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator, log_softmax=TorchKernels.log_softmax
) -> tuple[int, float | None]:
    """Sample one token for one request. The plain reference for `sample_batch`.

    logits: [V] (any float dtype). Returns (token_id, log_prob); log_prob is
    `log_softmax(logits.float() / T)[token]` (T = 1 for greedy), without top-k/top-p
    truncation, or None when `params.logprobs` is off. Consumes one draw of `generator`.
    """
    u = _draw(generator)
    logits = logits.float()
    if params.greedy:
        token = int(torch.argmax(logits))  # ties: lowest id
        scaled = logits
    else:
        scaled = logits / params.temperature
        probs = pinned_softmax(scaled.double())
        probs = torch.where(_keep_mask(probs, params.top_k, params.top_p), probs, 0.0)
        token = _inverse_cdf(probs, u)
    log_prob = log_softmax(scaled[None])[0, token].item() if params.logprobs else None
    return token, log_prob


def sample_batch(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    uniforms: Sequence[float],
    log_softmax=TorchKernels.log_softmax,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row, vectorised; bitwise equal to `sample_next` row by row.

    logits: [B, V] on any device; uniforms: row b's draw for this token (the next value of
    its request's generator, see `draw_uniforms`). `log_softmax`: the model's kernel, run on
    the logits' device (the trainer recomputes the log-probs with it). Returns (tokens int64
    [B], log_probs float32 [B]) on the CPU; log_probs are computed for every row; callers
    drop those of requests with `logprobs` off.
    """
    B, V = logits.shape
    u = torch.tensor(uniforms, dtype=torch.float64)  # [B]
    greedy = torch.tensor([p.greedy for p in params])  # [B]
    temps = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params], dtype=torch.float32)
    scaled_on_device = logits.float() / temps.to(logits.device)[:, None]  # [B, V]; greedy rows unchanged
    log_probs_all = log_softmax(scaled_on_device)  # [B, V]
    logits, scaled = logits.float().cpu(), scaled_on_device.cpu()
    tokens = torch.argmax(logits, dim=-1)  # [B], the greedy answer

    sampled_rows = (~greedy).nonzero().flatten()
    if len(sampled_rows) > 0:
        rows = sampled_rows
        probs = pinned_softmax(scaled[rows].double())  # [S, V]
        top_k = [params[i].top_k for i in rows.tolist()]
        top_p = [params[i].top_p for i in rows.tolist()]
        if any(k != -1 for k in top_k) or any(p < 1 for p in top_p):
            probs = torch.where(_keep_mask_batch(probs, top_k, top_p), probs, 0.0)
        cdf = probs.cumsum(dim=-1)  # [S, V]
        target = u[rows] * cdf[:, -1]  # [S]
        idx = torch.searchsorted(cdf, target[:, None], right=True).squeeze(1)  # [S]
        # Last token with mass: first positive from the right.
        last = V - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1)
        tokens[rows] = torch.minimum(idx, last)
    log_probs = log_probs_all.gather(1, tokens.to(log_probs_all.device)[:, None]).squeeze(1)  # [B]
    return tokens, log_probs.cpu()


def _keep_mask_batch(probs: torch.Tensor, top_k: Sequence[int], top_p: Sequence[float]) -> torch.Tensor:
    """`_keep_mask` for S rows at once. probs: [S, V] float64 -> bool [S, V]."""
    S, V = probs.shape
    k = torch.tensor([V if kk == -1 else min(kk, V) for kk in top_k])  # [S]
    p = torch.tensor(list(top_p), dtype=torch.float64)  # [S]
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)
    keep_sorted = torch.arange(V)[None, :] < k[:, None]  # [S, V]
    cum = sorted_probs.cumsum(dim=-1)  # [S, V]
    kept_mass = cum.gather(1, (k - 1)[:, None]).squeeze(1)  # [S]
    mass_before = torch.cat([cum.new_zeros(S, 1), cum[:, :-1]], dim=1)
    # Rows with top_p = 1 skip the test (float sums may exceed 1 and cut the tail).
    keep_sorted &= (mass_before < (p * kept_mass)[:, None]) | (p >= 1)[:, None]
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


# ---- the GPU path --------------------------------------------------------------------


def pack_step_params(params: Sequence[SamplingParams], uniforms: Sequence[float], vocab_size: int) -> torch.Tensor:
    """One step's sampling inputs as one float64 tensor [4, B] (one host-to-device copy):
    rows uniform, temperature (0 = greedy), top_k (vocab_size when off), top_p. Exact:
    top_k fits a float64, uniforms are float64 already."""
    return torch.tensor(
        [list(uniforms), [p.temperature for p in params],
         [vocab_size if p.top_k == -1 else min(p.top_k, vocab_size) for p in params], [p.top_p for p in params]],
        dtype=torch.float64,
    )


def any_filter(params: Sequence[SamplingParams]) -> bool:
    """Whether any sampled row of the step uses top-k or top-p (else the sort is skipped)."""
    return any(not p.greedy and (p.top_k != -1 or p.top_p < 1) for p in params)


def filtered_rows(packed: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Which rows of `pack_step_params`' step sample with top-k or top-p: bool [B]."""
    _, temperature, top_k, top_p = packed
    return (temperature != 0) & ((top_k < vocab_size) | (top_p < 1))


def sample_on_device(logits: torch.Tensor, packed: torch.Tensor, filtered: bool, softmax, cumsum,
                     full_sampler) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample one token per row where the logits are, with no host sync.

    logits [B, V]; packed [4, B] float64 from `pack_step_params`, on the logits' device;
    `full_sampler`: (logits, packed) -> (tokens, log-probs, log_z), every row from its full
    distribution (`reprorl.kernels.gpu.sampling.sample_rows`: one launch, its log-probs the
    Triton log-softmax's bits). `filtered`: `any_filter` of the step's params; then the rows
    that use top-k or top-p (`filtered_rows`: a property of the row, never of the batch) are
    sampled again by the sort-based rule with `softmax` and `cumsum` (a row-wise running sum
    [B, V] -> [B, V], `row_cumsum` on CUDA), and their log-probs are x[token] / T - log_z.
    Returns (tokens int64 [B], log_probs float32 [B]) on the device: log_softmax(logits / T)
    at the token, T = 1 for greedy, untruncated, as `sample_batch`.
    """
    tokens, log_probs, log_z = full_sampler(logits, packed)
    if not filtered:
        return tokens, log_probs
    B, V = logits.shape
    u, temperature, top_k, top_p = packed
    temps = torch.where(temperature == 0, 1.0, temperature).float()
    scaled = logits.float() / temps[:, None]  # [B, V]; greedy rows unchanged
    probs = softmax(scaled)  # [B, V] float32
    probs = torch.where(_keep_mask_on_device(probs, top_k.long(), top_p, cumsum), probs, 0.0)
    cdf = cumsum(probs)  # [B, V]
    target = (u * cdf[:, -1].double()).float()  # [B]
    idx = (cdf <= target[:, None]).sum(-1)  # first token whose cumulative mass exceeds the target
    last = V - 1 - torch.argmax((probs > 0).flip(-1).to(torch.int8), dim=-1)  # last token with mass
    rows = filtered_rows(packed, V)
    tokens = torch.where(rows, torch.minimum(idx, last), tokens)
    x = scaled.gather(1, tokens[:, None]).squeeze(1)
    return tokens, torch.where(rows, x - log_z, log_probs)


def _keep_mask_on_device(probs: torch.Tensor, k: torch.Tensor, p: torch.Tensor, cumsum) -> torch.Tensor:
    """`_keep_mask_batch` on the device: probs [B, V] float32, k [B] int64, p [B] float64 -> bool [B, V]."""
    B, V = probs.shape
    sorted_probs, order = torch.sort(probs, dim=-1, descending=True, stable=True)  # ties: lower id first
    keep_sorted = torch.arange(V, device=probs.device)[None, :] < k[:, None]  # [B, V]
    cum = cumsum(sorted_probs)  # [B, V]
    kept_mass = cum.gather(1, (k - 1)[:, None]).squeeze(1)  # [B]
    mass_before = torch.nn.functional.pad(cum[:, :-1], (1, 0))  # mass ranked above token j (exact shift)
    keep_sorted &= (mass_before < (p.float() * kept_mass)[:, None]) | (p >= 1)[:, None]
    return torch.zeros_like(keep_sorted).scatter_(1, order, keep_sorted)


def join_tokens_and_log_probs(tokens: torch.Tensor, log_probs: torch.Tensor) -> tuple[list[int], list[float]]:
    """The step's one device-to-host copy: tokens and the log-probs' float32 bits as one int32 tensor."""
    joined = torch.cat([tokens.to(torch.int32), log_probs.float().view(torch.int32)]).cpu()
    n = tokens.shape[0]
    return joined[:n].tolist(), joined[n:].view(torch.float32).tolist()
