// The CPU batch-invariant matmul's engine: a product cut into tiles of ONE fixed shape,
// each tile one single-threaded BLAS call, the tiles spread over threads.
//
// Why this is batch-invariant on any CPU: an output entry is computed by one BLAS call of
// shape [mt, K] x [K, nt], always with the same strides and 64-byte aligned operands, inside
// an ATen parallel region (so ATen and the BLAS run that call on one thread). Nothing about
// that call depends on M, on the other rows or on the thread count; only the row's place
// inside its tile could, and the start-up check tests that on each machine.
#include <torch/extension.h>
#include <ATen/Parallel.h>

// a [G, M, K] (M % mt == 0), b [G, K, N] (any strides) -> out [G, M, N]: one call per row
// tile of mt rows and column tile of nt columns (the last one narrower when nt does not
// divide N: a column is always in the same place, so only the ROW tile must have one shape).
torch::Tensor tiled_mm(torch::Tensor a, torch::Tensor b, int64_t mt, int64_t nt) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0) && a.size(2) == b.size(1),
              "tiled_mm: a [G, M, K] and b [G, K, N] expected");
  const int64_t G = a.size(0), M = a.size(1), N = b.size(2);
  TORCH_CHECK(M % mt == 0, "tiled_mm: M must be whole row tiles");
  const int64_t tm = M / mt, tn = (N + nt - 1) / nt, tiles = G * tm * tn;
  auto out = torch::empty({G, M, N}, a.options());
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t g = t / (tm * tn), r = t % (tm * tn), i = r / tn, j = r % tn;
      const int64_t width = std::min(nt, N - j * nt);
      auto tile = out[g].narrow(0, i * mt, mt).narrow(1, j * nt, width);  // row stride N: BLAS's ldc
      at::mm_out(tile, a[g].narrow(0, i * mt, mt), b[g].narrow(1, j * nt, width));
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("tiled_mm", &tiled_mm, "fixed-shape tiles, one thread each"); }
