"""The single-turn and tool loops on a scripted fake `generate` (no engine, no Ray)."""

import asyncio
import json
from dataclasses import dataclass

import pytest

from reprorl.agent_loop.single_turn import AgentSample, SingleTurnAgentLoop
from reprorl.agent_loop.tool_loop import ToolAgentLoop
from reprorl.determinism import request_seed
from reprorl.rollout.request import SamplingParams


@dataclass
class FakeOutput:
    token_ids: list
    log_probs: list
    finish_reason: str


class ScriptedGenerate:
    """Returns the scripted texts turn after turn; records every call."""

    def __init__(self, tokenizer, texts, finish_reasons=None):
        self.tokenizer = tokenizer
        self.texts = list(texts)
        self.finish_reasons = finish_reasons or ["stop"] * len(texts)
        self.calls = []

    async def __call__(self, request_id, prompt_ids, params, seed, priority):
        turn = len(self.calls)
        self.calls.append(dict(request_id=request_id, prompt_ids=list(prompt_ids), params=params, seed=seed,
                               priority=priority))
        ids = self.tokenizer.encode(self.texts[turn], add_special_tokens=False)[: params.max_tokens]
        # Distinct, exactly representable log-probs so the test can see which token got which.
        return FakeOutput(ids, [-(turn + 1) - i / 64 for i in range(len(ids))], self.finish_reasons[turn])


def _sample(tokenizer, max_tokens=400):
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3*(4+5)?"}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    return AgentSample(index=5, request_id="s3/u7/1", prompt_ids=list(prompt),
                       sampling_params=SamplingParams(temperature=1.0, max_tokens=max_tokens),
                       seed_identity=(11, 3, "u7", 1, "train"))


def _call(expression):
    return "<tool_call>" + json.dumps({"name": "calculator", "arguments": {"expression": expression}}) + "</tool_call>"


def _enc(tok, text):
    return tok.encode(text, add_special_tokens=False)


def test_single_turn(char_tokenizer):
    sample = _sample(char_tokenizer)
    gen = ScriptedGenerate(char_tokenizer, ["27<|im_end|>"])
    out = asyncio.run(SingleTurnAgentLoop().run(sample, gen))
    assert out.response_ids == _enc(char_tokenizer, "27<|im_end|>")
    assert out.response_mask == [1, 1, 1]
    assert out.response_log_probs == [-1.0, -1 - 1 / 64, -1 - 2 / 64]
    assert (out.num_turns, out.finish_reason) == (1, "stop")
    assert gen.calls[0]["seed"] == request_seed(11, 3, "u7", 1, 0)
    assert gen.calls[0]["priority"] == 5


def test_tool_loop_transcript_and_masks(char_tokenizer):
    tok = char_tokenizer
    sample = _sample(tok)
    turn0 = "Let me compute. " + _call("3*(4+5)") + "<|im_end|>"
    turn1 = "It is 27.<|im_end|>"
    gen = ScriptedGenerate(tok, [turn0, turn1])
    out = asyncio.run(ToolAgentLoop(tok, max_turns=4).run(sample, gen))

    tool_turn = "\n<|im_start|>tool\n<tool_response>\n27\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
    m0, t, m1 = _enc(tok, turn0), _enc(tok, tool_turn), _enc(tok, turn1)
    assert out.response_ids == m0 + t + m1
    assert out.response_mask == [1] * len(m0) + [0] * len(t) + [1] * len(m1)
    assert out.response_log_probs == (
        [-1 - i / 64 for i in range(len(m0))] + [0.0] * len(t) + [-2 - i / 64 for i in range(len(m1))]
    )
    assert (out.num_turns, out.finish_reason) == (2, "stop")
    # Same request id every turn (sticky routing); turn k's seed is request_seed(..., turn=k);
    # turn 1 sees the prompt, turn 0 and the tool turn; its budget is what is left.
    assert [c["request_id"] for c in gen.calls] == ["s3/u7/1", "s3/u7/1"]
    assert [c["seed"] for c in gen.calls] == [request_seed(11, 3, "u7", 1, turn) for turn in (0, 1)]
    assert gen.calls[1]["prompt_ids"] == sample.prompt_ids + m0 + t
    assert gen.calls[1]["params"].max_tokens == 400 - len(m0) - len(t)
    assert gen.calls[1]["params"].temperature == 1.0


def test_tool_loop_malformed_call_is_an_error_message(char_tokenizer):
    tok = char_tokenizer
    turn0 = "<tool_call>{calculator: 1+1}</tool_call><|im_end|>"
    gen = ScriptedGenerate(tok, [turn0, "sorry<|im_end|>"])
    out = asyncio.run(ToolAgentLoop(tok, max_turns=4).run(_sample(tok), gen))
    text = tok.decode(out.response_ids, skip_special_tokens=False)
    assert "<tool_response>\nerror: tool call is not valid JSON (Expecting property name enclosed" in text
    assert text.endswith("sorry<|im_end|>")
    assert out.num_turns == 2


def test_tool_loop_stops_at_max_turns_and_without_calls(char_tokenizer):
    tok = char_tokenizer
    calls = [_call(f"{k}+1") + "<|im_end|>" for k in range(5)]
    gen = ScriptedGenerate(tok, calls)
    out = asyncio.run(ToolAgentLoop(tok, max_turns=3).run(_sample(tok), gen))
    assert out.num_turns == 3 and len(gen.calls) == 3
    # The last turn's tool call is not run: the response ends with the model's tokens.
    assert out.response_mask[-1] == 1
    gen = ScriptedGenerate(tok, ["no tools needed<|im_end|>"])
    assert asyncio.run(ToolAgentLoop(tok, max_turns=3).run(_sample(tok), gen)).num_turns == 1


def test_tool_loop_budget_truncates_the_tool_turn(char_tokenizer):
    tok = char_tokenizer
    turn0 = _call("6*7") + "<|im_end|>"
    n0 = len(_enc(tok, turn0))
    gen = ScriptedGenerate(tok, [turn0, "never reached"])
    out = asyncio.run(ToolAgentLoop(tok, max_turns=4).run(_sample(tok, max_tokens=n0 + 10), gen))
    assert len(out.response_ids) == n0 + 10
    assert out.response_mask == [1] * n0 + [0] * 10
    assert out.finish_reason == "length" and out.num_turns == 1
    # A model turn cut by the budget ends the loop even if it holds a call.
    gen = ScriptedGenerate(tok, [turn0], finish_reasons=["length"])
    out = asyncio.run(ToolAgentLoop(tok, max_turns=4).run(_sample(tok, max_tokens=n0 + 5), gen))
    assert out.finish_reason == "length" and out.num_turns == 1


def test_tool_turn_closes_a_turn_that_ended_without_eos(char_tokenizer):
    loop = ToolAgentLoop(char_tokenizer, max_turns=2)
    with_eos = loop.tool_turn_ids(["1"], model_ended_with_eos=True)
    without = loop.tool_turn_ids(["1"], model_ended_with_eos=False)
    assert without == [char_tokenizer.eos_token_id] + with_eos


def test_max_turns_validated(char_tokenizer):
    with pytest.raises(ValueError, match="max_turns=0"):
        ToolAgentLoop(char_tokenizer, max_turns=0)


def test_the_saved_tokenizer_renders_tool_turns_like_the_original(char_tokenizer, tiny_policy):
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tiny_policy)  # what the workers use
    assert loaded.encode("a\nb", add_special_tokens=False) == char_tokenizer.encode("a\nb", add_special_tokens=False)
    assert ToolAgentLoop(loaded, 2).tool_turn_ids(["42"], True) == ToolAgentLoop(char_tokenizer, 2).tool_turn_ids(
        ["42"], True)
