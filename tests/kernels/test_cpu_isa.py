"""The CPU path's bits on any x86-64 CPU: the batch-invariant kernels built for no vector
unit (x86-64), AVX2 and AVX-512 (where this CPU runs them), at 1 and 2 threads, give a tiny
model's forward, its backward, two warm-start steps and cpu_math's functions the same bits. Each case runs in its
own process, as a full-determinism run does: torch's kernels on their portable build
(ATEN_CPU_CAPABILITY=default) and ours built for the case's -march.

The kernels have one code path per vector unit (`cpu_kernels.h`: AVX-512, AVX2 with FMA,
none), and each build is about half a minute on 2 cores, so each path is built once: the
native build takes this CPU's widest path, x86-64 the scalar one, and haswell the AVX2 one
where native is AVX-512 (haswell on an AVX2 CPU, or skylake-avx512 on an AVX-512 one, would
build native's path again).
"""

import json
import os
import subprocess
import sys
import textwrap

import pytest

SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from reprorl.determinism import pin_cpu_kernels, stable_digest, tensor_digest
    pin_cpu_kernels()
    torch.set_num_threads(int(sys.argv[1]))
    from reprorl.kernels import CpuInvariantKernels
    from reprorl.kernels.cpu import nt_plan
    from reprorl.models.tiny import init_weights, tiny_args
    from reprorl.models.transformer import CausalLM
    from reprorl.bootstrap.warm_start import sft_train

    model = CausalLM(tiny_args("policy"))
    init_weights(model, seed=3)
    model.kernels = CpuInvariantKernels
    g = torch.Generator().manual_seed(5)
    lengths = [5, 17, 40, 130]  # one over a KEY_BLOCK of keys
    ids = torch.randint(1, 128, (len(lengths), max(lengths)), generator=g)
    mask = torch.zeros_like(ids)
    for row, n in enumerate(lengths):
        mask[row, -n:] = 1  # left padding, as the trainer's prompts
    logits = model(ids, mask)  # [B, T, V]
    log_probs, entropy = CpuInvariantKernels.token_log_probs(logits[:, :-1], ids[:, 1:], 0.7, with_entropy=True)
    loss = -(log_probs * mask[:, 1:]).sum() + 0.01 * (entropy * mask[:, 1:]).sum()
    loss.backward()
    grads = [stable_digest(name, tensor_digest(p.grad)) for name, p in model.named_parameters()]
    model.zero_grad(set_to_none=True)
    examples = [([1] * 3 + list(range(2, 2 + n)), [0] * 3 + [1] * n) for n in (4, 9, 23, 6)]
    sft_train(model, examples, steps=2, batch_size=3, lr=1e-3, seed=0, pad_token_id=0, batch_invariant=True,
              log_every=0)
    weights = [stable_digest(name, tensor_digest(p.detach())) for name, p in model.named_parameters()]
    from reprorl.kernels import cpu_math, pinned
    x = torch.linspace(-110.0, 90.0, 1 << 16)
    math_digest = stable_digest(tensor_digest(cpu_math.exp(x)), tensor_digest(cpu_math.log(x.abs())),
                                *[tensor_digest(t) for t in pinned.pinned_sincos(x * 1e4)],
                                tensor_digest(pinned.pinned_pow(10000.0, x.abs() / 110)),
                                tensor_digest(cpu_math.log_softmax(x.view(64, -1))))
    print(json.dumps({"math": math_digest, "block": nt_plan(1, 4, 4, 64)["block_rows"], "logits": tensor_digest(logits),
                      "log_probs": tensor_digest(log_probs), "loss": tensor_digest(loss.detach()),
                      "grads": stable_digest(*grads), "warm_start": stable_digest(*weights)}))
""")


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _run(march: str, threads: int) -> dict:
    env = {**os.environ, "REPRORL_CPU_MARCH": march, "ATEN_CPU_CAPABILITY": "default"}
    result = subprocess.run([sys.executable, "-c", SCRIPT, str(threads)], env=env, capture_output=True, text=True,
                            timeout=1200)
    assert result.returncode == 0, f"-march={march}, {threads} thread(s):\n{result.stderr[-3000:]}"
    out = json.loads(result.stdout.strip().splitlines()[-1])
    out.pop("block")  # (the register block differs by build; only the bits must not)
    return out


@pytest.mark.slow
@pytest.mark.skipif(os.uname().machine != "x86_64", reason="the instruction sets compared are x86-64's")
def test_scalar_avx2_and_avx512_builds_give_the_same_forward_backward_and_warm_start():
    flags = _cpu_flags()
    cases = [("native", 1), ("native", 2), ("x86-64", 2)]
    if "avx512f" in flags:  # native is the AVX-512 path: the AVX2 path needs a build of its own
        cases.append(("haswell", 2))
    results = {case: _run(*case) for case in cases}
    reference = results[cases[0]]
    for case, digests in results.items():
        assert digests == reference, f"-march={case[0]} at {case[1]} thread(s) differs from -march=native at 1"
