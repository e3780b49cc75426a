"""`data.overlong_prompts=truncate_*` reaches the engine: the rollout sends the dataset's cut
`prompt_ids`, not the whole messages re-templated (which crashed the run at the first long
prompt), in the single-turn and the tool loop alike (no engine, no Ray: a recording fake)."""

import asyncio
import json
from dataclasses import dataclass

import pytest

from reprorl.agent_loop.manager import plan_samples
from reprorl.agent_loop.request import rollout_requests
from reprorl.agent_loop.worker import AgentLoopWorker, ShippedTokenizer
from reprorl.data.dataset import PromptDataset
from reprorl.errors import DataError
from reprorl.models.hf_io import load_tokenizer
from reprorl.protocol import Batch
from reprorl.rollout.load_balancer import LoadBalancer
from reprorl.rollout.request import SamplingParams

MAX_PROMPT = 24
SAMPLING = SamplingParams(temperature=1.0, max_tokens=200)
TOOL_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call><|im_end|>'


@dataclass
class FakeOutput:
    token_ids: list
    log_probs: list
    finish_reason: str


class RecordingReplica:
    """A rollout replica as the worker calls it (`generate.remote(...)`, awaited): answers
    every turn with `text` and records the prompt of each call."""

    def __init__(self, tokenizer, text):
        self.ids = tokenizer.encode(text, add_special_tokens=False)
        self.prompts = []
        self.generate = self  # so that `replica.generate.remote` is `self.remote`

    async def remote(self, request_id, prompt_ids, params, seed, priority):
        self.prompts.append(list(prompt_ids))
        ids = self.ids[: params.max_tokens]
        return FakeOutput(ids, [-1.0] * len(ids), "stop")


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, char_tokenizer):
    out = tmp_path_factory.mktemp("char-tokenizer")
    char_tokenizer.save_pretrained(out)
    return out


def _long_prompts(tmp_path, n=2):
    """A JSONL file of `n` prompts well over MAX_PROMPT tokens (the char tokenizer: a token a character)."""
    path = tmp_path / "long.jsonl"
    rows = [{"data_source": "reprorl/arithmetic", "ability": "math",
             "prompt": [{"role": "user", "content": f"question {i}: " + "1+" * 30 + f"{i}="}],
             "reward_model": {"style": "rule", "ground_truth": "31"}} for i in range(n)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _batch(dataset):
    """The rows as the trainer hands them to the rollout: ids and messages both."""
    rows = list(dataset.rows)
    return Batch(non_tensors={"uid": [f"train-{r.index}" for r in rows], "repeat_index": [0] * len(rows),
                              "prompt_ids": [list(r.prompt_ids) for r in rows],
                              "raw_prompt": [r.messages for r in rows]},
                 meta={"step": 1})


def _plan(batch, **kwargs):
    return plan_samples(rollout_requests(batch), run_seed=3, sampling_params=SAMPLING, val_sampling_params=SAMPLING,
                        max_response_length=200, **kwargs)


@pytest.mark.parametrize("mode", ["truncate_left", "truncate_right"])
@pytest.mark.parametrize("agent", ["single_turn", "tool"])
def test_the_engine_gets_the_truncated_prompt(tmp_path, char_tokenizer, tokenizer_dir, mode, agent):
    dataset = PromptDataset(_long_prompts(tmp_path), char_tokenizer, MAX_PROMPT, overlong=mode)
    assert dataset.stats["truncated"] == 2
    cut = [r.prompt_ids for r in dataset.rows]
    assert all(len(ids) == MAX_PROMPT for ids in cut)
    samples = _plan(_batch(dataset), max_prompt_length=MAX_PROMPT)
    assert [s.prompt_ids for s in samples] == cut and all("raw_prompt" not in s.extra for s in samples)

    replica = RecordingReplica(char_tokenizer, TOOL_CALL)
    tokenizer = ShippedTokenizer(load_tokenizer(tokenizer_dir))
    worker = AgentLoopWorker(0, {0: replica}, LoadBalancer([0]), tokenizer, {}, agent, max_turns=2)
    outputs = asyncio.run(worker.generate(samples))
    assert [o.prompt_ids for o in outputs] == cut
    turns = 2 if agent == "tool" else 1  # the tool loop's second turn ran
    assert len(replica.prompts) == turns * len(samples)
    assert sorted(p for p in replica.prompts if len(p) == MAX_PROMPT) == sorted(cut)  # first turns
    assert all(p[:MAX_PROMPT] in cut for p in replica.prompts)  # later turns continue them


def test_a_prompt_over_the_limit_fails_before_the_engine():
    batch = Batch(non_tensors={"uid": ["a", "b"], "repeat_index": [0, 0], "prompt_ids": [[1, 2], [1, 2, 3]]},
                  meta={"step": 1})
    assert len(_plan(batch, max_prompt_length=3)) == 2
    with pytest.raises(DataError, match=r"^rollout batch row 1 \(uid 'b'\): prompt of 3 tokens is longer than "
                                        r"max_prompt_length=2; expected at most that$"):
        _plan(batch, max_prompt_length=2)


def test_messages_alone_are_templated_by_the_worker():
    msgs = [{"role": "user", "content": "1+1?"}]
    (sample,) = _plan(Batch(non_tensors={"uid": ["q"], "repeat_index": [0], "raw_prompt": [msgs]}, meta={"step": 0}))
    assert sample.prompt_ids is None and sample.raw_prompt == msgs
