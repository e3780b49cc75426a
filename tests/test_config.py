"""The typed config: defaults, YAML + overrides, every error as one line, round trip."""

import dataclasses
import shutil
import subprocess
import typing
from pathlib import Path

import pytest
import yaml

from reprorl.cli import main
from reprorl.config import Config, ConfigError, config_to_yaml, load_config, resolve_config

REPO = Path(__file__).resolve().parents[1]


def _leaf_fields(cls=Config, prefix=""):
    """(dotted key, field) of every non-section field."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            yield from _leaf_fields(hints[f.name], prefix + f.name + ".")
        else:
            yield prefix + f.name, f


def _write(tmp_path, text, name="run.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# --- defaults ---------------------------------------------------------------------------


def test_defaults_resolve():
    cfg = load_config()
    assert cfg.seed == 42 and cfg.full_determinism is True
    assert cfg.algorithm.adv_estimator == "grpo" and cfg.rollout.n == 8
    # derived values (the `derive` step, config/checks.py)
    assert cfg.model.ref_path == cfg.model.path == cfg.model.critic_path == "models/tiny-policy"
    assert cfg.rollout.max_tokens == cfg.data.max_response_length == 8
    assert (cfg.critic.ppo_epochs, cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_micro_batch_size) == (1, 16, 32)
    assert cfg.trainer.run_dir == "runs/reprorl/tiny-grpo"
    assert cfg.actor.betas == (0.9, 0.999)


def test_every_field_has_help():
    leaves = list(_leaf_fields())
    assert len(leaves) > 80
    for key, f in leaves:
        assert f.metadata.get("help", "").strip(), key


def test_configs_do_not_share_lists():
    cfg = load_config(None, ["data.train_files=[a.parquet]"])
    cfg.trainer.loggers.append("wandb")
    fresh = load_config()
    assert fresh.data.train_files == ["data/arithmetic/train.parquet"]
    assert fresh.trainer.loggers == ["console", "jsonl"]


def test_resolve_config_of_a_python_built_config():
    assert resolve_config(Config()) == load_config()
    cfg = Config()
    cfg.rollout.n = "4"
    with pytest.raises(ConfigError, match=r"^rollout.n: expected an integer >= 1, got '4'$"):
        resolve_config(cfg)


# --- YAML file and overrides ------------------------------------------------------------


def test_yaml_then_overrides(tmp_path):
    path = _write(
        tmp_path,
        """
seed: 7
model:
  path: my/model
rollout:
  n: 8
  temperature: 1          # an int is fine for a float field
  val:
    temperature: 0.3
actor:
  lr: 3e-6                # YAML 1.2 float, not the string '3e-6'
trainer:
  loggers: [console]
  experiment_name: 'no'   # quoted; plain `no` is a string here too
""",
    )
    cfg = load_config(path, ["rollout.n=6", "trainer.loggers=[console,jsonl,tensorboard]", "critic.lr=2.5e-5"])
    assert cfg.seed == 7
    assert cfg.rollout.n == 6  # the override wins over the file
    assert cfg.rollout.temperature == 1.0 and isinstance(cfg.rollout.temperature, float)
    assert cfg.rollout.val.temperature == 0.3
    assert cfg.actor.lr == 3e-6
    assert cfg.critic.lr == 2.5e-5
    assert cfg.trainer.loggers == ["console", "jsonl", "tensorboard"]
    assert cfg.trainer.experiment_name == "no"
    assert cfg.model.ref_path == "my/model"  # derived after the file is read
    assert cfg.trainer.run_dir == "runs/reprorl/no"
    assert cfg.data.max_prompt_length == 64  # untouched keys keep their defaults


def test_overrides_alone_and_null_and_sections(tmp_path):
    cfg = load_config(
        None,
        [
            "model.path=a",
            "model.ref_path=b",
            "model.ref_path=null",  # back to "derive it"
            "rollout.val={n: 3, do_sample: true}",  # a mapping for a section sets each key
            "rollout.max_tokens=6",
            "reward.fn=my_rewards.py:score",
            "data.val_files=[]",
            "trainer.experiment_name=x=y",  # only the first '=' splits
        ],
    )
    assert cfg.model.ref_path == "a"
    assert (cfg.rollout.val.n, cfg.rollout.val.do_sample, cfg.rollout.val.temperature) == (3, True, 0.0)
    assert cfg.rollout.max_tokens == 6
    assert cfg.reward.fn == "my_rewards.py:score"
    assert cfg.data.val_files == []
    assert cfg.trainer.experiment_name == "x=y"
    assert load_config(Path(_write(tmp_path, ""))) == load_config()  # an empty file changes nothing


def test_critic_batches_are_checked_only_for_gae():
    load_config(None, ["critic.ppo_micro_batch_size=3"])  # grpo: no critic, no check
    load_config(None, ["algorithm.adv_estimator=remax", "rollout.n=1", "actor.ppo_micro_batch_size=4"])
    gae = ["algorithm.adv_estimator=gae", "rollout.n=1", "actor.ppo_micro_batch_size=4", "critic.ppo_micro_batch_size=2"]
    assert load_config(None, gae).critic.ppo_micro_batch_size == 2
    load_config(None, ["algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false"])


def test_any_power_of_two_worker_count_is_allowed_whatever_the_micro_batch_count():
    # The default's 4 micro-batches a mini-batch, and the critic's 2: 8 workers leave some
    # ranks only empty leaves of the gradient tree (workers/flat.py), with the same bits.
    assert load_config(None, ["trainer.num_workers=8"]).trainer.num_workers == 8
    gae = ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=64", "trainer.num_workers=4"]
    assert load_config(None, gae).trainer.num_workers == 4
    assert load_config(None, ["actor.ppo_mini_batch_size=12", "data.train_batch_size=12",
                              "trainer.num_workers=2"]).trainer.num_workers == 2  # 3 micro-batches


def test_a_token_budget_replaces_the_micro_batch_size_rule():
    # With a budget, ppo_micro_batch_size is unused: its divisibility is not checked.
    cfg = load_config(None, ["actor.ppo_max_token_len_per_micro_batch=72", "actor.ppo_micro_batch_size=5",
                             "trainer.num_workers=8"])
    assert cfg.actor.ppo_max_token_len_per_micro_batch == 72
    # The critic's budget defaults to the actor's, and is checked in its place.
    gae = ["algorithm.adv_estimator=gae", "actor.ppo_max_token_len_per_micro_batch=200",
           "critic.ppo_micro_batch_size=3"]
    assert load_config(None, gae).critic.ppo_max_token_len_per_micro_batch == 200
    own = load_config(None, [*gae, "critic.ppo_max_token_len_per_micro_batch=80"])
    assert own.critic.ppo_max_token_len_per_micro_batch == 80
    assert load_config().actor.ppo_max_token_len_per_micro_batch is None  # off by default
    assert load_config().critic.ppo_max_token_len_per_micro_batch is None


def test_cli_takes_a_first_override_in_the_file_slot(capsys):
    # argparse puts `rollout.n=8` in the optional file argument; it is an override all the same.
    assert main(["config", "rollout.n=8", "rollout.temperature=0.5"]) == 0
    cfg = yaml.safe_load(capsys.readouterr().out)
    assert cfg["rollout"]["n"] == 8 and cfg["rollout"]["temperature"] == 0.5


# --- errors: exit code 2 and one line on stderr ----------------------------------------

OVERRIDE_ERRORS = [
    (["rollout.temprature=0.7"], "unknown config key 'rollout.temprature' (did you mean 'rollout.temperature'?)"),
    (["rollout.val.temprature=0"], "unknown config key 'rollout.val.temprature' (did you mean 'rollout.val.temperature'?)"),
    (["temperature=0.7"], "unknown config key 'temperature' (did you mean 'rollout.temperature'?)"),
    (["rollout.n.x=1"], "unknown config key 'rollout.n.x' (did you mean 'rollout.n'?)"),
    (["zzzzzz=1"], "unknown config key 'zzzzzz' (`reprorl config` prints every key)"),
    (["rollout.n=4", "rollout.temperature"], "malformed override 'rollout.temperature' (expected key=value, e.g. rollout.temperature=0.7)"),
    (["=3"], "malformed override '=3' (expected key=value, e.g. rollout.temperature=0.7)"),
    (["trainer.loggers=[console"], "override 'trainer.loggers=[console': invalid YAML at line 1, column 9: expected ',' or ']', but got '<stream end>'"),
    # types
    (["rollout.n=abc"], "rollout.n: expected an integer >= 1, got 'abc'"),
    (["rollout.n=1.5"], "rollout.n: expected an integer >= 1, got 1.5"),
    (["rollout.n=2.0"], "rollout.n: expected an integer >= 1, got 2.0"),
    (["rollout.n=true"], "rollout.n: expected an integer >= 1, got true"),
    (["full_determinism=yes"], "full_determinism: expected true or false, got 'yes'"),
    (["full_determinism=1"], "full_determinism: expected true or false, got 1"),
    (["rollout.temperature=hot"], "rollout.temperature: expected a number >= 0, got 'hot'"),
    (["rollout.temperature=.nan"], "rollout.temperature: expected a number >= 0, got .nan"),
    (["trainer.experiment_name=123"], "trainer.experiment_name: expected a string, got 123"),
    (["rollout.max_tokens=abc"], "rollout.max_tokens: expected an integer >= 1 or null, got 'abc'"),
    (["trainer.loggers=console"], "trainer.loggers: expected a list, each one of console, jsonl, tensorboard, wandb, got 'console'"),
    (["trainer.loggers=[console,mlflow]"], "trainer.loggers[1]: expected one of console, jsonl, tensorboard, wandb, got 'mlflow'"),
    (["data.train_files=a.parquet"], "data.train_files: expected a list of strings, got 'a.parquet'"),
    (["actor.betas=[0.9]"], "actor.betas: expected a list of 2 numbers, got [0.9]"),
    (["rollout=3"], "rollout: expected a mapping of keys, got 3"),
    # choices
    (["algorithm.adv_estimator=ppo"], "algorithm.adv_estimator: expected one of gae, grpo, remax, rloo, reinforce_pp, reinforce_pp_baseline, grpo_passk, opo, gpg, gdpo, got 'ppo'"),
    (["data.overlong_prompts=drop"], "data.overlong_prompts: expected one of error, filter, truncate_left, truncate_right, got 'drop'"),
    (["actor.kl_loss_type=low_var_kl"], "actor.kl_loss_type: expected one of k1, k2, k3, abs, k1+, k2+, k3+, abs+, got 'low_var_kl'"),
    (["model.dtype=float16"], "model.dtype: expected one of float32, bfloat16, got 'float16'"),
    # ranges
    (["rollout.n=0"], "rollout.n: expected an integer >= 1, got 0"),
    (["rollout.temperature=-0.1"], "rollout.temperature: expected a number >= 0, got -0.1"),
    (["rollout.top_p=0"], "rollout.top_p: expected a number in (0, 1], got 0"),
    (["rollout.top_p=1.5"], "rollout.top_p: expected a number in (0, 1], got 1.5"),
    (["rollout.top_k=-2"], "rollout.top_k: expected an integer >= -1, got -2"),
    (["rollout.top_k=0"], "rollout.top_k: expected -1 (off) or an integer >= 1, got 0"),
    (["rollout.val.top_k=0"], "rollout.val.top_k: expected -1 (off) or an integer >= 1, got 0"),
    (["actor.clip_ratio_c=1.0"], "actor.clip_ratio_c: expected a number > 1, got 1.0"),
    (["actor.clip_ratio_low=1"], "actor.clip_ratio_low: expected a number in [0, 1), got 1"),
    (["algorithm.gamma=1.01"], "algorithm.gamma: expected a number in [0, 1], got 1.01"),
    (["seed=-1"], "seed: expected an integer >= 0, got -1"),
    (["reward.fn=my_rewards"], "reward.fn: expected 'module:function' or 'path.py:function' or null, got 'my_rewards'"),
    (["trainer.resume=''"], "trainer.resume: expected 'never', 'auto' or a checkpoint path, got ''"),
    # several rewards, batch rewards, the overlong buffer, mask_truncated
    (["reward.fn=a:f", "reward.fns=[{fn: b:g}]"],
     "reward.fn and reward.fns are both set: pick one (reward.fns=[{fn: ..., weight: 1.0}] is reward.fn alone)"),
    (["reward.fns=a:f"], "reward.fns: expected a list, each a mapping of fn, weight, got 'a:f'"),
    (["reward.fns=[a:f]"], "reward.fns[0]: expected a mapping of fn, weight, got 'a:f'"),
    (["reward.fns=[{fn: a:f, wieght: 2}]"], "reward.fns[0]: unknown key 'wieght'; expected fn, weight"),
    (["reward.fns=[{fn: a:f, weight: heavy}]"], "reward.fns[0].weight: expected a number, got 'heavy'"),
    (["reward.fns=[{fn: a:f}, {fn: my_rewards}]"],
     "reward.fns[1].fn: expected 'module:function' or 'path.py:function' or null, got 'my_rewards'"),
    (["reward.fns=[{fn: a:f}, {fn: b.py:f}]"],
     "reward.fns[1].fn='b.py:f': a function named 'f' is already in reward.fns[0]; each logs its metric "
     "reward/<name>/mean under its name"),
    (["reward.reward_manager=lists"], "reward.reward_manager: expected one of naive, batch, got 'lists'"),
    (["reward.reward_manager=batch"],
     "reward.fn=null with reward.reward_manager=batch: the built-in compute_score scores one sample at a time; "
     "name a function that takes lists"),
    (["reward.reward_manager=batch", "reward.fns=[{fn: a:f}, {weight: 2}]"],
     "reward.fns[1].fn=null with reward.reward_manager=batch: the built-in compute_score scores one sample at a "
     "time; name a function that takes lists"),
    (["reward.overlong_buffer.enable=true"],
     "reward.overlong_buffer.len=0 with reward.overlong_buffer.enable=true: expected 1 <= len <= "
     "rollout.max_tokens=8"),
    (["reward.overlong_buffer.enable=true", "reward.overlong_buffer.len=9"],
     "reward.overlong_buffer.len=9 with reward.overlong_buffer.enable=true: expected 1 <= len <= "
     "rollout.max_tokens=8"),
    (["reward.overlong_buffer.len=-1"], "reward.overlong_buffer.len: expected an integer >= 0, got -1"),
    (["reward.overlong_buffer.penalty_factor=-1"],
     "reward.overlong_buffer.penalty_factor: expected a number >= 0, got -1"),
    (["reward.overlong_buffer.enable=yes"], "reward.overlong_buffer.enable: expected true or false, got 'yes'"),
    (["actor.mask_truncated=1"], "actor.mask_truncated: expected true or false, got 1"),
    # dynamic sampling
    (["algorithm.filter_groups.metric=accuracy"],
     "algorithm.filter_groups.metric: expected one of seq_reward, score, acc, got 'accuracy'"),
    (["algorithm.filter_groups.max_num_gen_batches=-1"],
     "algorithm.filter_groups.max_num_gen_batches: expected an integer >= 0, got -1"),
    (["algorithm.filter_groups.enable=true", "algorithm.adv_estimator=reinforce_pp", "rollout.n=1"],
     "algorithm.filter_groups.enable=true with rollout.n=1: a group of one sample never varies, so every group "
     "would be dropped; expected rollout.n >= 2"),
    (["algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=acc", "reward.model_path=rm",
      "reward.rule_weight=0"],
     "algorithm.filter_groups.metric=acc reads the rule reward, which does not run with reward.rule_weight=0 (a "
     "reward model alone); use metric=seq_reward"),
    # cross-field
    (["actor.ppo_mini_batch_size=3"], "data.train_batch_size=16 must be divisible by actor.ppo_mini_batch_size=3"),
    (
        ["actor.ppo_micro_batch_size=5"],
        "actor.ppo_mini_batch_size * rollout.n = 16 * 8 = 128 samples must be divisible by actor.ppo_micro_batch_size=5",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.ppo_micro_batch_size=3"],
        "critic.ppo_mini_batch_size * rollout.n = 16 * 8 = 128 samples must be divisible by critic.ppo_micro_batch_size=3",
    ),
    (
        ["algorithm.adv_estimator=gae", "critic.ppo_mini_batch_size=32"],
        "data.train_batch_size=16 must be divisible by critic.ppo_mini_batch_size=32",
    ),
    (
        ["trainer.num_workers=3"],
        "trainer.num_workers=3: expected a power of two (1, 2, 4, 8, ...), so that every allowed count gives the "
        "same bits (reprorl/workers/flat.py)",
    ),
    (
        ["actor.ppo_max_token_len_per_micro_batch=71"],
        "actor.ppo_max_token_len_per_micro_batch=71 must be >= data.max_prompt_length + data.max_response_length = "
        "64 + 8 = 72: the longest sample must fit in one micro-batch",
    ),
    (
        ["algorithm.adv_estimator=gae", "actor.ppo_max_token_len_per_micro_batch=100",
         "critic.ppo_max_token_len_per_micro_batch=50"],
        "critic.ppo_max_token_len_per_micro_batch=50 must be >= data.max_prompt_length + data.max_response_length = "
        "64 + 8 = 72: the longest sample must fit in one micro-batch",
    ),
    (
        ["actor.ppo_max_token_len_per_micro_batch=72", "trainer.num_workers=6"],
        "trainer.num_workers=6: expected a power of two (1, 2, 4, 8, ...), so that every allowed count gives the "
        "same bits (reprorl/workers/flat.py)",
    ),
    (
        ["actor.ppo_max_token_len_per_micro_batch=0"],
        "actor.ppo_max_token_len_per_micro_batch: expected an integer >= 1 or null, got 0",
    ),
    (["rollout.max_tokens=9"], "rollout.max_tokens=9 must be <= data.max_response_length=8"),
    (["data.max_response_length=16", "rollout.max_tokens=32"], "rollout.max_tokens=32 must be <= data.max_response_length=16"),
    (["rollout.n=1"], "algorithm.adv_estimator=grpo compares samples of one prompt: it needs rollout.n >= 2, got rollout.n=1"),
    (
        ["algorithm.adv_estimator=rloo", "rollout.n=1"],
        "algorithm.adv_estimator=rloo compares samples of one prompt: it needs rollout.n >= 2, got rollout.n=1",
    ),
    (
        ["algorithm.adv_estimator=reinforce_pp_baseline", "rollout.n=1"],
        "algorithm.adv_estimator=reinforce_pp_baseline compares samples of one prompt: it needs rollout.n >= 2, got rollout.n=1",
    ),
    (
        ["rollout.temperature=0"],
        "algorithm.adv_estimator=grpo with rollout.temperature=0 (greedy sampling): the rollout.n=8 samples of a "
        "prompt are one same response, so every advantage is 0 and nothing is learned; expected "
        "rollout.temperature > 0 and rollout.top_k != 1",
    ),
    (
        ["algorithm.adv_estimator=rloo", "rollout.n=2", "rollout.temperature=0", "rollout.top_k=1"],
        "algorithm.adv_estimator=rloo with rollout.temperature=0 and rollout.top_k=1 (greedy sampling): the "
        "rollout.n=2 samples of a prompt are one same response, so every advantage is 0 and nothing is learned; "
        "expected rollout.temperature > 0 and rollout.top_k != 1",
    ),
    (
        ["algorithm.adv_estimator=reinforce_pp_baseline", "rollout.top_k=1"],
        "algorithm.adv_estimator=reinforce_pp_baseline with rollout.top_k=1 (greedy sampling): the rollout.n=8 "
        "samples of a prompt are one same response, so every advantage is 0 and nothing is learned; expected "
        "rollout.temperature > 0 and rollout.top_k != 1",
    ),
    (
        ["algorithm.adv_estimator=remax", "rollout.n=1", "rollout.temperature=0.0"],
        "algorithm.adv_estimator=remax with rollout.temperature=0 (greedy sampling): every sample is the greedy "
        "response ReMax takes as its baseline, so every advantage is 0 and nothing is learned; expected "
        "rollout.temperature > 0 and rollout.top_k != 1",
    ),
    (
        ["algorithm.adv_estimator=grpo_passk", "rollout.n=1"],
        "algorithm.adv_estimator=grpo_passk compares samples of one prompt: it needs rollout.n >= 2, got rollout.n=1",
    ),
    (
        ["actor.policy_loss=geo_mean", "algorithm.adv_estimator=reinforce_pp"],
        "actor.policy_loss=geo_mean takes one advantage a sequence, and algorithm.adv_estimator=reinforce_pp gives "
        "one a token; use an estimator of sequence scores (grpo, rloo, opo, ...)",
    ),
    (
        ["actor.policy_loss=geo_mean", "actor.off_policy_correction=tis"],
        "actor.off_policy_correction=tis with actor.policy_loss=geo_mean: the correction weighs each token's "
        "advantage, which that loss's token selection or sequence advantage would read; use one of vanilla, gspo, "
        "cispo, sapo, dppo, gpg",
    ),
    (["actor.policy_loss=sapo", "actor.tau_neg=0"], "actor.tau_neg: expected a number > 0, got 0"),
    (["algorithm.use_kl_in_reward=true"], "algorithm.use_kl_in_reward and actor.use_kl_loss are both true: pick one"),
    (
        ["algorithm.adv_estimator=gdpo", "algorithm.use_kl_in_reward=true", "actor.use_kl_loss=false"],
        "algorithm.use_kl_in_reward with algorithm.adv_estimator=gdpo: it normalises each reward term on its own and "
        "the KL penalty is none of them, so it would be ignored; use actor.use_kl_loss",
    ),
    (
        ["algorithm.adv_estimator=gdpo", "rollout.n=1"],
        "algorithm.adv_estimator=gdpo compares samples of one prompt: it needs rollout.n >= 2, got rollout.n=1",
    ),
    (
        ["algorithm.adv_estimator=gdpo", "algorithm.norm_adv_by_std=false"],
        "algorithm.norm_adv_by_std=false with algorithm.adv_estimator=gdpo: only grpo and grpo_passk read it "
        "(whether to divide by the group's std), so it would be ignored; leave it true",
    ),
    (
        ["model.lora_rank=4", "rollout.backend=vllm", "model.shard_params=true"],
        "model.shard_params=true with model.lora_rank=4 and rollout.backend=vllm: vLLM's replicas take the adapters "
        "merged into the base weights, and merging needs a layer's weights on one rank; use model.shard_params=false "
        "or rollout.backend=native",
    ),
]


def test_optimizer_offload_on_several_gpus_is_refused_in_one_line():
    with pytest.raises(ConfigError, match=r"^actor.optimizer_offload=true with trainer.num_workers=2 on CUDA: ") as err:
        load_config(None, ["actor.optimizer_offload=true", "trainer.num_workers=2", "resources.device=cuda"])
    assert "\n" not in str(err.value)
    load_config(None, ["actor.optimizer_offload=true", "trainer.num_workers=2", "resources.device=cpu"])
    load_config(None, ["critic.optimizer_offload=true", "resources.device=cuda"])


def test_lora_with_vllm_is_taken():
    """vLLM's replicas take the merged weights (workers/worker.py `pushed_weights`)."""
    cfg = load_config(None, ["model.lora_rank=4", "rollout.backend=vllm"])
    assert (cfg.model.lora_rank, cfg.rollout.backend) == (4, "vllm")


def test_norm_adv_by_std_false_is_taken_where_it_is_read():
    for name in ("grpo", "grpo_passk"):  # Dr. GRPO, and pass@k likewise
        assert not load_config(None, [f"algorithm.adv_estimator={name}", "algorithm.norm_adv_by_std=false"]
                               ).algorithm.norm_adv_by_std


def test_greedy_rollouts_are_allowed_where_samples_need_not_differ():
    """gae and reinforce_pp compare no samples of one prompt; validation is greedy by default."""
    for estimator in ("gae", "reinforce_pp"):
        cfg = load_config(None, [f"algorithm.adv_estimator={estimator}", "rollout.temperature=0", "rollout.top_k=1"])
        assert cfg.rollout.temperature == 0.0
    assert load_config(None, ["rollout.val.temperature=0", "rollout.val.top_k=1"]).algorithm.adv_estimator == "grpo"
    assert load_config(None, ["rollout.temperature=0.01", "rollout.top_k=2"]).rollout.top_k == 2


def _run_error(capsys, argv):
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("overrides, message", OVERRIDE_ERRORS, ids=[" ".join(o) for o, _ in OVERRIDE_ERRORS])
def test_override_errors(capsys, overrides, message):
    assert _run_error(capsys, ["config", *overrides]) == f"error: {message}"


FILE_ERRORS = [
    ("rollout:\n  temprature: 0.7\n", "unknown config key 'rollout.temprature' in {path!r} (did you mean 'rollout.temperature'?)"),
    ("rollout:\n  n: abc\n", "rollout.n: expected an integer >= 1, got 'abc' (in {path!r})"),
    ("data:\n  shuffle: yes\n", "data.shuffle: expected true or false, got 'yes' (in {path!r})"),
    ("rollout: 3\n", "rollout: expected a mapping of keys, got 3 (in {path!r})"),
    ("- a\n- b\n", "config file {path!r}: expected a mapping of sections and keys, got [a, b]"),
    ("just a string\n", "config file {path!r}: expected a mapping of sections and keys, got 'just a string'"),
    ("rollout:\n  n: 2\n  n: 3\n", "config file {path!r}: invalid YAML at line 3, column 3: duplicate key 'n'"),
    ("rollout: [\n", "config file {path!r}: invalid YAML at line 2, column 1: expected the node content, but found '<stream end>'"),
    ("1: 2\n", "config file {path!r}: keys must be strings, got 1"),
]


@pytest.mark.parametrize("text, message", FILE_ERRORS)
def test_file_errors(capsys, tmp_path, text, message):
    path = _write(tmp_path, text)
    assert _run_error(capsys, ["config", path, "rollout.n=4"]) == "error: " + message.format(path=path)


def test_missing_file(capsys, tmp_path):
    path = str(tmp_path / "nope.yaml")
    assert _run_error(capsys, ["config", path]) == f"error: config file {path!r} not found"


# --- output: round trip, help comments, the example file, the console command ----------


def _reload(tmp_path, cfg):
    """`load_config` of `config_to_yaml(cfg)`."""
    return load_config(_write(tmp_path, config_to_yaml(cfg), name="printed.yaml"))


def test_round_trip_defaults(tmp_path):
    cfg = load_config()
    assert _reload(tmp_path, cfg) == cfg


@pytest.mark.parametrize("name", ["123", "1e3", "true", "yes", "null", "a: b", "#x", "- y", "[z]", "", "é ü", "it's"])
def test_round_trip_of_strings_that_look_like_other_things(tmp_path, name):
    cfg = load_config()
    cfg.trainer.experiment_name = name
    cfg.data.train_files = [name, "b"]
    assert _reload(tmp_path, cfg) == cfg


def test_round_trip_of_changed_values(tmp_path):
    cfg = load_config(
        None,
        [
            "actor.lr=1.5e-7",
            "actor.betas=[0.8, 0.95]",
            "reward.model_path=rm",
            "reward.rule_weight=-0.25",
            "trainer.max_ckpt_to_keep=3",
            "rollout.tools=[calculator]",
            "algorithm.adv_estimator=gae",
            "algorithm.use_kl_in_reward=true",
            "actor.use_kl_loss=false",
            "algorithm.kl_ctrl.type=adaptive",
        ],
    )
    assert cfg != load_config()
    assert _reload(tmp_path, cfg) == cfg
    # a stock YAML reader sees the same values
    as_dict = dataclasses.asdict(cfg, dict_factory=lambda kv: {k: list(v) if isinstance(v, tuple) else v for k, v in kv})
    assert yaml.safe_load(config_to_yaml(cfg)) == as_dict


def test_weighted_rewards_and_dapo_keys(tmp_path):
    cfg = load_config(None, ["reward.fns=[{fn: a.py:f, weight: 0.5}, {fn: null, weight: -2}, {fn: m:g}]",
                             "reward.overlong_buffer={enable: true, len: 4, penalty_factor: 1.0}",
                             "actor.mask_truncated=true"])
    assert [(e.fn, e.weight) for e in cfg.reward.fns] == [("a.py:f", 0.5), (None, -2.0), ("m:g", 1.0)]
    assert cfg.reward.overlong_buffer.len == 4 and cfg.actor.mask_truncated
    assert _reload(tmp_path, cfg) == cfg
    batch = load_config(None, ["reward.reward_manager=batch", "reward.fn=m:score_all"])
    assert batch.reward.reward_manager == "batch"
    assert load_config().reward.fns == [] and not load_config().reward.overlong_buffer.enable
    groups = load_config(None, ["algorithm.filter_groups={enable: true, metric: acc, max_num_gen_batches: 0}"])
    assert groups.algorithm.filter_groups.enable and groups.algorithm.filter_groups.max_num_gen_batches == 0
    assert _reload(tmp_path, groups) == groups
    assert not load_config().algorithm.filter_groups.enable  # off by default: a run's bits as before


def test_yaml_has_help_comments():
    lines = config_to_yaml(load_config()).splitlines()
    i = lines.index("  temperature: 1.0  # a number >= 0")
    assert lines[i - 3 : i] == ["  # sampling temperature for training rollouts; 0 = greedy (an error with grpo, remax,",
                                "  # rloo, reinforce_pp_baseline, grpo_passk, opo, gpg, gdpo, which compare samples that",
                                "  # must differ)"]
    i = lines.index("  adv_estimator: grpo  # one of gae, grpo, remax, rloo, reinforce_pp, reinforce_pp_baseline, "
                    "grpo_passk, opo, gpg, gdpo")
    assert lines[i - 14] == "  # advantage estimator: gae = PPO's GAE on the critic's values (trains a critic); grpo"
    # every field's help is printed, whole (wrapped lines joined back)
    comments = " ".join(line.strip().removeprefix("# ") for line in lines if line.strip().startswith("# "))
    for key, f in _leaf_fields():
        assert f.metadata["help"] in comments, key


def test_example_file_is_in_sync():
    # Regenerate with: reprorl config > examples/default.yaml
    assert (REPO / "examples" / "default.yaml").read_text() == config_to_yaml(load_config())


def test_console_command_smoke(tmp_path):
    exe = shutil.which("reprorl")
    assert exe is not None, "the `reprorl` console script is not installed (pip install -e .)"
    out = subprocess.run(
        [exe, "config", "rollout.temperature=0.7", "trainer.loggers=[console]"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    printed = yaml.safe_load(out.stdout)
    assert printed["rollout"]["temperature"] == 0.7 and printed["trainer"]["loggers"] == ["console"]
    bad = subprocess.run([exe, "config", "rollout.n=abc"], capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert bad.returncode == 2 and bad.stderr == "error: rollout.n: expected an integer >= 1, got 'abc'\n"


def test_chat_template_kwargs_are_a_mapping_of_scalars_and_round_trip(tmp_path):
    cfg = load_config(None, ["data.apply_chat_template_kwargs={enable_thinking: false, depth: 2}"])
    assert cfg.data.apply_chat_template_kwargs == {"enable_thinking": False, "depth": 2}
    assert load_config().data.apply_chat_template_kwargs == {}  # not shared between configs
    path = tmp_path / "c.yaml"
    path.write_text(config_to_yaml(cfg))
    assert load_config(path) == cfg
    with pytest.raises(ConfigError, match=r"^data.apply_chat_template_kwargs.a: expected true or false or an "
                                          r"integer or a number or a string, got \[1\]$"):
        load_config(None, ["data.apply_chat_template_kwargs={a: [1]}"])
    with pytest.raises(ConfigError, match=r"^data.apply_chat_template_kwargs: expected a mapping of names to "):
        load_config(None, ["data.apply_chat_template_kwargs=3"])
