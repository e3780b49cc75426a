// The portable transcendentals and row reductions of cpu_math.h as tensor ops (bound in
// cpu_matmul.cpp). Elementwise ops split their entries over threads, row ops their rows:
// an entry or a row is computed by one thread from start to end, so no split moves a bit.
#include "cpu_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <vector>

using namespace reprorl_math;

namespace {

// The arguments as [rows, n] contiguous CPU rows of a float dtype the caller allows.
at::Tensor as_rows(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu(), "cpu_math: a CPU tensor expected");
  TORCH_CHECK(x.dim() >= 1, "cpu_math: a tensor of at least one dimension expected");
  return x.contiguous().reshape({-1, x.size(-1)});
}

template <typename F>
void for_rows(int64_t rows, int64_t n, F body) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(n, 1));
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) body(r);
  });
}

// body(T{}) with T the C++ type of x's dtype, float32 or float64 (a literal error
// otherwise: cpu_kernels.h says why).
template <typename F>
void with_float_type(const at::Tensor& x, F body) {
  if (x.scalar_type() == at::kFloat) {
    body(float{});
  } else if (x.scalar_type() == at::kDouble) {
    body(double{});
  } else {
    TORCH_CHECK(false, "cpu_math: float32 or float64 expected");
  }
}

// f of each entry of x (a CPU tensor of C++ type T), entries split over threads.
template <typename T, typename F>
at::Tensor map_entries(at::Tensor x, F f) {
  x = x.contiguous();
  auto out = at::empty_like(x);
  const T* src = x.data_ptr<T>();
  T* dst = out.data_ptr<T>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) dst[i] = f(src[i]);
  });
  return out;
}

void check_cpu_float32(const at::Tensor& x) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kFloat, "cpu_math: a float32 CPU tensor expected");
}

}  // namespace

// e^x entry by entry: float32 (rounded once from double) or float64.
at::Tensor portable_exp(at::Tensor x) {
  TORCH_CHECK(x.device().is_cpu(), "portable_exp: a CPU tensor expected");
  at::Tensor out;
  with_float_type(x, [&](auto zero) {
    using T = decltype(zero);
    out = map_entries<T>(x, [](T v) { return exp_of(v); });
  });
  return out;
}

// log x entry by entry, float32.
at::Tensor portable_log(at::Tensor x) {
  check_cpu_float32(x);
  return map_entries<float>(x, log_f32);
}

// sqrt x entry by entry, float32: the IEEE square root (correctly rounded). torch's CPU
// sqrt is not on every machine (MKL's vector math, picked by the CPU, differs between an
// AMD EPYC and an Intel Xeon).
at::Tensor portable_sqrt(at::Tensor x) {
  check_cpu_float32(x);
  return map_entries<float>(x, [](float v) { return std::sqrt(v); });
}

// (sin x, cos x) entry by entry, float32.
std::vector<at::Tensor> portable_sincos(at::Tensor x) {
  check_cpu_float32(x);
  x = x.contiguous();
  auto s = at::empty_like(x), c = at::empty_like(x);
  const float* src = x.data_ptr<float>();
  float* ps = s.data_ptr<float>();
  float* pc = c.data_ptr<float>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) sincos_f32(src[i], ps[i], pc[i]);
  });
  return {s, c};
}

// base^e entry by entry for a positive base, float32.
at::Tensor portable_pow(double base, at::Tensor e) {
  check_cpu_float32(e);
  const float b = static_cast<float>(base);
  return map_entries<float>(e, [b](float v) { return pow_f32(b, v); });
}

// The sum of each row over the last dimension, float32 or float64: [..., n] -> [...].
at::Tensor portable_row_sums(at::Tensor x) {
  auto rows = as_rows(x);
  const int64_t r = rows.size(0), n = rows.size(1);
  auto out = at::empty({r}, rows.options());
  with_float_type(rows, [&](auto zero) {
    using T = decltype(zero);
    const T* src = rows.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for_rows(r, n, [&](int64_t i) { dst[i] = row_sum(src + i * n, n); });
  });
  auto sizes = x.sizes().vec();
  sizes.pop_back();
  return out.reshape(sizes);
}

// softmax over the last dimension, float32 or float64.
at::Tensor portable_softmax(at::Tensor x) {
  auto rows = as_rows(x);
  const int64_t r = rows.size(0), n = rows.size(1);
  auto out = at::empty_like(rows);
  with_float_type(rows, [&](auto zero) {
    using T = decltype(zero);
    const T* src = rows.data_ptr<T>();
    T* dst = out.data_ptr<T>();
    for_rows(r, n, [&](int64_t i) { softmax_row(src + i * n, dst + i * n, n); });
  });
  return out.reshape(x.sizes());
}

// log-softmax over the last dimension, float32: (x - max) - log(sum of e^(x - max)).
at::Tensor portable_log_softmax(at::Tensor x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat, "portable_log_softmax: float32 expected");
  auto rows = as_rows(x);
  const int64_t r = rows.size(0), n = rows.size(1);
  auto out = at::empty_like(rows);
  const float* src = rows.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  for_rows(r, n, [&](int64_t i) {
    const float* xr = src + i * n;
    float* yr = dst + i * n;
    const float m = row_max(xr, n);
    for (int64_t j = 0; j < n; ++j) yr[j] = exp_f32(xr[j] - m);  // the terms, then the shifted logits
    const float lse = log_f32(row_sum(yr, n));
    for (int64_t j = 0; j < n; ++j) yr[j] = (xr[j] - m) - lse;
  });
  return out.reshape(x.sizes());
}
