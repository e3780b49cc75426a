// The CPU batch-invariant matmuls' vector type, register blocks and tasks (cpu_matmul.cpp
// runs them as a @ b^T and a @ b, cpu_attention.cpp as attention's two products, and
// cpu_linear.cpp builds the linear's own kernel from the vector type). Each file compiles
// its own copy, so GCC's inlining of one file's kernels does not move with another's code
// (in one file it spilled an accumulator of the AVX2 4x3 block and a matmul took twice as
// long). Every output entry is one fixed sequence of IEEE operations, whatever the batch,
// the entry's place in it or the thread count.
//
// No BLAS: a BLAS picks its kernels (and which rows of a tile take an edge path) from the
// call's shape and the machine; an Intel Xeon gave a row different bits at place 0 and 1
// of one fixed-shape single-threaded call. Here the arithmetic is written out:
//   mm_nt: out[i, j] = sum_k a[i, k] * b[j, k]    (attention's scores)
//          SUM_LANES = 16 lane sums, lane l over k = l, l+16, ... in order (fused
//          multiply-adds), then the lanes added in one fixed tree: 16 on every instruction
//          set (one AVX-512 vector, two AVX2 vectors, or 16 scalars), so an AMD and an Intel
//          CPU, with or without AVX-512, give the same bits.
//   mm_nn: out[i, j] = sum_k a[i, k] * b[k, j]    (attention's p v)
//          one running sum per entry over k in order (fused multiply-adds).
// A fused multiply-add (the FMA instructions, or std::fma) is exact-then-round-once, and the
// module is built without fast-math or contraction, so every lane computes exactly what
// the scalar source says, whichever instructions carry it.
//
// Speed without touching that arithmetic (each entry's sequence is the same in any block,
// task or thread):
//   mm_nt: register blocks of NT_ROWS x NT_COLS entries (one vector of lanes each), a's and
//          b's vectors pinned in registers; a thread's task is a plan's rows x column blocks
//          (default_nt_plan in cpu_matmul.cpp: up to 64 x 16) with the row tasks innermost,
//          so at <= 64 rows each weight row is read from memory once; K in blocks of 512
//          (the lane vectors wait in a per-thread buffer, stored and reloaded exactly, and
//          the sums go on in k order).
//   mm_nn: vectorised across columns (a[i, k] broadcast, b's row k loaded), so each lane is
//          one entry's running sum; NN_ROWS x NN_VECS vectors a register block.
// Work is split over threads by tasks of rows and columns, never of K: each entry is
// computed by one thread from start to end.
//
// Every TORCH_CHECK here has a literal message: on the GPU machine (torch 2.11+cu130, g++
// 13.3) a check whose message is formatted (c10::str, a std::string) segfaulted when it
// failed, in any extension built there, while a literal one raised (2026-12-02). The Python
// callers (cpu.py) check their arguments first and name the values.
#pragma once

#include "cpu_tensor.h"
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <vector>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace {

// LANES: the floats of one vector register (mm_nn's columns, the linear's rows); they are
// independent running sums, so LANES only changes speed. SUM_LANES: the partial sums of one
// a @ b^T entry, part of its arithmetic, so the same on every instruction set (an AVX2
// SumVec is two registers). The register blocks hold as many accumulators as the vector
// registers do (32 zmm with AVX-512, 16 ymm with AVX2); the block shape only changes speed:
// an entry's arithmetic is the same in a full block and in an edge block.
constexpr int64_t SUM_LANES = 16;
#if defined(__AVX512F__)
constexpr int64_t LANES = 16;
constexpr int64_t NT_ROWS = 4, NT_COLS = 4;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t LANES = 8;
constexpr int64_t NT_ROWS = 2, NT_COLS = 2;  // 8 accumulators of two ymm each, 4 of b, 2 of a
#else
constexpr int64_t LANES = 16;
constexpr int64_t NT_ROWS = 2, NT_COLS = 2;
#endif
// mm_nn's register blocks: NN_ROWS rows x NN_VECS vectors of LANES columns (its arithmetic,
// one running sum per entry, does not depend on LANES or the block).
#if defined(__AVX512F__)
constexpr int64_t NN_ROWS = 6, NN_VECS = 4;
#elif defined(__AVX2__) && defined(__FMA__)
constexpr int64_t NN_ROWS = 6, NN_VECS = 2;
#else
constexpr int64_t NN_ROWS = 4, NN_VECS = 1;
#endif
constexpr int64_t NN_COLS = NN_VECS * LANES;

template <typename T>
inline float f(T x) { return static_cast<float>(x); }

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
// lane_total's tree over 8 lanes, as vector adds of the same pairs: lanes l + l+4, then
// [0]+[2] and [1]+[3], then [0]+[1]. Each add is one IEEE add of the same two floats.
inline float total8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
}
#endif

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
  void pin() { asm("" : "+v"(v)); }
  static Vec broadcast(float x) { return {_mm512_set1_ps(x)}; }
  float total() const {  // lane_total's tree: lanes l + l+8, then as AVX2 below
    const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
    return total8(_mm256_add_ps(_mm512_castps512_ps256(v), hi));
  }
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
  void pin() { asm("" : "+x"(v)); }
  static Vec broadcast(float x) { return {_mm256_set1_ps(x)}; }
  float total() const { return total8(v); }
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
  void pin() {}
  static Vec broadcast(float x) { Vec r; for (int l = 0; l < LANES; ++l) r.v[l] = x; return r; }
  float total() const;
#endif
  // pin(): an empty asm that makes the compiler hold the value in a register from here on.
  // Without it GCC re-reads a's or b's vectors from memory at every FMA of the AVX2 4x3
  // block (15-16 loads for 12 FMAs, so the loop waited on loads). It changes no arithmetic.
};

inline float lane_total(float* acc) {
  // A fixed pairwise tree over the SUM_LANES partial sums: l + l+8, l + l+4, l + l+2, l + l+1.
  for (int64_t width = SUM_LANES / 2; width >= 1; width /= 2)
    for (int64_t l = 0; l < width; ++l) acc[l] = acc[l] + acc[l + width];
  return acc[0];
}

#if !defined(__AVX512F__) && !(defined(__AVX2__) && defined(__FMA__))
inline float Vec::total() const {
  float lanes[LANES];
  store(lanes);
  return lane_total(lanes);
}
#endif

// SUM_LANES partial sums of a dot product (mm_nt): one Vec where a Vec holds 16 floats,
// else two, lanes 0-7 in lo and 8-15 in hi. total() is lane_total's tree either way (its
// first level, l + l+8, is lo + hi).
#if defined(__AVX2__) && defined(__FMA__) && !defined(__AVX512F__)
struct SumVec {
  Vec lo, hi;
  static SumVec zero() { return {Vec::zero(), Vec::zero()}; }
  template <typename T>
  static SumVec load(const T* p) { return {Vec::load(p), Vec::load(p + 8)}; }
  static SumVec fma(SumVec a, SumVec b, SumVec c) { return {Vec::fma(a.lo, b.lo, c.lo), Vec::fma(a.hi, b.hi, c.hi)}; }
  void store(float* p) const { lo.store(p); hi.store(p + 8); }
  void pin() { lo.pin(); hi.pin(); }
  float total() const { return total8(_mm256_add_ps(lo.v, hi.v)); }
};
#else
using SumVec = Vec;
static_assert(LANES == SUM_LANES, "a Vec of 16 lanes is one SumVec");
#endif

// One register block of a [M, K] @ b [N, K]^T: rows i0.. (R of them), columns j0.. (C), over
// k in [k0, k1) (whole vectors). acc holds the block's NR x NC lane vectors between k
// blocks (stored and reloaded exactly); `first` starts them at zero. NR, NC known at
// compile time keep the accumulators in registers; DYN takes R, C <= NR, NC at run time
// (edges). An entry's arithmetic is the same in every case: its lane sums continue in k
// order from one k block to the next.
template <typename T, int64_t NR, int64_t NC, bool DYN>
inline void nt_block(const T* a, const T* b, int64_t lda, int64_t ldb, int64_t i0, int64_t R_, int64_t j0,
                     int64_t C_, int64_t k0, int64_t k1, float* acc, bool first) {
  const int64_t R = DYN ? R_ : NR, C = DYN ? C_ : NC;
  SumVec r[NR][NC];
  for (int64_t i = 0; i < NR; ++i)
    for (int64_t c = 0; c < NC; ++c)
      r[i][c] = (first || i >= R || c >= C) ? SumVec::zero() : SumVec::load(acc + (i * NC + c) * SUM_LANES);
  const T* ar[NR];
  const T* bc[NC];
  for (int64_t i = 0; i < NR; ++i) ar[i] = a + (i0 + (i < R ? i : 0)) * lda;
  for (int64_t c = 0; c < NC; ++c) bc[c] = b + (j0 + (c < C ? c : 0)) * ldb;
  for (int64_t k = k0; k < k1; k += SUM_LANES) {
    SumVec bv[NC];
    for (int64_t c = 0; c < C; ++c) {
      bv[c] = SumVec::load(bc[c] + k);
      bv[c].pin();
    }
    for (int64_t i = 0; i < R; ++i) {
      SumVec av = SumVec::load(ar[i] + k);
      av.pin();
      for (int64_t c = 0; c < C; ++c) r[i][c] = SumVec::fma(av, bv[c], r[i][c]);
    }
  }
  for (int64_t i = 0; i < R; ++i)
    for (int64_t c = 0; c < C; ++c) r[i][c].store(acc + (i * NC + c) * SUM_LANES);
}

// The end of an entry: the tail of K (K % SUM_LANES values) goes to lanes 0.. in order, then
// the lanes are added in the fixed tree.
template <typename T>
inline float nt_finish(const T* arow, const T* brow, int64_t kv, int64_t K, const float* lanes_in) {
  float lanes[SUM_LANES];
  for (int64_t l = 0; l < SUM_LANES; ++l) lanes[l] = lanes_in[l];
  for (int64_t k = kv; k < K; ++k) lanes[k - kv] = std::fma(f(arow[k]), f(brow[k]), lanes[k - kv]);
  return lane_total(lanes);
}

// Blocks with NR rows compiled in (1..NT_ROWS, so small batches keep their accumulators in
// registers too); DYN only for a partial column block.
template <typename T, int64_t NR>
inline void nt_rows(const T* a, const T* b, int64_t lda, int64_t ldb, int64_t i0, int64_t j0, int64_t nc,
                    int64_t k0, int64_t k1, float* acc, bool first) {
  if (nc == NT_COLS) {
    nt_block<T, NR, NT_COLS, false>(a, b, lda, ldb, i0, NR, j0, nc, k0, k1, acc, first);
  } else {
    nt_block<T, NR, NT_COLS, true>(a, b, lda, ldb, i0, NR, j0, nc, k0, k1, acc, first);
  }
}

template <typename T>
inline void nt_any(const T* a, const T* b, int64_t lda, int64_t ldb, int64_t i0, int64_t nr, int64_t j0,
                   int64_t nc, int64_t k0, int64_t k1, float* acc, bool first) {
  static_assert(NT_ROWS == 4 || NT_ROWS == 2, "nt_any dispatches 1..NT_ROWS rows");
  switch (nr) {
    case 1: nt_rows<T, 1>(a, b, lda, ldb, i0, j0, nc, k0, k1, acc, first); break;
    case 2: nt_rows<T, 2>(a, b, lda, ldb, i0, j0, nc, k0, k1, acc, first); break;
    case 3: if constexpr (NT_ROWS >= 3) nt_rows<T, 3>(a, b, lda, ldb, i0, j0, nc, k0, k1, acc, first); break;
    case 4: if constexpr (NT_ROWS >= 4) nt_rows<T, 4>(a, b, lda, ldb, i0, j0, nc, k0, k1, acc, first); break;
    default: TORCH_CHECK(false, "nt_any: more rows than a register block");
  }
}

// Rows [i0, i1) x columns [j0, j1) of a [M, K] @ b [N, K]^T (one thread's task). K is cut
// into blocks of KC (the task's rows of a and columns of b for one k block stay in L1/L2);
// each register block's lane vectors wait in `acc` between k blocks.
template <typename T>
void nt_task(const T* a, const T* b, float* out, int64_t K, int64_t ldo, int64_t i0, int64_t i1, int64_t j0,
             int64_t j1, int64_t kc, float* acc) {
  const int64_t kv = K - K % SUM_LANES;
  const int64_t nbj = (j1 - j0 + NT_COLS - 1) / NT_COLS;
  constexpr int64_t BLOCK = NT_ROWS * NT_COLS * SUM_LANES;  // floats of one register block's lanes
  for (int64_t k0 = 0; k0 < std::max<int64_t>(kv, 1); k0 += kc) {
    const int64_t k1 = std::min(kv, k0 + kc);
    for (int64_t i = i0, bi = 0; i < i1; i += NT_ROWS, ++bi) {
      const int64_t nr = std::min(NT_ROWS, i1 - i);
      for (int64_t j = j0, bj = 0; j < j1; j += NT_COLS, ++bj) {
        nt_any<T>(a, b, K, K, i, nr, j, std::min(NT_COLS, j1 - j), k0, k1, acc + (bi * nbj + bj) * BLOCK, k0 == 0);
      }
    }
  }
  for (int64_t i = i0, bi = 0; i < i1; i += NT_ROWS, ++bi)
    for (int64_t j = j0, bj = 0; j < j1; j += NT_COLS, ++bj)
      for (int64_t r = 0; r < std::min(NT_ROWS, i1 - i); ++r)
        for (int64_t c = 0; c < std::min(NT_COLS, j1 - j); ++c)
          out[(i + r) * ldo + j + c] =
              kv == K ? SumVec::load(acc + (bi * nbj + bj) * BLOCK + (r * NT_COLS + c) * SUM_LANES).total()
                      : nt_finish(a + (i + r) * K, b + (j + c) * K, kv, K,
                                  acc + (bi * nbj + bj) * BLOCK + (r * NT_COLS + c) * SUM_LANES);
}

// Entries (i0..i0+NR) x (j0..j0+V*LANES) of a [M, K] @ b [K, N]: each entry one running sum
// over k in order, as the scalar loop in nn_columns; vectorised across columns (a[i, k]
// broadcast, b's row k loaded), so a lane is one entry's sum. V = NN_VECS, or nv at run
// time with DYN.
template <typename T, int64_t NR, bool DYN>
inline void nn_block(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t ldo,
                     int64_t i0, int64_t j0, int64_t nv) {
  const int64_t V = DYN ? nv : NN_VECS;
  Vec acc[NR][NN_VECS];
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t v = 0; v < NN_VECS; ++v) acc[r][v] = Vec::zero();
  for (int64_t k = 0; k < K; ++k) {
    Vec bv[NN_VECS];
    for (int64_t v = 0; v < V; ++v) {
      bv[v] = Vec::load(b + k * ldb + j0 + v * LANES);
      bv[v].pin();
    }
    for (int64_t r = 0; r < NR; ++r) {
      Vec av = Vec::broadcast(f(a[(i0 + r) * lda + k]));
      av.pin();
      for (int64_t v = 0; v < V; ++v) acc[r][v] = Vec::fma(av, bv[v], acc[r][v]);
    }
  }
  for (int64_t r = 0; r < NR; ++r)
    for (int64_t v = 0; v < V; ++v) acc[r][v].store(out + (i0 + r) * ldo + j0 + v * LANES);
}

// The same sums, one entry at a time (the columns past the last whole vector).
template <typename T>
void nn_columns(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t ldo,
                int64_t i0, int64_t i1, int64_t j0, int64_t j1) {
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t j = j0; j < j1; ++j) {
      float acc = 0.f;
      for (int64_t k = 0; k < K; ++k) acc = std::fma(f(a[i * lda + k]), f(b[k * ldb + j]), acc);
      out[i * ldo + j] = acc;
    }
}

template <typename T, int64_t NR>
inline void nn_rows(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t ldo,
                    int64_t i0, int64_t j0, int64_t nv) {
  if (nv == NN_VECS) {
    nn_block<T, NR, false>(a, b, out, K, lda, ldb, ldo, i0, j0, nv);
  } else {
    nn_block<T, NR, true>(a, b, out, K, lda, ldb, ldo, i0, j0, nv);
  }
}

// Rows [i0, i1) x columns [j0, j1) of a [M, K] @ b [K, N] (one thread's task).
template <typename T>
void nn_task(const T* a, const T* b, float* out, int64_t K, int64_t N, int64_t i0, int64_t i1, int64_t j0,
             int64_t j1) {
  static_assert(NN_ROWS <= 6, "nn_task dispatches 1..6 rows");
  const int64_t jv = j0 + (j1 - j0) / LANES * LANES;  // columns [j0, jv) in whole vectors
  for (int64_t i = i0; i < i1; i += NN_ROWS) {
    const int64_t nr = std::min(NN_ROWS, i1 - i);
    for (int64_t j = j0; j < jv; j += NN_COLS) {
      const int64_t nv = std::min(NN_COLS, jv - j) / LANES;
      switch (nr) {
        case 1: nn_rows<T, 1>(a, b, out, K, K, N, N, i, j, nv); break;
        case 2: nn_rows<T, 2>(a, b, out, K, K, N, N, i, j, nv); break;
        case 3: nn_rows<T, 3>(a, b, out, K, K, N, N, i, j, nv); break;
        case 4: nn_rows<T, 4>(a, b, out, K, K, N, N, i, j, nv); break;
        case 5: nn_rows<T, 5>(a, b, out, K, K, N, N, i, j, nv); break;
        case 6: nn_rows<T, 6>(a, b, out, K, K, N, N, i, j, nv); break;
        default: TORCH_CHECK(false, "nn_task: more rows than a register block");
      }
    }
  }
  if (jv < j1) nn_columns<T>(a, b, out, K, K, N, N, i0, i1, jv, j1);
}

// Our own OpenMP loops at torch's thread count (this module is built with -fopenmp; ATen's
// inline parallel_for would run serially in an extension built without it). The split into
// tasks follows the shape and the thread count, which only changes speed: each entry is
// computed by one thread from start to end, K is never split between threads.
//
// Every region takes the whole team, even with fewer tasks than threads (those threads wait
// at its end): a team of another size than the last region's makes OpenMP move threads in
// or out of it, and at 16 rows on the Xeon's 16 threads that cost more than the work (with
// the linear's packing split over k, one change; its effect: docs/performance.md).
inline int team_threads() { return std::max(1, at::get_num_threads()); }

// mm_nt's k blocks of 512 (a task's 64 rows of a take 128 KiB, its columns of b fit L1/L2);
// a short K is one block, so the lane vectors never leave registers.
inline int64_t k_block(int64_t K) {
  const int64_t kv = K - K % SUM_LANES;
  return kv <= 768 ? std::max<int64_t>(kv, SUM_LANES) : 512;
}

}  // namespace
