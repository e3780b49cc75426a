// The CPU batch-invariant matmuls: every output entry is one fixed sequence of IEEE
// operations, whatever the batch, the entry's place in it or the thread count.
//
// No BLAS: a BLAS picks its kernels (and which rows of a tile take an edge path) from the
// call's shape and the machine; an Intel Xeon gave a row different bits at place 0 and 1
// of one fixed-shape single-threaded call. Here the arithmetic is written out:
//   mm_nt: out[i, j] = sum_k a[i, k] * b[j, k]    (a linear layer; attention's scores)
//          LANES lane sums, lane l over k = l, l+LANES, ... in order (fused multiply-adds),
//          then the lanes added in one fixed tree (LANES: 16 with AVX-512, 8 with AVX2).
//   mm_nn: out[i, j] = sum_k a[i, k] * b[k, j]    (attention's p v)
//          one running sum per entry over k in order (fused multiply-adds).
// A fused multiply-add (the FMA instructions, or std::fma) is exact-then-round-once, and the
// module is built without fast-math or contraction, so every lane computes exactly what
// the scalar source says, whichever instructions carry it. Work is split over threads by blocks of rows and
// columns, and each entry is computed by one thread from start to end.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <omp.h>

#include <cmath>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// LANES partial sums per a @ b^T entry (one vector register) and the register blocks: as
// many accumulators as the vector registers hold (32 zmm with AVX-512, 16 ymm with AVX2).
// The lane count is part of the arithmetic, so it is fixed per instruction set (two CPUs
// may give different bits; one CPU always gives the same); the block shape only changes
// speed: an entry's arithmetic is the same in a full block and in an edge block.
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t NT_ROWS = 4, NT_COLS = 4;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
constexpr int64_t NT_ROWS = 4, NT_COLS = 3;
#else
constexpr int64_t LANES = 16;
constexpr int64_t NT_ROWS = 2, NT_COLS = 2;
#endif
constexpr int64_t ROWS = 4;      // rows of a register block (mm_nn)
constexpr int64_t NN_COLS = 64;  // columns of a register block (mm_nn)

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

// LANES float lanes and a lane-wise fused multiply-add (_mm512_fmadd_ps, _mm256_fmadd_ps or
// std::fma): each lane exact-then-rounded-once, as the scalar source says.
struct Vec {
#if defined(__AVX512F__)
  __m512 v;
  static Vec zero() { return {_mm512_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm512_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    __m512i x = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return {_mm512_castsi512_ps(_mm512_slli_epi32(x, 16))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
  void store(float* p) const { _mm512_storeu_ps(p, v); }
#elif defined(__AVX2__) && defined(__FMA__)
  __m256 v;
  static Vec zero() { return {_mm256_setzero_ps()}; }
  static Vec load(const float* p) { return {_mm256_loadu_ps(p)}; }
  static Vec load(const at::BFloat16* p) {
    __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return {_mm256_castsi256_ps(_mm256_slli_epi32(x, 16))};
  }
  static Vec fma(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.v, b.v, c.v)}; }
  void store(float* p) const { _mm256_storeu_ps(p, v); }
#else
  float v[LANES];
  static Vec zero() { Vec r; for (int l = 0; l < LANES; ++l) r.v[l] = 0.f; return r; }
  template <typename T>
  static Vec load(const T* p) { Vec r; for (int l = 0; l < LANES; ++l) r.v[l] = f(p[l]); return r; }
  static Vec fma(Vec a, Vec b, Vec c) {
    Vec r;
    for (int l = 0; l < LANES; ++l) r.v[l] = std::fma(a.v[l], b.v[l], c.v[l]);
    return r;
  }
  void store(float* p) const { for (int l = 0; l < LANES; ++l) p[l] = v[l]; }
#endif
};

inline float lane_total(float* acc) {
  // A fixed pairwise tree over the lanes.
  for (int64_t width = LANES / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
  return acc[0];
}

// Entries (i0..i0+NR) x (j0..j0+NC) of a [M, K] @ b [N, K]^T. NR, NC known at compile time
// (full blocks: the accumulators stay in registers) or, with DYN, nr and nc at run time
// (edges); the arithmetic of an entry is the same either way.
template <typename T, int64_t NR, int64_t NC, bool DYN>
void nt_block(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t ldo,
              int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
  const int64_t R = DYN ? nr : NR, C = DYN ? nc : NC;
  Vec acc[NR][NC];
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t c = 0; c < NC; ++c) acc[r][c] = Vec::zero();
  const int64_t kv = K - K % LANES;
  for (int64_t k = 0; k < kv; k += LANES) {
    Vec bv[NC];
    for (int64_t c = 0; c < C; ++c) bv[c] = Vec::load(b + (j0 + c) * ldb + k);
    for (int64_t r = 0; r < R; ++r) {
      const Vec av = Vec::load(a + (i0 + r) * lda + k);
      for (int64_t c = 0; c < C; ++c) acc[r][c] = Vec::fma(av, bv[c], acc[r][c]);
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    for (int64_t c = 0; c < C; ++c) {
      float lanes[LANES];
      acc[r][c].store(lanes);
      for (int64_t k = kv; k < K; ++k) {  // the tail of K goes to lanes 0.. in order
        lanes[k - kv] = std::fma(f(a[(i0 + r) * lda + k]), f(b[(j0 + c) * ldb + k]), lanes[k - kv]);
      }
      out[(i0 + r) * ldo + j0 + c] = lane_total(lanes);
    }
  }
}

// Entries (i0..i0+nr) x (j0..j0+nc) of a [M, K] @ b [K, N], nr <= ROWS, nc <= NN_COLS.
template <typename T>
void nn_block(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t ldo,
              int64_t i0, int64_t nr, int64_t j0, int64_t nc) {
  float acc[ROWS][NN_COLS] = {};
  for (int64_t k = 0; k < K; ++k) {
    const T* bk = b + k * ldb + j0;
    for (int64_t r = 0; r < nr; ++r) {
      const float ark = f(a[(i0 + r) * lda + k]);
      for (int64_t c = 0; c < nc; ++c) acc[r][c] = std::fma(ark, f(bk[c]), acc[r][c]);
    }
  }
  for (int64_t r = 0; r < nr; ++r)
    for (int64_t c = 0; c < nc; ++c) out[(i0 + r) * ldo + j0 + c] = acc[r][c];
}

template <typename T, bool NT>
void run(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out) {
  const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = out.size(2);
  // Tasks of a few register blocks: enough of them to keep 16 threads busy at 16 rows
  // (a decode step), large enough that a task's blocks reuse its rows from cache.
  const int64_t bc = NT ? NT_COLS * 8 : NN_COLS;  // columns per task
  const int64_t br = NT ? NT_ROWS * 2 : ROWS * 2;  // rows per task
  const int64_t tm = (M + br - 1) / br, tn = (N + bc - 1) / bc;
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  // Our own OpenMP loop at torch's thread count (this module is built with -fopenmp; ATen's
  // inline parallel_for would run serially in an extension built without it).
  const int64_t tasks = G * tm * tn;
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), tasks)));
#pragma omp parallel for schedule(static) num_threads(threads)
  for (int64_t t = 0; t < tasks; ++t) {
    {
      const int64_t g = t / (tm * tn), rest = t % (tm * tn), ti = rest / tn, tj = rest % tn;
      const T* ag = pa + g * M * K;
      const T* bg = pb + g * K * N;
      float* og = po + g * M * N;
      const int64_t row_end = std::min(M, (ti + 1) * br), col_end = std::min(N, (tj + 1) * bc);
      const int64_t rstep = NT ? NT_ROWS : ROWS, cstep = NT ? NT_COLS : NN_COLS;
      for (int64_t i = ti * br; i < row_end; i += rstep) {
        for (int64_t j = tj * bc; j < col_end; j += cstep) {
          const int64_t nr = std::min(rstep, row_end - i), nc = std::min(cstep, col_end - j);
          if (!NT) {
            nn_block<T>(ag, bg, og, K, K, N, N, i, nr, j, nc);
          } else if (nr == NT_ROWS && nc == NT_COLS) {
            nt_block<T, NT_ROWS, NT_COLS, false>(ag, bg, og, K, K, K, N, i, nr, j, nc);
          } else {
            nt_block<T, NT_ROWS, NT_COLS, true>(ag, bg, og, K, K, K, N, i, nr, j, nc);
          }
        }
      }
    }
  }
}

torch::Tensor launch(torch::Tensor a, torch::Tensor b, bool nt) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), "a [G, M, K] and b [G, ., .] expected");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "a and b must have one dtype");
  a = a.contiguous();
  b = b.contiguous();
  const int64_t N = nt ? b.size(1) : b.size(2);
  TORCH_CHECK((nt ? b.size(2) : b.size(1)) == a.size(2), "inner dimensions differ");
  auto out = torch::empty({a.size(0), a.size(1), N}, a.options().dtype(torch::kFloat32));
  if (a.scalar_type() == torch::kFloat32) {
    nt ? run<float, true>(a, b, out) : run<float, false>(a, b, out);
  } else if (a.scalar_type() == torch::kBFloat16) {
    nt ? run<at::BFloat16, true>(a, b, out) : run<at::BFloat16, false>(a, b, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}

}  // namespace

// a [G, M, K], b [G, N, K] -> float32 [G, M, N]
torch::Tensor mm_nt(torch::Tensor a, torch::Tensor b) { return launch(a, b, true); }
// a [G, M, K], b [G, K, N] -> float32 [G, M, N]
torch::Tensor mm_nn(torch::Tensor a, torch::Tensor b) { return launch(a, b, false); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm_nt", &mm_nt, "a @ b^T, each entry one fixed sequence of fused multiply-adds");
  m.def("mm_nn", &mm_nn, "a @ b, each entry one fixed sequence of fused multiply-adds");
}
