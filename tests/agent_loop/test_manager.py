"""The agent-loop manager end to end: Ray workers, the balancer, replicas of a tiny model.

Every determinism claim is checked with exact equality (`Batch.equal`, `torch.equal`).
Slow: starting the Ray actors (4 replicas, 5 workers, 3 balancers) takes 30-90 s on 2 cores.
"""

import pytest
import torch

from reprorl.protocol import Batch
from reprorl.rollout.request import SamplingParams

QUESTIONS = ["What is 3*(4+5)?", "Add 12 and 30.", "Compute 7-9.", "Is 5 > 2?"]
R = 128  # max_response_length: long enough for the random model to stumble on tool calls
SAMPLING = SamplingParams(temperature=1.0, max_tokens=R)

pytestmark = pytest.mark.slow


def _batch(prompt_indices, repeats, step=0, agent_name=None, validate=False):
    """Rows (prompt i, repeat r) for i in prompt_indices, r in range(repeats[i]), in that order."""
    uids, reps, msgs = [], [], []
    for i in prompt_indices:
        for r in range(repeats[i] if isinstance(repeats, dict) else repeats):
            uids.append(f"q{i}")
            reps.append(r)
            msgs.append([{"role": "user", "content": QUESTIONS[i]}])
    cols = {"uid": uids, "repeat_index": reps, "raw_prompt": msgs, "data_source": ["arith"] * len(uids)}
    if agent_name is not None:
        cols["agent_name"] = [agent_name] * len(uids)
    return Batch(non_tensors=cols, meta={"step": step, "validate": validate})


@pytest.fixture(scope="module")
def managers(pools, tiny_policy):
    """(replicas, workers) -> manager: 1 replica/1 worker, 3/1 and 3/3."""
    from reprorl.agent_loop.manager import AgentLoopManager

    made = {
        (r, w): AgentLoopManager(pools[r], w, tiny_policy, max_response_length=R, sampling_params=SAMPLING,
                                 max_turns=3, wait=False)
        for r, w in ((1, 1), (3, 1), (3, 3))
    }
    for m in made.values():  # started together, their processes' start-ups overlap
        m.wait_ready()
    yield made
    for m in made.values():
        m.shutdown()


def test_same_batch_across_replica_and_worker_counts(managers):
    # 7 rows: not a multiple of 3 workers; uneven copies per prompt.
    batch = _batch([0, 1, 2], {0: 3, 1: 2, 2: 2}, step=3)
    out = {key: m.generate_sequences(batch) for key, m in managers.items()}
    ref = out[(1, 1)]
    assert len(ref) == 7
    assert ref["responses"].shape == (7, R) and ref["rollout_log_probs"].shape == (7, R)
    assert ref["input_ids"].shape == (7, ref["prompts"].shape[1] + R)
    for key in ((3, 1), (3, 3)):
        assert out[key].equal(ref), key
    # Columns carried through, per-sample info added, row order kept.
    assert list(ref["uid"]) == ["q0", "q0", "q0", "q1", "q1", "q2", "q2"]
    assert list(ref["request_id"]) == ["train/3/q0/0", "train/3/q0/1", "train/3/q0/2", "train/3/q1/0",
                                       "train/3/q1/1", "train/3/q2/0", "train/3/q2/1"]
    assert set(ref["finish_reason"]) <= {"stop", "length"}
    assert list(ref["num_turns"]) == [1] * 7
    assert ref.meta["num_generate_calls"] == 7 and ref.meta["step"] == 3
    # Single-turn: the mask is exactly the response's real tokens.
    lengths = ref["response_mask"].sum(dim=1)
    assert torch.equal(ref["attention_mask"][:, -R:], ref["response_mask"])
    assert torch.equal(ref["rollout_log_probs"] != 0, ref["response_mask"].bool())
    assert (lengths > 0).all()


def test_a_row_does_not_depend_on_its_batch(managers):
    full = managers[(3, 3)].generate_sequences(_batch([0, 1, 2, 3], 2, step=1))
    alone = managers[(3, 1)].generate_sequences(_batch([2], 2, step=1))
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(full[key][4:6], alone[key]), key


def test_n_copies_differ_and_repeat_on_rerun(managers):
    batch = _batch([0], 4, step=7)
    first = managers[(3, 3)].generate_sequences(batch)
    rows = [tuple(r.tolist()) for r in first["responses"]]
    assert len(set(rows)) == 4, "the 4 copies of a prompt must get 4 different samples"
    again = managers[(1, 1)].generate_sequences(batch)
    assert again.equal(first)
    # Another step gives other samples for the same prompt.
    other = managers[(1, 1)].generate_sequences(_batch([0], 4, step=8))
    assert not torch.equal(other["responses"], first["responses"])


def test_validation_uses_its_own_seeds(managers):
    train = managers[(3, 3)].generate_sequences(_batch([1], 2, step=2))
    val = managers[(3, 3)].generate_sequences(_batch([1], 2, step=2, validate=True))
    assert list(val["request_id"]) == ["val/2/q1/0", "val/2/q1/1"]
    assert not torch.equal(train["responses"], val["responses"])


def _greedy_reference(model_dir, prompt_ids, max_new):
    """Greedy decoding by hand: full forward each step, argmax of the last position."""
    from kernel_modes import on_kernels
    from reprorl.models.hf_io import load_model

    model, _ = load_model(model_dir)
    ids = list(prompt_ids)
    new = []
    with torch.no_grad(), on_kernels(model):
        for _ in range(max_new):
            x = torch.tensor([ids])
            logits = model(x, torch.ones_like(x))[0, -1]  # [V]
            tok = int(torch.argmax(logits))
            new.append(tok)
            ids.append(tok)
            if tok == 2:  # eos
                break
    return new


def test_greedy_rows_equal_the_argmax_path_and_mix_with_sampled_rows(managers, tiny_policy):
    # Rows: q0 sampled, q0 greedy, q1 sampled, q1 greedy (the ReMax layout: one call).
    mixed = managers[(3, 3)].generate_sequences(
        _batch([0, 1], 2, step=4), do_sample=[True, False, True, False])
    sampled = managers[(1, 1)].generate_sequences(_batch([0, 1], 2, step=4))
    greedy = managers[(3, 1)].generate_sequences(_batch([0, 1], 2, step=4), do_sample=[False] * 4)
    for key in ("responses", "response_mask", "rollout_log_probs"):
        assert torch.equal(mixed[key][[0, 2]], sampled[key][[0, 2]]), key
        assert torch.equal(mixed[key][[1, 3]], greedy[key][[1, 3]]), key
    # Greedy ignores the seed: both copies of a prompt agree, and differ from sampling.
    assert torch.equal(greedy["responses"][0], greedy["responses"][1])
    assert not torch.equal(mixed["responses"][0], mixed["responses"][1])
    # The flags are the call's, not a column: the output holds the input's columns alone.
    assert set(mixed.non_tensors) == {"uid", "repeat_index", "raw_prompt", "data_source", "request_id",
                                      "num_turns", "finish_reason"}
    # And greedy is the argmax path of the model itself (first 32 tokens: the reference
    # recomputes the whole sequence per token).
    for row in (1, 3):
        prompt = mixed["prompts"][row][mixed["attention_mask"][row, : -R].bool()].tolist()
        reference = _greedy_reference(tiny_policy, prompt, 32)
        assert mixed["responses"][row, : len(reference)].tolist() == reference


def test_tool_loop_end_to_end_is_reproducible(managers, char_tokenizer):
    from reprorl.agent_loop.tool_loop import ToolAgentLoop
    from reprorl.agent_loop.tools import parse_tool_calls, run_tool_call

    # A random tiny model writes <tool_call> ... </tool_call> by chance (1/128 per token at
    # temperature 1), with garbage inside: the loop answers with an error message and goes on.
    batch = _batch([0, 1, 2, 3], 4, step=11, agent_name="tool")
    out = managers[(3, 3)].generate_sequences(batch)
    assert managers[(1, 1)].generate_sequences(batch).equal(out)
    assert managers[(3, 1)].generate_sequences(batch).equal(out)

    multi = [i for i, t in enumerate(out["num_turns"]) if t > 1]
    assert multi, "no row made a tool call: pick another step so the tool path runs"
    assert out.meta["num_generate_calls"] == sum(out["num_turns"])
    loop = ToolAgentLoop(char_tokenizer, max_turns=3)
    for i in multi:
        # Rebuild the transcript from the model's turns alone: every mask-0 run must be
        # exactly the tool turn the loop derives from the model turn before it.
        n = int(out["attention_mask"][i, -R:].sum())
        ids, mask = out["responses"][i, :n].tolist(), out["response_mask"][i, :n].tolist()
        runs, start = [], 0
        for j in range(1, n + 1):
            if j == n or mask[j] != mask[start]:
                runs.append((mask[start], ids[start:j]))
                start = j
        assert runs[0][0] == 1
        for (_, model_ids), (m, tool_ids) in zip(runs, runs[1:]):
            if m == 1:
                continue
            text = char_tokenizer.decode(model_ids, skip_special_tokens=False)
            calls = parse_tool_calls(text)
            expected = loop.tool_turn_ids([run_tool_call(c) for c in calls], model_ids[-1] == 2)
            assert tool_ids == expected[: len(tool_ids)]
        assert sum(m for m, _ in runs) == out["num_turns"][i]  # one model run per turn
        log_probs = out["rollout_log_probs"][i, :n]
        assert torch.equal(log_probs[torch.tensor(mask) == 0], torch.zeros(mask.count(0)))


def test_the_workers_tokenize_route_and_run_tools_without_importing_torch(managers):
    """An agent-loop worker runs no model: after single-turn and tool rollouts, none of its
    processes has imported torch (its `process_info` then reports torch's keys as None)."""
    manager = managers[(3, 3)]
    manager.generate_sequences(_batch([0, 1], 2, step=11, agent_name="tool"))
    manager.generate_sequences(_batch([2, 3], 1, step=12))
    infos = manager.determinism_info()
    assert sorted(infos) == [0, 1, 2]
    assert [info["torch_version"] for info in infos.values()] == [None] * 3, infos
    assert all(info["env"] for info in infos.values())  # the run's variables still reach them
