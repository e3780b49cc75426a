// mm_nt (attention's scores; a @ b^T) and mm_nn (a @ b) over threads (the kernels: cpu_kernels.h).
#include "cpu_kernels.h"

namespace {

// How mm_nt splits its work: K in blocks of kc, tasks of up to `rows` rows x `col_blocks`
// register blocks of columns. Only speed depends on it: an entry's arithmetic is the same
// sequence in any block, task or thread (tests/kernels/test_invariant_kernels.py compares
// plans bit for bit).
struct NtPlan {
  int64_t kc, rows, col_blocks;
};

// The default plan: K in `k_block`s; tasks of up to 64 rows; columns per task: up to 16
// register blocks, fewer when that leaves under 4 tasks a thread (a decode step's few rows
// on 16 threads). Chosen when mm_nt was the linear too, from bench/tune/cpu_plans.py (it now
// times the linear's own kernel, cpu_linear.cpp) over the bench linears at 16, 64 and 256
// rows, on a Xeon and an AMD EPYC: closer to each machine's best plan than the old rule
// (8 blocks and 8 tasks a thread); 16-row tasks were best on the Xeon at 16 threads but
// worst on the EPYC (the figures: docs/performance.md).
NtPlan default_nt_plan(int64_t G, int64_t M, int64_t N, int64_t K) {
  const int64_t kc = k_block(K);
  const int64_t br = std::clamp<int64_t>((M + NT_ROWS - 1) / NT_ROWS * NT_ROWS, NT_ROWS, 64);
  const int64_t row_tasks = std::max<int64_t>(1, G * ((M + br - 1) / br));  // (at least 1: an empty call has none)
  const int64_t want = (4 * at::get_num_threads() + row_tasks - 1) / row_tasks;
  const int64_t bc = std::clamp<int64_t>(((N + want - 1) / want + NT_COLS - 1) / NT_COLS * NT_COLS, NT_COLS,
                                         NT_COLS * 16);
  return {kc, br, bc / NT_COLS};
}

template <typename T>
void run_nt(const at::Tensor& a, const at::Tensor& b, at::Tensor& out, NtPlan plan) {
  const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = out.size(2);
  if (G == 0 || M == 0 || N == 0) return;  // (the task sizes below divide by these)
  const int64_t kc = plan.kc;
  const int64_t br = std::min<int64_t>(plan.rows, (M + NT_ROWS - 1) / NT_ROWS * NT_ROWS);  // rows per task
  const int64_t tm = (M + br - 1) / br;
  const int64_t bc = plan.col_blocks * NT_COLS;  // columns per task
  const int64_t tn = (N + bc - 1) / bc;
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t tasks = G * tm * tn;
  const int64_t scratch = (br / NT_ROWS) * (bc / NT_COLS) * NT_ROWS * NT_COLS * SUM_LANES;
#pragma omp parallel num_threads(team_threads())
  {
    std::vector<float> acc(scratch);
    // Task t: the row task is the fastest index, so a thread's consecutive tasks share
    // their columns of b (streamed from memory once at up to 64 rows).
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tasks; ++t) {
      const int64_t g = t / (tm * tn), rest = t % (tm * tn), tj = rest / tm, ti = rest % tm;
      nt_task<T>(pa + g * M * K, pb + g * N * K, po + g * M * N, K, N, ti * br, std::min(M, (ti + 1) * br),
                 tj * bc, std::min(N, (tj + 1) * bc), kc, acc.data());
    }
  }
}

template <typename T>
void run_nn(const at::Tensor& a, const at::Tensor& b, at::Tensor& out) {
  const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = out.size(2);
  // Tasks of 4 row blocks x 2 column blocks (attention's p v: N is the head size).
  const int64_t br = NN_ROWS * 4, bc = NN_COLS * 2;
  const int64_t tm = (M + br - 1) / br, tn = (N + bc - 1) / bc;
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t tasks = G * tm * tn;
#pragma omp parallel for schedule(static) num_threads(team_threads())
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g = t / (tm * tn), rest = t % (tm * tn), ti = rest / tn, tj = rest % tn;
    nn_task<T>(pa + g * M * K, pb + g * K * N, po + g * M * N, K, N, ti * br, std::min(M, (ti + 1) * br), tj * bc,
               std::min(N, (tj + 1) * bc));
  }
}

// plan: {kc, rows, col_blocks} for mm_nt, empty for the default; mm_nn has none.
at::Tensor launch(at::Tensor a, at::Tensor b, bool nt, const std::vector<int64_t>& plan = {}) {
  TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && a.size(0) == b.size(0), "a [G, M, K] and b [G, ., .] expected");
  TORCH_CHECK(a.scalar_type() == b.scalar_type(), "a and b must have one dtype");
  a = a.contiguous();
  b = b.contiguous();
  const int64_t N = nt ? b.size(1) : b.size(2);
  TORCH_CHECK((nt ? b.size(2) : b.size(1)) == a.size(2), "inner dimensions differ");
  auto out = at::empty({a.size(0), a.size(1), N}, a.options().dtype(at::kFloat));
  NtPlan p{};  // mm_nt's: the one given, else the default (mm_nn takes none)
  if (!plan.empty()) {
    // (cpu.matmul_nt checks a plan first and names the field; this message stays a literal, see cpu_kernels.h)
    TORCH_CHECK(plan.size() == 3 && plan[0] > 0 && plan[0] % SUM_LANES == 0 && plan[1] > 0 && plan[1] % NT_ROWS == 0 &&
                    plan[2] > 0,
                "plan: [kc (a multiple of the lanes), rows (a multiple of the register block's), col_blocks] expected");
    p = {plan[0], plan[1], plan[2]};
  } else if (nt) {
    p = default_nt_plan(a.size(0), a.size(1), N, a.size(2));
  }
  if (a.scalar_type() == at::kFloat) {
    nt ? run_nt<float>(a, b, out, p) : run_nn<float>(a, b, out);
  } else if (a.scalar_type() == at::kBFloat16) {
    nt ? run_nt<at::BFloat16>(a, b, out, p) : run_nn<at::BFloat16>(a, b, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}

}  // namespace

// a [G, M, K], b [G, N, K] -> float32 [G, M, N]
at::Tensor mm_nt(at::Tensor a, at::Tensor b) { return launch(a, b, true); }
// mm_nt with the work split given: [kc, rows, col_blocks] (the bench and the tests)
at::Tensor mm_nt_plan(at::Tensor a, at::Tensor b, std::vector<int64_t> plan) {
  return launch(a, b, true, plan);
}
// The plan mm_nt takes for a [G, M, K] @ b [G, N, K]^T at torch's thread count, and the
// partial sums of an entry and the register block: [kc, rows, col_blocks, SUM_LANES, NT_ROWS, NT_COLS]
std::vector<int64_t> nt_plan(int64_t G, int64_t M, int64_t N, int64_t K) {
  const NtPlan p = default_nt_plan(G, M, N, K);
  return {p.kc, p.rows, p.col_blocks, SUM_LANES, NT_ROWS, NT_COLS};
}
// a [G, M, K], b [G, K, N] -> float32 [G, M, N]
at::Tensor mm_nn(at::Tensor a, at::Tensor b) { return launch(a, b, false); }
