// exp, log, pow, sin and cos, and the row reductions of softmax, log-softmax and entropy,
// written out in plain IEEE operations: the same bits on any x86-64 CPU, any instruction
// set and thread count.
//
// Why not torch's: its CPU exp, log, tanh and sqrt come from MKL's vector math (picked by
// the CPU) or the C library, and an AMD EPYC (glibc 2.36) and an Intel Xeon (glibc 2.39)
// with the same torch build give different bits for them on some arguments
// (bench/cpu_bits.py): the warm start's SiLU, then everything after it, parted there.
//
// The method: the float argument is widened to double, where the polynomial's few ulps of
// double error sit far below float's last bit, and the result is rounded to float once.
//   exp(x) = 2^k * e^r, k = round(x / ln 2), r = x - k ln 2 (ln 2 in two parts, k * hi
//            exact), e^r by its Taylor polynomial to degree 11 (|r| <= 0.35: error below
//            2e-13 relative), 2^k put together from its exponent bits;
//   log(x) = e ln 2 + log(m), x = m 2^e with m in [sqrt(1/2), sqrt(2)),
//            log(m) = 2 atanh(s), s = (m - 1) / (m + 1), |s| <= 0.172, its series to s^19;
//   pow(b, e) = e^(e log b) (b > 0: RoPE's frequencies); sin and cos: see sincos_f32.
// (glibc also takes other code for expf, logf, powf, sinf and cosf on a CPU without FMA,
// and the RoPE tables are sines and cosines: so they are these too.)
// Not correctly rounded (a result within 2e-13 of a float rounding boundary may round the
// other way than the true value would), but a function of its argument alone: every step
// is +, -, *, / or a bit operation, the module is built without fast-math or contraction,
// so a compiler's vectorisation carries the same operations lane by lane. Branch-free, so
// the loops vectorise.
//
// Row sums (softmax's denominator, log-softmax's, entropy's and the gradients'): 16 lane
// sums, lane l over the entries l, l + 16, ... in order, then the lanes added in a fixed
// tree, as mm_nt's sums (cpu_kernels.h): one AVX-512 vector, two AVX2 vectors or 16 scalars
// carry the same arithmetic. A row is one thread's from start to end.
#pragma once

#include "cpu_tensor.h"

#include <cmath>
#include <cstdint>
#include <cstring>

namespace reprorl_math {

constexpr int ROW_LANES = 16;

inline double bits_to_double(int64_t b) {
  double d;
  std::memcpy(&d, &b, sizeof d);
  return d;
}

inline int64_t double_to_bits(double d) {
  int64_t b;
  std::memcpy(&b, &d, sizeof b);
  return b;
}

// c[0] x^(N-1) + c[1] x^(N-2) + ... + c[N-1] by Horner's rule: N - 1 multiplies and adds,
// in that order (a subtraction of 1/k! is the addition of -1/k!, the same bits).
template <int N>
inline double horner(const double (&c)[N], double x) {
  double p = c[0];
  for (int i = 1; i < N; ++i) p = p * x + c[i];
  return p;
}

// e^x in double for x in [-1020 ln 2, 1020 ln 2] (the callers clamp): the core of exp.
inline double exp_core(double x) {
  constexpr double LOG2E = 0x1.71547652b82fep0;
  constexpr double LN2_HI = 0x1.62e42fee00000p-1;  // 32 significant bits: k * LN2_HI is exact
  constexpr double LN2_LO = 0x1.a39ef35793c76p-33;
  constexpr double SHIFTER = 0x1.8p52;  // adding it rounds to an integer (to nearest, ties to even)
  const double t = x * LOG2E + SHIFTER;
  const double k = t - SHIFTER;
  const int64_t ki = double_to_bits(t) - double_to_bits(SHIFTER);  // k as an integer
  const double r = (x - k * LN2_HI) - k * LN2_LO;
  constexpr double TAYLOR[] = {1.0 / 39916800.0, 1.0 / 3628800.0, 1.0 / 362880.0, 1.0 / 40320.0,  // 1/11!, ..
                               1.0 / 5040.0, 1.0 / 720.0, 1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0};
  return horner(TAYLOR, r) * bits_to_double((ki + 1023) << 52);
}

// e^x rounded to float. -inf and arguments below -110 give +0, above 89 +inf, NaN NaN.
inline float exp_f32(float x) {
  const float c = x < -110.f ? -110.f : (x > 89.f ? 89.f : x);  // NaN passes through both
  const float y = static_cast<float>(exp_core(static_cast<double>(c)));
  return x != x ? x : y;
}

// e^x in double, for the sampler's probabilities (double, as it sums them in double):
// below -708 it gives +0 (the smallest normal double is e^-708.4), above 709 +inf.
inline double exp_f64(double x) {
  const double c = x < -708.0 ? -708.0 : (x > 709.0 ? 709.0 : x);
  const double y = exp_core(c);
  return x != x ? x : (x < -708.0 ? 0.0 : (x > 709.0 ? INFINITY : y));
}

// log(d) in double for a positive normal double d (about 1e-16 relative).
inline double log_core(double d) {
  constexpr double LN2 = 0x1.62e42fefa39efp-1;
  constexpr double SQRT2 = 0x1.6a09e667f3bcdp0;
  const int64_t b = double_to_bits(d);
  int64_t e = ((b >> 52) & 0x7ff) - 1023;
  double m = bits_to_double((b & 0xfffffffffffffLL) | (int64_t(1023) << 52));  // [1, 2)
  const bool high = m > SQRT2;
  m = high ? m * 0.5 : m;
  e = high ? e + 1 : e;
  const double s = (m - 1.0) / (m + 1.0);
  const double s2 = s * s;
  constexpr double ATANH[] = {1.0 / 19.0, 1.0 / 17.0, 1.0 / 15.0, 1.0 / 13.0, 1.0 / 11.0,  // 1/(2k+1)
                              1.0 / 9.0, 1.0 / 7.0, 1.0 / 5.0, 1.0 / 3.0, 1.0};
  return static_cast<double>(e) * LN2 + 2.0 * s * horner(ATANH, s2);
}

// log(x) rounded to float: +0 and -0 give -inf, negatives NaN, +inf +inf. (Float
// subnormals are double normals.)
inline float log_f32(float x) {
  const float y = static_cast<float>(log_core(x > 0.f ? static_cast<double>(x) : 1.0));
  if (x != x || x == INFINITY) return x;
  if (x == 0.f) return -INFINITY;
  return x < 0.f ? NAN : y;
}

// base^e rounded to float for base > 0 (RoPE's inverse frequencies, theta^(-2i/d)), from
// e^(e log base) in double; other bases give NaN.
inline float pow_f32(float base, float e) {
  const double t = static_cast<double>(e) * log_core(base > 0.f ? static_cast<double>(base) : 1.0);
  const double c = t < -745.0 ? -745.0 : (t > 709.0 ? 709.0 : t);
  const float y = static_cast<float>(c < -708.0 ? 0.0 : exp_core(c));
  return base > 0.f && base != INFINITY && e == e ? y : NAN;
}

// sin and cos of x rounded to float, for |x| below about 1.6e6 (2^20 quarter turns: RoPE's
// angles are positions times frequencies <= 1): x - k pi/2 with pi/2 in three parts of 33
// bits (fdlibm's), so k times each is exact, then the Taylor polynomials on |r| <= pi/4 to
// degree 17 and 18 in double. NaN and infinities give NaN.
inline void sincos_f32(float x, float& sin_out, float& cos_out) {
  constexpr double TWO_OVER_PI = 6.36619772367581382433e-01;
  constexpr double PIO2_1 = 1.57079632673412561417e+00;
  constexpr double PIO2_2 = 6.07710050630396597660e-11;
  constexpr double PIO2_3 = 2.02226624871116645580e-21;
  constexpr double SHIFTER = 0x1.8p52;
  const bool finite = x == x && x != INFINITY && x != -INFINITY;
  const double a = finite ? static_cast<double>(x) : 0.0;
  const double t = a * TWO_OVER_PI + SHIFTER;
  const double k = t - SHIFTER;
  const int64_t quadrant = (double_to_bits(t) - double_to_bits(SHIFTER)) & 3;
  const double r = ((a - k * PIO2_1) - k * PIO2_2) - k * PIO2_3;
  const double r2 = r * r;
  // sin r = r + r^3 sp(r^2), cos r = 1 + r^2 cp(r^2): 1/17!, -1/15!, ..., -1/3! and
  // -1/18!, 1/16!, ..., -1/2.
  constexpr double SIN[] = {1.0 / 355687428096000.0, -1.0 / 1307674368000.0, 1.0 / 6227020800.0,
                            -1.0 / 39916800.0, 1.0 / 362880.0, -1.0 / 5040.0, 1.0 / 120.0, -1.0 / 6.0};
  constexpr double COS[] = {-1.0 / 6402373705728000.0, 1.0 / 20922789888000.0, -1.0 / 87178291200.0,
                            1.0 / 479001600.0, -1.0 / 3628800.0, 1.0 / 40320.0, -1.0 / 720.0, 1.0 / 24.0, -0.5};
  const double s = r + r * r2 * horner(SIN, r2);
  const double c = 1.0 + r2 * horner(COS, r2);
  const double sin_a = quadrant == 0 ? s : (quadrant == 1 ? c : (quadrant == 2 ? -s : -c));
  const double cos_a = quadrant == 0 ? c : (quadrant == 1 ? -s : (quadrant == 2 ? -c : s));
  sin_out = finite ? static_cast<float>(sin_a) : NAN;
  cos_out = finite ? static_cast<float>(cos_a) : NAN;
}

// The sum of v[0..n) (n > 0 or 0), 16 lane sums in order, then a fixed tree.
template <typename T>
inline T row_sum(const T* v, int64_t n) {
  T lanes[ROW_LANES] = {};
  int64_t i = 0;
  for (; i + ROW_LANES <= n; i += ROW_LANES)
    for (int l = 0; l < ROW_LANES; ++l) lanes[l] += v[i + l];
  for (int l = 0; i + l < n; ++l) lanes[l] += v[i + l];
  for (int w = ROW_LANES / 2; w > 0; w /= 2)
    for (int l = 0; l < w; ++l) lanes[l] += lanes[l + w];
  return lanes[0];
}

template <typename T>
inline T row_max(const T* v, int64_t n) {  // exact in any order; -inf for an empty row
  T m = -INFINITY;
  for (int64_t i = 0; i < n; ++i) m = v[i] > m ? v[i] : m;
  return m;
}

inline float exp_of(float x) { return exp_f32(x); }
inline double exp_of(double x) { return exp_f64(x); }

// softmax of one row x[0..n) into y: e^(x - max) / their sum. A row of -inf only gives NaN,
// as torch's softmax does.
template <typename T>
inline void softmax_row(const T* x, T* y, int64_t n) {
  const T m = row_max(x, n);
  for (int64_t i = 0; i < n; ++i) y[i] = exp_of(x[i] - m);
  const T total = row_sum(y, n);
  for (int64_t i = 0; i < n; ++i) y[i] = y[i] / total;
}

}  // namespace reprorl_math
