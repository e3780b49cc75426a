// mm_nt (the linear; a @ b^T) and mm_nn (a @ b) over threads (the kernels: cpu_kernels.h).
#include "cpu_kernels.h"

namespace {

template <typename T>
void run_nt(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out) {
  const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = out.size(2);
  if (G == 0 || M == 0 || N == 0) return;  // (the task sizes below divide by these)
  const int64_t kv = K - K % LANES;
  // k blocks of 512 (a task's 64 rows of a take 128 KiB, its columns of b fit L1/L2); a
  // short K is one block, so the lane vectors never leave registers.
  const int64_t kc = kv <= 768 ? std::max<int64_t>(kv, LANES) : 512;
  const int64_t br = std::min<int64_t>(64, (M + NT_ROWS - 1) / NT_ROWS * NT_ROWS);  // rows per task
  const int64_t tm = (M + br - 1) / br;
  // Columns per task: up to 8 register blocks, fewer when that leaves under 8 tasks a
  // thread (a decode step's few rows on 16 threads).
  const int64_t want = (8 * at::get_num_threads() + G * tm - 1) / (G * tm);
  const int64_t bc = std::clamp<int64_t>(((N + want - 1) / want + NT_COLS - 1) / NT_COLS * NT_COLS, NT_COLS,
                                         NT_COLS * 8);
  const int64_t tn = (N + bc - 1) / bc;
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t tasks = G * tm * tn;
  const int64_t scratch = (br / NT_ROWS) * (bc / NT_COLS) * NT_ROWS * NT_COLS * LANES;
#pragma omp parallel num_threads(threads_for(tasks))
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
void run_nn(const torch::Tensor& a, const torch::Tensor& b, torch::Tensor& out) {
  const int64_t G = a.size(0), M = a.size(1), K = a.size(2), N = out.size(2);
  // Tasks of 4 row blocks x 2 column blocks (attention's p v: N is the head size).
  const int64_t br = NN_ROWS * 4, bc = NN_COLS * 2;
  const int64_t tm = (M + br - 1) / br, tn = (N + bc - 1) / bc;
  const T* pa = a.data_ptr<T>();
  const T* pb = b.data_ptr<T>();
  float* po = out.data_ptr<float>();
  const int64_t tasks = G * tm * tn;
#pragma omp parallel for schedule(static) num_threads(threads_for(tasks))
  for (int64_t t = 0; t < tasks; ++t) {
    const int64_t g = t / (tm * tn), rest = t % (tm * tn), ti = rest / tn, tj = rest % tn;
    nn_task<T>(pa + g * M * K, pb + g * K * N, po + g * M * N, K, N, ti * br, std::min(M, (ti + 1) * br), tj * bc,
               std::min(N, (tj + 1) * bc));
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
    nt ? run_nt<float>(a, b, out) : run_nn<float>(a, b, out);
  } else if (a.scalar_type() == torch::kBFloat16) {
    nt ? run_nt<at::BFloat16>(a, b, out) : run_nn<at::BFloat16>(a, b, out);
  } else {
    TORCH_CHECK(false, "float32 or bfloat16 expected");
  }
  return out;
}

}  // namespace

// q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B] -> [B, Hq, Tq, D] (cpu_attention.cpp)
torch::Tensor attention(torch::Tensor q, torch::Tensor k, torch::Tensor v, torch::Tensor q_start, double scale,
                        int64_t query_block, int64_t key_block);

// a [G, M, K], b [G, N, K] -> float32 [G, M, N]
torch::Tensor mm_nt(torch::Tensor a, torch::Tensor b) { return launch(a, b, true); }
// a [G, M, K], b [G, K, N] -> float32 [G, M, N]
torch::Tensor mm_nn(torch::Tensor a, torch::Tensor b) { return launch(a, b, false); }

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm_nt", &mm_nt, "a @ b^T, each entry one fixed sequence of fused multiply-adds");
  m.def("mm_nn", &mm_nn, "a @ b, each entry one fixed sequence of fused multiply-adds");
  m.def("attention", &attention, "causal GQA attention from mm_nt, torch's softmax and mm_nn, one parallel region");
}
