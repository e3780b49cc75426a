"""The agent-loop worker: one Ray actor that runs the agent loops of a chunk of samples.

A process of its own for each worker (`AgentLoopManager` starts them). It tokenizes,
routes requests through the load balancer and runs tools; it runs no model, so nothing it
imports pulls in torch (about 2 s of a core and 300 MB a worker);
`tests/agent_loop/test_manager.py` checks that. Nor does it import transformers until a
row needs the tokenizer (`ShippedTokenizer`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import pickle
from collections.abc import Mapping
from typing import Any

import numpy as np

from reprorl.agent_loop.single_turn import AgentOutput, AgentSample, SingleTurnAgentLoop
from reprorl.agent_loop.tool_loop import ToolAgentLoop
from reprorl.agent_loop.tools import select_tools
from reprorl.data.dataset import template_ids
from reprorl.determinism import check_worker_env, stable_digest
from reprorl.determinism_report import process_info
from reprorl.rollout.load_balancer import generate_balanced
from reprorl.actors.supervision import KillSwitch


class ShippedTokenizer:
    """The policy's tokenizer on its way to the agent-loop workers: pickled once, shipped as
    bytes, unpickled in a worker on first use. Unpickling imports transformers (about 1.2 s
    of a core), which a worker whose rows all come tokenized and single-turn (the trainer's)
    never needs."""

    def __init__(self, tokenizer: Any):
        self._blob = pickle.dumps(tokenizer)
        self._tokenizer = tokenizer

    def __getstate__(self) -> dict[str, Any]:
        return {"_blob": self._blob, "_tokenizer": None}

    def get(self) -> Any:
        if self._tokenizer is None:
            self._tokenizer = pickle.loads(self._blob)  # noqa: S301 (bytes this class pickled)
        return self._tokenizer


class AgentLoopWorker:
    """Runs agent loops for a chunk of samples; create with `ray.remote(AgentLoopWorker)`.

    A row's loop is its `agent_name` column ("single_turn" or "tool") if the batch has
    one, else `agent`. The tool loop may call the tools named in `tools` (None = every
    tool in `TOOLS`). Every generate call goes through `generate_balanced` (the shared
    balancer actor; retry on a dead replica; the prompt's digest as its affinity key). The
    samples of one call run concurrently, so the replicas see them all at once and batch them.
    """

    def __init__(self, worker_id: int, replicas: Mapping[int, Any], balancer: Any, tokenizer: ShippedTokenizer,
                 expected_env: Mapping[str, str], agent: str, max_turns: int, tools: list[str] | None = None,
                 template_kwargs: Mapping[str, Any] | None = None):
        """`tokenizer`: the policy's, as `load_tokenizer` gives it, in a `ShippedTokenizer`
        (the manager loads it once and ships it so: loading it here imported transformers'
        auto classes, 2-4 s of a core in every worker)."""
        check_worker_env(expected_env, where=f"agent-loop worker {worker_id}")
        self.replicas = dict(replicas)
        self.balancer = balancer
        self._tokenizer = tokenizer
        self.agent = agent
        self.template_kwargs = dict(template_kwargs or {})
        self._tool_loop_args = (max_turns, select_tools(tools))
        self.loops: dict[str, Any] = {"single_turn": SingleTurnAgentLoop()}
        if agent == "tool":  # made now: a chat template the loop cannot use fails the worker's start
            self._loop("tool")
        self.kill_switch = KillSwitch.from_env(f"agent-loop worker {worker_id}")  # fault tests only

    async def generate(self, samples: list[AgentSample],
                       limits: tuple[float | None, float | None] = (None, None)) -> list[AgentOutput]:
        """The loops' outputs, in the order of `samples`. `limits`: (seconds a generate
        request may take on a replica, seconds a balancer call may take); see `rollout_limits`."""
        return list(await asyncio.gather(*(self._run(s, limits) for s in samples)))

    async def ready(self) -> bool:
        """True once the constructor ran (surfaces start-up errors)."""
        return True

    async def set_replicas(self, replicas: Mapping[int, Any], balancer: Any = None) -> None:
        """Route to these replica handles (the pool replaced some), through `balancer` if given
        (the manager replaced it), from now on."""
        self.replicas = dict(replicas)
        self.balancer = balancer if balancer is not None else self.balancer

    async def determinism_info(self) -> dict[str, Any]:
        """Its process's determinism switches and variables (it runs no model)."""
        return process_info()

    @property
    def tokenizer(self) -> Any:
        return self._tokenizer.get()

    def _loop(self, name: str) -> Any:
        """The loop `name`; the tool loop is made on first use (it needs the tokenizer)."""
        if name not in self.loops:
            self.loops[name] = ToolAgentLoop(self.tokenizer, *self._tool_loop_args)
        return self.loops[name]

    async def _run(self, sample: AgentSample, limits: tuple[float | None, float | None]) -> AgentOutput:
        if sample.prompt_ids is None:
            ids = template_ids(self.tokenizer, sample.raw_prompt, self.template_kwargs)
            sample = dataclasses.replace(sample, prompt_ids=ids)
        generate = functools.partial(self._generate, limits=limits)
        return await self._loop(sample.extra.get("agent_name", self.agent)).run(sample, generate)

    async def _generate(self, request_id, prompt_ids, sampling_params, seed, priority, *, limits):
        if self.kill_switch is not None:
            self.kill_switch.see(request_id)
        # The copies of a prompt meet on one replica, which prefills it once (prefix sharing).
        affinity = stable_digest(np.asarray(prompt_ids, dtype=np.int64).tobytes())
        return await generate_balanced(self.balancer, self.replicas, request_id, prompt_ids,
                                       sampling_params, seed, priority, affinity=affinity, timeout_s=limits[0],
                                       balancer_timeout_s=limits[1])
