// The optimizer's element-wise arithmetic on the host (reprorl/kernels/optim_math.py writes
// the same steps as torch ops for any other device). Each line is one IEEE operation,
// rounded once: the build has no contraction (build.py), so a GPU that runs the same
// operations one kernel each gives the same bits, and an optimizer state offloaded to the
// host steps exactly as it would on the GPU. Entries are split over threads, each computed
// by one thread from start to end, so the thread count moves no bit.
#include "cpu_tensor.h"

#include <cmath>
#include <vector>

namespace {

// optim_math.adamw_step_ names the tensor and the sizes; this is the kernel's own guard.
void check_vector(const at::Tensor& x, int64_t n) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous() && x.numel() == n,
              "adamw_step: contiguous float32 CPU tensors of one size expected");
}

}  // namespace

// One AdamW step of p in place (its moments m and v too) from the gradient g, in the order
// of optim_math.adamw_torch. scalars (each already a float32 value): grad_scale, decay
// (1 - lr * weight_decay), beta1, 1 - beta1, beta2, 1 - beta2, the square root of beta2's
// bias correction, eps and the step size (lr / beta1's bias correction).
void adamw_step(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, std::vector<double> scalars) {
  TORCH_CHECK(scalars.size() == 9, "adamw_step: 9 scalars expected");
  const int64_t n = p.numel();
  check_vector(p, n);
  check_vector(g, n);
  check_vector(m, n);
  check_vector(v, n);
  const float scale = static_cast<float>(scalars[0]), decay = static_cast<float>(scalars[1]);
  const float beta1 = static_cast<float>(scalars[2]), rest1 = static_cast<float>(scalars[3]);
  const float beta2 = static_cast<float>(scalars[4]), rest2 = static_cast<float>(scalars[5]);
  const float bias2 = static_cast<float>(scalars[6]), eps = static_cast<float>(scalars[7]);
  const float step = static_cast<float>(scalars[8]);
  float* pp = p.data_ptr<float>();
  const float* pg = g.data_ptr<float>();
  float* pm = m.data_ptr<float>();
  float* pv = v.data_ptr<float>();
  at::parallel_for(0, n, 1 << 16, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const float gi = pg[i] * scale;
      const float pi = pp[i] * decay;
      const float mi = pm[i] * beta1 + gi * rest1;
      const float vi = pv[i] * beta2 + (gi * gi) * rest2;
      const float denom = std::sqrt(vi) / bias2 + eps;
      pm[i] = mi;
      pv[i] = vi;
      pp[i] = pi - (mi / denom) * step;
    }
  });
}

// The sum of squares of each `width`-entry row of x (a power of two; the last row padded
// with zeros), float32, by halving: entry i of the row takes entry i + w, for w = width / 2,
// width / 4, ..., 1 (optim_math.chunk_sums_of_squares as torch ops).
at::Tensor chunk_sums_of_squares(at::Tensor x, int64_t width) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "chunk_sums_of_squares: a contiguous float32 CPU tensor expected");
  TORCH_CHECK(width > 0 && (width & (width - 1)) == 0, "chunk_sums_of_squares: width must be a power of two");
  const int64_t n = x.numel(), rows = (n + width - 1) / width;
  auto out = at::empty({rows}, x.options());
  const float* src = x.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const int64_t start = r * width;
      for (int64_t i = 0; i < width; ++i) {
        const float e = start + i < n ? src[start + i] : 0.0f;
        row[i] = e * e;
      }
      for (int64_t w = width / 2; w >= 1; w /= 2) {
        for (int64_t i = 0; i < w; ++i) row[i] = row[i] + row[i + w];
      }
      dst[r] = row[0];
    }
  });
  return out;
}
