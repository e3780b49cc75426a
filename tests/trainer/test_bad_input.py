"""Bad input at the trainer level (issue 4, item 6): a clear one-line error, and the last
checkpoint stays intact.

- a model whose vocabulary cannot embed its tokenizer's ids, or whose positions cannot hold
  a prompt plus its response: a ConfigError at start, before any model loads or actor starts;
- replica settings no replica can run, unknown tools: a ConfigError when the config loads;
- NaN or inf in a step: an error naming the step, the update, micro-batch and quantity; the
  optimizer is not stepped, the checkpoint on disk is unchanged and `resume=auto` continues
  from it exactly;
- a reward function returning NaN counts as a failed reward function; one failing on more than
  reward.max_error_rate of a step's samples stops the run, the checkpoint intact; a data_source no
  built-in rule reward knows fails at start;
- prompts cut by data.overlong_prompts=truncate_* reach the engine cut.
"""

import dataclasses
import hashlib
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reprorl.agent_loop.manager import AgentLoopManager
from reprorl.agent_loop.tools import TOOLS, calculator, parse_tool_calls, run_tool_call
from reprorl.agent_loop.worker import AgentLoopWorker, ShippedTokenizer
from reprorl.cli import main as cli_main
from reprorl.compare import compare_runs
from reprorl.config import load_config
from reprorl.data.dataset import read_rows
from reprorl.errors import ConfigError, ReproRLError
from reprorl.models.hf_io import load_tokenizer, save_model
from reprorl.models.tiny import init_weights, tiny_args
from reprorl.models.tokenizer import make_char_tokenizer
from reprorl.models.transformer import CausalLM
from reprorl.protocol import Batch
from reprorl.reward.loop import RewardFnError, RewardLoop, RewardTimeoutError
from reprorl.records.checkpoint import load_checkpoint
from reprorl.trainer import saving
from reprorl.trainer.checks import check_models
from reprorl.trainer.fit import Trainer
from reprorl.workers.optim import NonFiniteError
from small_run import WITH_KL, run_trainer, small_run_overrides

def _tiny_policy(out: Path, tokenizer=None, **changes) -> Path:
    """A tiny policy whose config differs from `make_tiny`'s by `changes` (e.g. vocab_size)."""
    args = dataclasses.replace(tiny_args("policy"), **changes)
    model = CausalLM(args)
    init_weights(model, seed=0)
    save_model(model, args, out)
    (tokenizer or make_char_tokenizer()).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def inputs(assets, tmp_path_factory):
    """The small runs' assets (conftest.py), and tiny policies that differ from their policy."""
    root = tmp_path_factory.mktemp("bad-input")
    no_pad = make_char_tokenizer()
    no_pad.pad_token = None
    eos_beyond = _tiny_policy(root / "eos-beyond")
    (eos_beyond / "generation_config.json").write_text(json.dumps({"eos_token_id": 500}))
    return {
        **assets,  # train, val, policy (vocab 128, as the char tokenizer), reward
        "small_vocab": _tiny_policy(root / "small-vocab", vocab_size=100),
        "big_vocab": _tiny_policy(root / "big-vocab", vocab_size=160),  # padded embeddings: allowed
        "eos_beyond": eos_beyond,
        "no_pad": _tiny_policy(root / "no-pad", tokenizer=no_pad),
    }


def overrides(inputs, run_dir, *extra):
    return small_run_overrides(inputs, run_dir, *extra)


def config(inputs, run_dir, *extra):
    return load_config(None, overrides(inputs, run_dir, *extra))


@pytest.fixture
def no_workers(monkeypatch):
    """Fail the test if a Trainer gets as far as loading a model or starting a Ray actor."""
    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded or a Ray actor started before the input was checked")

    monkeypatch.setattr("reprorl.trainer.parts.WorkerGroup", refuse)
    monkeypatch.setattr("reprorl.rollout.replica.ReplicaPool.__init__", refuse)
    monkeypatch.setattr("reprorl.reward.reward_model.RewardModelPool.__init__", refuse)


# ------------------------------------------------------------------ models that cannot serve the run


@pytest.mark.parametrize("key", ["model.path", "model.ref_path", "model.critic_path"])
def test_model_vocab_smaller_than_the_tokenizer_fails_at_start(inputs, tmp_path, no_workers, key):
    extra = [f"{key}={inputs['small_vocab']}"]
    if key == "model.ref_path":
        extra.extend(WITH_KL)  # the reference is checked only for a run with a KL term
    if key == "model.critic_path":
        extra.append("algorithm.adv_estimator=gae")
    cfg = config(inputs, tmp_path / "run", *extra)
    path = str(inputs["small_vocab"])
    expected = (f"{key}: {path!r} has vocab_size=100 in config.json but the tokenizer of model.path has 128 tokens; "
                "expected vocab_size >= 128")
    with pytest.raises(ConfigError) as info:
        Trainer(cfg)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert not (tmp_path / "run").exists()  # nothing written for a run that cannot start


def test_model_vocab_larger_than_the_tokenizer_is_allowed(inputs, tmp_path):
    cfg = config(inputs, tmp_path / "run", f"model.path={inputs['big_vocab']}", "algorithm.adv_estimator=gae")
    check_models(cfg, make_char_tokenizer())  # no error: padded embeddings (as Qwen's) are normal


def test_eos_the_model_cannot_produce_fails_at_start(inputs, tmp_path, no_workers):
    cfg = config(inputs, tmp_path / "run", f"model.path={inputs['eos_beyond']}")
    with pytest.raises(ConfigError, match=r"model.path: '.*eos-beyond' stops generation at eos_token_id=500 "
                                          r"\(generation_config.json or config.json\), which its vocab_size=128 "
                                          r"cannot produce; expected an id in \[0, 128\)"):
        Trainer(cfg)


def test_tokenizer_without_pad_token_pads_with_eos(inputs, tmp_path):
    """A tokenizer without a pad token (Llama 3's, say) pads with eos, in every part that loads it."""
    tokenizer = load_tokenizer(inputs["no_pad"])
    assert tokenizer.pad_token_id == tokenizer.eos_token_id == tokenizer.convert_tokens_to_ids("<|im_end|>")
    check_models(config(inputs, tmp_path / "run", f"model.path={inputs['no_pad']}"), tokenizer)  # no error


def test_tokenizer_without_pad_or_eos_token_fails_at_start(inputs, tmp_path):
    tokenizer = load_tokenizer(inputs["no_pad"])
    tokenizer.pad_token = tokenizer.eos_token = None
    cfg = config(inputs, tmp_path / "run", f"model.path={inputs['no_pad']}")
    with pytest.raises(ConfigError, match=r"model.path: the tokenizer in '.*no-pad' has neither a pad token nor an "
                                          r"eos token"):
        check_models(cfg, tokenizer)


def test_reward_model_shorter_than_a_sample_warns_at_start(inputs, tmp_path, caplog):
    """The RM re-tokenizes the text, so fewer positions than the policy's P + R may still
    fit: a warning at start, not an error."""
    from reprorl.models.tiny import make_tiny

    rm = make_tiny(tmp_path / "rm", kind="reward", seed=1)
    config_file = rm / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "max_position_embeddings": 40}))
    cfg = config(inputs, tmp_path / "run", f"reward.model_path={rm}", "reward.model_weight=0.5")
    with caplog.at_level("WARNING", logger="reprorl.trainer.checks"):
        check_models(cfg, make_char_tokenizer())
    assert "max_position_embeddings=40, fewer than data.max_prompt_length + data.max_response_length = 72" in caplog.text


def test_prompt_plus_response_longer_than_the_model_fails_at_start(inputs, tmp_path, no_workers):
    # The tiny model has 2048 positions; the trainer's forward and the engine need P + R of them.
    cfg = config(inputs, tmp_path / "run", "data.max_prompt_length=2040", "data.max_response_length=16",
                 "algorithm.adv_estimator=gae")
    policy = re.escape(repr(str(inputs["policy"])))
    with pytest.raises(ConfigError, match=r"^data.max_prompt_length \+ data.max_response_length = 2040 \+ 16 = "
                                          rf"2056 tokens is more than model.path {policy} holds "
                                          r"\(max_position_embeddings=2048\); expected at most 2048$"):
        Trainer(cfg)
    check_models(config(inputs, tmp_path / "run", "data.max_prompt_length=2040", "data.max_response_length=8"),
                 make_char_tokenizer())  # exactly 2048: fits


def test_reprorl_train_prints_the_vocab_error_as_one_line(inputs, tmp_path):
    args = overrides(inputs, tmp_path / "run", f"model.path={inputs['small_vocab']}")
    proc = subprocess.run([sys.executable, "-m", "reprorl.cli", "train", *args], capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.path: ") and "vocab_size=100" in lines[0], lines


# ------------------------------------------------------------------ replica settings and tools


def test_batched_tokens_below_running_sequences_is_a_config_error(capsys):
    with pytest.raises(ConfigError, match=r"^rollout.max_num_batched_tokens=32 must be >= rollout.max_num_seqs=64: "
                                          r"each running sequence decodes one token per forward pass$"):
        load_config(None, ["rollout.max_num_batched_tokens=32"])
    assert cli_main(["config", "rollout.max_num_seqs=8", "rollout.max_num_batched_tokens=4"]) == 2
    assert capsys.readouterr().err.startswith("error: rollout.max_num_batched_tokens=4 must be >= ")
    assert load_config(None, ["rollout.max_num_seqs=8", "rollout.max_num_batched_tokens=8"])  # equal is enough


def test_rollout_tools_are_checked_by_name():
    assert load_config().rollout.tools is None  # null: every tool
    assert load_config(None, ["rollout.tools=[calculator]"]).rollout.tools == ["calculator"]
    with pytest.raises(ConfigError, match=r"^rollout.tools: unknown tool 'search'; expected a built-in \(calculator, python\), "):
        load_config(None, ["rollout.tools=[calculator, search]"])
    with pytest.raises(ConfigError, match=r"^rollout.tools=\[\] with rollout.agent_loop=tool: the tool loop needs "):
        load_config(None, ["rollout.tools=[]", "rollout.agent_loop=tool"])
    assert load_config(None, ["rollout.tools=[]"]).rollout.tools == []  # no tool loop: nothing to call
    with pytest.raises(ValueError, match="AgentLoopManager: tools: unknown tool 'search'"):
        AgentLoopManager(None, 1, "unused", max_response_length=8, sampling_params=None, tools=["search"])


def test_the_tool_loop_calls_only_the_configured_tools(tiny_policy_dir):
    call = parse_tool_calls('<tool_call>{"name": "calculator", "arguments": {"expression": "2+3"}}</tool_call>')[0]
    by_tools = {}
    for tools in (None, ["calculator"], []):
        worker = AgentLoopWorker(0, {}, None, ShippedTokenizer(load_tokenizer(tiny_policy_dir)), {}, "tool", 2, tools)
        by_tools[str(tools)] = worker.loops["tool"].tools
        by_tools[f"{tools} answer"] = run_tool_call(call, worker.loops["tool"].tools)
    assert by_tools["None"] == TOOLS and by_tools["['calculator']"] == {"calculator": calculator}
    assert by_tools["[]"] == {}
    assert by_tools["None answer"] == "5" and by_tools["[] answer"] == "error: unknown tool 'calculator'; available: "


# ------------------------------------------------------------------ overlong prompts


def _long_prompts(path: Path, source: Path) -> Path:
    """`source`'s rows as JSONL, each question after 80 characters of preamble: over the small
    run's data.max_prompt_length=64 (the char tokenizer: a token a character)."""
    rows = read_rows(source)
    for row in rows:
        row["prompt"] = [{**m, "content": "Work it out carefully and answer with the number. " * 2 + m["content"]}
                         for m in row["prompt"]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


@pytest.mark.slow
def test_truncated_prompts_reach_the_engine_in_training_and_validation(inputs, tmp_path, ray_local):
    """data.overlong_prompts=truncate_left: the rollout sends the dataset's cut prompt ids (it
    re-templated the whole messages, and the first long prompt crashed the run)."""
    train = _long_prompts(tmp_path / "train.jsonl", inputs["train"])
    val = _long_prompts(tmp_path / "val.jsonl", inputs["val"])
    run_dir = tmp_path / "run"
    trainer = run_trainer(config(inputs, run_dir, f"data.train_files=[{train}]", f"data.val_files=[{val}]",
                                 "data.overlong_prompts=truncate_left", "trainer.val_before_train=true",
                                 "trainer.total_steps=1", "trainer.test_freq=1"))
    assert trainer.train_set.stats["truncated"] == trainer.train_set.stats["rows"] == 64
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [0, 1]
    assert records[1]["prompt_length/mean"] == records[1]["prompt_length/max"] == 64.0
    assert "val/accuracy" in records[0] and "val/accuracy" in records[1]


# ------------------------------------------------------------------ non-finite rewards


def _reward_batch(n: int) -> Batch:
    return Batch({"responses": torch.full((n, 2), 5), "response_mask": torch.ones(n, 2, dtype=torch.long)},
                 {"data_source": ["s"] * n, "ground_truth": ["g"] * n, "raw_prompt": [[]] * n})


def test_a_nan_or_inf_reward_counts_as_a_failed_reward_function(char_tokenizer):
    returns = iter([0.5, float("nan"), float("-inf"), {"score": float("inf")}, 1.0])
    loop = RewardLoop(lambda **kw: next(returns))
    scores, _, metrics, *_ = loop.compute(_reward_batch(5), char_tokenizer)
    assert torch.equal(scores, torch.tensor([0.5, 0.0, 0.0, 0.0, 1.0]))
    assert metrics["reward/fn_errors"] == 3.0 and metrics["reward/mean"] == 0.3


def test_a_non_finite_reward_model_score_is_an_error(char_tokenizer):
    class NanModel:
        def score(self, prompts, responses):
            return torch.tensor([1.0, float("nan"), 0.0, float("inf")])

    loop = RewardLoop(lambda **kw: 0.0, NanModel())
    with pytest.raises(ReproRLError, match=r"^reward model returned non-finite scores for samples \[1, 3\] of 4 "
                                           r"\(first: nan\); expected finite scores"):
        loop.compute(_reward_batch(4), char_tokenizer)


def test_a_source_no_builtin_rule_knows_fails_at_start(inputs, tmp_path, no_workers):
    """data_source 'gsm8k' (verl names it 'openai/gsm8k') scored 0 on every sample, all run long."""
    rows = read_rows(inputs["train"])
    rows[3]["data_source"] = "gsm8k"
    train = tmp_path / "train.jsonl"
    train.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    with pytest.raises(ReproRLError, match=rf"^{train}: row 3: field 'data_source': no built-in rule reward scores "
                                           r"'gsm8k' \(reward.fn=null picks one by data_source\); known: "
                                           r"reprorl/arithmetic, openai/gsm8k, .*; or set reward.fn to a function "
                                           r"of yours$"):
        Trainer(config(inputs, tmp_path / "run", f"data.train_files=[{train}]", "reward.fn=null"))


@pytest.mark.slow
def test_a_reward_function_failing_past_the_error_rate_stops_the_run_at_that_step(inputs, tmp_path, ray_local):
    """reward.max_error_rate: a function that raises on every sample from step 2 stops the run
    there, naming it and its first error; step 1's checkpoint is intact."""
    run_dir = tmp_path / "run"
    failing = f"{Path(__file__).parent / 'raise_at_step_2.py'}:raise_at_step_2"
    with pytest.raises(RewardFnError) as info:
        run_trainer(config(inputs, run_dir, f"reward.fn={failing}", "trainer.total_steps=3", "trainer.save_freq=1"))
    ckpt_dir = run_dir / "checkpoints" / "step_1"
    assert str(info.value) == (
        "step 2: the reward function 'raise_at_step_2' failed on 4 of 4 samples, more than reward.max_error_rate=0.1; "
        "the first, sample 0 (data_source='reprorl/arithmetic'): KeyError: 'no answer key for this sample'; the run "
        f"stopped. The newest checkpoint, {str(ckpt_dir)!r}, is unchanged; trainer.resume=auto continues from it."
    )
    assert isinstance(info.value, ReproRLError)  # the CLI prints it as one line
    assert _steps(run_dir) == [1] and load_checkpoint(run_dir)[0] == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1"]


# ------------------------------------------------------------------ NaN / inf in a training step


def _file_digests(directory: Path) -> dict[str, str]:
    """sha256 of every file under `directory` (a checkpoint holds its groups' shard directories)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file()}


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow
def test_nan_loss_stops_the_step_keeps_the_checkpoint_and_resume_continues_exactly(
    inputs, tmp_path, ray_local, monkeypatch, three_step_run
):
    run_dir = tmp_path / "run"
    common = (*WITH_KL, "trainer.total_steps=3", "trainer.save_freq=1")  # as conftest's 3-step run
    saved = {}
    real_save = saving.save

    trainer = Trainer(config(inputs, run_dir, *common))
    actor = trainer.parts.actor
    weights_at_save = {}

    def save_and_digest(where, step, *args, **kwargs):
        path = real_save(where, step, *args, **kwargs)
        saved[step] = _file_digests(path)
        weights_at_save[step] = dict(actor.named_weights())
        return path

    real_update = actor.update

    def nan_in_micro_batch_1_of_step_2(batch, **kwargs):
        # The actor's workers are other processes: the NaN travels in the batch, after the
        # trainer's finiteness check, in micro-batch 1's samples (4 samples in micro-batches of 2).
        if trainer.step == 2:
            batch["advantages"] = batch["advantages"].clone()
            batch["advantages"][2:4] = float("nan")
        return real_update(batch, **kwargs)

    monkeypatch.setattr(actor, "update", nan_in_micro_batch_1_of_step_2)
    monkeypatch.setattr(saving, "save", save_and_digest)
    try:
        with pytest.raises(NonFiniteError) as info:
            trainer.fit()
        live_actor = dict(actor.named_weights())
    finally:
        trainer.close()
    message = str(info.value)
    ckpt_dir = run_dir / "checkpoints" / "step_1"
    assert message == (f"step 2: actor update 2 (epoch 0, mini-batch 0), micro-batch 1: loss is nan; optimizer not "
                       f"stepped; the run stopped. The newest checkpoint, {str(ckpt_dir)!r}, is unchanged; "
                       "trainer.resume=auto continues from it.")
    assert isinstance(info.value, ReproRLError)  # the CLI prints it as one line, no traceback

    # On disk: step 1's checkpoint byte for byte as saved, `latest` on it, no step 2 anywhere.
    assert list(saved) == [1] and _file_digests(ckpt_dir) == saved[1]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_1"
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1"]
    assert _steps(run_dir) == [1]
    # In memory: the optimizer was not stepped at step 2, so the actor is still step 1's.
    assert load_checkpoint(run_dir)[0] == 1
    assert [k for k, v in weights_at_save[1].items() if not torch.equal(live_actor[k], v)] == []

    # resume=auto (the default) continues from step 1, exactly as a run that never stopped
    # (conftest.py's 3-step run).
    monkeypatch.undo()
    run_trainer(config(inputs, run_dir, *common))
    assert _steps(run_dir) == [1, 2, 3]
    result = compare_runs(three_step_run, run_dir)
    assert result.identical and result.common_steps == [1, 2, 3], result


@pytest.mark.slow
def test_a_reward_past_its_time_limit_stops_a_deterministic_run_at_that_step(inputs, tmp_path, ray_local,
                                                                             monkeypatch):
    """full_determinism: a sample that would score 0 by timing instead stops the run, naming
    the step, the sample, its data source and the limit; the last checkpoint is intact. The
    hung call runs twice (a hung worker is replaced once) and hangs both times."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("HANG_AT_STEP_2_CALLS", str(tmp_path / "calls"))
    hanging = f"{Path(__file__).parent / 'hang_at_step_2.py'}:hang_at_step_2"
    trainer = Trainer(config(inputs, run_dir, f"reward.fn={hanging}", "reward.timeout_s=2", "trainer.total_steps=3",
                             "trainer.save_freq=1"))
    try:
        with pytest.raises(RewardTimeoutError) as info:
            trainer.fit()
    finally:
        trainer.close()
    ckpt_dir = run_dir / "checkpoints" / "step_1"
    assert str(info.value) == (
        "step 2: the reward function did not return within reward.timeout_s=2 s on sample 0 (data_source="
        "'reprorl/arithmetic'); with full_determinism a timed-out sample cannot score 0 (the result would depend on "
        f"timing): fix the function or raise the limit; the run stopped. The newest checkpoint, {str(ckpt_dir)!r}, "
        "is unchanged; trainer.resume=auto continues from it."
    )
    assert isinstance(info.value, ReproRLError)  # the CLI prints it as one line
    assert _steps(run_dir) == [1] and load_checkpoint(run_dir)[0] == 1
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == ["latest", "step_1"]


@pytest.mark.slow
def test_non_finite_critic_grad_norm_stops_before_any_parameter_moves(inputs, tmp_path, ray_local, monkeypatch):
    # One-token responses: 4 tokens a mini-batch, 2 a micro-batch.
    trainer = Trainer(config(inputs, tmp_path / "run", "algorithm.adv_estimator=gae", "trainer.save_freq=1",
                             "data.max_response_length=1"))
    actor, critic = trainer.parts.actor, trainer.parts.critic
    real_update = critic.update

    def returns_whose_gradient_overflows(batch, **kwargs):
        # Returns R = 8e18 (the workers are other processes: it travels in the batch). A
        # micro-batch's loss sums 2 errors of R^2 = 6.4e37: finite in float32 (3.4e38). The
        # value head's gradient is -R times the mean of 4 normed hidden states (each of
        # squared norm 128), so its chunk's sum of squares is about R^2 * 32 = 2e39: inf.
        batch["returns"] = torch.full_like(batch["returns"], 8e18)
        return real_update(batch, **kwargs)

    monkeypatch.setattr(critic, "update", returns_whose_gradient_overflows)
    before = {"actor": dict(actor.named_weights()), "critic": dict(critic.named_weights())}
    try:
        with pytest.raises(NonFiniteError, match=r"^step 1: critic update 1 \(epoch 0, mini-batch 0\): gradient "
                                                 r"norm is (nan|inf); optimizer not stepped; the run stopped\. No "
                                                 r"checkpoint was saved before it\.$"):
            trainer.fit()
        for name, group in (("actor", actor), ("critic", critic)):
            after = dict(group.named_weights())
            assert [k for k, v in after.items() if not torch.equal(v, before[name][k])] == [], name
    finally:
        trainer.close()
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_diverged_weights_are_named_before_they_become_a_nan_loss(inputs, tmp_path, ray_local):
    # lr 1e30: step 1 is finite but leaves weights of ~1e30, whose logits overflow at step 2.
    with pytest.raises(NonFiniteError, match=r"^step 2: old_log_probs not finite in samples \[0, 1, 2, 3\] of 4 "
                                             r"\(diverged weights\? check the learning rates\); optimizer not "
                                             r"stepped; the run stopped\. The newest checkpoint, '.*step_1', is "
                                             r"unchanged"):
        run_trainer(config(inputs, tmp_path / "run", "actor.lr=1e30", "trainer.save_freq=1"))
    assert load_checkpoint(tmp_path / "run")[0] == 1


@pytest.mark.slow
def test_a_model_with_a_larger_vocab_than_its_tokenizer_trains(inputs, tmp_path, ray_local):
    run_dir = tmp_path / "run"
    run_trainer(config(inputs, run_dir, f"model.path={inputs['big_vocab']}", "trainer.total_steps=1"))
    record = json.loads((run_dir / "metrics.jsonl").read_text())
    assert record["step"] == 1 and record["rollout/log_prob_max_gap"] == 0.0
