"""Decoder-only transformers (Qwen2, Qwen3, Llama) shared by the engine and the trainer.

Three heads on one backbone, each named as transformers names it so checkpoints load
by parameter name alone:
- `CausalLM` (XForCausalLM): `lm_head`, or the embedding when tied. The policy and reference.
- `SequenceClassifier` (XForSequenceClassification): `score` [num_labels, H], no bias,
  read at each sequence's last real token. The reward model.
- `ValueModel` (XForTokenClassification, num_labels=1): `score` [1, H] with a bias, read at
  every token. The PPO critic. transformers has no value-head class; token classification
  with one label is the layout verl's critics use, so transformers and vLLM load it too.

Two forward paths, both built only from `reprorl.models.ops`:
- `forward(input_ids [B, T], attention_mask, position_ids)`: padded batches, differentiable
  (trainer log-probs, values, reward scores).
- `forward_packed(input_ids [N], positions [N], seq_lens, caches)`: the engine's path: the
  new tokens of several sequences packed back to back, each appending to its `KVCache`.
In batch-invariant mode both compute every token with the same row-wise ops and the same
per-sequence attention, so a token's hidden state is the same bits on either path,
whatever it is batched or packed with and however its prompt was chunked.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from reprorl.models import ops
from reprorl.models.arch import ModelArgs


def _dtype(args: ModelArgs, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None else getattr(torch, args.torch_dtype)


class Linear(nn.Module):
    """A linear layer that runs through `ops.linear`. Weights start at zero: they come
    from a checkpoint or an explicit init, never from a global RNG."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.zeros(out_features, dtype=dtype)) if bias else None

    def forward(self, x: Tensor) -> Tensor:
        return ops.linear(x, self.weight, self.bias)


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size, dtype=dtype))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class KVCache:
    """Keys and values of ONE sequence for every layer: [layers, capacity, kv_heads, head_dim].

    `length` counts the cached tokens; `forward_packed` appends after it and advances it.
    The engine may set `length` back to rewind (the slots past it are simply overwritten).
    """

    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        capacity: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        self.keys = torch.zeros(num_layers, capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    @classmethod
    def for_model(
        cls, args: ModelArgs, capacity: int, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
    ) -> KVCache:
        """A cache shaped for `args`, in the model's dtype unless given."""
        return cls(
            args.num_hidden_layers, args.num_key_value_heads, args.head_dim, capacity, _dtype(args, dtype), device
        )

    @property
    def capacity(self) -> int:
        return self.keys.shape[1]


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
        if args.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype)
            self.k_norm = RMSNorm(self.head_dim, args.rms_norm_eps, dtype)
        else:
            self.q_norm = self.k_norm = None

    def project(self, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x [..., H], cos/sin [..., D] -> q [..., Hq, D], k [..., Hkv, D], v [..., Hkv, D] (RoPE applied)."""
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim))
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        return ops.apply_rotary(q, cos, sin), ops.apply_rotary(k, cos, sin), v


class MLP(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.gate_proj = Linear(args.hidden_size, args.intermediate_size, args.mlp_bias, dtype)
        self.up_proj = Linear(args.hidden_size, args.intermediate_size, args.mlp_bias, dtype)
        self.down_proj = Linear(args.intermediate_size, args.hidden_size, args.mlp_bias, dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(ops.swiglu(self.gate_proj(x), self.up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, args: ModelArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.self_attn = Attention(args, dtype)
        self.mlp = MLP(args, dtype)
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, attention_mask: Tensor) -> Tensor:
        """x [B, T, H], cos/sin [B, T, D], attention_mask [B, T] -> [B, T, H]."""
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        x = x + self.self_attn.o_proj(ops.padded_attention(q, k, v, attention_mask).flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_packed(
        self, x: Tensor, cos: Tensor, sin: Tensor, seq_lens: list[int], caches: list[KVCache], layer: int
    ) -> Tensor:
        """x [N, H], cos/sin [N, D] -> [N, H]; writes this layer's keys/values into the caches.

        Sequences with one new token (decode steps) share one batched attention call; the
        others (prompts, prefill chunks) go one by one. Both give the same bits per token.
        """
        q, k, v = self.self_attn.project(self.input_layernorm(x), cos, sin)
        attn = torch.empty_like(q)  # [N, Hq, D]
        single = []  # (row in the pack, sequence) of the one-token sequences
        offset = 0
        for i, (n, cache) in enumerate(zip(seq_lens, caches)):
            start, end = cache.length, cache.length + n
            cache.keys[layer, start:end] = k[offset : offset + n]
            cache.values[layer, start:end] = v[offset : offset + n]
            if n == 1:
                single.append((offset, i))
            elif n > 1:
                attn[offset : offset + n] = ops.attention(
                    q[offset : offset + n], cache.keys[layer, :end], cache.values[layer, :end], start
                )
            offset += n
        if single:
            rows = [row for row, _ in single]
            ends = [caches[i].length + 1 for _, i in single]
            attn[rows] = ops.decode_attention(
                q[rows],
                [caches[i].keys[layer, :end] for (_, i), end in zip(single, ends)],
                [caches[i].values[layer, :end] for (_, i), end in zip(single, ends)],
            )
        x = x + self.self_attn.o_proj(attn.flatten(-2))
        return x + self.mlp(self.post_attention_layernorm(x))


class Transformer(nn.Module):
    """The backbone (HF's `model.` prefix): embeddings, decoder layers, final norm."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        dtype = _dtype(args, dtype)
        self.args = args
        self.embed_tokens = nn.Embedding(
            args.vocab_size, args.hidden_size, _weight=torch.zeros(args.vocab_size, args.hidden_size, dtype=dtype)
        )
        self.layers = nn.ModuleList(DecoderLayer(args, dtype) for _ in range(args.num_hidden_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        cos, sin = ops.rope_tables(args.head_dim, args.rope_theta, args.max_position_embeddings)
        self.register_buffer("rope_cos", cos, persistent=False)  # [P, D] float32
        self.register_buffer("rope_sin", sin, persistent=False)

    def _rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        if positions.numel() and int(positions.max()) >= self.rope_cos.shape[0]:
            raise ValueError(
                f"position {int(positions.max())} is past max_position_embeddings={self.rope_cos.shape[0]}"
            )
        return self.rope_cos[positions], self.rope_sin[positions]

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T] (1 = real; left or right padding) -> hidden [B, T, H].

        position_ids default to the number of real tokens before each token, so a sequence's
        result does not depend on its padding (transformers defaults to 0..T-1 instead).
        """
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
        cos, sin = self._rope(position_ids)
        x = F.embedding(input_ids, self.embed_tokens.weight)
        for layer in self.layers:
            x = layer(x, cos, sin, attention_mask)
        return self.norm(x)

    def forward_packed(
        self, input_ids: Tensor, positions: Tensor, seq_lens: list[int], caches: list[KVCache]
    ) -> Tensor:
        """See `CausalLM.forward_packed`."""
        if len(seq_lens) != len(caches) or sum(seq_lens) != input_ids.shape[0] or positions.shape != input_ids.shape:
            raise ValueError(
                f"forward_packed: {input_ids.shape[0]} tokens, positions {tuple(positions.shape)}, "
                f"seq_lens summing to {sum(seq_lens)} over {len(seq_lens)} sequences, {len(caches)} caches"
            )
        shape = (self.args.num_hidden_layers, self.args.num_key_value_heads, self.args.head_dim)
        for n, cache in zip(seq_lens, caches):
            if (cache.keys.shape[0], *cache.keys.shape[2:]) != shape or cache.keys.dtype != self.norm.weight.dtype:
                raise ValueError(
                    f"KVCache {tuple(cache.keys.shape)} {cache.keys.dtype} does not fit this model: "
                    f"expected [{shape[0]}, capacity, {shape[1]}, {shape[2]}] {self.norm.weight.dtype}"
                )
            if cache.length + n > cache.capacity:
                raise ValueError(f"KVCache of capacity {cache.capacity} holds {cache.length} tokens; cannot add {n}")
        cos, sin = self._rope(positions)
        x = F.embedding(input_ids, self.embed_tokens.weight)
        for i, layer in enumerate(self.layers):
            x = layer.forward_packed(x, cos, sin, seq_lens, caches, i)
        for n, cache in zip(seq_lens, caches):
            cache.length += n
        return self.norm(x)


class CausalLM(nn.Module):
    """Policy / reference model: backbone + LM head (the embedding when tied)."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.lm_head = (
            None if args.tie_word_embeddings else Linear(args.hidden_size, args.vocab_size, False, _dtype(args, dtype))
        )

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T], position_ids [B, T] | None -> logits [B, T, V]."""
        return self.logits(self.model(input_ids, attention_mask, position_ids))

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """The final-normed hidden states [B, T, H] that `logits` maps to the vocabulary."""
        return self.model(input_ids, attention_mask, position_ids)

    @torch.inference_mode()
    def forward_packed(
        self, input_ids: Tensor, positions: Tensor, seq_lens: list[int], caches: list[KVCache]
    ) -> Tensor:
        """The engine path: the new tokens of len(caches) sequences, packed back to back.

        input_ids [N], positions [N] (RoPE positions), seq_lens[i] tokens for sequence i (a
        prompt, a prefill chunk or one decode token), caches[i] its KVCache. Each token attends
        to its sequence's cached tokens and the new ones up to itself; the new keys/values are
        appended and cache.length advances. Returns final-normed hidden states [N, H],
        created in inference mode: map them with `logits` under torch.inference_mode() too.
        """
        return self.model.forward_packed(input_ids, positions, seq_lens, caches)

    def logits(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> logits [..., V]."""
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return ops.linear(hidden, weight)


class SequenceClassifier(nn.Module):
    """Reward model: backbone + `score` head read at each sequence's last real token."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.score = Linear(args.hidden_size, args.num_labels, False, _dtype(args, dtype))

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
        self, input_ids: Tensor, positions: Tensor, seq_lens: list[int], caches: list[KVCache]
    ) -> Tensor:
        """As `CausalLM.forward_packed`; score a sequence with `scores(hidden[its last token])`."""
        return self.model.forward_packed(input_ids, positions, seq_lens, caches)

    def scores(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> [..., num_labels]."""
        return self.score(hidden)


class ValueModel(nn.Module):
    """PPO critic: backbone + `score` head [1, H] with bias, one value per token."""

    def __init__(self, args: ModelArgs, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args = args
        self.model = Transformer(args, dtype)
        self.score = Linear(args.hidden_size, 1, True, _dtype(args, dtype))

    def forward(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """input_ids [B, T], attention_mask [B, T] -> values [B, T]."""
        return self.values(self.model(input_ids, attention_mask, position_ids))

    def hidden_states(
        self, input_ids: Tensor, attention_mask: Tensor | None = None, position_ids: Tensor | None = None
    ) -> Tensor:
        """Final-normed hidden states [B, T, H]."""
        return self.model(input_ids, attention_mask, position_ids)

    def values(self, hidden: Tensor) -> Tensor:
        """hidden [..., H] -> values [...]."""
        return self.score(hidden).squeeze(-1)
