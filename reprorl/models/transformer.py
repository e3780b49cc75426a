"""Decoder-only transformers (the families of `models/arch.py`) shared by the engine and the trainer.

Three heads on one backbone, each named as transformers names it so checkpoints load
by parameter name alone:
- `CausalLM` (XForCausalLM): `lm_head`, or the embedding when tied. The policy and reference.
- `SequenceClassifier` (XForSequenceClassification): `score` [num_labels, H], no bias,
  read at each sequence's last real token. The reward model.
- `ValueModel` (XForTokenClassification, num_labels=1): `score` [1, H] with a bias, read at
  every token. The PPO critic. transformers has no value-head class; token classification
  with one label is the layout verl's critics use, so transformers and vLLM load it too.

Two forward paths, both built only from the model's kernels (`reprorl.kernels`; the
model holds its backend in `kernels`, stock torch unless the engine or trainer chooses):
- `forward(input_ids [B, T], attention_mask, position_ids)`: padded batches, differentiable
  (trainer log-probs, values, reward scores).
- `forward_packed(input_ids [N], seq_lens, cache, slots)`: the engine's and the reward
  model's path: the new tokens of several sequences packed back to back, each appending to
  its slot of a `KVCache`; attention for all of them in one or two batched calls.
With a batch-invariant backend both compute every token with the same row-wise ops and the
same attention arithmetic (`batched_attention`), so a token's hidden state is the same bits
on either path, whatever it is batched or packed with and however its prompt was chunked.
"""

from __future__ import annotations

import torch
import torch.utils.checkpoint
import torch.nn.functional as F
from torch import Tensor, nn

from reprorl.kernels import TorchKernels
from reprorl.kernels.backend import Kernels
from reprorl.kernels.shared import Padding, rope_tables, rotary_tables, write_rows
from reprorl.models.arch import ModelArgs, model_dtype
from reprorl.models.kv_cache import KVCache, cache_rows
from reprorl.models.packing import PackPlan
from reprorl.models.rope import inverse_frequencies, max_positions


class Linear(nn.Module):
    """A linear layer that runs through the model's kernels. Weights start at zero: they
    come from a checkpoint or an explicit init, never from a global RNG. With LoRA
    adapters (`lora_A`, `lora_B`: models/lora.py), PEFT's `x W^T + b + (x A^T) B^T * scaling`,
    each product on the same kernels, unless switched off (`lora_enabled`)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None
        self.lora_A: nn.Parameter | None = None
        self.lora_B: nn.Parameter | None = None
        self.lora_scaling = 0.0
        self.lora_enabled = True

    def forward(self, x: Tensor, kernels: Kernels) -> Tensor:
        y = kernels.linear(x, self.weight, self.bias)
        if self.lora_A is None or not self.lora_enabled:
            return y
        return y + kernels.linear(kernels.linear(x, self.lora_A), self.lora_B) * self.lora_scaling


class RMSNorm(nn.Module):
    """RMSNorm with its weight, or (`plus_one`, Gemma's) with 1 + its weight, which starts at 0."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, plus_one: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size, dtype=dtype) if plus_one else torch.ones(size, dtype=dtype))
        self.eps = eps
        self.plus_one = plus_one

    def forward(self, x: Tensor, kernels: Kernels) -> Tensor:
        # 1 + w in float32, as transformers' Gemma3RMSNorm, rounded once to the weight's dtype
        # for the kernel (a bfloat16 model's (1 + w) is one bfloat16 rounding from transformers').
        weight = (self.weight.float() + 1.0).to(self.weight.dtype) if self.plus_one else self.weight
        return kernels.rms_norm(x, weight, self.eps)


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads = args.num_attention_heads
        self.num_kv_heads = args.num_key_value_heads
        self.head_dim = args.head_dim
        hidden, q_out, kv_out = args.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = Linear(hidden, q_out, args.qkv_bias, dtype)
        self.k_proj = Linear(hidden, kv_out, args.qkv_bias, dtype)
        self.v_proj = Linear(hidden, kv_out, args.qkv_bias, dtype)
        self.o_proj = Linear(q_out, hidden, args.o_bias, dtype)
        # q/k norms per head (qwen3), or over the whole projection (olmo2: `qk_norm_whole`)
        self.qk_norm_whole = args.qk_norm_whole
        if args.qk_norm or args.qk_norm_whole:
            q_width, k_width = (q_out, kv_out) if args.qk_norm_whole else (self.head_dim, self.head_dim)
            self.q_norm = RMSNorm(q_width, args.rms_norm_eps, dtype, args.norm_plus_one)
            self.k_norm = RMSNorm(k_width, args.rms_norm_eps, dtype, args.norm_plus_one)
        else:
            self.q_norm = self.k_norm = None
        # The kernels scale scores by head_dim^-1/2; gemma3 wants query_pre_attn_scalar^-1/2:
        # the queries take the ratio's square root (1.0 for Gemma 3 1B-12B, where both are 256).
        scalar = args.query_pre_attn_scalar
        self.query_scale = 1.0 if scalar is None else (self.head_dim / scalar) ** 0.5

    def project(self, x: Tensor, cos: Tensor, sin: Tensor, kernels: Kernels) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., H], cos/sin [..., D] -> q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D] (RoPE applied)."""
        q, k = self.q_proj(x, kernels), self.k_proj(x, kernels)
        if self.qk_norm_whole:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        q = q.unflatten(-1, (self.num_heads, self.head_dim))
        k = k.unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x, kernels).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None and not self.qk_norm_whole:
            q, k = self.q_norm(q, kernels), self.k_norm(k, kernels)
        q = self._rotate(q, cos, sin, kernels)
        if self.query_scale != 1.0:
            q = q * self.query_scale
        return q, self._rotate(k, cos, sin, kernels), v

    def _rotate(self, x: Tensor, cos: Tensor, sin: Tensor, kernels: Kernels) -> Tensor:
        """RoPE on each head's first cos.shape[-1] dimensions (all, but for a partial rotary: phi3)."""
        rotary = cos.shape[-1]
        if rotary == self.head_dim:
            return kernels.apply_rotary(x, cos, sin)
        return torch.cat((kernels.apply_rotary(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, args.mlp_bias, dtype)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, args.mlp_bias, dtype)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias, dtype)
        self.gated = args.gated  # the kernel: "swiglu" or "geglu"

    def forward(self, x: Tensor, kernels: Kernels) -> Tensor:
        gated = getattr(kernels, self.gated)
        return self.down_proj(gated(self.gate_proj(x, kernels), self.up_proj(x, kernels)), kernels)


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype, index: int) -> None:
        super().__init__()
        self.self_attn = Attention(args, dtype)
        self.mlp = MLP(args, dtype)
        self.window = args.layer_windows[index]  # attention's: 0 (full) or the sliding window
        # Pre-norm (Llama, Qwen): x + attn(norm(x)), then + mlp(norm(.)). Post-norm (OLMo 2):
        # x + norm(attn(x)), then + norm(mlp(.)), with HF's names for those two norms.
        # Sandwich (Gemma 3): both, x + norm(attn(norm(x))), then + norm(mlp(norm(.))).
        self.post_norm = args.post_norm
        hidden, eps, plus_one = args.hidden_size, args.rms_norm_eps, args.norm_plus_one
        pre_norm = args.sandwich_norm or not args.post_norm
        self.input_layernorm = RMSNorm(hidden, eps, dtype, plus_one) if pre_norm else None
        self.post_attention_layernorm = RMSNorm(hidden, eps, dtype, plus_one)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, dtype, plus_one) if args.sandwich_norm else None
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, dtype, plus_one) if args.post_norm else None

    def _attention_input(self, x: Tensor, kernels: Kernels) -> Tensor:
        return x if self.input_layernorm is None else self.input_layernorm(x, kernels)

    def _rest(self, x: Tensor, attn: Tensor, kernels: Kernels) -> Tensor:
        """The layer after attention: attn [..., Hq, D] through o_proj into the residual, then the MLP's."""
        out = self.self_attn.o_proj(attn.flatten(-2), kernels)
        if self.post_norm:
            x = x + self.post_attention_layernorm(out, kernels)
            h = x if self.pre_feedforward_layernorm is None else self.pre_feedforward_layernorm(x, kernels)
            return x + self.post_feedforward_layernorm(self.mlp(h, kernels), kernels)
        x = x + out
        return x + self.mlp(self.post_attention_layernorm(x, kernels), kernels)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, padding: Padding, kernels: Kernels) -> Tensor:
        """x [B, T, H], cos/sin [B, T, D], padding (the batch's, `Transformer.forward`) -> [B, T, H]."""
        q, k, v = self.self_attn.project(self._attention_input(x, kernels), cos, sin, kernels)
        return self._rest(x, kernels.padded_attention(q, k, v, padding, window=self.window), kernels)

    def forward_packed(self, x: Tensor, cos: Tensor, sin: Tensor, plan: PackPlan, cache: KVCache, layer: int,
                       kernels: Kernels) -> Tensor:
        """x [N, H], cos/sin [N, D] -> [N, H]; writes this layer's keys/values into the cache.

        Attention runs in one `batched_attention` call per group of `plan` (the decode
        tokens, the longer chunks), whatever the number of sequences.
        """
        q, k, v = self.self_attn.project(self._attention_input(x, kernels), cos, sin, kernels)  # [N, Hq|Hkv, D]
        keys, values = cache.keys[layer], cache.values[layer]  # [slots, Hkv, cap, D]
        kv_rows = plan.kv_rows(cache)
        write_rows(keys.view(-1, keys.shape[-1]), kv_rows, k.reshape(-1, k.shape[-1]))
        write_rows(values.view(-1, values.shape[-1]), kv_rows, v.reshape(-1, v.shape[-1]))
        if plan.in_order:  # decode tokens of consecutive slots, in slot order: no gather, no scatter
            lo, hi = plan.lo, plan.hi
            out = kernels.batched_attention(q[:, :, None], keys[lo:hi], values[lo:hi], plan.q_start,
                                            window=self.window)
            attn = out[:, :, 0]  # [N, Hq, D]
        else:
            attn = q.new_empty(q.shape)  # [N, Hq, D]
            q_ext = torch.cat([q, q.new_zeros(1, *q.shape[1:])])  # row N: zeros for padding queries
            for g in plan.groups:
                qg = q_ext[g.gather].permute(0, 2, 1, 3)  # [B, Hq, Tq, D]
                rows = slice(g.lo, g.hi) if g.index is None else g.index
                kg, vg = keys[rows], values[rows]
                out = kernels.batched_attention(qg, kg, vg, g.q_start, window=self.window)  # [B, Hq, Tq, D]
                real = out.permute(0, 2, 1, 3).reshape(-1, q.shape[1] * q.shape[2])[g.real]
                write_rows(attn.view(attn.shape[0], -1), g.rows, real)
        return self._rest(x, attn, kernels)


    def forward_decode(self, x: Tensor, cos: Tensor, sin: Tensor, slots: Tensor, kv_rows: Tensor,
                       q_start: Tensor, cache: KVCache, layer: int, attention, kernels: Kernels) -> Tensor:
        """One decode token per row, with no host sync and static shapes (a CUDA graph can
        replay it): x [B, H], slots [B], kv_rows [B * Hkv] (`cache_rows`); q_start [S] (every
        slot of the cache; 0 for slots not decoding). Attention runs over all S slots as one
        view (zero queries for the idle ones cost a key block each) and each row takes its
        slot's output."""
        q, k, v = self.self_attn.project(self._attention_input(x, kernels), cos, sin, kernels)  # [B, Hq|Hkv, D]
        keys, values = cache.keys[layer], cache.values[layer]  # [S, Hkv, cap, D]
        write_rows(keys.view(-1, keys.shape[-1]), kv_rows, k.reshape(-1, k.shape[-1]))
        write_rows(values.view(-1, values.shape[-1]), kv_rows, v.reshape(-1, v.shape[-1]))
        q_all = q.new_zeros(keys.shape[0], *q.shape[1:])  # [S, Hq, D]
        write_rows(q_all.view(q_all.shape[0], -1), slots, q.reshape(q.shape[0], -1))
        attn = attention(q_all[:, :, None], keys, values, q_start, window=self.window)[slots, :, 0]  # [B, Hq, D]
        return self._rest(x, attn, kernels)


class Transformer(nn.Module):
    """The backbone (HF's `model.` prefix): embeddings, decoder layers, final norm.

    `kernels`: the backend every op runs on (`reprorl.kernels`); stock torch by default."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = model_dtype(args, dtype)
        self.args = args
        self.embed_tokens = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype)
        )
        self.layers = nn.ModuleList(DecoderLayer(args, dtype, i) for i in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype, args.norm_plus_one)
        self.kernels = TorchKernels
        # Recompute each layer's activations in backward (the trainer's option): the same
        # kernels run twice on the same inputs, so the gradient keeps its bits.
        self.gradient_checkpointing = False
        inv_freq, attention_factor = inverse_frequencies(args.rope_scaling, args.rotary_dim, args.rope_theta,
                                                         args.max_position_embeddings)
        positions = max_positions(args.rope_scaling, args.max_position_embeddings)
        cos, sin_rot = rotary_tables(inv_freq, positions, attention_factor)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D] float32
        self.register_buffer("rope_sin_rot", sin_rot, persistent=False)  # sin, first half negated
        # Gemma 3's sliding layers rotate with plain RoPE of their own base: a second pair.
        self.local_layers = [bool(w) and args.local_rope_theta is not None for w in args.layer_windows]
        if any(self.local_layers):
            cos, sin_rot = rope_tables(args.rotary_dim, args.local_rope_theta, positions)
        self.register_buffer("rope_local_cos", cos if any(self.local_layers) else None, persistent=False)
        self.register_buffer("rope_local_sin_rot", sin_rot if any(self.local_layers) else None, persistent=False)
        # transformers multiplies by sqrt(hidden) rounded to the weights' dtype (`_embed`)
        self.embed_scale = args.hidden_size**0.5 if args.scale_embeddings else None

    def _embed(self, input_ids: Tensor) -> Tensor:
        x = F.embedding(input_ids, self.embed_tokens.weight)
        if self.embed_scale is None:
            return x
        return x * torch.tensor(self.embed_scale).to(x.dtype).item()

    def _rope(self, positions: Tensor, bound: int | None = None) -> list[tuple[Tensor, Tensor]]:
        """Each layer's rotary tables (cos, sin_rot) at `positions`, which must be inside them.
        `bound`: an upper bound of the positions known on the host; when it is inside the tables
        the check reads nothing from the device (on a GPU, reading positions.max() waits for the
        queue: once a forward). Otherwise the check reads the max, except while a CUDA graph is
        being captured."""
        inside = bound is not None and bound < self.rope_cos.shape[0]
        capturing = positions.is_cuda and torch.cuda.is_current_stream_capturing()
        if not inside and positions.numel() and not capturing and int(positions.max()) >= self.rope_cos.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is past max_position_embeddings={self.rope_cos.shape[0]}"
            )
        tables = (self.rope_cos[positions], self.rope_sin_rot[positions])
        if self.rope_local_cos is None:
            return [tables] * len(self.layers)
        local = (self.rope_local_cos[positions], self.rope_local_sin_rot[positions])
        return [local if is_local else tables for is_local in self.local_layers]

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, *,
        position_bound: int | None = None,
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T] (1 = real; left or right padding) -> hidden [B, T, H].

        position_ids default to the number of real tokens before each token, so a sequence's
        result does not depend on its padding (transformers defaults to 0..T-1 instead).
        `position_bound`: the largest of the given position_ids, when the caller knows it on
        the host (`_rope`: the check then reads nothing from the device).
        """
        padding = Padding(attention_mask)  # its sorts once, for every layer
        bound = position_bound
        if position_ids is None:  # each below the row's length: at most T - 1
            if attention_mask is None:
                position_ids = torch.arange(input_ids.shape[-1], device=input_ids.device).expand_as(input_ids)
            else:
                position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
            bound = input_ids.shape[-1] - 1
        # An invariant backend's layers run on each row's real tokens first (`Padding.front` says why).
        front = padding.front() if self.kernels.batch_invariant and padding.mask is not None else None
        if front is not None:
            input_ids, position_ids = padding.to_front(input_ids), padding.to_front(position_ids)
        layout = padding if front is None else front
        x = self._embed(input_ids)
        for layer, (cos, sin) in zip(self.layers, self._rope(position_ids, bound)):
            if self.gradient_checkpointing and torch.is_grad_enabled():
                x = torch.utils.checkpoint.checkpoint(layer, x, cos, sin, layout, self.kernels, use_reentrant=False)
            else:
                x = layer(x, cos, sin, layout, self.kernels)
        x = self.norm(x, self.kernels)
        return x if front is None else padding.from_front(x)

    def forward_packed(
        self, input_ids: Tensor, seq_lens: list[int], cache: KVCache, slots: list[int] | None = None
    ) -> Tensor:
        """See `CausalLM.forward_packed`."""
        slots = list(range(len(seq_lens))) if slots is None else list(slots)
        if len(seq_lens) != len(slots) or sum(seq_lens) != input_ids.shape[0] or min(seq_lens, default=1) < 1:
            raise ValueError(
                f"forward_packed: {input_ids.shape[0]} tokens, seq_lens {list(seq_lens)[:8]} summing to "
                f"{sum(seq_lens)} over {len(seq_lens)} sequences, {len(slots)} slots; expected one slot and "
                "at least one token per sequence"
            )
        shape = (self.args.num_hidden_layers, self.args.num_key_value_heads, self.args.head_dim)
        got = (len(cache.keys), cache.keys[0].shape[1], cache.keys[0].shape[3])
        if got != shape or cache.dtype != self.embed_tokens.weight.dtype:
            raise ValueError(
                f"KVCache of {got[0]} layers x {got[1]} kv heads x head_dim {got[2]}, {cache.dtype}, does not "
                f"fit this model: expected {shape[0]} x {shape[1]} x {shape[2]}, {self.embed_tokens.weight.dtype}"
            )
        if len(set(slots)) != len(slots) or not all(0 <= s < cache.num_slots for s in slots):
            raise ValueError(f"forward_packed: slots {slots[:8]} must be distinct, in [0, {cache.num_slots})")
        starts = [cache.lengths[s] for s in slots]
        for n, s, start in zip(seq_lens, slots, starts):
            if start + n > cache.capacity:
                raise ValueError(
                    f"KVCache slot {s} of capacity {cache.capacity} holds {start} tokens; cannot add {n}"
                )
        plan = PackPlan(seq_lens, slots, starts, input_ids.device)
        rope = self._rope(plan.positions, max((start + n for n, start in zip(seq_lens, starts)), default=0) - 1)
        x = self._embed(input_ids)
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, rope)):
            x = layer.forward_packed(x, cos, sin, plan, cache, i, self.kernels)
        for n, s in zip(seq_lens, slots):
            cache.lengths[s] += n
        return self.norm(x, self.kernels)


    def forward_decode(self, input_ids: Tensor, slots: Tensor, positions: Tensor, cache: KVCache,
                       attention=None) -> Tensor:
        """A decode step as device ops only (what `reprorl.rollout.cuda_graphs` captures):
        input_ids, slots, positions [B] on the device; each row's token goes to position
        positions[b] of slot slots[b] (rows may share a padding slot). `attention`: a
        `batched_attention` that reads no value on the host (default: the kernels').
        Unlike `forward_packed` it checks nothing and leaves `cache.lengths` to the caller.
        -> hidden [B, H]. With batch-invariant kernels a row's bits equal `forward_packed`'s."""
        attention = attention or self.kernels.batched_attention
        q_start = positions.new_zeros(cache.num_slots, 1)  # [S, 1]
        write_rows(q_start, slots, positions[:, None])  # the padding rows' duplicates: the spare slot's
        kv_rows = cache_rows(cache, slots, positions)
        x = self._embed(input_ids)
        for i, (layer, (cos, sin)) in enumerate(zip(self.layers, self._rope(positions))):
            x = layer.forward_decode(x, cos, sin, slots, kv_rows, q_start[:, 0], cache, i, attention, self.kernels)
        return self.norm(x, self.kernels)


class _BackboneKernels:
    """`kernels` of a model with a head: the backbone's backend (`reprorl.kernels`), which
    its head's linear uses too; setting it sets the backbone's."""

    @property
    def kernels(self):
        return self.model.kernels

    @kernels.setter
    def kernels(self, backend) -> None:
        self.model.kernels = backend


class CausalLM(_BackboneKernels, nn.Module):
    """Policy / reference model: backbone + LM head (the embedding when tied)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.lm_head = (
            None if args.tie_word_embeddings
            else Linear(args.hidden_size, args.vocab_size, False, model_dtype(args, dtype))
        )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, *,
        position_bound: int | None = None,
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T], position_ids [B, T] | None -> logits [B, T, V]
        (`position_bound`: as `Transformer.forward`)."""
        return self.logits(self.model(input_ids, attention_mask, position_ids, position_bound=position_bound))

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, *,
        position_bound: int | None = None,
    ) -> Tensor:
        """The final-normed hidden states [B, T, H] that `logits` maps to the vocabulary."""
        return self.model(input_ids, attention_mask, position_ids, position_bound=position_bound)

    @torch.inference_mode()
    def forward_packed(
        self, input_ids: Tensor, seq_lens: list[int], cache: KVCache, slots: list[int] | None = None
    ) -> Tensor:
        """The engine path: the new tokens of len(seq_lens) sequences, packed back to back.

        input_ids [N]; seq_lens[i] tokens for sequence i (a prompt, a prefill chunk or one
        decode token), cached in slot slots[i] of `cache` (default: slot i), at positions
        cache.lengths[slot] onwards (also their RoPE positions). Each token attends to its
        sequence's cached tokens and the new ones up to itself; the new keys/values are
        appended and the slot's length advances. Returns final-normed hidden states [N, H],
        created in inference mode: map them with `logits` under torch.inference_mode() too.
        """
        return self.model.forward_packed(input_ids, seq_lens, cache, slots)

    def forward_decode(self, input_ids: Tensor, slots: Tensor, positions: Tensor, cache: KVCache,
                       attention=None) -> Tensor:
        """See `Transformer.forward_decode` (call under torch.inference_mode())."""
        return self.model.forward_decode(input_ids, slots, positions, cache, attention)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> logits [..., V]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return self.kernels.linear(hidden, weight)


class SequenceClassifier(_BackboneKernels, nn.Module):
    """Reward model: backbone + `score` head read at each sequence's last real token."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.score = Linear(args.hidden_size, args.num_labels, False, model_dtype(args, dtype))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T] -> scores [B, num_labels] at the last real token.

        "Last real" is the rightmost position with attention_mask 1 (transformers looks for
        the rightmost token that is not pad_token_id; the mask also works when pad == eos).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self.model(input_ids, attention_mask, position_ids)  # [B, T, H]
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        last = (positions * attention_mask.long()).argmax(-1)  # [B]
        return self.scores(hidden[torch.arange(hidden.shape[0], device=hidden.device), last])

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Final-normed hidden states [B, T, H]."""
        return self.model(input_ids, attention_mask, position_ids)

    @torch.inference_mode()
    def forward_packed(
        self, input_ids: Tensor, seq_lens: list[int], cache: KVCache, slots: list[int] | None = None
    ) -> Tensor:
        """As `CausalLM.forward_packed`; score a sequence with `scores(hidden[its last token])`."""
        return self.model.forward_packed(input_ids, seq_lens, cache, slots)

    def scores(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> [..., num_labels]."""
        return self.score(hidden, self.kernels)


class ValueModel(_BackboneKernels, nn.Module):
    """PPO critic: backbone + `score` head [1, H] with bias, one value per token."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.score = Linear(args.hidden_size, 1, True, model_dtype(args, dtype))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, *,
        position_bound: int | None = None,
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T] -> values [B, T] (`position_bound`: as
        `Transformer.forward`)."""
        return self.values(self.model(input_ids, attention_mask, position_ids, position_bound=position_bound))

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None, *,
        position_bound: int | None = None,
    ) -> Tensor:
        """Final-normed hidden states [B, T, H]."""
        return self.model(input_ids, attention_mask, position_ids, position_bound=position_bound)

    def values(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> values [...]."""
        return self.score(hidden, self.kernels).squeeze(-1)
