"""A served reward model: batched, batch-invariant scoring, on Ray replicas.

- `RewardModelScorer`: loads an HF sequence-classification directory (`reprorl make-tiny
  --kind reward` writes one) and scores (prompt messages, response text) pairs. The
  input is the RM's own chat template over `messages + [assistant: response]`; the score
  is the head's output at the last token.
- `RewardReplica`: one scorer in one Ray actor; it checks the run's determinism
  environment before anything else.
- `RewardModelPool`: `num_replicas` replicas; a batch is cut into contiguous chunks, one
  per replica, and the scores are concatenated back in sample order. A replica that
  died is replaced and its chunk scored again (`reprorl.actors.supervision`).

Determinism. verl serialises its reward model (`max_num_seqs=1`) so that a score cannot
depend on its batch. Here each forward packs several sequences one after another
through the engine path (`forward_packed`: one slot of a KV cache per sequence, linear
layers over the packed tokens, attention for all sequences in one batched call), and
with `batch_invariant=True` the op layer computes every row with a fixed reduction
order: a sample's score is then bitwise the same alone or in any batch, at any
position, on any replica, with any thread count. Batching only changes speed.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from reprorl.determinism import ENV_SEED, check_worker_env, enable_full_determinism, is_full_determinism
from reprorl.determinism_report import model_part_info
from reprorl.errors import ReproRLError
from reprorl.kernels import select_kernels, verify_batch_invariance
from reprorl.models.hf_io import load_model
from reprorl.models.kv_cache import KVCache
from reprorl.reward.chat import ChatScorer
from reprorl.actors.pool import ReplicaPoolBase
from reprorl.actors.supervision import PART_TIMEOUT_S, KillSwitch, Restarts, gather, time_limit


# Measured on a 2-core CPU: packing more tokens than this into one forward got slower
# (the activations outgrow the cache), and fewer gave away the batching gain.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048

# The scorer keeps its KV cache between calls (making one costs more than a tiny model's
# forward) only while it is at most this big: for a 0.5B model, 64 sequences of 2048 tokens
# would otherwise hold 3 GiB between reward steps.
KEEP_CACHE_BYTES = 256 << 20


class RewardModelScorer(ChatScorer):
    """Scores (prompt messages, response) pairs with a sequence-classification model.

    Args:
        model_path: an HF-format directory: config.json with `num_labels` 1, weights
            (`score.weight` head) and the RM's tokenizer with a chat template.
        max_num_seqs: the most sequences packed into one forward.
        max_num_batched_tokens: the most tokens in one forward (a longer sequence goes alone).
        batch_invariant: run under the op layer's batch-invariant mode (on with
            full determinism), so a score does not depend on the batch around it.
        dtype: load the weights in this dtype (None: as saved).
        device: where the model runs ("cpu" or "cuda"); scores come back on the CPU.
    """

    def __init__(
        self,
        model_path: str,
        *,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        batch_invariant: bool = True,
        dtype: torch.dtype | None = None,
        device: str = "cpu",
    ) -> None:
        if max_num_seqs < 1 or max_num_batched_tokens < 1:
            raise ValueError(f"max_num_seqs={max_num_seqs}, max_num_batched_tokens={max_num_batched_tokens}; "
                             "expected both >= 1")
        self.model_path = str(model_path)
        model, self.args = load_model(self.model_path, kind="reward", dtype=dtype)
        self.model = model.to(device)
        if self.args.num_labels != 1:
            raise ReproRLError(f"reward model {self.model_path}: num_labels={self.args.num_labels}; "
                               "a reward model gives one score (num_labels 1)")
        self.model.eval()
        from transformers import AutoTokenizer  # here: its auto classes cost seconds at import

        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        if self.tokenizer.chat_template is None:
            raise ReproRLError(f"reward model {self.model_path}: its tokenizer has no chat template")
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.batch_invariant = batch_invariant
        param = next(self.model.parameters())
        self.dtype, self.device = param.dtype, param.device
        self.model.kernels = select_kernels(self.device, batch_invariant)
        verify_batch_invariance(self.model.kernels, self.args, self.dtype, self.device)
        self._cache: KVCache | None = None  # made by the first forward

    def score_ids(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """[B] float32 scores of token-id sequences, in order, packed in order into forwards
        of at most `max_num_seqs` sequences and `max_num_batched_tokens` tokens."""
        for i, s in enumerate(sequences):
            if len(s) == 0:
                raise ValueError(f"score: sequence {i} is empty")
            if len(s) > self.args.max_position_embeddings:
                raise ValueError(f"score: sequence {i} has {len(s)} tokens, over the reward model's "
                                 f"max_position_embeddings={self.args.max_position_embeddings}")
        chunks = forward_chunks([len(s) for s in sequences], self.max_num_seqs, self.max_num_batched_tokens)
        parts = [self._forward(sequences[start:end]) for start, end in chunks]
        if self._cache is not None and self._cache.nbytes > KEEP_CACHE_BYTES:
            self._cache = None  # a big model's or long sequences' cache is not held between calls
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.float32)

    def _forward(self, sequences: Sequence[Sequence[int]]) -> torch.Tensor:
        """One packed forward: [b] float32 scores of b <= max_num_seqs non-empty sequences."""
        lens = [len(s) for s in sequences]
        ids = torch.tensor(list(itertools.chain.from_iterable(sequences)), dtype=torch.long,
                           device=self.device)  # [N]
        last = torch.tensor(list(itertools.accumulate(lens)), device=self.device) - 1  # [b] each sequence's last token
        # One cache for every forward (allocating it costs more than a tiny model's forward):
        # slots 0..b-1 start empty; what earlier forwards left past them is masked out.
        if self._cache is None:
            self._cache = KVCache.for_model(self.args, max(lens), self.max_num_seqs, self.dtype, self.device)
        self._cache.grow(max(lens))
        self._cache.lengths = [0] * self.max_num_seqs
        with torch.inference_mode():
            hidden = self.model.forward_packed(ids, lens, self._cache)  # [N, H]
            scores = self.model.scores(hidden[last])  # [b, 1]
        return scores[:, 0].float().cpu()


def forward_chunks(lengths: Sequence[int], max_num_seqs: int, max_num_batched_tokens: int) -> list[tuple[int, int]]:
    """`[start, end)` ranges cutting the sequences, in order, into forwards of at most
    `max_num_seqs` sequences and `max_num_batched_tokens` tokens; a sequence longer than
    the token budget goes alone.

    >>> forward_chunks([30, 30, 50, 200, 10, 10, 10], max_num_seqs=2, max_num_batched_tokens=100)
    [(0, 2), (2, 3), (3, 4), (4, 6), (6, 7)]
    """
    chunks, start = [], 0
    while start < len(lengths):
        end, tokens = start + 1, lengths[start]
        while end < len(lengths) and end - start < max_num_seqs and tokens + lengths[end] <= max_num_batched_tokens:
            tokens += lengths[end]
            end += 1
        chunks.append((start, end))
        start = end
    return chunks


class RewardReplica:
    """One reward-model scorer; create with `ray.remote(RewardReplica)` (as the pool does).

    `scorer_options` go to `RewardModelScorer` (max_num_seqs, max_num_batched_tokens,
    batch_invariant, dtype name, device);
    `expected_env` is the run's `determinism_env(...)`, checked before anything else.
    """

    def __init__(self, replica_id: int, model_path: str, scorer_options: Mapping[str, Any],
                 expected_env: Mapping[str, str]) -> None:
        check_worker_env(expected_env, where=f"reward replica {replica_id}")
        if is_full_determinism():
            enable_full_determinism(int(os.environ[ENV_SEED]))
        self.replica_id = replica_id
        if scorer_options.get("backend") == "vllm":  # reprorl/reward/vllm_reward.py
            from reprorl.reward.vllm_reward import VllmRewardScorer

            options = {k: v for k, v in scorer_options.items() if k not in ("backend", "batch_invariant")}
            self.scorer = VllmRewardScorer(model_path, expected_env=expected_env,
                                           where=f"reward replica {replica_id}", **options)
        else:
            from reprorl.models.hf_io import dtype_from_name

            options = dict(scorer_options, dtype=dtype_from_name(scorer_options.get("dtype")))
            self.scorer = RewardModelScorer(model_path, **options)
        self.kill_switch = KillSwitch.from_env(f"reward replica {replica_id}")  # fault tests only

    def ready(self) -> int:
        """The replica id, once the constructor ran (surfaces start-up errors)."""
        return self.replica_id

    def score(self, prompts: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> torch.Tensor:
        if self.kill_switch is not None:
            self.kill_switch.see("score")
        return self.scorer.score(prompts, responses)

    def determinism_info(self) -> dict[str, Any]:
        """This replica's determinism mode (the keys of `reprorl.rollout.replica`'s replicas)."""
        if hasattr(self.scorer, "determinism_info"):  # vLLM's, measured in its worker
            return self.scorer.determinism_info()
        return model_part_info(backend="reprorl", batch_invariant=self.scorer.batch_invariant,
                               dtype=self.scorer.dtype, kernels=self.scorer.model.kernels.name,
                               device=self.scorer.device)


class RewardModelPool(ReplicaPoolBase):
    """`num_replicas` reward-model replicas on Ray, started with the run's determinism env.

    `score(prompts, responses)` gives replica k the k-th contiguous chunk of the batch
    and concatenates the chunks' scores in order; with `batch_invariant` (default: on
    with full determinism) the result does not depend on `num_replicas`. CPUs per
    replica default as for rollout replicas: together at most half the cluster's CPUs,
    at most one each. `runtime_env` is the user's, merged with the determinism variables.

    Placement, as `ReplicaPool`'s: `device="cuda"` builds each scorer on the GPU Ray gives
    its replica (`num_gpus` each, a fraction when the run shares one GPU:
    reprorl/resources/placement.py; None = 1 on cuda, 0 on cpu), weights in `dtype` (None:
    the checkpoint's); `scheduling`, each replica's GPU on several GPUs.

    The constructor starts every replica at once and waits until all are ready;
    `wait=False` returns as soon as they are asked for, and `wait_ready()` waits.

    A replica found dead by a call is replaced within `restarts` (the run's budget; None:
    no replacement, the call raises `FaultError`) by a new actor with the next unused id,
    checked to run in the first replica's determinism mode; its chunk is scored again.
    Start-up, waiting and replacement are the rollout pool's: reprorl/actors/pool.py.
    """

    KIND = "reward replica"
    NAME = "reward model"

    def __init__(
        self,
        model_path: str,
        num_replicas: int,
        *,
        seed: int,
        full_determinism: bool,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int = DEFAULT_MAX_NUM_BATCHED_TOKENS,
        batch_invariant: bool | None = None,
        num_cpus_per_replica: float | None = None,
        runtime_env: Mapping[str, Any] | None = None,
        ray_address: str | None = None,
        backend: str = "native",
        vllm_options: Mapping[str, Any] | None = None,
        restarts: Restarts | None = None,
        device: str = "cpu",
        dtype: str | None = None,
        num_gpus: float | None = None,
        scheduling: Sequence[Any] | None = None,
        wait: bool = True,
        part_timeout_s: float = PART_TIMEOUT_S,
    ) -> None:
        super().__init__(num_replicas, backend=backend, seed=seed, full_determinism=full_determinism,
                         runtime_env=runtime_env, ray_address=ray_address, restarts=restarts,
                         num_cpus_per_replica=num_cpus_per_replica, part_timeout_s=part_timeout_s)
        options = {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "batch_invariant": full_determinism if batch_invariant is None else batch_invariant,
            "device": device, "dtype": dtype,
        }
        if backend == "vllm":  # options: reprorl/rollout/vllm_replica.py
            options = {k: v for k, v in options.items() if k != "device"}  # vLLM's platform says
            options.update(backend="vllm", **(vllm_options or {}))
        self._start_replicas(RewardReplica, num_replicas, model_path, options,
                             num_gpus=self._gpus_per_replica(device, num_gpus), max_num_seqs=max_num_seqs, wait=wait,
                             scheduling=scheduling)

    def score(self, prompts: Sequence[Sequence[Mapping[str, str]]], responses: Sequence[str]) -> torch.Tensor:
        """[B] float32 scores, in the order given."""
        if len(prompts) != len(responses):
            raise ValueError(f"score: {len(prompts)} prompts but {len(responses)} responses")
        if not prompts:
            return torch.zeros(0, dtype=torch.float32)
        # Contiguous chunks in sample order, sizes differing by at most one; chunk j on the
        # j-th replica by id, or on the replacement of a replica that died under it.
        ids = sorted(self.replicas)
        k = min(len(ids), len(prompts))
        bounds = [len(prompts) * i // k for i in range(k + 1)]
        chunks = {j: (ids[j], bounds[j], bounds[j + 1]) for j in range(k)}
        # A call's limit grows with what it scores; characters bound its tokens from above.
        chars = sum(len(m["content"]) for messages in prompts for m in messages) + sum(map(len, responses))
        limit = time_limit(self.part_timeout_s, chars)
        scores: dict[int, torch.Tensor] = {}
        while chunks:  # each pass after the first follows a charged replacement: bounded by `restarts`
            refs = {j: self.replicas[rid].score.remote(list(prompts[a:b]), list(responses[a:b]))
                    for j, (rid, a, b) in chunks.items()}
            done, dead = gather(refs, timeout_s=limit)  # a hung replica (no answer in time) is replaced too
            scores.update(done)
            replaced = self._replace_dead({chunks[j][0] for j in dead}, "score")
            chunks = {j: (replaced[rid], a, b) for j, (rid, a, b) in chunks.items() if j in dead}
        return torch.cat([scores[j] for j in sorted(scores)])
