"""Agent loops: how a prompt becomes a response (one turn, or several with tools).

- `manager`: `AgentLoopManager.generate_sequences(batch, do_sample) -> batch`, the rollout
  entry point (per-sample identity, seeds and params; workers; padding, in sample order).
- `request`: `RolloutRequest`, a row's identity (uid, repeat index, step, phase, prompt,
  do_sample) as the manager reads it.
- `worker`: `AgentLoopWorker`, the Ray actor that runs a chunk's loops (no torch).
- `single_turn`: `AgentSample` / `AgentOutput` and the single-turn loop.
- `tool_loop`: the multi-turn loop with tool calls.
- `tools`: the tool registry (a dict), the calculator, the tool-call format.
"""
