"""The CPU linear's arithmetic does not depend on the instruction set: each entry is one running
sum over k in order, so `cpu_linear.cpp` built for AVX2 (8 lanes) and with no vector unit at all
(std::fma, 16 floats a "vector") gives the native build's bits, on the few-rows path (columns as
lanes, the weight transposed in tiles) and with rows as lanes. (Attention's scores still sum in
lanes, so a whole forward may differ between an AVX2 and an AVX-512 CPU.)"""

import platform

import pytest
import torch

from reprorl.kernels import build, cpu

pytestmark = [pytest.mark.slow,  # two builds of the linear's source, about 30 s each
              pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="x86 instruction sets")]


@pytest.mark.parametrize("march", ["haswell", "x86-64"])
def test_cpu_linear_gives_the_same_bits_on_avx2_and_scalar_builds(march):
    module = build.build_linear_variant(f"isa_{march.replace('-', '_')}", [f"-march={march}"])
    gen = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for m, k, n in ((1, 896, 100), (5, 1100, 37), (9, 64, 29), (40, 1551, 70), (150, 7, 5), (300, 512, 200)):
            a = torch.randn(m, k, generator=gen).to(dtype)
            b = (torch.randn(n, k, generator=gen) * 0.1).to(dtype)
            assert torch.equal(module.mm_rows(a, b, []), cpu.matmul_rows(a, b)), (march, dtype, m, k, n)
