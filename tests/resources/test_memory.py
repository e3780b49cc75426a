"""The GPU memory estimate (reprorl/resources/memory.py): literal bytes on small shapes, the KV cache
as the engine sizes it, the one-line error, and `reprorl config --memory`."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from reprorl import cli
from reprorl.config import load_config
from reprorl.errors import ConfigError
from reprorl.models.arch import ModelArgs
from reprorl.models.tiny import TINY_FAMILIES
from reprorl.models.transformer import CausalLM
from reprorl.resources import memory
from reprorl.resources.memory import GIB, activation_bytes, check_gpu_memory, estimate_memory, kv_cache_bytes, param_count

# One layer, 2 query heads and 1 kv head of 2, vocab 10, tied: small enough to count by hand.
SMALL = ModelArgs(model_type="qwen2", vocab_size=10, hidden_size=4, intermediate_size=6, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=1, head_dim=2, tie_word_embeddings=True, qkv_bias=True)
# The tiny test model's shape (models/tiny.py): 128 wide, 2 layers, vocab 128, tied.
TINY = ModelArgs(model_type="qwen2", vocab_size=128, hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                 num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=True, qkv_bias=True)


def test_parameter_count_by_hand_and_as_the_model_has_it():
    # embedding 10x4 = 40; q 4x4 + 4, k 4x2 + 2, v 4x2 + 2, o 4x4; mlp 3 x 4x6 = 72; 2 norms 8; final norm 4
    assert param_count(SMALL) == 40 + (16 + 4) + (8 + 2) + (8 + 2) + 16 + 72 + 8 + 4 == 180
    assert param_count(SMALL) == sum(p.numel() for p in CausalLM(SMALL).parameters())
    untied = dataclasses.replace(SMALL, tie_word_embeddings=False)
    assert param_count(untied) == 180 + 40 == sum(p.numel() for p in CausalLM(untied).parameters())
    assert param_count(SMALL, "critic") == 180 + 4 + 1


def test_kv_cache_by_hand():
    # 2 (k, v) x 1 layer x 1 kv head x 2 dims x 2 bytes = 8 bytes a token; 100 tokens -> one KEY_BLOCK of 128
    assert kv_cache_bytes(SMALL, 2, max_num_seqs=4, max_model_len=100, utilization=0.5, free_bytes=None) == 5 * 128 * 8
    # 0.5 x 6000 bytes hold 2 slots of 1024 bytes, one of them the spare: 1 sequence
    assert kv_cache_bytes(SMALL, 2, max_num_seqs=4, max_model_len=100, utilization=0.5, free_bytes=6000) == 2 * 1024
    # not one whole slot of 1024 tokens: one shorter slot, 3000 // 16 // 128 = 1 block, and its spare
    assert kv_cache_bytes(SMALL, 2, max_num_seqs=4, max_model_len=1000, utilization=0.5, free_bytes=6000) == 2 * 128 * 8


@pytest.mark.parametrize("free,max_len", [(10**9, 300), (2_000_000, 300), (2_000_000, 3000)])
def test_kv_cache_is_what_the_engine_allocates(monkeypatch, free, max_len):
    from reprorl.rollout import engine_options

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, 8 * free))
    slots, capacity = engine_options.gpu_cache_shape(TINY, torch.bfloat16, torch.device("cuda"), 16, max_len, 0.5)
    per_token = 2 * 2 * 1 * 64 * 2
    assert kv_cache_bytes(TINY, 2, 16, max_len, 0.5, free) == (slots + 1) * capacity * per_token


def test_activations_by_hand():
    # a layer keeps 6H + 2q + 2kv + 3I = 24 + 8 + 4 + 18 = 54 elements a token; 2 rows x 5 tokens, fp32
    tokens, layer = 10, 54 * 4 * 10
    around = 3 * 4 * 4 * tokens
    logits = 2 * 3 * 10 * 4  # rows x response x vocab x 4 bytes
    assert activation_bytes(SMALL, 4, 2, 5, 3, checkpointing=False) == layer + around + 2 * logits
    assert activation_bytes(SMALL, 4, 2, 5, 3, checkpointing=True) == 4 * 4 * tokens + around + logits + max(
        logits, layer)
    # the batch-invariant kernels keep one more attention output (q = 4 elements a token)
    invariant = (54 + 4) * 4 * 10
    assert activation_bytes(SMALL, 4, 2, 5, 3, checkpointing=False, batch_invariant=True) == (
        invariant + around + 2 * logits)


def small_config(model_dir, *extra):
    return load_config(None, [f"model.path={model_dir}", "data.max_prompt_length=64", "data.max_response_length=8",
                              "rollout.n=8", "data.train_batch_size=16", "actor.ppo_mini_batch_size=16",
                              "actor.ppo_micro_batch_size=32", "rollout.num_replicas=2", "rollout.max_num_seqs=64",
                              *extra])


@pytest.fixture
def tiny_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY.to_hf_config()))
    return tmp_path


def test_the_estimate_of_a_small_run_by_hand(tiny_dir):
    est = estimate_memory(small_config(tiny_dir))  # float32, GRPO with a KL loss: actor, reference, 2 replicas
    params, padded = 410_752, 101 * 4096  # 16384 + 2 x 197120 + 128; 101 chunks of 4096
    weights = params * 4
    assert est.resident == {
        "actor weights": weights, "actor master weights (float32)": padded * 4,
        "actor AdamW moments (float32)": 2 * padded * 4, "reference weights": weights,
        "rollout weights (2 replica(s))": 2 * weights,
    }
    # 128 samples, 32 a micro-batch: 4 leaves, at most 2 whole vectors (grad_tree.max_pending)
    assert est.phases["actor update"] == {
        "gradient sums (2 x float32)": 2 * padded * 4,
        "activations (32 x 72 tokens)": activation_bytes(TINY, 4, 32, 72, 8, checkpointing=False, batch_invariant=True),
    }
    # 2 x 64 slots (+1 spare) of 128 tokens x 1024 bytes; the last step's logits, 64 x 128 x 4
    assert est.phases["generation"] == {"KV cache (2 replica(s))": 2 * 65 * 128 * 1024,
                                       "engine logits (float32)": 2 * 64 * 128 * 4}
    assert est.processes == 4
    assert est.peak == est.phase_total(est.peak_phase) == sum(est.resident.values()) + sum(
        est.phases[est.peak_phase].values()) + 4 * memory.CUDA_CONTEXT_BYTES


def test_ppo_adds_the_critic_and_its_update(tiny_dir):
    est = estimate_memory(small_config(tiny_dir, "algorithm.adv_estimator=gae"))
    critic = 410_752 + 128 + 1  # the backbone and a value head [1, H] with its bias
    assert est.resident["critic weights"] == critic * 4
    assert est.resident["critic AdamW moments (float32)"] == 2 * 101 * 4096 * 4
    assert est.phases["critic update"] == {
        "gradient sums (2 x float32)": 2 * 101 * 4096 * 4,
        "activations (32 x 72 tokens)": activation_bytes(TINY, 4, 32, 72, 8, checkpointing=False, head="critic",
                                                            batch_invariant=True),
    }
    assert est.processes == 5  # actor, reference, critic, 2 replicas


def test_host_sums_bound_the_vectors_and_a_token_budget_lays_leaves_on_a_power_of_two(tiny_dir):
    # 128 samples, 4 micro-batches of 32: the tree's own max_pending(4) = 2 caps k
    for k, vectors in ((0, 2), (1, 1), (2, 2), (3, 2)):
        est = estimate_memory(small_config(tiny_dir, f"model.gpu_gradient_vectors={k}"))
        assert f"gradient sums ({vectors} x float32)" in est.phases["actor update"]
    # 72-token samples, 3 to a 216-token micro-batch: 43 micro-batches -> 64 leaves -> max_pending 6
    est = estimate_memory(small_config(tiny_dir, "actor.ppo_max_token_len_per_micro_batch=216"))
    assert "gradient sums (6 x float32)" in est.phases["actor update"]


def test_an_offloaded_optimizer_keeps_its_state_and_sums_on_the_host(tiny_dir):
    """actor.optimizer_offload: master, moments and the gradient tree's vectors leave the
    GPU's estimate for the host's; the GPU keeps a parameter's gradient and a slice of the
    new weights on their way."""
    from reprorl.resources.host_memory import largest_parameter
    from reprorl.workers.offload import PUBLISH_SLICE

    padded = 101 * 4096
    on, off = (estimate_memory(small_config(tiny_dir, f"actor.optimizer_offload={x}")) for x in ("true", "false"))
    assert on.host == {"actor master weights (float32, host)": padded * 4,
                       "actor AdamW moments (float32, host)": 2 * padded * 4,
                       "actor gradient sums (2 x float32, host)": 2 * padded * 4}  # 4 leaves: max_pending 2
    assert not off.host
    assert {k: v for k, v in on.resident.items()} == {k: v for k, v in off.resident.items() if "float32" not in k}
    largest = largest_parameter(TINY)
    assert largest == 384 * 128  # a layer's MLP projection, wider than the 128 x 128 embedding
    assert on.phases["actor gradients to the host"] == {
        "a parameter's gradient (float32 and its 4-byte cast, and a pending sum's piece)": largest * 12}
    assert on.phases["actor update"] == {k: v for k, v in off.phases["actor update"].items()
                                         if not k.startswith("gradient sums")}
    assert on.phases["actor optimizer step"] == {"new weights on their way from the host (a slice)": PUBLISH_SLICE * 4}
    assert "total on the host" in on.table()


def test_an_offloaded_run_the_host_cannot_hold_stops_with_one_line(tiny_dir, monkeypatch):
    from reprorl.resources import host_memory

    cfg = small_config(tiny_dir, "actor.optimizer_offload=true")
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 20)
    with pytest.raises(ConfigError, match=r"^host memory: optimizer offload keeps about 0\.0 GiB on the host and "
                                          r"0\.0 GiB are available; would fit: fewer micro-batches") as err:
        check_gpu_memory(cfg, 80 * GIB)
    assert "\n" not in str(err.value)
    monkeypatch.setattr(memory, "host_available_bytes", lambda: 1 << 40)
    check_gpu_memory(cfg, 80 * GIB)
    assert host_memory.host_available_bytes() > 0  # this machine's /proc/meminfo


def test_lora_counts_the_adapters_alone(tiny_dir):
    cfg = small_config(tiny_dir, "model.lora_rank=8")
    est = estimate_memory(cfg)
    # rank 8 x (in + out) per projection: q 256, k 192, v 192, o 256, gate, up, down 512 each: 2432 x 8 x 2 layers
    adapters = 8 * 2432 * 2
    assert est.resident["actor LoRA adapters (rank 8)"] == adapters * 4
    assert est.resident["actor master weights (float32)"] == 10 * 4096 * 4  # 38,912 padded to 10 chunks
    assert "reference weights" not in est.resident  # the base with the adapters off
    cfg.model.target_modules = ["q_proj", "qkv"]
    with pytest.raises(ConfigError, match="model.target_modules: unknown module 'qkv'"):
        estimate_memory(cfg)


def test_a_run_that_cannot_fit_stops_with_one_line_saying_what_would(tiny_dir):
    cfg = small_config(tiny_dir, "rollout.max_num_seqs=8")
    est = estimate_memory(cfg)
    assert check_gpu_memory(cfg, est.peak) is not None  # fits exactly
    gpu = est.peak - 1
    with pytest.raises(ConfigError) as err:
        check_gpu_memory(cfg, gpu)
    message = str(err.value)
    assert "\n" not in message
    assert f"needs about {est.peak / GIB:.1f} GiB at its peak (actor update)" in message
    assert f"the GPU has {gpu / GIB:.1f} GiB" in message
    assert "actor.ppo_micro_batch_size=16" in message and "model.gradient_checkpointing=true" in message
    assert estimate_memory(dataclasses.replace(cfg, actor=dataclasses.replace(
        cfg.actor, ppo_micro_batch_size=16)), gpu).peak <= gpu  # what it says would fit does


def test_when_no_change_alone_fits_the_error_gives_them_together(tiny_dir):
    # a token budget: no micro-batch size to halve; a LoRA run, so LoRA is no suggestion; at
    # the peak of both switches on, neither alone is enough
    cfg = small_config(tiny_dir, "actor.ppo_max_token_len_per_micro_batch=2160", "rollout.max_num_seqs=8",
                       "model.lora_rank=8")
    both = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, gradient_checkpointing=True,
                                                               gpu_gradient_vectors=1))
    with pytest.raises(ConfigError, match=r"would fit: model.gradient_checkpointing=true \+ "
                                          r"model.gpu_gradient_vectors=1 \(`reprorl config"):
        check_gpu_memory(cfg, estimate_memory(both).peak)
    # Full fine-tuning at the peak of its own two switches on: LoRA alone fits that GPU
    full = small_config(tiny_dir, "actor.ppo_max_token_len_per_micro_batch=2160", "rollout.max_num_seqs=8")
    full_both = dataclasses.replace(full, model=dataclasses.replace(full.model, gradient_checkpointing=True,
                                                                     gpu_gradient_vectors=1))
    with pytest.raises(ConfigError, match=r"would fit: LoRA \(model.lora_rank=64\) \(`reprorl config"):
        check_gpu_memory(full, estimate_memory(full_both).peak)


def test_a_gpu_too_small_for_the_weights_says_nothing_in_reach_fits(tiny_dir):
    with pytest.raises(ConfigError, match="nothing in reach fits"):
        check_gpu_memory(small_config(tiny_dir), 2**20)


def test_config_memory_prints_the_table(tiny_dir, capsys):
    assert cli.main(["config", f"model.path={tiny_dir}", "resources.device=cpu", "--memory", "--gpu-gib", "1"]) == 0
    out = capsys.readouterr().out
    assert "actor AdamW moments (float32)" in out and "actor update: gradient sums" in out
    assert "total during actor update" in out and "<- peak" in out
    assert "does NOT fit a GPU of 1.0 GiB" in out  # 5 CUDA contexts alone are 2.5 GiB


def test_several_gpus_each_hold_one_rank_and_their_share_of_replicas(tiny_dir):
    """4 ranks, 6 replicas colocated: GPU 0 (the busiest) holds one actor and one reference
    rank, 2 replicas; the master and moments are a quarter (26 of the padded 104 chunks)."""
    one, four = (estimate_memory(small_config(tiny_dir, f"trainer.num_workers={n}", "rollout.num_replicas=6",
                                              "data.train_batch_size=32", "actor.ppo_mini_batch_size=32"))
                 for n in (1, 4))
    assert one.processes == 2 + 6 and four.processes == 2 + 2
    assert four.resident["rollout weights (2 replica(s))"] == one.resident["rollout weights (6 replica(s))"] // 3
    assert four.resident["actor weights"] == one.resident["actor weights"]  # weights are whole on every rank
    assert one.resident["actor master weights (float32)"] == 101 * 4096 * 4
    assert four.resident["actor master weights (float32)"] == 104 * 4096 * 4 // 4  # padded to 4 x 26 chunks
    assert four.phases["generation"]["KV cache (2 replica(s))"] * 3 == one.phases["generation"][
        "KV cache (6 replica(s))"]


def test_parameters_sharded_at_rest_keep_a_shard_and_gather_a_unit(tiny_dir):
    """4 ranks, `model.shard_params`, bfloat16: the actor's and the reference's weights are a
    quarter of the padded 104 chunks in bf16; the actor's update holds shard-sized sums over
    its rounds (128 samples in 4 micro-batches: 4 leaves, one round of 4, one sum), the root
    unit and two layers gathered (one prefetched), and the units' float32 gradients; the
    log-prob pass gathers as many."""
    est = estimate_memory(small_config(tiny_dir, "trainer.num_workers=4", "model.shard_params=true",
                                       "model.dtype=bfloat16"))
    shard = 104 * 4096 // 4
    root, layer = 128 * 128 + 128, 197_120  # embeddings (tied) and the final norm; one layer
    assert est.resident["actor weights (this rank's shard)"] == shard * 2
    assert est.resident["reference weights (this rank's shard)"] == shard * 2
    assert "actor weights" not in est.resident and "reference weights" not in est.resident
    update = est.phases["actor update"]
    assert update["gradient sums over rounds (1 x float32 shard)"] == shard * 4
    assert update["gathered weights (root, head and 2 layer(s))"] == (root + 2 * layer) * 2  # one prefetched
    # a layer's being sent (larger than the embeddings' and the final norm's), the next one's, and from each
    # of the 4 ranks a slice: an 8th of the shard in whole chunks (106,496 / 8 -> 3 x 4096)
    assert update["units' gradients (float32: the one sent, the layer computed, the slices received)"] == (
        2 * layer + 4 * 3 * 4096) * 4
    assert est.phases["log-probs"]["gathered weights (root, head and 2 layer(s))"] == (root + 2 * layer) * 2
    whole_cfg = small_config(tiny_dir, "trainer.num_workers=4", "model.dtype=bfloat16")
    whole = estimate_memory(whole_cfg)
    assert est.peak < whole.peak
    assert "model.shard_params=true" in memory.what_fits(whole_cfg, (est.peak + whole.peak) // 2)
    # float32: a trainable rank's weights are its master, nothing more
    est = estimate_memory(small_config(tiny_dir, "trainer.num_workers=4", "model.shard_params=true"))
    assert not any(name.startswith("actor weights") for name in est.resident)


def test_a_lora_runs_frozen_base_sharded_at_rest_is_a_shard_and_gathered_with_the_adapters(tiny_dir):
    """LoRA r4 on 4 ranks, bfloat16: the base (410,752 weights, 101 chunks padded to 104) is
    a quarter on each rank, and a pass gathers the base's root and two layers beside the
    adapters' two layers (they have no root)."""
    cfg = small_config(tiny_dir, "trainer.num_workers=4", "model.shard_params=true", "model.dtype=bfloat16",
                       "model.lora_rank=4")
    est = estimate_memory(cfg)
    adapters = memory.lora_param_count(memory.read_model_args(tiny_dir, "model.path"), 4, cfg.model.target_modules)
    root, layer = 128 * 128 + 128, 197_120
    assert est.resident["actor weights (frozen base, this rank's shard)"] == 104 * 4096 // 4 * 2
    assert "actor weights (frozen base)" not in est.resident
    gathered = (2 * adapters // 2 + root + 2 * layer) * 2
    assert est.phases["actor update"]["gathered weights (root, head and 2 layer(s))"] == gathered
    assert est.phases["log-probs"]["gathered weights (root, head and 2 layer(s))"] == gathered
    whole = estimate_memory(small_config(tiny_dir, "trainer.num_workers=4", "model.dtype=bfloat16",
                                         "model.lora_rank=4"))
    assert whole.resident["actor weights (frozen base)"] == 410_752 * 2


def test_rollout_gpus_of_their_own_are_estimated_apart(tiny_dir):
    cfg = small_config(tiny_dir, "trainer.num_workers=2", "rollout.num_replicas=4", "resources.rollout_gpus=2")
    trainer_gpu, rollout_gpu = estimate_memory(cfg), memory.estimate_rollout_gpu(cfg)
    assert "generation" not in trainer_gpu.phases and not any("rollout" in k for k in trainer_gpu.resident)
    assert trainer_gpu.processes == 2  # an actor and a reference rank
    assert rollout_gpu.processes == 2 and set(rollout_gpu.phases) == {"generation"}
    assert rollout_gpu.resident == {"rollout weights (2 replica(s))": 2 * 410_752 * 4}
    assert memory.estimate_rollout_gpu(small_config(tiny_dir)) is None  # colocated: no GPU of their own
    with pytest.raises(ConfigError, match=r"^GPU memory: a rollout GPU needs about .* more resources.rollout_gpus"):
        check_gpu_memory(cfg, rollout_gpu.peak - 1)


def test_config_memory_prints_each_kind_of_gpu(tiny_dir, capsys):
    args = [f"model.path={tiny_dir}", "trainer.num_workers=4", "rollout.num_replicas=2", "resources.rollout_gpus=2"]
    assert cli.main(["config", *args, "--memory", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    assert "the run takes 6 GPU(s)" in out
    assert "GPU 0 of the trainer's 4 (actor rank, reference rank)" in out
    assert "GPU 4, the first of the rollout's 2 (rollout replica)" in out
    assert out.count("fits a GPU of 80.0 GiB") == 2


def test_config_memory_names_a_missing_model(tmp_path, capsys):
    assert cli.main(["config", f"model.path={tmp_path / 'none'}", "--memory"]) == 2
    assert "model.path=" in capsys.readouterr().err


def test_a_cuda_run_that_cannot_fit_stops_before_any_part_starts(tmp_path, monkeypatch):
    from reprorl.data.synthetic import write_arithmetic_dataset
    from reprorl.models.tiny import make_tiny
    from reprorl.trainer import fit, parts

    policy = make_tiny(tmp_path / "policy", kind="policy", seed=0)
    data = write_arithmetic_dataset(tmp_path / "data", num_train=64, num_val=8, seed=0)
    # A GPU of 1 GiB (2 processes' CUDA contexts alone are 1 GiB), and no Ray.
    monkeypatch.setattr(parts, "resolve_device", lambda device: "cuda")
    monkeypatch.setattr(fit, "gpu_total_bytes", lambda: GIB)
    monkeypatch.setattr(fit, "init_ray", lambda: pytest.fail("a part started"))
    cfg = load_config(None, [f"model.path={policy}", f"data.train_files=[{data['train']}]", "data.val_files=[]",
                             f"trainer.run_dir={tmp_path / 'run'}", "rollout.num_replicas=1"])
    with pytest.raises(ConfigError, match=r"^GPU memory: the run needs about [0-9.]+ GiB at its peak \(\w[\w -]*\) "
                                          r"and the GPU has 1.0 GiB; "):
        fit.Trainer(cfg)


@pytest.mark.parametrize("family", sorted(TINY_FAMILIES))
def test_param_count_is_the_models(family):
    from reprorl.models.transformer import CausalLM

    args = dataclasses.replace(TINY, model_type=family, **TINY_FAMILIES[family])
    assert param_count(args) == sum(p.numel() for p in CausalLM(args).parameters())
