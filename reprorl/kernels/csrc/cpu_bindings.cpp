// The module's Python bindings: pybind11 with torch's tensor casters, not <torch/extension.h>,
// whose whole C++ frontend is most of a build's time (cpu_tensor.h).
#include <pybind11/stl.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

// cpu_matmul.cpp
at::Tensor mm_nt(at::Tensor a, at::Tensor b);
at::Tensor mm_nt_plan(at::Tensor a, at::Tensor b, std::vector<int64_t> plan);
std::vector<int64_t> nt_plan(int64_t G, int64_t M, int64_t N, int64_t K);
at::Tensor mm_nn(at::Tensor a, at::Tensor b);

// q [B, Hq, Tq, D], k/v [B, Hkv, Tk, D], q_start [B], window (0: none) -> [B, Hq, Tq, D] (cpu_attention.cpp)
at::Tensor attention(at::Tensor q, at::Tensor k, at::Tensor v, at::Tensor q_start, double scale,
                     int64_t query_block, int64_t key_block, int64_t window);

// a [M, K] @ b [N, K]^T -> float32 [M, N] with rows as lanes, plan [kc, vecs, cols] or empty (cpu_linear.cpp)
at::Tensor mm_rows(at::Tensor a, at::Tensor b, std::vector<int64_t> plan);
std::vector<int64_t> rows_plan(int64_t M, int64_t N, int64_t K);

// cpu_math.cpp
at::Tensor portable_exp(at::Tensor x);
at::Tensor portable_log(at::Tensor x);
at::Tensor portable_sqrt(at::Tensor x);
std::vector<at::Tensor> portable_sincos(at::Tensor x);
at::Tensor portable_pow(double base, at::Tensor e);
at::Tensor portable_row_sums(at::Tensor x);
at::Tensor portable_softmax(at::Tensor x);
at::Tensor portable_log_softmax(at::Tensor x);

// cpu_optim.cpp
void adamw_step(at::Tensor p, at::Tensor g, at::Tensor m, at::Tensor v, std::vector<double> scalars);
at::Tensor chunk_sums_of_squares(at::Tensor x, int64_t width);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("mm_nt", &mm_nt, "a @ b^T, each entry one fixed sequence of fused multiply-adds");
  m.def("mm_nt_plan", &mm_nt_plan, "mm_nt with its work split given: [kc, rows, col_blocks]");
  m.def("nt_plan", &nt_plan, "mm_nt's default split and block: [kc, rows, col_blocks, SUM_LANES, NT_ROWS, NT_COLS]");
  m.def("mm_nn", &mm_nn, "a @ b, each entry one fixed sequence of fused multiply-adds");
  m.def("mm_rows", &mm_rows, "the linear's a @ b^T with rows as lanes: mm_nn's arithmetic, b in place");
  m.def("rows_plan", &rows_plan, "mm_rows's default split and block: [kc, vecs, cols, LANES, block vecs, block cols]");
  m.def("attention", &attention,
        "causal GQA attention (in a sliding window) from mm_nt, cpu_math.h's softmax and mm_nn, one parallel region");
  m.def("exp", &portable_exp, "e^x, float32 or float64, the same bits on any x86-64 CPU (cpu_math.h)");
  m.def("log", &portable_log, "log x, float32, the same bits on any x86-64 CPU (cpu_math.h)");
  m.def("sqrt", &portable_sqrt, "the IEEE square root, float32 (torch's CPU sqrt is MKL's, which differs by CPU)");
  m.def("sincos", &portable_sincos, "(sin x, cos x), float32, the same bits on any x86-64 CPU (cpu_math.h)");
  m.def("pow", &portable_pow, "base^e for a positive base, float32, the same bits on any x86-64 CPU (cpu_math.h)");
  m.def("row_sums", &portable_row_sums, "sums over the last dimension in a fixed order (cpu_math.h)");
  m.def("softmax", &portable_softmax, "softmax over the last dimension from exp and row_sums' order");
  m.def("log_softmax", &portable_log_softmax, "log-softmax over the last dimension from exp, log and row_sums' order");
  m.def("adamw_step", &adamw_step, "one AdamW step in place, each operation rounded once (optim_math.py's order)");
  m.def("chunk_sums_of_squares", &chunk_sums_of_squares, "each row's sum of squares by halving (optim_math.py)");
}
