"""The Triton kernels on a CUDA GPU, at real model shapes: row invariance with torch.equal
for 1..4096 rows, attention's paths, the engine's log-probs against the trainer's forward,
two processes, and the start-up check. Skipped without CUDA (CI); run on the GPU machine."""

import asyncio
import hashlib
import os
import subprocess
import sys

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

# (hidden, intermediate, heads, kv heads, head_dim, vocab) of the models the kernels issue names.
MODELS = {
    "qwen2.5-0.5b": (896, 4864, 14, 2, 64, 151936),
    "qwen2.5-1.5b": (1536, 8960, 12, 2, 128, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128, 152064),
    "qwen3-8b": (4096, 12288, 32, 8, 128, 151936),
}
ROWS = (1, 2, 3, 7, 13, 64, 100, 256, 1000, 4096)


def kernels():
    from reprorl.kernels.gpu import TritonKernels

    return TritonKernels


def linears(hidden, inter, heads, kv, hd, vocab):
    return {"q": (hidden, heads * hd), "kv": (hidden, kv * hd), "o": (heads * hd, hidden), "up": (hidden, inter),
            "down": (inter, hidden), "lm_head": (hidden, vocab)}


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_linear_rows_invariant_at_model_shapes(model, dtype):
    k = kernels()
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, (kk, n) in linears(*MODELS[model]).items():
        if dtype == torch.float32 and name == "lm_head":
            continue  # fp32 LM heads of 152k x 4096 at 4096 rows: minutes of IEEE fp32; bf16 covers the shape
        w = (torch.randn(n, kk, device="cuda", generator=g) * 0.02).to(dtype)
        bias = torch.randn(n, device="cuda", generator=g).to(dtype) if name == "q" else None
        row = torch.randn(1, kk, device="cuda", generator=g).to(dtype)
        alone = k.linear(row, w, bias)[0]
        for m in ROWS[1:]:
            x = torch.randn(m, kk, device="cuda", generator=g).to(dtype)
            for pos in {0, m // 2, m - 1}:
                x[pos] = row[0]
                assert torch.equal(k.linear(x, w, bias)[pos], alone), (model, name, dtype, m, pos)


@pytest.mark.parametrize("width", [896, 3584, 4096, 151936, 152064])
def test_row_reductions_invariant_at_model_widths(width):
    k = kernels()
    g = torch.Generator(device="cuda").manual_seed(width)
    row = torch.randn(1, width, device="cuda", generator=g)
    w = 1 + 0.1 * torch.randn(width, device="cuda", generator=g)
    ops = {"log_softmax": lambda x: k.log_softmax(x * 4), "softmax": lambda x: k.softmax(x * 4),
           "rms_norm_bf16": lambda x: k.rms_norm(x.bfloat16(), w.bfloat16(), 1e-6),
           "swiglu_bf16": lambda x: k.swiglu(x.bfloat16(), x.flip(-1).bfloat16())}
    for name, fn in ops.items():
        if width > 8192 and name.startswith(("rms", "swiglu")):
            continue
        alone = fn(row)[0]
        for m in ROWS[1:]:
            x = torch.randn(m, width, device="cuda", generator=g)
            x[m - 1] = row[0]
            assert torch.equal(fn(x)[m - 1], alone), (name, width, m)


@pytest.mark.parametrize("model", sorted(MODELS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_decode_prefill_and_batch_agree(model, dtype):
    """A sequence's queries: one prefill of 300 tokens == chunks == decode steps == the same
    sequence inside a batch of 8 of other lengths with stale cache entries."""
    k = kernels()
    _, _, heads, kv, hd, _ = MODELS[model]
    g = torch.Generator(device="cuda").manual_seed(1)
    t = 300
    q = torch.randn(1, heads, t, hd, device="cuda", generator=g).to(dtype)
    keys = torch.randn(1, kv, t + 20, hd, device="cuda", generator=g).to(dtype)
    values = torch.randn(1, kv, t + 20, hd, device="cuda", generator=g).to(dtype)
    zero = torch.zeros(1, dtype=torch.long, device="cuda")
    whole = k.batched_attention(q, keys[:, :, :t], values[:, :, :t], zero)
    pieces, start = [], 0
    for n in (1, 63, 64, 100, 72):
        pieces.append(k.batched_attention(q[:, :, start : start + n], keys, values, zero + start))
        start += n
    assert torch.equal(torch.cat(pieces, dim=2), whole)
    for i in (0, 1, 63, 64, 127, 128, 255, 299):
        assert torch.equal(k.batched_attention(q[:, :, i : i + 1], keys, values, zero + i), whole[:, :, i : i + 1])
    # decode step of position 200 inside a batch of 8 sequences (other lengths, stale keys)
    bq = torch.randn(8, heads, 1, hd, device="cuda", generator=g).to(dtype)
    bk = torch.randn(8, kv, 512, hd, device="cuda", generator=g).to(dtype)
    bv = torch.randn(8, kv, 512, hd, device="cuda", generator=g).to(dtype)
    bq[5], bk[5, :, : t + 20], bv[5, :, : t + 20] = q[0, :, 200:201], keys[0], values[0]
    starts = torch.tensor([3, 40, 511, 130, 0, 200, 77, 300], device="cuda")
    assert torch.equal(k.batched_attention(bq, bk, bv, starts)[5], whole[0, :, 200:201])


def test_startup_check_passes_at_real_shapes():
    from reprorl.kernels import verify_batch_invariance
    from reprorl.models.arch import ModelArgs

    for name, (hidden, inter, heads, kv, hd, vocab) in MODELS.items():
        args = ModelArgs(model_type="qwen2", vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd)
        for dtype in (torch.bfloat16, torch.float32):
            verify_batch_invariance(kernels(), args, dtype, "cuda")


def _forward_digest(model_dir: str, dtype: str) -> str:
    from reprorl.kernels import select_kernels
    from reprorl.models.hf_io import load_model

    model, _ = load_model(model_dir, dtype=getattr(torch, dtype))
    model = model.cuda().eval()
    model.kernels = select_kernels("cuda", True)
    ids = torch.randint(3, 120, (4, 50), generator=torch.Generator().manual_seed(0)).cuda()
    with torch.no_grad():
        logits = model(ids)
    return hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_padded_forward_rows_equal_each_sequence_alone(dtype):
    """The trainer's padded forward on the GPU, two layers at Qwen2.5-0.5B's width: each row's
    logits, behind left, right or both-sided padding among other rows, are the bits of its
    sequence alone (the layers run on real tokens moved to the front, `Padding.front`), and
    the same bits as the layers in the caller's layout, each attention moving the rows."""
    from padded_layers import hidden_states_moving_in_each_layer
    from reprorl.kernels import select_kernels
    from reprorl.models.arch import ModelArgs
    from reprorl.models.tiny import init_weights
    from reprorl.models.transformer import CausalLM

    hidden, inter, heads, kv, hd, _ = MODELS["qwen2.5-0.5b"]
    args = ModelArgs(model_type="qwen2", vocab_size=4096, hidden_size=hidden, intermediate_size=inter,
                     num_hidden_layers=2, num_attention_heads=heads, num_key_value_heads=kv, head_dim=hd,
                     qkv_bias=True, max_position_embeddings=512)
    model = CausalLM(args)
    init_weights(model, 0, std=0.05)
    model = model.to("cuda", dtype).eval()
    model.kernels = select_kernels("cuda", True)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 4096, (5, 96), generator=g).cuda()
    mask = torch.ones_like(ids)
    mask[0, :30] = 0  # left padding
    mask[1, 70:] = 0  # right padding
    mask[2, :5], mask[2, 90:] = 0, 0  # both
    mask[4, 1:] = 0  # one real token
    with torch.no_grad():
        batch = model(ids, mask)
        for row in range(5):
            real = mask[row].bool()
            alone = model(ids[row][real][None])[0]
            assert torch.equal(batch[row][real], alone), f"row {row}"
        assert torch.equal(model.hidden_states(ids, mask), hidden_states_moving_in_each_layer(model, ids, mask))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_two_processes_give_the_same_bits(tiny_policy_dir, dtype):
    here = _forward_digest(str(tiny_policy_dir), dtype)
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r}); import test_gpu; "
            f"print(test_gpu._forward_digest({str(tiny_policy_dir)!r}, {dtype!r}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == here


@pytest.mark.parametrize("dtype,temperature", [(torch.bfloat16, 1.0), (torch.float32, 1.0), (torch.bfloat16, 0.7)])
def test_engine_log_probs_equal_the_trainers_forward(tiny_policy_dir, dtype, temperature):
    """The engine on the GPU (prefill, decode, 12 requests batched and one alone) against
    the trainer's padded forward on the same tokens: bitwise equal log-probs (at T != 1 too:
    both divide by the temperature on the device)."""
    from reprorl.models.hf_io import load_model
    from reprorl.rollout.engine import Engine
    from reprorl.rollout.request import SamplingParams

    model, _ = load_model(tiny_policy_dir, dtype=dtype)
    model = model.cuda()
    engine = Engine(model, batch_invariant=True, eos_token_id=None, max_num_seqs=16)
    prompts = [[5 + i, 17, 33 + i, 8, 91][: 2 + i % 4] + [40] * (i % 7) for i in range(12)]
    params = SamplingParams(temperature=temperature, max_tokens=24, ignore_eos=True)

    async def run(batch):
        return await asyncio.gather(*[engine.generate(f"r{i}", p, params, seed=100 + i)
                                      for i, p in batch])

    together = asyncio.run(run(list(enumerate(prompts))))
    alone = asyncio.run(run([(4, prompts[4])]))[0]
    assert alone.token_ids == together[4].token_ids and alone.log_probs == together[4].log_probs
    for p, out in zip(prompts, together):
        ids = torch.tensor([p + out.token_ids], device="cuda")
        with torch.no_grad():
            logits = model(ids)[:, -len(out.token_ids) - 1 : -1]  # the positions that predict the response
            expected, _ = model.kernels.token_log_probs(logits, torch.tensor([out.token_ids], device="cuda"),
                                                        temperature)
        assert torch.equal(torch.tensor(out.log_probs, dtype=torch.float32), expected[0].cpu())
