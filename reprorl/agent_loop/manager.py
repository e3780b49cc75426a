"""The agent-loop manager: a batch of prompts in, a batch of padded responses out.

    AgentLoopManager.generate_sequences(batch)
      -> rollout_requests: each row as a typed request (request.py)
      -> plan_samples: per row, its identity (request id, seeds), params and priority
      -> contiguous chunks of rows to `num_workers` AgentLoopWorker actors
           -> each runs its rows' loops concurrently; every generate call goes through
              the shared load balancer to a rollout replica
      -> outputs concatenated back in row order -> assemble: padded tensors

Determinism: everything that decides a sample (prompt ids, params, seeds) is fixed by
`plan_samples` from the row alone, before any routing; workers and replicas only decide
where and when it runs. So the output is the same for any number of workers or
replicas, any batch around a row, and any retry after a replica died.

Faults (`reprorl.actors.supervision`): a request whose replica dies, or does not answer
within its limit (hung), is retried on another by the balancer; a chunk whose worker dies
or hangs is run again on a replacement worker, a chunk that found every replica dead is
run again once the pool has replaced them, and one whose balancer died or hung once a new
balancer took over. Limits: `rollout_limits`.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import ray
import torch
from ray.exceptions import RayActorError, RayTaskError

from reprorl.agent_loop.request import RolloutRequest, rollout_requests
from reprorl.agent_loop.single_turn import AgentOutput, AgentSample
from reprorl.agent_loop.tools import select_tools
from reprorl.agent_loop.worker import AgentLoopWorker, ShippedTokenizer
from reprorl.errors import DataError
from reprorl.models.hf_io import load_tokenizer
from reprorl.protocol import Batch
from reprorl.rollout.load_balancer import BalancerError, LoadBalancerActor, NoReplicaError
from reprorl.actors.pool import wait_for_actors
from reprorl.rollout.request import SamplingParams
from reprorl.actors.supervision import (
    PART_TIMEOUT_S, PartTimeoutError, gather, get_within, replace_dead, time_limit,
)

AGENTS = ("single_turn", "tool")


def greedy_params(params: SamplingParams) -> SamplingParams:
    """`params` made greedy: temperature 0, no top-p/top-k (the seed is then ignored)."""
    return dataclasses.replace(params, temperature=0.0, top_p=1.0, top_k=-1)


def plan_samples(
    requests: list[RolloutRequest],
    *,
    run_seed: int,
    sampling_params: SamplingParams,
    val_sampling_params: SamplingParams,
    max_response_length: int,
    max_prompt_length: int | None = None,
) -> list[AgentSample]:
    """One `AgentSample` per request, in order: the sample's whole identity, before routing.

    For request i:
    - priority i (its row number) and its `request_id`, "{phase}/{step}/{uid}/{repeat_index}";
    - seeds `request_seed(run_seed, step, uid, repeat_index, turn, phase=phase)` (a
      validation's phase "val" keeps them apart from training's, see `request_seed`);
    - params: `val_sampling_params` for phase "val", else `sampling_params`; greedy where
      `do_sample` is False. Their `max_tokens` is kept (`rollout.max_tokens`); it must be at
      most `max_response_length`, the width the responses are padded to.
    A prompt longer than `max_prompt_length` (None: no limit) is a DataError here, before
    any request reaches a replica, and so are two requests of one (uid, repeat_index).
    """
    samples, seen = [], {}
    for i, request in enumerate(requests):
        base = val_sampling_params if request.phase == "val" else sampling_params
        if base.max_tokens > max_response_length:
            raise ValueError(f"sampling params max_tokens={base.max_tokens} is more than max_response_length="
                             f"{max_response_length}, the width responses are padded to; expected at most that")
        identity = (request.uid, request.repeat_index)
        if identity in seen:
            # Same identity -> same seed and request id: a bug upstream (e.g. a ReMax
            # baseline row that reuses a sampled row's repeat_index).
            raise DataError(f"rollout batch rows {seen[identity]} and {i} have the same "
                            f"(uid, repeat_index) = ({request.uid!r}, {request.repeat_index}); every row needs its own")
        seen[identity] = i
        agent_name = request.extra.get("agent_name", AGENTS[0])
        if agent_name not in AGENTS:
            raise DataError(f"rollout batch row {i}: agent_name={agent_name!r}, expected one of {AGENTS}")
        ids = request.prompt_ids
        if ids is not None and max_prompt_length is not None and len(ids) > max_prompt_length:
            raise DataError(f"rollout batch row {i} (uid {request.uid!r}): prompt of {len(ids)} tokens is longer "
                            f"than max_prompt_length={max_prompt_length}; expected at most that")
        samples.append(AgentSample(
            index=i,
            request_id=request.request_id,
            prompt_ids=None if ids is None else list(ids),
            raw_prompt=request.raw_prompt,
            sampling_params=base if request.do_sample else greedy_params(base),
            seed_identity=(run_seed, request.step, request.uid, request.repeat_index, request.phase),
            extra=dict(request.extra),
        ))
    return samples


def split_contiguous(n: int, k: int) -> list[tuple[int, int]]:
    """`[start, end)` ranges cutting `range(n)` into min(k, n) contiguous parts, sizes
    differing by at most one (the first `n % k` parts are one longer).

    >>> split_contiguous(7, 3)
    [(0, 3), (3, 5), (5, 7)]
    """
    k = max(1, min(k, n))
    bounds = [0]
    for i in range(k):
        bounds.append(bounds[-1] + n // k + (1 if i < n % k else 0))
    return list(zip(bounds[:-1], bounds[1:]))


def assemble(
    outputs: list[AgentOutput], *, pad_token_id: int, max_response_length: int, max_prompt_length: int | None = None
) -> dict[str, torch.Tensor]:
    """The loops' outputs as padded tensors, rows in the order given.

    P = `max_prompt_length` (or the longest prompt), R = `max_response_length`.
    Returns `prompts` [B, P] (left-padded), `responses` [B, R] (right-padded),
    `response_mask` [B, R] (1 on model tokens), `rollout_log_probs` [B, R] float32 (0 on
    padding and tool tokens), `input_ids` / `attention_mask` / `position_ids` [B, P+R]
    (attention 1 on every real prompt and response token; positions count real tokens
    from 0, and stay 0 over the left padding).
    """
    B = len(outputs)
    P = max_prompt_length if max_prompt_length is not None else max((len(o.prompt_ids) for o in outputs), default=0)
    R = max_response_length
    prompts = torch.full((B, P), pad_token_id, dtype=torch.long)
    prompt_attn = torch.zeros((B, P), dtype=torch.long)
    responses = torch.full((B, R), pad_token_id, dtype=torch.long)
    response_attn = torch.zeros((B, R), dtype=torch.long)
    response_mask = torch.zeros((B, R), dtype=torch.long)
    log_probs = torch.zeros((B, R), dtype=torch.float32)
    for i, o in enumerate(outputs):
        p, r = len(o.prompt_ids), len(o.response_ids)
        if p > P:
            raise DataError(f"rollout row {i}: prompt of {p} tokens is longer than max_prompt_length={P}")
        if r > R:
            raise RuntimeError(f"rollout row {i}: response of {r} tokens exceeds max_response_length={R}")
        if p:
            prompts[i, P - p :] = torch.tensor(o.prompt_ids, dtype=torch.long)
            prompt_attn[i, P - p :] = 1
        if r:
            responses[i, :r] = torch.tensor(o.response_ids, dtype=torch.long)
            response_attn[i, :r] = 1
            response_mask[i, :r] = torch.tensor(o.response_mask, dtype=torch.long)
            # float32 -> Python float -> float32 is exact: the engine's bits survive.
            log_probs[i, :r] = torch.tensor(o.response_log_probs, dtype=torch.float32)
    attention_mask = torch.cat([prompt_attn, response_attn], dim=1)  # [B, P+R]
    return {
        "prompts": prompts,
        "responses": responses,
        "response_mask": response_mask,
        "rollout_log_probs": log_probs,
        "input_ids": torch.cat([prompts, responses], dim=1),
        "attention_mask": attention_mask,
        "position_ids": torch.clamp(attention_mask.cumsum(dim=1) - 1, min=0),
    }


def rollout_limits(part_timeout_s: float, *, num_samples: int, sample_tokens: int, max_turns: int,
                   num_replicas: int) -> tuple[float, float, float]:
    """Seconds allowed to (a generate request, a balancer call, a worker's chunk) of a rollout.

    A request may wait behind every other request of the rollout on its replica, so each
    gets the whole rollout's limit: `time_limit(part_timeout_s, num_samples * sample_tokens)`
    (`sample_tokens`: a sample's prompt and response budget). A balancer call is
    bookkeeping: `part_timeout_s`. A chunk's rows run concurrently, but each turn may try
    every replica, the hung ones first: max_turns * num_replicas * (request + 2 balancer calls).

    >>> rollout_limits(10.0, num_samples=4, sample_tokens=72, max_turns=1, num_replicas=2)
    (10.0, 10.0, 60.0)
    """
    request_s = time_limit(part_timeout_s, num_samples * sample_tokens)
    return request_s, part_timeout_s, max_turns * max(1, num_replicas) * (request_s + 2 * part_timeout_s)


class AgentLoopManager:
    """Rolls out batches over `num_workers` agent-loop workers and `pool`'s replicas.

    `pool`: a `ReplicaPool` (its replicas, run seed and runtime_env are used).
    `sampling_params` / `val_sampling_params`: the rollout's and validation's params
    (validation defaults to the rollout's); their `max_tokens` (at most
    `max_response_length`, which responses are padded to) bounds each response.
    `agent`: the default loop, "single_turn" or "tool" (a row's `agent_name` column
    overrides it); `max_turns` bounds the tool loop, which may call
    the tools named in `tools` (`tools.select_tools`; a bad entry is a ValueError);
    `template_kwargs` go to the chat template with the messages of a sample that comes
    without prompt ids (the tools' schemas). `routing`: the balancer's mode ("least_loaded" or "hash").
    A dead worker, or the balancer actor, is replaced within the pool's restart budget
    (`pool.restarts`); so is a hung one: past its limit (`rollout_limits` of `part_timeout_s`).
    """

    def __init__(
        self,
        pool: Any,
        num_workers: int,
        tokenizer_path: str,
        *,
        max_response_length: int,
        sampling_params: SamplingParams,
        val_sampling_params: SamplingParams | None = None,
        max_prompt_length: int | None = None,
        agent: str = "single_turn",
        max_turns: int = 4,
        routing: str = "least_loaded",
        tools: list[str] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        part_timeout_s: float = PART_TIMEOUT_S,
        wait: bool = True,
    ):
        if agent not in AGENTS:
            raise ValueError(f"AgentLoopManager: agent={agent!r}; expected one of {AGENTS}")
        try:
            select_tools(tools)  # here, before any worker starts
        except ValueError as err:
            raise ValueError(f"AgentLoopManager: tools: {err}") from None
        if num_workers < 1:
            raise ValueError(f"AgentLoopManager: num_workers={num_workers}; expected >= 1")
        self.run_seed = pool.seed
        self.max_response_length = max_response_length
        self.max_prompt_length = max_prompt_length
        self.sampling_params = sampling_params
        self.val_sampling_params = val_sampling_params or sampling_params
        tokenizer = load_tokenizer(tokenizer_path)
        self.pad_token_id = tokenizer.pad_token_id
        self.num_generate_sequences_calls = 0
        self.pool = pool
        self.restarts = pool.restarts
        self.restarts.watch("agent-loop worker")
        self.restarts.watch("load balancer")
        self.part_timeout_s = part_timeout_s
        self.max_turns = max_turns
        self._balancer = LoadBalancerActor.options(runtime_env=pool.runtime_env)
        self._routing = routing
        self.balancer_id, self._new_balancer_ids = 0, itertools.count(1)
        self.balancer = self._start_balancer(pool.replica_ids(), wait=False)
        self.replicas = dict(pool.replicas)  # what the balancer and the workers route to
        # num_cpus=0: a worker mostly awaits replicas; it must not hold a CPU they need.
        self._worker = ray.remote(AgentLoopWorker).options(num_cpus=0, runtime_env=pool.runtime_env)
        self._worker_args = (ShippedTokenizer(tokenizer), pool.env, agent, max_turns, tools, template_kwargs)
        self.workers = {i: self._start_worker(i) for i in range(num_workers)}
        self._new_worker_ids = itertools.count(num_workers)  # a replacement's id: never one used before
        self.first_worker_info: dict[str, Any] | None = None  # what a replacement must equal; set by wait_ready
        if wait:
            self.wait_ready()

    def wait_ready(self) -> None:
        """Block until the balancer and every worker have started (within the pools' start
        limit). Done by the constructor unless `wait=False`, which returns once the processes
        are asked for, so that they start beside the other parts (reprorl/trainer/parts.py);
        call it before any other method. A second call returns at once."""
        if self.first_worker_info is not None:
            return
        wait_for_actors([self.balancer], f"load balancer {self.balancer_id}", 0, method="__ray_ready__")
        wait_for_actors(list(self.workers.values()), "agent-loop workers", 0)
        self.first_worker_info = self._get(self.workers[0].determinism_info.remote(), "agent-loop worker 0")

    def generate_sequences(self, batch: Batch, do_sample: Sequence[bool] | None = None) -> Batch:
        """Responses for every row of `batch`, in row order (see `rollout_requests`,
        `plan_samples`, `assemble`); `do_sample`: a flag a row, False for a greedy row
        (ReMax's baseline; None: every row sampled).

        Returns the tensors of `assemble`, the input's non-tensor columns plus
        `request_id`, `num_turns`, `finish_reason`, the input's tensor columns that
        `assemble` does not replace, and its meta plus `num_generate_calls` (engine calls).
        """
        self.num_generate_sequences_calls += 1
        samples = plan_samples(rollout_requests(batch, do_sample), run_seed=self.run_seed,
                               sampling_params=self.sampling_params, val_sampling_params=self.val_sampling_params,
                               max_response_length=self.max_response_length,
                               max_prompt_length=self.max_prompt_length)
        outputs = self._run(samples)
        tensors = assemble(outputs, pad_token_id=self.pad_token_id, max_response_length=self.max_response_length,
                           max_prompt_length=self.max_prompt_length)
        tensors.update({k: t for k, t in batch.tensors.items() if k not in tensors})
        non_tensors = dict(batch.non_tensors)
        non_tensors["request_id"] = [s.request_id for s in samples]
        non_tensors["num_turns"] = [o.num_turns for o in outputs]
        non_tensors["finish_reason"] = [o.finish_reason for o in outputs]
        meta = dict(batch.meta, num_generate_calls=sum(o.num_turns for o in outputs))
        return Batch(tensors, non_tensors, meta)

    def _run(self, samples: list[AgentSample]) -> list[AgentOutput]:
        """The loops' outputs for `samples`, in order: one contiguous chunk per worker.

        A chunk whose worker died or hung, or whose requests found every replica dead, or
        whose balancer died or hung, runs again (on a replacement worker, once the pool
        replaced the replicas, through a new balancer) under request ids marked
        `#retry<k>`: the failed attempt's requests may still be running on a replica.
        Each rerun follows a charged replacement, so `pool.restarts` bounds the loop.
        """
        self.pool.replace_dead("a probe before a rollout")
        self._sync_replicas()
        limits = rollout_limits(self.part_timeout_s, num_samples=len(samples), max_turns=self.max_turns,
                                sample_tokens=(self.max_prompt_length or 0) + self.max_response_length,
                                num_replicas=len(self.replicas))
        bounds = dict(enumerate(split_contiguous(len(samples), len(self.workers))))
        owner = dict(zip(bounds, sorted(self.workers)))  # chunk -> worker id
        chunks = {k: samples[a:b] for k, (a, b) in bounds.items()}
        parts: dict[int, list[AgentOutput]] = {}
        for attempt in itertools.count(1):
            refs = {k: self.workers[owner[k]].generate.remote(chunk, limits[:2]) for k, chunk in chunks.items()}
            done, failed = gather(refs, (RayActorError, NoReplicaError, BalancerError), timeout_s=limits[2])
            parts.update(done)
            if not failed:
                break
            self._recover(failed, owner)
            # A dead or hung worker never released its requests: the balancer would count them in flight.
            self._on_balancer([("release", (s.request_id,)) for k in failed for s in chunks[k]],
                              "releasing a failed chunk's requests")
            chunks = {k: [dataclasses.replace(s, request_id=f"{s.request_id}#retry{attempt}")
                          for s in samples[slice(*bounds[k])]] for k in failed}
        return [o for k in sorted(parts) for o in parts[k]]

    def _recover(self, failed: Mapping[int, BaseException], owner: dict[int, int]) -> None:
        """Replace what the failed chunks lost: their dead or hung workers, the balancer, the pool's dead replicas."""
        for err in failed.values():
            if isinstance(err, RayTaskError) and not isinstance(err, (NoReplicaError, BalancerError)):
                raise err  # the worker ran and failed: nothing here mends it
        dead = {k: err for k, err in failed.items() if isinstance(err, (RayActorError, PartTimeoutError))}
        replaced = self._replace_dead_workers({owner[k]: err for k, err in dead.items()}, "a rollout")
        owner.update({k: replaced[owner[k]] for k in dead})
        lost_balancer = [e for e in failed.values() if isinstance(e, BalancerError)]
        if lost_balancer:
            cause = getattr(lost_balancer[0], "cause", None) or lost_balancer[0]  # Ray's wrapper holds the worker's
            self._replace_balancer(str(cause).removeprefix("the load balancer "), "a rollout")
        lost_replicas = [e for e in failed.values() if isinstance(e, NoReplicaError)]
        if lost_replicas and not self.pool.replace_dead("a probe after a rollout lost every replica"):
            raise lost_replicas[0]
        self._sync_replicas()

    def _get(self, ref: Any, what: str) -> Any:
        """`ray.get(ref)` within `part_timeout_s` (`get_within`)."""
        return get_within(ref, self.part_timeout_s, what)

    def _start_worker(self, worker_id: int) -> Any:
        return self._worker.remote(worker_id, self.replicas, self.balancer, *self._worker_args)

    def _start_worker_ready(self, worker_id: int) -> Any:
        """A replacement, started and ready (`replace_dead` kills it if this raises)."""
        actor = self._start_worker(worker_id)
        wait_for_actors([actor], f"agent-loop worker {worker_id}", 0)
        return actor

    def _replace_dead_workers(self, dead: Mapping[int, BaseException], noticed_in: str) -> dict[int, int]:
        """Replace each dead or hung worker (in id order); returns {dead id: replacement id}."""
        return replace_dead(self.workers, dead, "agent-loop worker", self._new_worker_ids,
                            start=self._start_worker_ready, reference_info=self.first_worker_info,
                            restarts=self.restarts, noticed_in=noticed_in, timeout_s=self.part_timeout_s)

    def _start_balancer(self, replica_ids: list[int], wait: bool = True) -> Any:
        """A balancer actor over `replica_ids`, started (within the pools' start limit) unless
        not `wait` (then `wait_ready` waits)."""
        balancer = self._balancer.remote(replica_ids, self._routing, expected_env=self.pool.env)
        if wait:
            wait_for_actors([balancer], f"load balancer {self.balancer_id}", 0, method="__ray_ready__")
        return balancer

    def _replace_balancer(self, how: str, noticed_in: str) -> None:
        """Charge the budget, kill the balancer, start another over the replicas routed to
        now and hand it to every worker. Only speed is lost: routing decides no bit."""
        self.restarts.charge("load balancer", self.balancer_id, noticed_in, how)
        ray.kill(self.balancer)
        self.balancer_id = next(self._new_balancer_ids)
        self.balancer = self._start_balancer(sorted(self.replicas))
        # A worker that does not take it fails its next chunk, and is replaced then.
        gather({i: w.set_replicas.remote(self.replicas, self.balancer) for i, w in self.workers.items()},
               timeout_s=self.part_timeout_s)

    def _on_balancer(self, calls: list[tuple[str, tuple]], noticed_in: str) -> None:
        """Make `calls` (method, args) on the balancer; one that died or hung is replaced
        instead (the new one starts from the replicas routed to, nothing in flight)."""
        refs = {i: getattr(self.balancer, method).remote(*args) for i, (method, args) in enumerate(calls)}
        _, failed = gather(refs, timeout_s=self.part_timeout_s)
        if failed:
            err = failed[min(failed)]
            self._replace_balancer(f"hung ({err})" if isinstance(err, PartTimeoutError) else "died", noticed_in)

    def _sync_replicas(self) -> None:
        """Route to the pool's replicas as they are now (it may have replaced some)."""
        current = dict(self.pool.replicas)
        if set(current) != set(self.replicas):
            self.replicas = current
            # A worker that died or hangs is ignored here: its next chunk fails and replaces it.
            gather({i: w.set_replicas.remote(current) for i, w in self.workers.items()}, timeout_s=self.part_timeout_s)
        self._on_balancer([("set_replicas", (sorted(current),))], "routing to the pool's replicas")

    def determinism_info(self) -> dict[int, dict[str, Any]]:
        """Each worker's `determinism_info()`, by worker id (for the determinism report)."""
        results, dead = gather({i: w.determinism_info.remote() for i, w in self.workers.items()},
                               timeout_s=self.part_timeout_s)
        for new_id in self._replace_dead_workers(dead, "determinism_info").values():
            results[new_id] = self._get(self.workers[new_id].determinism_info.remote(), f"agent-loop worker {new_id}")
        return dict(sorted(results.items()))

    def shutdown(self) -> None:
        for w in self.workers.values():
            ray.kill(w)
        ray.kill(self.balancer)
        self.workers = {}
