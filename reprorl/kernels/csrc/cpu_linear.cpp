// The linear layer on the CPU: out = a @ b^T with the rows of a as the vector lanes.
//
//   out[i, j] = sum_k a[i, k] * b[j, k]: one running sum per entry over k in order (fused
//   multiply-adds from +0), mm_nn's arithmetic (cpu_kernels.h), so no LANES or block in it.
//
// Why not mm_nt's lane sums: their register block loads a vector of a and one of b for every
// few FMAs (a 4x4 block: 8 loads for 16 FMAs), mostly from L2, and ran the 256-row linears
// at 0.54-0.71x MKL's speed on one Xeon core. Here a lane is one row: a vector holds LANES
// rows of a at one k (a packed transposed per call, [row vectors][K][LANES], zero past M),
// and b[j, k] is broadcast straight from the weight in place (no copy of it to keep in
// sync). A register block of RV vectors x NC columns takes RV + NC loads for RV * NC FMAs
// (2 x 12: 14 for 24), as a BLAS micro-kernel does.
//
// Up to FEW_ROWS rows (a decode step) most lanes of a row vector would go unused, so there
// the lanes hold columns instead: tiles of the weight are transposed into an L1 buffer and
// a[i, k] is broadcast against them (`few_block`), the same running sums in the same order.
//
// Speed without touching the arithmetic (each entry's sequence is the same in any block,
// task, k block or thread):
//   - tasks: rows (up to TASK_VECS vectors) x a range of columns, one thread each, the work
//     split evenly over threads; never a split of K.
//   - K in blocks of kc: the task's packed rows for one k block stay in L2 while its columns
//     pass, a column block's weights in L1 while the rows pass. Between k blocks the
//     accumulators wait in a per-thread buffer (stored and reloaded exactly) and go on in
//     k order.
#include "cpu_kernels.h"

namespace {

// Register blocks: RV vectors of rows x NC columns (RV * NC accumulators, RV vectors of a and
// a broadcast of b: 32 zmm with AVX-512, 16 ymm with AVX2). The widest RV that the rows fill
// sets the columns of a block; fewer row vectors at a task's end take the same columns.
// AVX-512: 1 x 8 and 2 x 12, the fastest in bench/tune/cpu_blocks.py on a Xeon, summed over the
// bench linears (wider blocks, such as 1 x 24, spill their weight pointers; the timings:
// docs/performance.md). (-D RL1=.. RL4=.., RL_MAX=..: the blocks bench/tune/cpu_blocks.py builds.)
#if defined(__AVX512F__)
#ifndef RL1
#define RL1 8
#define RL2 12
#define RL3 8
#define RL4 6
#endif
#ifndef RL_MAX
#define RL_MAX 2
#endif
constexpr int64_t RL_MAX_VECS = RL_MAX;
constexpr int64_t rl_cols(int64_t rv) { return rv == 1 ? RL1 : rv == 2 ? RL2 : rv == 3 ? RL3 : RL4; }
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t RL_MAX_VECS = 2;
constexpr int64_t rl_cols(int64_t rv) { return rv == 1 ? 12 : 6; }
#else
constexpr int64_t RL_MAX_VECS = 2;
constexpr int64_t rl_cols(int64_t rv) { return rv == 1 ? 4 : 2; }
#endif
constexpr int64_t TASK_VECS = 4, TASK_COLS = 256;  // a task's row vectors and columns at most (default_rows_plan)
constexpr int64_t FEW_ROWS = 8;  // up to this many rows the lanes hold columns (few_block)

// One register block: row vectors [0, RV) of the panel `x` (vector v at x + v * panel), columns
// j0.. (C of them, <= NC; NC known at compile time keeps the accumulators in registers; DYN
// takes C at run time, at the last block of a task), k in [k0, k1). acc: the block's
// accumulators between k blocks, column c's vector v at acc + c * ldacc + v * LANES.
template <typename T, int64_t RV, int64_t NC, bool DYN>
inline void rl_block(const float* x, int64_t panel, const T* b, int64_t K, int64_t j0, int64_t C_, int64_t k0,
                     int64_t k1, float* acc, int64_t ldacc, bool first) {
  const int64_t C = DYN ? C_ : NC;
  Vec r[RV][NC];
  for (int64_t v = 0; v < RV; ++v)
    for (int64_t c = 0; c < NC; ++c)
      r[v][c] = (first || c >= C) ? Vec::zero() : Vec::load(acc + c * ldacc + v * LANES);
  const T* bc[NC];
  for (int64_t c = 0; c < NC; ++c) bc[c] = b + (j0 + (c < C ? c : 0)) * K;
  const float* xk = x + k0 * LANES;
  for (int64_t k = k0; k < k1; ++k, xk += LANES) {
    Vec xv[RV];
    for (int64_t v = 0; v < RV; ++v) {
      xv[v] = Vec::load(xk + v * panel);
      xv[v].pin();
    }
    for (int64_t c = 0; c < C; ++c) {
      const Vec w = Vec::broadcast(f(bc[c][k]));
      for (int64_t v = 0; v < RV; ++v) r[v][c] = Vec::fma(xv[v], w, r[v][c]);
    }
  }
  for (int64_t v = 0; v < RV; ++v)
    for (int64_t c = 0; c < C; ++c) r[v][c].store(acc + c * ldacc + v * LANES);
}

template <typename T, int64_t RV, int64_t NC>
inline void rl_cols_block(const float* x, int64_t panel, const T* b, int64_t K, int64_t j0, int64_t C, int64_t k0,
                          int64_t k1, float* acc, int64_t ldacc, bool first) {
  if (C == NC) {
    rl_block<T, RV, NC, false>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first);
  } else {
    rl_block<T, RV, NC, true>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first);
  }
}

// rv (1..RV_MAX) row vectors at NC columns a block.
template <typename T, int64_t NC, int64_t RV_MAX>
inline void rl_any(int64_t rv, const float* x, int64_t panel, const T* b, int64_t K, int64_t j0, int64_t C,
                   int64_t k0, int64_t k1, float* acc, int64_t ldacc, bool first) {
  switch (rv) {
    case 1: rl_cols_block<T, 1, NC>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first); break;
    case 2: if constexpr (RV_MAX >= 2) { rl_cols_block<T, 2, NC>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first); break; }
    [[fallthrough]];
    case 3: if constexpr (RV_MAX >= 3) { rl_cols_block<T, 3, NC>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first); break; }
    [[fallthrough]];
    case 4: if constexpr (RV_MAX >= 4) { rl_cols_block<T, 4, NC>(x, panel, b, K, j0, C, k0, k1, acc, ldacc, first); break; }
    [[fallthrough]];
    default: TORCH_CHECK(false, "rl_any: more row vectors than a register block");
  }
}

// One task: row vectors [g0, g1) of the packed a (rows past M are zeros) x columns [j0, j1),
// NC columns a register block; its rows of out written at the end.
template <typename T, int64_t NC, int64_t RV_MAX>
void rl_task(const float* ap, const T* b, float* out, int64_t M, int64_t K, int64_t N, int64_t g0, int64_t g1,
             int64_t j0, int64_t j1, int64_t kc, float* acc) {
  const int64_t panel = K * LANES;  // floats of one packed row vector
  const int64_t ldacc = (g1 - g0) * LANES;
  for (int64_t k0 = 0; k0 < std::max<int64_t>(K, 1); k0 += kc) {
    const int64_t k1 = std::min(K, k0 + kc);
    for (int64_t j = j0; j < j1; j += NC) {
      for (int64_t g = g0; g < g1; g += RV_MAX) {
        rl_any<T, NC, RV_MAX>(std::min(RV_MAX, g1 - g), ap + g * panel, panel, b, K, j, std::min(NC, j1 - j), k0, k1,
                              acc + (j - j0) * ldacc + (g - g0) * LANES, ldacc, k0 == 0);
      }
    }
  }
  const int64_t i1 = std::min(M, g1 * LANES);
  for (int64_t i = g0 * LANES; i < i1; ++i)
    for (int64_t j = j0; j < j1; ++j) out[i * N + j] = acc[(j - j0) * ldacc + (i - g0 * LANES)];
}

// Row vector g of a [M, K] at k in [k0, k1) (one thread's share), transposed:
// ap[(g * K + k) * LANES + l] = a[g * LANES + l, k], 0 past M.
template <typename T>
void pack_rows(const T* a, float* ap, int64_t M, int64_t K, int64_t g, int64_t k0, int64_t k1) {
  float* dst = ap + g * K * LANES;
  for (int64_t l = 0; l < LANES; ++l) {
    const int64_t i = g * LANES + l;
    if (i < M) {
      for (int64_t k = k0; k < k1; ++k) dst[k * LANES + l] = f(a[i * K + k]);
    } else {
      for (int64_t k = k0; k < k1; ++k) dst[k * LANES + l] = 0.f;
    }
  }
}
constexpr int64_t PACK_K = 256;  // a packing share: one row vector x PACK_K of k

// How the work is split (speed only): K in blocks of kc; tasks of up to `vecs` row vectors x
// `cols` columns (a multiple of the register block's).
struct RowsPlan {
  int64_t kc, vecs, cols;
};

// Buffers that live as long as their thread (an OpenMP worker, or the caller for the packed
// rows), so a call pays no page faults for fresh memory once the largest shape has run.
float* scratch(std::vector<float>& buffer, size_t floats) {
  if (buffer.size() < floats) buffer.resize(floats);
  return buffer.data();
}

template <typename T, int64_t NC, int64_t RV_MAX>
void run_rows_nc(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, RowsPlan plan) {
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  const int64_t vecs = (M + LANES - 1) / LANES;
  thread_local std::vector<float> packed;
  float* ap = scratch(packed, static_cast<size_t>(vecs * K * LANES));
  const T* pa = a.data_ptr<T>();
  const int64_t tm = (vecs + plan.vecs - 1) / plan.vecs;
  const int64_t tv = (vecs + tm - 1) / tm;  // row vectors a task, spread evenly
  const int64_t blocks = (N + NC - 1) / NC;
  const int64_t tn = std::min(blocks, (N + plan.cols - 1) / plan.cols);
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t tasks = tm * tn;
#pragma omp parallel num_threads(team_threads())
  {
    thread_local std::vector<float> acc_buffer;
    float* acc = nullptr;
    // The packing in the same parallel region, by the same threads (a region of another
    // thread count before it cost about 0.6 ms a call on the Xeon's 16 threads), in shares
    // of a row vector x PACK_K of k, so that at 16 rows (one row vector) not one thread
    // packs all of K while the others wait.
    const int64_t k_shares = (K + PACK_K - 1) / PACK_K;
#pragma omp for schedule(static)
    for (int64_t s = 0; s < vecs * k_shares; ++s) {
      const int64_t g = s / k_shares, k0 = s % k_shares * PACK_K;
      pack_rows<T>(pa, ap, M, K, g, k0, std::min(K, k0 + PACK_K));
    }
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      // Column tasks are the slow index: a thread's consecutive tasks share their weights.
      const int64_t tj = t / tm, ti = t % tm;
      const int64_t g0 = ti * tv, g1 = std::min(vecs, g0 + tv);
      const int64_t j0 = tj * blocks / tn * NC, j1 = std::min(N, (tj + 1) * blocks / tn * NC);
      if (g0 >= g1 || j0 >= j1) continue;
      acc = scratch(acc_buffer, static_cast<size_t>((j1 - j0 + NC) * (g1 - g0) * LANES));
      rl_task<T, NC, RV_MAX>(ap, pb, po, M, K, N, g0, g1, j0, j1, plan.kc, acc);
    }
  }
}

// The default plan, for `threads` threads: tasks of up to TASK_VECS row vectors x up to
// TASK_COLS columns, more column tasks when that leaves a thread idle, the tasks a whole
// number a thread when there are more than threads; K whole up to 512, else in blocks of 512.
// Chosen from bench/tune/cpu_plans.py on a Xeon (the bench linears at 16, 64 and 256 rows): near
// the best plan of its grid at 1 and 16 threads, closer than tasks of 16 vectors x an even
// share of the columns (the figures: docs/performance.md).
RowsPlan default_rows_plan(int64_t M, int64_t N, int64_t K, int64_t nc, int64_t threads) {
  const int64_t vecs = (M + LANES - 1) / LANES;
  const int64_t tm = (vecs + TASK_VECS - 1) / TASK_VECS;
  const int64_t tv = (vecs + tm - 1) / tm;
  int64_t tn = std::max((N + TASK_COLS - 1) / TASK_COLS, (threads + tm - 1) / tm);
  if (tm * tn > threads) tn = ((tm * tn + threads - 1) / threads * threads + tm - 1) / tm;
  const int64_t cols = std::max<int64_t>(nc, (N + tn - 1) / tn);
  return {K <= 512 ? std::max<int64_t>(K, 1) : 512, std::max<int64_t>(tv, 1), cols};
}

// The register block rows as lanes run at M rows: its row vectors and columns.
int64_t block_vecs(int64_t M) { return std::clamp<int64_t>((M + LANES - 1) / LANES, 1, RL_MAX_VECS); }
int64_t block_cols(int64_t M) { return rl_cols(block_vecs(M)); }

// A few rows (a decode step): most lanes of a row vector would go unused, so the lanes hold
// columns instead. A task's weights are transposed FEW_VECS vectors of columns x FEW_KC k at a
// time into an L1 buffer, and a[i, k] is broadcast against them. Each lane is still one
// entry's running sum over k in order, so the bits are the same as with rows as lanes.
constexpr int64_t FEW_VECS = 2, FEW_KC = 128, FEW_COLS = FEW_VECS * LANES;

#if defined(__AVX512F__)
// A 16 x 16 tile in registers, transposed: r[i] holds row i's 16 values on entry, column i's
// on return. Four rounds of 16 shuffles (4 x 4 blocks within each 128-bit lane, then the
// lanes), moves only.
inline void transpose16(__m512 r[16]) {
  __m512 t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  __m512 u[16];  // u[4g + m], 128-bit lane q: column 4q + m of rows 4g..4g+3
  for (int g = 0; g < 16; g += 4) {
    const __m512d a = _mm512_castps_pd(t[g]), b = _mm512_castps_pd(t[g + 1]);
    const __m512d c = _mm512_castps_pd(t[g + 2]), d = _mm512_castps_pd(t[g + 3]);
    u[g] = _mm512_castpd_ps(_mm512_unpacklo_pd(a, c));
    u[g + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(a, c));
    u[g + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(b, d));
    u[g + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(b, d));
  }
  for (int m = 0; m < 4; ++m) {
    const __m512 s1 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0x44), s2 = _mm512_shuffle_f32x4(u[m], u[4 + m], 0xEE);
    const __m512 s3 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0x44);
    const __m512 s4 = _mm512_shuffle_f32x4(u[8 + m], u[12 + m], 0xEE);
    r[m] = _mm512_shuffle_f32x4(s1, s3, 0x88);
    r[4 + m] = _mm512_shuffle_f32x4(s1, s3, 0xDD);
    r[8 + m] = _mm512_shuffle_f32x4(s2, s4, 0x88);
    r[12 + m] = _mm512_shuffle_f32x4(s2, s4, 0xDD);
  }
}
#endif

// wt[k][c] = b[c, k] for columns c < C (zero past them, up to FEW_COLS) and k < kn; b's rows
// are ldb apart. A move of values, no arithmetic.
template <typename T>
void transpose_block(const T* b, int64_t ldb, int64_t C, int64_t kn, float* wt) {
  int64_t k = 0;
#if defined(__AVX512F__)
  for (; k + LANES <= kn; k += LANES) {
    for (int64_t v = 0; v < FEW_VECS; ++v) {
      __m512 r[16];
      for (int64_t c = 0; c < 16; ++c) {
        const int64_t col = v * 16 + c;
        r[c] = col < C ? Vec::load(b + col * ldb + k).v : _mm512_setzero_ps();
      }
      transpose16(r);
      for (int64_t kk = 0; kk < 16; ++kk) _mm512_storeu_ps(wt + (k + kk) * FEW_COLS + v * 16, r[kk]);
    }
  }
#endif
  for (int64_t c = 0; c < FEW_COLS; ++c)
    for (int64_t kk = k; kk < kn; ++kk) wt[kk * FEW_COLS + c] = c < C ? f(b[c * ldb + kk]) : 0.f;
}

template <typename T, int64_t MR>
void few_block(const T* a, const T* b, float* out, int64_t K, int64_t N, int64_t j0, int64_t C, float* wt) {
  Vec acc[MR][FEW_VECS];
  for (int64_t i = 0; i < MR; ++i)
    for (int64_t v = 0; v < FEW_VECS; ++v) acc[i][v] = Vec::zero();
  for (int64_t k0 = 0; k0 < K; k0 += FEW_KC) {
    const int64_t kn = std::min(FEW_KC, K - k0);
    transpose_block(b + j0 * K + k0, K, C, kn, wt);
    for (int64_t k = 0; k < kn; ++k) {
      Vec wv[FEW_VECS];
      for (int64_t v = 0; v < FEW_VECS; ++v) {
        wv[v] = Vec::load(wt + k * FEW_COLS + v * LANES);
        wv[v].pin();
      }
      for (int64_t i = 0; i < MR; ++i) {
        const Vec x = Vec::broadcast(f(a[i * K + k0 + k]));
        for (int64_t v = 0; v < FEW_VECS; ++v) acc[i][v] = Vec::fma(x, wv[v], acc[i][v]);
      }
    }
  }
  float lanes[FEW_COLS];
  for (int64_t i = 0; i < MR; ++i) {
    for (int64_t v = 0; v < FEW_VECS; ++v) acc[i][v].store(lanes + v * LANES);
    for (int64_t c = 0; c < C; ++c) out[i * N + j0 + c] = lanes[c];
  }
}

template <typename T, int64_t MR>
void run_few_mr(const T* a, const T* b, float* out, int64_t K, int64_t N) {
  const int64_t blocks = (N + FEW_COLS - 1) / FEW_COLS;
#pragma omp parallel num_threads(team_threads())
  {
    thread_local std::vector<float> wt_buffer;
    float* wt = scratch(wt_buffer, FEW_KC * FEW_COLS);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < blocks; ++t)
      few_block<T, MR>(a, b, out, K, N, t * FEW_COLS, std::min(FEW_COLS, N - t * FEW_COLS), wt);
  }
}

template <typename T>
void run_few(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  static_assert(FEW_ROWS == 8, "run_few dispatches 1..8 rows");
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t K = a.size(1), N = b.size(0);
  switch (a.size(0)) {
    case 1: run_few_mr<T, 1>(pa, pb, po, K, N); break;
    case 2: run_few_mr<T, 2>(pa, pb, po, K, N); break;
    case 3: run_few_mr<T, 3>(pa, pb, po, K, N); break;
    case 4: run_few_mr<T, 4>(pa, pb, po, K, N); break;
    case 5: run_few_mr<T, 5>(pa, pb, po, K, N); break;
    case 6: run_few_mr<T, 6>(pa, pb, po, K, N); break;
    case 7: run_few_mr<T, 7>(pa, pb, po, K, N); break;
    case 8: run_few_mr<T, 8>(pa, pb, po, K, N); break;
    default: TORCH_CHECK(false, "run_few: more rows than it dispatches");
  }
}

template <typename T>
void run_rows(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, RowsPlan plan) {
  if (a.size(0) <= FEW_ROWS) return run_few<T>(a, b, out);
  switch (block_vecs(a.size(0))) {
    case 1: run_rows_nc<T, rl_cols(1), 1>(a, b, out, plan); break;
    case 2: run_rows_nc<T, rl_cols(2), 2>(a, b, out, plan); break;
#if defined(__AVX512F__)
    case 3: run_rows_nc<T, rl_cols(3), 3>(a, b, out, plan); break;
    case 4: run_rows_nc<T, rl_cols(4), 4>(a, b, out, plan); break;
#endif
    default: TORCH_CHECK(false, "run_rows: more row vectors than a register block");
  }
}

}  // namespace

// a [M, K] @ b [N, K]^T -> float32 [M, N]; plan: [kc, vecs, cols] or empty for the default.
at::Tensor mm_rows(at::Tensor a, at::Tensor b, std::vector<int64_t> plan) {
  TORCH_CHECK(a.dim() == 2 && b.dim() == 2, "a [M, K] and b [N, K] expected");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "a and b must have one dtype");
  TORCH_CHECK(a.size(1) == b.size(1), "inner dimensions differ");
  a = a.contiguous();
  b = b.contiguous();
  const int64_t M = a.size(0), K = a.size(1), N = b.size(0);
  auto out = at::empty({M, N}, a.options().dtype(at::kFloat));
  if (M == 0 || N == 0) return out;
  if (K == 0) return out.zero_();
  RowsPlan p = default_rows_plan(M, N, K, block_cols(M), at::get_num_threads());
  if (!plan.empty()) {
    // (cpu.matmul_rows checks a plan first and names the field; this message stays a literal, see cpu_kernels.h)
    TORCH_CHECK(plan.size() == 3 && plan[0] > 0 && plan[1] > 0 && plan[2] > 0, "plan: [kc, vecs, cols] expected");
    p = {plan[0], plan[1], plan[2]};
  }
  if (a.scalar_type() == at::kFloat) {
    run_rows<float>(a, b, out, p);
  } else if (a.scalar_type() == at::kBFloat16) {
    run_rows<at::BFloat16>(a, b, out, p);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}

// The default plan and block for a [M, K] @ b [N, K]^T at torch's thread count:
// [kc, vecs, cols, LANES, block row vectors, block columns]. Up to FEW_ROWS rows the
// few-rows path runs instead, with no plan: its block is given as 0 row vectors x FEW_COLS.
std::vector<int64_t> rows_plan(int64_t M, int64_t N, int64_t K) {
  const RowsPlan p = default_rows_plan(M, N, K, block_cols(M), at::get_num_threads());
  if (M <= FEW_ROWS) return {p.kc, p.vecs, p.cols, LANES, 0, FEW_COLS};
  return {p.kc, p.vecs, p.cols, LANES, block_vecs(M), block_cols(M)};
}
