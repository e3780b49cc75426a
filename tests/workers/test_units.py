"""Parameters sharded at rest (workers/units.py): the unit plan over the flat layout, one
rank through the sharded path against the whole-parameter path (the same bits, weights
freed between passes), and a gradient that comes after its unit was sent. Several ranks:
test_group.py and test_train.py."""

import pytest
import torch

from reprorl.models.lora import LoraSpec
from reprorl.workers.flat import FlatLayout
from reprorl.workers.grad_tree import GradTree
from reprorl.workers.optim import OptimArgs
from reprorl.workers.policy import PolicyLossArgs, load_policy
from reprorl.workers.units import ROOT, Exchange, UnitPlan, exchange_slice, shard_parts

OPTIM = OptimArgs(lr=1e-2, weight_decay=0.01, grad_clip=0.5)
# 16 samples, mini-batches of 8, micro-batches of 2: 4 micro-batches per mini-batch, 2 optimizer steps.
STEP = {"ppo_epochs": 1, "mini_batch_size": 8, "micro_batch_size": 2, "max_response_length": 5,
        "loss": PolicyLossArgs(entropy_coeff=0.01), "temperature": 1.0}


@pytest.fixture(scope="module")
def layout(tiny_policy_dir):
    model = load_policy(tiny_policy_dir, trainable=True)
    return FlatLayout.of([(n, p) for n, p in model.named_parameters() if p.requires_grad], 4)


def test_each_parameter_is_in_one_unit_and_the_units_tile_the_flat_vector(layout):
    plan = UnitPlan.of(layout)
    assert list(plan.modules) == [None, "model.layers.0", "model.layers.1", None] and plan.head == 3
    for u, members in enumerate(plan.members):
        names = [layout.names[p] for p in members]
        if u == ROOT:  # tied: the head is the embeddings
            assert names == ["model.embed_tokens.weight"]
        elif u == plan.head:
            assert names == ["model.norm.weight"]
        else:
            assert all(n.startswith(f"{plan.modules[u]}.") for n in names), names
    assert sorted(p for members in plan.members for p in members) == list(range(len(layout.names)))
    spans = sorted((start, end) for unit in plan.spans for start, end, _ in unit)
    assert spans[0][0] == 0 and spans[-1][1] == layout.numel
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:]))
    assert sum(end - start for start, end in spans) == layout.numel
    assert [plan.size(u) for u in range(len(plan.members))] == [
        sum(layout.offsets()[p + 1] - layout.offsets()[p] if p + 1 < len(layout.names)
            else layout.numel - layout.offsets()[p] for p in members) for members in plan.members]


@pytest.mark.parametrize("rank", range(4))
def test_the_round_trees_parts_cut_each_rank_shard_at_its_slices_of_the_units(layout, rank):
    plan = UnitPlan.of(layout)
    parts, part_of = shard_parts([plan.exchange_slices(u, layout) for u in range(len(plan.members))], rank,
                                 layout.shard_size)
    start, end = layout.shard_range(rank)
    real = max(0, min(end, layout.numel) - start)  # the shard's elements that are not padding
    assert parts.size == layout.shard_size and parts.bounds[0] == 0 and parts.bounds[-1] == real
    slices = sorted((at, at + hi - lo) for u in range(len(plan.members)) for cut in plan.exchange_slices(u, layout)
                    if cut[rank] is not None for lo, hi, at in [cut[rank]])
    assert [(parts.bounds[i], parts.bounds[i + 1]) for i in range(parts.count)] == slices
    assert sorted(part_of.values()) == list(range(parts.count))


@pytest.mark.parametrize("world", [1, 2, 4])
def test_an_exchange_slice_is_each_owners_next_cut_of_its_pieces_of_the_unit(tiny_policy_dir, world):
    """A unit's gradient is exchanged a slice at a time (at most `exchange_slice` elements
    from each rank to each owner): per owner, its slices in order are its pieces, cut."""
    model = load_policy(tiny_policy_dir, trainable=True)
    layout = FlatLayout.of([(n, p) for n, p in model.named_parameters() if p.requires_grad], world)
    plan, most = UnitPlan.of(layout), exchange_slice(layout.shard_size)
    for unit in range(len(plan.members)):
        exchanges = plan.exchange_slices(unit, layout)
        assert all(any(cut) for cut in exchanges)  # no exchange without a slice
        for owner in range(world):
            taken = [cut[owner] for cut in exchanges if cut[owner] is not None]
            assert all(0 < hi - lo <= most for lo, hi, _ in taken)
            assert [cut[owner] is None for cut in exchanges] == sorted(cut[owner] is None for cut in exchanges)
            joined, pieces = [], plan.owner_pieces(unit, layout, owner)
            for lo, hi, at in taken:  # consecutive slices of one piece join up
                if joined and joined[-1][1] == lo and joined[-1][2] + joined[-1][1] - joined[-1][0] == at:
                    joined[-1] = (joined[-1][0], hi, joined[-1][2])
                else:
                    joined.append((lo, hi, at))
            assert joined == pieces
    assert max(len(plan.exchange_slices(u, layout)) for u in plan.layers) > 1  # the tests run the sliced path


def _train(in_process_group, policy_dir, batch, **options):
    """Log-probs, two updates' metrics, the weights and digests after them, and the shard file."""
    group = in_process_group("actor", policy_dir, optim=OPTIM, seed=1, full_determinism=True, **options)
    b = batch.slice(0, len(batch))
    b["old_log_probs"] = group.compute_log_probs(b, temperature=1.0, micro_batch_size=2)
    metrics = [group.update(b, **STEP) for _ in range(2)]
    return group, b["old_log_probs"], metrics, dict(group.named_weights()), group.weight_digests()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_one_rank_sharded_at_rest_gives_the_whole_paths_bits_and_keeps_no_weight_between_passes(
        tiny_policy_dir, in_process_group, rollout_batch, checkpointing, tmp_path):
    batch = rollout_batch(16, 6, 5, 0)
    _, *whole = _train(in_process_group, tiny_policy_dir, batch)
    group, *sharded = _train(in_process_group, tiny_policy_dir, batch, shard_params=True,
                             gradient_checkpointing=checkpointing)
    assert torch.equal(sharded[0], whole[0])
    assert sharded[1] == whole[1]  # every metric, exactly
    assert sharded[2].keys() == whole[2].keys()
    assert [k for k in whole[2] if not torch.equal(whole[2][k], sharded[2][k])] == []
    assert sharded[3] == whole[3]

    worker = group.workers[0]
    at_rest = worker.at_rest
    most, gather = [0], at_rest.gather

    def counting_gather(unit):  # how many units are gathered at once, at most
        gather(unit)
        most[0] = max(most[0], sum(at_rest.is_gathered))

    at_rest.gather = counting_gather
    b = batch.slice(0, len(batch))
    b["old_log_probs"] = sharded[0]
    group.update(b, **STEP)
    assert most[0] == 3  # root, head, one layer: a layer is freed before the next is gathered (one rank: no prefetch)
    del at_rest.gather
    assert worker.flat is None and not any(at_rest.is_gathered)
    assert [b.untyped_storage().nbytes() for b in at_rest.buffers] == [0] * len(at_rest.buffers)
    seen = []  # a layer's storage as its forward starts (this pre-hook runs after the gathering one)
    handle = worker.model.model.layers[1].register_forward_pre_hook(
        lambda *_: seen.append(at_rest.buffers[2].untyped_storage().nbytes()))
    try:
        group.compute_log_probs(batch, temperature=1.0, micro_batch_size=8)
    finally:
        handle.remove()
    assert seen == [at_rest.buffers[2].numel() * 4] * 2  # float32, two micro-batches
    assert [b.untyped_storage().nbytes() for b in at_rest.buffers] == [0] * len(at_rest.buffers)


def test_a_lora_actor_sharded_at_rest_keeps_its_shard_of_the_frozen_base_alone_with_the_whole_paths_bits(
        tiny_policy_dir, in_process_group, rollout_batch):
    """LoRA: the adapters are the trained set; the frozen base is cut into the same units
    and gathered with them (no master, no gradient), so at rest a rank keeps its range of
    the base too. The whole path's bits, the base's buffers freed between passes."""
    batch = rollout_batch(16, 6, 5, 0)
    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj", "v_proj", "down_proj"), seed=7)
    _, *whole = _train(in_process_group, tiny_policy_dir, batch, lora=lora)
    group, *sharded = _train(in_process_group, tiny_policy_dir, batch, lora=lora, shard_params=True)
    assert torch.equal(sharded[0], whole[0])
    assert sharded[1] == whole[1]
    assert sharded[2].keys() == whole[2].keys()  # the adapters alone (what the replicas take)
    assert [k for k in whole[2] if not torch.equal(whole[2][k], sharded[2][k])] == []
    assert sharded[3] == whole[3]  # every weight's digest, the base's too
    worker = group.workers[0]
    base = [n for n, p in worker.model.named_parameters() if not p.requires_grad]
    trained, frozen = worker.at_rest.sets
    assert list(frozen.layout.names) == base and frozen.plan.modules == trained.plan.modules
    assert frozen.local.numel() == frozen.layout.shard_size
    assert all(worker.at_rest.place_of(n) is not None for n, _ in worker.model.named_parameters())
    assert [b.untyped_storage().nbytes() for s in (trained, frozen) for b in s.buffers] == [0] * 2 * len(frozen.buffers)
    gathers, start = [], frozen.start_gather  # what reading the weights gathers of the base
    frozen.start_gather = lambda unit, *args: gathers.append(unit) or start(unit, *args)
    group.named_weights()  # the adapters alone (the replicas' push): no base weight moves
    assert gathers == []
    group.weight_digests()  # every weight: each unit of the base once
    assert gathers == list(range(len(frozen.buffers)))


def test_an_untied_heads_gradient_is_sent_as_the_last_layers_backward_starts_never_beside_the_roots(
        tmp_path, in_process_group, rollout_batch, monkeypatch):
    """An untied LM head: the head unit (final norm, lm_head) is sent before the last layer's
    backward, so its float32 gradient and the root's (the embeddings') are never held at
    once; the whole path's bits."""
    from dataclasses import replace

    from reprorl.models.hf_io import save_model
    from reprorl.models.tiny import init_weights, tiny_args
    from reprorl.models.transformer import CausalLM

    args = replace(tiny_args(), tie_word_embeddings=False)
    model = CausalLM(args)
    init_weights(model, 0)
    path = save_model(model, args, tmp_path / "untied")
    batch = rollout_batch(16, 6, 5, 0)
    sends, send = [], Exchange._send

    def recording_send(exchange, unit):
        sends.append((unit, sorted(exchange.grads)))  # the unit sent, and the gradients held then
        send(exchange, unit)

    monkeypatch.setattr(Exchange, "_send", recording_send)
    group, *sharded = _train(in_process_group, path, batch, shard_params=True)
    monkeypatch.undo()
    _, *whole = _train(in_process_group, path, batch)
    plan = group.workers[0].at_rest.plan
    assert [group.workers[0].at_rest.layout.names[p] for p in plan.members[plan.head]] == [
        "model.norm.weight", "lm_head.weight"]
    # Per micro-batch (16: two updates of two mini-batches of 4): head, layer 2, layer 1, root.
    assert [unit for unit, _ in sends] == [plan.head, 2, 1, ROOT] * 16
    assert all(not {plan.head, ROOT} <= set(held) for _, held in sends)  # never both at once
    assert all(held == [unit] for unit, held in sends if unit == plan.head)
    assert torch.equal(sharded[0], whole[0]) and sharded[1] == whole[1] and sharded[3] == whole[3]
    assert [k for k in whole[2] if not torch.equal(whole[2][k], sharded[2][k])] == []


def test_reading_a_unit_a_pass_holds_gathered_raises_and_leaves_it_gathered(tiny_policy_dir, in_process_group):
    at_rest = in_process_group("ref", tiny_policy_dir, shard_params=True).workers[0].at_rest
    with at_rest.root_gathered():
        with pytest.raises(RuntimeError, match="unit 0 is gathered already"):
            with at_rest.reading(ROOT, [0]):
                pass
        assert at_rest.is_gathered[ROOT] and at_rest.buffers[ROOT].untyped_storage().nbytes() > 0
    assert at_rest.buffers[ROOT].untyped_storage().nbytes() == 0


def test_a_gradient_that_comes_after_its_unit_was_sent_raises(tiny_policy_dir, in_process_group):
    group = in_process_group("actor", tiny_policy_dir, optim=OPTIM, shard_params=True)
    at_rest = group.workers[0].at_rest
    tree = GradTree(0, 1, at_rest.parts, torch.device("cpu"))
    tree.start_leaf(empty=False)
    exchange = Exchange(at_rest, tree, computing=True)
    exchange.unit_done_before(None)  # the backward pass is over: the root is sent
    embed = at_rest.plan.members[ROOT][0]
    with pytest.raises(RuntimeError, match="model.embed_tokens.weight came after its unit was sent"):
        exchange.add(embed, torch.zeros(at_rest.layout.shapes[embed]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("checkpointing", [False, True])
def test_on_the_gpu_one_rank_sharded_at_rest_gives_the_whole_paths_bits(tiny_policy_dir, in_process_group,
                                                                         rollout_batch, checkpointing):
    """bf16 on the GPU's batch-invariant kernels (the gathers and frees on the device, the
    backward's gathers on autograd's device thread): the whole path's log-probs, metrics and
    weights, and the weights packed for the replicas (`share_weights`, a unit at a time) too."""
    batch = rollout_batch(16, 6, 5, 0)
    on_gpu = dict(batch_invariant=True, device="cuda", dtype="bfloat16", gradient_checkpointing=checkpointing)
    whole_group, *whole = _train(in_process_group, tiny_policy_dir, batch, **on_gpu)
    group, *sharded = _train(in_process_group, tiny_policy_dir, batch, shard_params=True, **on_gpu)
    assert torch.equal(sharded[0], whole[0])
    assert sharded[1] == whole[1]
    assert [k for k in whole[2] if not torch.equal(whole[2][k], sharded[2][k])] == []
    assert sharded[3] == whole[3]
    packed = []
    for g in (whole_group, group):
        g.share_weights(1)
        packed.append(g.workers[0]._shared)
    assert packed[0].entries == packed[1].entries
    assert all(torch.equal(packed[0].buffers[k], packed[1].buffers[k]) for k in packed[0].buffers)
    for g in (whole_group, group):
        g.release_shared_weights()


def test_a_frozen_group_sharded_at_rest_gives_the_whole_log_probs_and_keeps_its_shard_alone(
        tiny_policy_dir, in_process_group, rollout_batch):
    """The reference (no optimizer): its shard of every weight, gathered a layer at a time."""
    batch = rollout_batch(16, 6, 5, 0)
    whole = in_process_group("ref", tiny_policy_dir, batch_invariant=True)
    sharded = in_process_group("ref", tiny_policy_dir, batch_invariant=True, shard_params=True)
    expected = whole.compute_log_probs(batch, temperature=0.7, micro_batch_size=4)
    assert torch.equal(sharded.compute_log_probs(batch, temperature=0.7, micro_batch_size=4), expected)
    at_rest = sharded.workers[0].at_rest
    assert at_rest.layout.numel == sum(p.numel() for p in sharded.workers[0].model.parameters())
    assert [b.untyped_storage().nbytes() for b in at_rest.buffers] == [0] * len(at_rest.buffers)
    assert sharded.weight_digests() == whole.weight_digests()


def test_an_error_inside_a_pass_leaves_every_unit_freed_and_the_next_pass_as_before(
        tiny_policy_dir, in_process_group, rollout_batch, monkeypatch):
    """An update that fails in its backward pass (here: the first gradient a unit takes)
    leaves no unit gathered and no pass under way; the log-probs after it are as before."""
    batch = rollout_batch(16, 6, 5, 0)
    group = in_process_group("actor", tiny_policy_dir, optim=OPTIM, shard_params=True)
    expected = group.compute_log_probs(batch, temperature=1.0, micro_batch_size=2)
    batch["old_log_probs"] = expected

    def fail(*_):
        raise ValueError("injected")

    monkeypatch.setattr(Exchange, "add", fail)
    with pytest.raises(ValueError, match="injected"):
        group.update(batch, **STEP)
    at_rest = group.workers[0].at_rest
    assert not any(at_rest.is_gathered) and not at_rest.in_backward and at_rest.exchange is None
    assert [b.untyped_storage().nbytes() for b in at_rest.buffers] == [0] * len(at_rest.buffers)
    assert torch.equal(group.compute_log_probs(batch, temperature=1.0, micro_batch_size=2), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("role, bound", [("ref", 1.5), ("actor", 3.5)])
def test_a_rank_sharded_at_rest_never_holds_the_whole_model_on_the_gpu_beside_its_shard(
        tmp_path, in_process_group, role, bound):
    """The model loads on the host and the rank moves its range alone (one rank here: the
    whole range, W bf16 bytes). The whole path's peak is the model, its range's copy and
    the buffers (3W and up); sharded at rest it is the range (W) and one 8th of it at a time
    (a layer's buffer), and an actor's float32 master (2W) with it."""
    from dataclasses import replace

    from reprorl.models.hf_io import save_model
    from reprorl.models.tiny import init_weights, tiny_args
    from reprorl.models.transformer import CausalLM

    args = replace(tiny_args(), hidden_size=1024, intermediate_size=3072, num_hidden_layers=8,
                   num_attention_heads=8, num_key_value_heads=2, head_dim=128)
    model = CausalLM(args)
    init_weights(model, 0)
    path = save_model(model, args, tmp_path / "wide")
    whole = 2 * sum(p.numel() for p in model.parameters())  # bf16 bytes
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    group = in_process_group(role, path, optim=OPTIM if role == "actor" else None, device="cuda",
                             dtype="bfloat16", batch_invariant=True, shard_params=True)
    peak = torch.cuda.max_memory_allocated() - before
    assert peak < bound * whole, f"{peak / whole:.2f} x the bf16 model"
    at_rest = group.workers[0].at_rest
    assert all(p.device.type == "cuda" for p in group.workers[0].model.parameters())
    assert [b.untyped_storage().nbytes() for b in at_rest.buffers] == [0] * len(at_rest.buffers)


def test_merged_pushes_are_refused_sharded_and_ignored_without_lora(in_process_group, tiny_policy_dir):
    """vLLM's replicas take merged LoRA weights, which need a layer's weights on one rank:
    refused with parameters sharded at rest; without LoRA there is nothing to merge, and a
    sharded vLLM run pushes its weights as any run does."""
    from reprorl.workers.worker import ShardWorker

    lora = LoraSpec(rank=4, alpha=8.0, target_modules=("q_proj",), seed=7)
    with pytest.raises(ValueError, match="push_merged_lora with shard_params"):
        ShardWorker("actor", 0, 1, str(tiny_policy_dir), optim=None, dtype=None, batch_invariant=False, seed=0,
                    expected_env={}, lora=lora, shard_params=True, push_merged_lora=True)
    group = in_process_group("actor", tiny_policy_dir, shard_params=True, push_merged_lora=True)
    plain = in_process_group("ref", tiny_policy_dir)
    assert [n for n, _ in group.named_weights()] == [n for n, _ in plain.named_weights()]
