"""The multi-turn tool loop: generate, run the tool calls, append the results, repeat.

    prompt ... <|im_start|>assistant\\n
    [model]  I'll compute it. <tool_call>{"name": "calculator", ...}</tool_call><|im_end|>
    [tool]   \\n<|im_start|>tool\\n<tool_response>\\n27\\n</tool_response><|im_end|>\\n<|im_start|>assistant\\n
    [model]  The answer is 27.<|im_end|>

The response is everything after the prompt; `response_mask` is 1 exactly on [model]
tokens. The tool turn's tokens come from the tokenizer's own chat template (what it
renders for a `tool` message after an assistant message), so the transcript is what the
trainer would get from rendering the conversation.

Determinism: turn k is sampled with `sample.seed(k)` (= `request_seed(..., turn=k)`),
the request id is the same for every turn (sticky routing), and tools are pure
functions of their arguments, or, with state (the `python` tool), of the trajectory's
calls so far, in a session of the trajectory's own (`session_tools`); so the transcript
is a function of the sample's identity. A tool call runs on a thread, so a program in the
sandbox does not hold up the worker's other trajectories.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Callable
from typing import Any

from reprorl.agent_loop.single_turn import AgentOutput, AgentSample, GenerateFn, output_log_probs
from reprorl.agent_loop.tools import (SESSIONS, TOOL_RESPONSE_END, TOOL_RESPONSE_START, TOOLS, parse_tool_calls,
                                      run_tool_call, session_tools)


class ToolAgentLoop:
    """Generate until a turn has no tool call, `max_turns` turns ran, or the budget is spent.

    The budget is `sample.sampling_params.max_tokens` tokens of response in all (model
    and tool tokens); each turn may generate what is left of it, and a tool turn that
    does not fit is truncated and ends the loop with finish reason "length".
    """

    def __init__(self, tokenizer: Any, max_turns: int, tools: dict[str, Callable[..., str]] = TOOLS):
        if max_turns < 1:
            raise ValueError(f"ToolAgentLoop: max_turns={max_turns}; expected >= 1")
        self.tokenizer = tokenizer
        self.max_turns = max_turns
        self.tools = tools
        if any(fn in SESSIONS for fn in tools.values()):  # the python tool: refuse now if it cannot be isolated
            from reprorl.sandbox import require_isolation

            require_isolation()
        self.eos_id = tokenizer.eos_token_id
        # What the template puts after an assistant message's eos ("\n" in ChatML): the
        # model stops at eos, so the tool turn starts with it.
        base = self._render([{"role": "user", "content": "."}, {"role": "assistant", "content": "."}], False)
        if self.eos_id not in base:
            raise ValueError("ToolAgentLoop: the chat template does not end assistant turns with the eos token")
        last_eos = len(base) - 1 - base[::-1].index(self.eos_id)
        self._after_eos = base[last_eos + 1 :]
        self._base = base

    def _render(self, messages: list[dict[str, str]], add_generation_prompt: bool) -> list[int]:
        out = self.tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(out["input_ids"] if hasattr(out, "keys") else out)

    def tool_turn_ids(self, tool_outputs: list[str], model_ended_with_eos: bool) -> list[int]:
        """Tokens from the end of the model's turn to the start of its next one."""
        content = "\n".join(f"{TOOL_RESPONSE_START}\n{out}\n{TOOL_RESPONSE_END}" for out in tool_outputs)
        messages = [{"role": "user", "content": "."}, {"role": "assistant", "content": "."}]
        full = self._render(messages + [{"role": "tool", "content": content}], True)
        if full[: len(self._base)] != self._base:
            raise ValueError(
                "ToolAgentLoop: the chat template renders earlier turns differently when a tool turn follows"
            )
        close = ([] if model_ended_with_eos else [self.eos_id]) + self._after_eos
        return close + full[len(self._base) :]

    async def run(self, sample: AgentSample, generate: GenerateFn) -> AgentOutput:
        budget = sample.sampling_params.max_tokens
        response: list[int] = []
        mask: list[int] = []
        log_probs: list[float] = []
        tools = session_tools(self.tools)
        turn = 0
        while True:
            params = dataclasses.replace(sample.sampling_params, max_tokens=budget - len(response))
            out = await generate(
                sample.request_id, sample.prompt_ids + response, params, sample.seed(turn), sample.index
            )
            tokens = list(out.token_ids)
            turn += 1
            response += tokens
            mask += [1] * len(tokens)
            log_probs += output_log_probs(out, len(tokens))
            finish = out.finish_reason
            if finish != "stop" or turn >= self.max_turns or len(response) >= budget:
                break
            calls = parse_tool_calls(self.tokenizer.decode(tokens, skip_special_tokens=False))
            if not calls:
                break
            outputs = [await asyncio.to_thread(run_tool_call, call, tools) for call in calls]
            tool_ids = self.tool_turn_ids(
                outputs,
                model_ended_with_eos=bool(tokens) and tokens[-1] == self.eos_id,
            )
            room = budget - len(response)
            if len(tool_ids) >= room:  # no room left for another model turn
                tool_ids, finish = tool_ids[:room], "length"
            response += tool_ids
            mask += [0] * len(tool_ids)
            log_probs += [0.0] * len(tool_ids)
            if finish == "length":
                break
        return AgentOutput(
            prompt_ids=list(sample.prompt_ids),
            response_ids=response,
            response_mask=mask,
            response_log_probs=log_probs,
            num_turns=turn,
            finish_reason=finish,
        )
