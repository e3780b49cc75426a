"""LoRA end to end on the tiny model (CPU, full determinism): the engine's log-probs stay
the trainer's, only the adapters train, the reference is the base, and runs are the same
bits with 1 or 2 replicas and workers, after a resume, and with PPO's critic."""

import json
from pathlib import Path

import peft
import pytest
import torch
import transformers
from safetensors.torch import load_file

from reprorl.compare import compare_runs
from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.export import ExportError, export
from reprorl.fingerprint import tensor_digests
from reprorl.models.hf_io import load_model
from reprorl.models.lora import spec_from_config
from small_run import WITH_KL, run_trainer, small_run_overrides

# One Ray for the module (ray_local); conftest's `assets`: the shared data and tiny policy.
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_local")]

# With the KL loss: the reference is the base with the adapters off (no process of its own).
LORA = ("model.lora_rank=4", "model.lora_alpha=8", "actor.lr=2e-2", *WITH_KL)


def lora_config(assets, run_dir, *extra):
    return load_config(None, small_run_overrides(assets, run_dir, *LORA, *extra))


def records(run_dir, name):
    return [json.loads(line) for line in (Path(run_dir) / name).read_text().splitlines()]


@pytest.fixture(scope="module")
def grpo_run(assets, tmp_path_factory):
    """3 steps of LoRA GRPO with a KL loss, a checkpoint each step: 2 replicas, 1 worker; the
    engine's log-probs checked against the trainer's every step (the runs it is compared
    with check only their first step)."""
    cfg = lora_config(assets, tmp_path_factory.mktemp("grpo") / "run", "trainer.total_steps=3", "trainer.save_freq=1",
                      "rollout.num_replicas=2", "actor.log_prob_check_freq=1")
    run_trainer(cfg)
    return Path(cfg.trainer.run_dir)


def test_only_the_adapters_train_and_the_gap_stays_zero(grpo_run):
    metrics = records(grpo_run, "metrics.jsonl")
    assert [m["rollout/log_prob_max_gap"] for m in metrics] == [0.0, 0.0, 0.0]
    assert all(m["actor/kl"] > 0 for m in metrics[1:])  # the reference (adapters off) differs once B moved
    steps = [r["params"] for r in records(grpo_run, "fingerprints.jsonl")]
    adapters = [n for n in steps[0] if ".lora_" in n]
    base = [n for n in steps[0] if ".lora_" not in n]
    assert adapters and base
    assert all(s[n] == steps[0][n] for s in steps for n in base)  # the base never moves
    moved = [n for n in adapters if steps[-1][n] != steps[0][n]]
    assert sorted(n for n in moved if n.endswith("lora_B")) == sorted(n for n in adapters if n.endswith("lora_B"))


def test_lora_with_one_replica_and_two_workers_is_the_same_run(assets, grpo_run, tmp_path):
    cfg = lora_config(assets, tmp_path / "run", "trainer.total_steps=3", "rollout.num_replicas=1",
                      "trainer.num_workers=2")
    run_trainer(cfg)
    result = compare_runs(grpo_run, cfg.trainer.run_dir)
    assert result.identical and result.common_steps == [1, 2, 3], result


def test_lora_resume_is_bitwise(assets, grpo_run, tmp_path):
    """2 steps, then the same run grown to 3 steps resumes from step 2's adapters."""
    first = lora_config(assets, tmp_path / "run", "trainer.total_steps=2", "trainer.save_freq=1")
    run_trainer(first)
    shards = list((tmp_path / "run" / "checkpoints" / "step_2").rglob("shard_*.pt"))
    assert shards
    saved = torch.load(shards[0], weights_only=True)
    assert saved["param"].numel() < 20_000  # the adapters alone, not the ~0.1M-parameter base
    run_trainer(lora_config(assets, tmp_path / "run", "trainer.total_steps=3", "trainer.save_freq=1"))
    result = compare_runs(grpo_run, tmp_path / "run")
    assert result.identical and result.common_steps == [1, 2, 3], result


def test_lora_ppo_with_a_critic_reruns_bitwise(assets, tmp_path):
    runs = [lora_config(assets, tmp_path / name, "algorithm.adv_estimator=gae", *extra)
            for name, extra in (("a", ["actor.log_prob_check_freq=1"]), ("b", []))]
    for cfg in runs:
        run_trainer(cfg)
    metrics = records(runs[0].trainer.run_dir, "metrics.jsonl")
    assert all(m["rollout/log_prob_max_gap"] == 0.0 for m in metrics) and "critic/vf_loss" in metrics[-1]
    assert compare_runs(runs[0].trainer.run_dir, runs[1].trainer.run_dir).identical


def test_lora_config_errors_name_the_key(assets, tmp_path):
    with pytest.raises(ConfigError, match="model.target_modules: unknown module 'qkv_proj'"):
        lora_config(assets, tmp_path, "model.target_modules=[q_proj,qkv_proj]")
    with pytest.raises(ConfigError, match="model.ref_path=.* with model.lora_rank=4"):
        lora_config(assets, tmp_path, f"model.ref_path={tmp_path}")


# ------------------------------------------------------------------------------ export


def ours_logits(model, ids):
    with torch.no_grad():
        return model(ids)


def hf_logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def token_ids():
    return torch.randint(3, 40, (2, 12), generator=torch.Generator().manual_seed(0))


def test_lora_export_is_the_trained_adapters_and_loads_in_peft(assets, grpo_run, tmp_path):
    adapters = export(grpo_run, tmp_path / "adapters")
    merged = export(grpo_run, tmp_path / "merged", merged=True)
    assert sorted(p.name for p in adapters.iterdir() if "adapter" in p.name) == [
        "adapter_config.json", "adapter_model.safetensors"]
    saved = {k.removeprefix("base_model.model.").removesuffix(".weight"): v
             for k, v in load_file(adapters / "adapter_model.safetensors").items()}
    step_3 = records(grpo_run, "fingerprints.jsonl")[-1]["params"]
    assert tensor_digests(saved.items()) == {n: step_3[n] for n in saved}  # the step's adapters, bit for bit
    assert len(saved) == len([n for n in step_3 if ".lora_" in n])

    cfg = lora_config(assets, grpo_run)
    ours, _ = load_model(assets["policy"], lora=spec_from_config(cfg.model, cfg.seed))
    params = dict(ours.named_parameters())
    with torch.no_grad():
        for name, tensor in saved.items():
            params[name].copy_(tensor)
    ids = token_ids()
    expected = ours_logits(ours, ids)
    base = transformers.AutoModelForCausalLM.from_pretrained(assets["policy"], dtype=torch.float32)
    with_adapters = peft.PeftModel.from_pretrained(base, adapters).eval()
    plain_merged = transformers.AutoModelForCausalLM.from_pretrained(merged, dtype=torch.float32).eval()
    torch.testing.assert_close(hf_logits(with_adapters, ids), expected, rtol=0, atol=1e-6)
    # The merged directory as transformers reads it is reprorl's merged model; merging itself
    # (W + B A s, one rounding where the adapted model rounds W x and (B A x) s apart) moves
    # logits of O(1) by a few float32 ulps (1.8e-6 seen), as PEFT's merge_and_unload does.
    ours_merged, _ = load_model(merged)
    torch.testing.assert_close(hf_logits(plain_merged, ids), ours_logits(ours_merged, ids), rtol=0, atol=1e-6)
    torch.testing.assert_close(ours_logits(ours_merged, ids), expected, rtol=0, atol=1e-5)


def test_full_fine_tuning_export_loads_in_transformers(three_step_run, tmp_path):
    """Step 1's checkpoint of conftest's shared full fine-tuning run (step 1 of 3: not its newest)."""
    out = export(three_step_run, tmp_path / "hf", step=1)
    ours, _ = load_model(out)
    step_1 = records(three_step_run, "fingerprints.jsonl")[0]["params"]
    assert tensor_digests(ours.named_parameters()) == step_1  # the weights step 1 ended with
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ids = token_ids()
    torch.testing.assert_close(hf_logits(hf, ids), ours_logits(ours, ids), rtol=0, atol=1e-6)
    tok = transformers.AutoTokenizer.from_pretrained(out)  # the base's tokenizer files came along
    assert tok.eos_token == "<|im_end|>" and tok.chat_template is not None


def test_export_errors_name_the_run(tmp_path):
    with pytest.raises(ExportError, match="has no checkpoint"):
        export(tmp_path, tmp_path / "out")
