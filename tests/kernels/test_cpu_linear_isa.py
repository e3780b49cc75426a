"""The CPU linear's arithmetic does not depend on the instruction set: each entry is one running
sum over k in order, so `cpu_linear.cpp` built for AVX2 (8 lanes) and with no vector unit at all
(std::fma, 16 floats a "vector") gives the native build's bits, on the few-rows path (columns as
lanes, the weight transposed in tiles) and with rows as lanes. (Attention's scores still sum in
lanes, so a whole forward may differ between an AVX2 and an AVX-512 CPU.)

The AVX2 and scalar `cpu_linear.cpp` are the ones in the kernels' whole extension built for
that -march (`build.extension` under REPRORL_CPU_MARCH), the very builds test_cpu_isa.py's
processes make and leave in torch's extension cache: in a full run this module loads them
instead of compiling the linear's source twice more (about 30 s a build on 2 cores). Alone,
it builds them itself. `mm_rows` there is `matmul_rows`'s kernel, as in a separate build of
the linear alone (`build.build_linear_variant`, which bench/tune/cpu_blocks.py uses)."""

import platform

import pytest
import torch

from reprorl.kernels import build, cpu

pytestmark = [pytest.mark.slow,  # a build of the kernels for each -march below, unless test_cpu_isa.py made it
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")]


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_cpu_linear_gives_the_same_bits_on_avx2_and_scalar_builds(march, monkeypatch):
    native = build.extension()  # the process's own build (cached), made before the variable below is set
    monkeypatch.setenv(build.ENV_MARCH, march)
    module = build.extension.__wrapped__()  # this -march's build, past the cache of the native one
    assert module is not native and build.extension() is native
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in ((1, 896, 100), (5, 1100, 37), (9, 64, 29), (40, 1551, 70), (150, 7, 5), (300, 512, 200)):
            a = torch.randn(m, k, generator=gen).to(dtype)
            b = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
            assert torch.equal(module.mm_rows(a, b, []), cpu.matmul_rows(a, b)), (march, dtype, m, k, n)
