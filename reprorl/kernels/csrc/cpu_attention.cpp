// Causal GQA attention, optionally in a sliding window, on the CPU kernels (cpu_kernels.h),
// one OpenMP region a call.
#include "cpu_kernels.h"
#include "cpu_math.h"

namespace {

// p [n, K] (rows lda apart) @ v [K, D] (rows ldb apart) -> out [n, D]: nn_task's blocks.
template <typename T>
void nn_attention(const T* a, const T* b, float* out, int64_t K, int64_t lda, int64_t ldb, int64_t D, int64_t n) {
  const int64_t jv = D / LANES * LANES;
  for (int64_t i = 0; i < n; i += NN_ROWS) {
    const int64_t nr = std::min(NN_ROWS, n - i);
    for (int64_t j = 0; j < jv; j += NN_COLS) {
      const int64_t nv = std::min(NN_COLS, jv - j) / LANES;
      switch (nr) {
        case 1: nn_rows<T, 1>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        case 2: nn_rows<T, 2>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        case 3: nn_rows<T, 3>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        case 4: nn_rows<T, 4>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        case 5: nn_rows<T, 5>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        case 6: nn_rows<T, 6>(a, b, out, K, lda, ldb, D, i, j, nv); break;
        default: TORCH_CHECK(false, "nn_attention: more rows than a register block");
      }
    }
  }
  if (jv < D) nn_columns<T>(a, b, out, K, lda, ldb, D, 0, n, jv, D);
}

// Causal GQA attention, the whole call in one OpenMP region (a Python op each for the
// scores, the mask, the softmax, p v and their reshapes cost more than the arithmetic at
// a few rows, and each opened its own parallel region). q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D]
// (rows along T packed, D apart; a q or k that is not is copied), q_start [B] -> [B, Hq, Tq, D] in q's dtype.
// window: 0 (full causal attention) or W > 0 (a query at pos sees keys pos-W+1..pos).
//
// The arithmetic is the one the Python version had, per entry:
//   query block qs.. of query_block queries: nk = min(max(q_start) + qs + qn, Tk) keys, the
//   softmax row padded to nb = nk rounded up to whole key_blocks;
//   s[j] = mm_nt's sum(q, k_j) * scale + (j > pos || j <= pos - W ? -inf : 0)   (-inf for j >= nk)
//   p = cpu_math.h's softmax over the nb entries (no libm exp: its bits differ between C
//       libraries), rounded to v's dtype by torch's copy (for bfloat16);
//   out = mm_nn's running sum over keys 0..nk-1 in order of p[j] * v_j, rounded by torch's copy.
// Keys past nk are masked for every row of the block, so their score is -inf whatever the
// dot product (finite keys, as the kernels' contract says) and their probability exactly
// 0, and p v stops at nk: the terms it leaves out, fma(+0, v, acc), return acc exactly (acc
// starts at +0 and an fma never makes it -0). A task is one head's chunk of up to 24 queries
// of one query block; tasks, their order and the thread that runs one change no bit.
//
// With a window, a task skips the whole key_blocks before its first query's window (j0 =
// that query's pos - W + 1 rounded down to a key_block), which no query of the task sees:
// the same bits as computing them, since each such key's score would be -inf, its
// probability exactly +0 (exp_f32 of -inf), which adds +0 to its lane of the softmax's row
// sum (lanes start at +0; j0 is a multiple of the 16 lanes, so every other key keeps its
// lane), and fma(+0, v, +0) = +0 to p v's running sum, which therefore starts at j0 from the
// +0 it would have held there.
template <typename T>
void run_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const int64_t* q_start,
                   double scale, int64_t query_block, int64_t key_block, int64_t window, at::Tensor& out) {
  const int64_t B = q.size(0), Hq = q.size(1), Tq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Tk = k.size(2), group = Hq / Hkv;
  int64_t max_start = 0;
  for (int64_t b = 0; b < B; ++b) max_start = std::max(max_start, q_start[b]);
  constexpr int64_t CHUNK = 24;  // queries per task: 6 register blocks of a @ b^T, 4 of p v
  const int64_t nqb = (Tq + query_block - 1) / query_block;
  const int64_t chunks = (std::min(query_block, Tq) + CHUNK - 1) / CHUNK;  // per query block
  const int64_t nb_max = [&] {
    const int64_t nk = std::min(max_start + Tq, Tk);
    return nk + (key_block - nk % key_block) % key_block;
  }();
  // The later query blocks see more keys: they go first, handed out one task at a time.
  const int64_t tasks = nqb * B * Hq * chunks;
  const float fscale = static_cast<float>(scale);  // what x.mul_(scale) multiplies by
  const int64_t kc = k_block(D);
  constexpr int64_t COLS = NT_COLS * 8;  // score columns per nt_task call (its lane buffer)
  const T* pq = q.data_ptr<T>();
  const T* pk = k.data_ptr<T>();
  const T* pv = v.data_ptr<T>();
  T* po = out.data_ptr<T>();
  const int64_t qs0 = q.stride(0), qs1 = q.stride(1);
  const int64_t ks0 = k.stride(0), ks1 = k.stride(1);
  const int64_t vs0 = v.stride(0), vs1 = v.stride(1), vs2 = v.stride(2);
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
#pragma omp parallel num_threads(team_threads())
  {
    std::vector<float> acc(((CHUNK + NT_ROWS - 1) / NT_ROWS) * (COLS / NT_COLS) * NT_ROWS * NT_COLS * SUM_LANES);
    std::vector<float> scores(CHUNK * nb_max), probs(CHUNK * nb_max), result(CHUNK * D);
    std::vector<T> probs_t(std::is_same<T, float>::value ? 0 : CHUNK * nb_max);
    std::vector<T> result_t(std::is_same<T, float>::value ? 0 : CHUNK * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t qb = nqb - 1 - t / (B * Hq * chunks), rest = t % (B * Hq * chunks);
      const int64_t b = rest / (Hq * chunks), h = rest / chunks % Hq, c = rest % chunks;
      const int64_t qs = qb * query_block, qn = std::min(query_block, Tq - qs);
      const int64_t t0 = qs + c * CHUNK, n = std::min(CHUNK, qs + qn - t0);
      if (n <= 0) continue;  // the last query block may have fewer chunks
      const int64_t nk = std::min(max_start + qs + qn, Tk);
      const int64_t nb = nk + (key_block - nk % key_block) % key_block;
      // The first key_block any query of the task sees (0 without a window; see above).
      const int64_t j0 = window > 0 ? std::max<int64_t>(std::min((q_start[b] + t0 - window + 1) / key_block * key_block,
                                                                 nb - key_block), 0) : 0;
      const T* rows = pq + b * qs0 + h * qs1 + t0 * D;
      const T* keys = pk + b * ks0 + (h / group) * ks1;
      const T* vals = pv + b * vs0 + (h / group) * vs1;
      for (int64_t jc = j0; jc < nk; jc += COLS)
        nt_task<T>(rows, keys, scores.data(), D, nb, 0, n, jc, std::min(nk, jc + COLS), kc, acc.data());
      for (int64_t r = 0; r < n; ++r) {
        const int64_t pos = q_start[b] + t0 + r;
        const int64_t first = window > 0 ? pos - window + 1 : 0;  // the first key in the window
        float* s = scores.data() + r * nb;
        for (int64_t j = j0; j < nk; ++j) s[j] = s[j] * fscale + (j > pos || j < first ? -INFINITY : 0.f);
        for (int64_t j = nk; j < nb; ++j) s[j] = -INFINITY;
      }
      for (int64_t r = 0; r < n; ++r)
        reprorl_math::softmax_row(scores.data() + r * nb + j0, probs.data() + r * nb + j0, nb - j0);
      const int64_t np = nb - j0;  // probabilities a row, from key j0
      auto p_t = at::from_blob(probs.data() + j0, {n, np}, {nb, 1}, f32);
      const T* p = nullptr;
      if constexpr (std::is_same<T, float>::value) {
        p = probs.data() + j0;
      } else {
        at::from_blob(probs_t.data(), {n, np}, {nb, 1}, q.options()).copy_(p_t);
        p = probs_t.data();
      }
      nn_attention<T>(p, vals + j0 * vs2, result.data(), nk - j0, nb, vs2, D, n);
      const float* o = result.data();
      if constexpr (!std::is_same<T, float>::value) {
        at::from_blob(result_t.data(), {n, D}, q.options()).copy_(at::from_blob(result.data(), {n, D}, f32));
      }
      for (int64_t r = 0; r < n; ++r) {
        T* dst = po + ((b * Hq + h) * Tq + t0 + r) * D;
        if constexpr (std::is_same<T, float>::value) {
          std::copy(o + r * D, o + (r + 1) * D, dst);
        } else {
          std::copy(result_t.data() + r * D, result_t.data() + (r + 1) * D, dst);
        }
      }
    }
  }
}

}  // namespace

// q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B] -> [B, Hq, Tq, D] (see run_attention)
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_start, double scale,
                     int64_t query_block, int64_t key_block, int64_t window) {
  TORCH_CHECK(q.dim() == 4 && k.dim() == 4 && k.sizes() == v.sizes() && q.size(0) == k.size(0) &&
                  q.size(3) == k.size(3) && q.size(1) % k.size(1) == 0 && q_start.numel() == q.size(0),
              "attention: q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B] expected");
  TORCH_CHECK(q.scalar_type() == k.scalar_type() && k.scalar_type() == v.scalar_type(), "q, k, v: one dtype");
  TORCH_CHECK(window >= 0, "attention: window >= 0 expected");
  TORCH_CHECK(key_block > 0 && key_block % reprorl_math::ROW_LANES == 0,
              "attention: key_block a multiple of the softmax's lanes expected (a window skips whole key blocks)");
  // mm_nt's tasks read a's and b's rows K apart (a separate stride for each slowed the
  // linear's register block, GCC spilling an accumulator): copy q or k whose rows are not.
  auto rows_packed = [](at::Tensor x) {
    return x.stride(3) == 1 && (x.stride(2) == x.size(3) || x.size(2) == 1) ? x : x.contiguous();
  };
  q = rows_packed(q);
  k = rows_packed(k);
  v = v.stride(3) == 1 ? v : v.contiguous();
  const auto starts = q_start.to(at::kCPU, at::kLong).contiguous();
  auto out = at::empty(q.sizes(), q.options());
  if (out.numel() == 0) return out;
  if (q.scalar_type() == at::kFloat) {
    run_attention<float>(q, k, v, starts.data_ptr<int64_t>(), scale, query_block, key_block, window, out);
  } else if (q.scalar_type() == at::kBFloat16) {
    run_attention<at::BFloat16>(q, k, v, starts.data_ptr<int64_t>(), scale, query_block, key_block, window, out);
  } else {
    TORCH_CHECK(false, "attention: float32 or bfloat16 expected");
  }
  return out;
}

