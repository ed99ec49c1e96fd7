// Fused CPU kernels of the channel-statistics norms (BN, PN-V, PN), ScaleNorm
// and RMSNorm: the contract of powernorm_fairseq/norms/kernels/contract.py.
//
// Rows are tokens (N = T * B, row r = t * B + b), columns are channels (C).
// x is read where it lies, (N, C) or (T, B, C) with any row strides (fairseq's
// residual stream is the transposed view of a (B, T, C) tensor); what the
// kernels write (y, dL/dx) is contiguous (N, C).
// Activations are bfloat16, float32 or float64, with float math for bfloat16
// (the callers upcast float16 ones). Every kernel makes one pass over its
// inputs: a row is read once, its group scaling (the released code's) is done
// per group while the group is in cache (the forward sums a row's squares in
// the loops over the row before it), and the per-channel sums a norm needs
// are accumulated on the way, per thread, and flushed into doubles every few
// rows.
// The math is documented beside the Python callers in
// powernorm_fairseq/norms/kernels/functions.py.

// The few headers it uses, not <torch/extension.h> (the whole C++ frontend):
// the build takes a third of the time.
#include <torch/csrc/utils/pybind.h>
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/EmptyTensor.h>
#include <ATen/ops/full.h>
#include <ATen/TensorOperators.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>

#include <cmath>
#include <array>
#include <cstring>
#include <numeric>
#include <set>
#include <type_traits>
#include <vector>

using at::Tensor;
namespace py = pybind11;

#include "launch.h"      // the driver launcher of the Triton kernels
#include "gpu_passes.h"  // the Triton path's plans and passes

namespace {

constexpr int64_t kGrain = 16;  // rows per task
constexpr int64_t kFlush = 32;  // rows between flushes of a thread's sums into doubles

// Per-thread sums of `width` values each: a row adds into an A-typed stage (so
// the inner loops vectorize), flushed into doubles every kFlush rows to keep
// the sums accurate; the threads' doubles are added at the end.
template <typename A>
struct Sums {
  int64_t width;
  std::vector<double> data;
  explicit Sums(int64_t w) : width(w), data(static_cast<size_t>(at::get_num_threads() * w), 0.0) {}
  double* local() { return data.data() + at::get_thread_num() * width; }
  std::vector<double> total() const {
    std::vector<double> out(width, 0.0);
    for (size_t t = 0; t < data.size() / std::max<int64_t>(width, 1); ++t)
      for (int64_t i = 0; i < width; ++i) out[i] += data[t * width + i];
    return out;
  }
};

template <typename A>
void flush(std::vector<A>& stage, double* into) {
  for (size_t i = 0; i < stage.size(); ++i) {
    into[i] += stage[i];
    stage[i] = A(0);
  }
}

// which rows are real: fairseq's (B, T) padding mask read in row order (once,
// into a flag per row: no division per row), or all of them
struct Real {
  std::vector<char> flag;  // empty: every row is real
  Real() = default;
  explicit Real(const Tensor& mask) {
    if (mask.numel() == 0) return;
    TORCH_CHECK(mask.dim() == 2 && mask.scalar_type() == at::kBool && mask.is_contiguous(),
                "mask: a contiguous (B, T) bool padding mask");
    const bool* pad = mask.data_ptr<bool>();
    const int64_t B = mask.size(0), T = mask.size(1);
    flag.resize(B * T);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t b = 0; b < B; ++b) flag[t * B + b] = !pad[b * T + t];
  }
  bool operator()(int64_t n) const { return flag.empty() || flag[n]; }
};

// the rows of x, (N, C) or (T, B, C) with unit column stride: row r = t * B + b
// starts at t * st + b * sb (offsets made once: no division per row)
template <typename T>
struct RowsOf {
  const T* p;
  std::vector<int64_t> offset;
  explicit RowsOf(const Tensor& x) : p(x.data_ptr<T>()) {
    const int64_t B = x.dim() == 3 ? x.size(1) : 1, N = x.dim() == 3 ? x.size(0) * B : x.size(0);
    const int64_t st = x.stride(0), sb = x.dim() == 3 ? x.stride(1) : 0;
    offset.resize(N);
    for (int64_t n = 0, t = 0; n < N; ++t)
      for (int64_t b = 0; b < B; ++b, ++n) offset[n] = t * st + b * sb;
  }
  const T* operator()(int64_t n) const { return p + offset[n]; }
};

int64_t rows_in(const Tensor& x) { return x.dim() == 3 ? x.size(0) * x.size(1) : x.size(0); }

// The values of a floating tensor as doubles, read where they lie (no tensor
// made: the small per-channel conversions of a call cost more than its kernel
// on small layers)
std::vector<double> doubles(const Tensor& t) {
  const Tensor c = t.contiguous();
  std::vector<double> out(c.numel());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, c.scalar_type(), "doubles", [&] {
    const scalar_t* p = c.data_ptr<scalar_t>();
    for (size_t i = 0; i < out.size(); ++i) out[i] = static_cast<double>(p[i]);
  });
  return out;
}

// t as a contiguous float64 tensor: t itself where it is one (a `to` is a dispatcher call)
Tensor as_double(const Tensor& t) {
  return t.scalar_type() == at::kDouble && t.is_contiguous() ? t : t.to(at::kDouble).contiguous();
}

// a per-channel vector as A values (zeros where absent)
template <typename A>
std::vector<A> channels(const Tensor& t, int64_t C, double times = 1.0) {
  std::vector<A> out(C, A(0));
  if (t.numel() == 0) return out;
  const std::vector<double> d = doubles(t);
  for (int64_t c = 0; c < C; ++c) out[c] = A(d[c] * times);
  return out;
}

// v as a value of dtype would hold it (float32 or float64)
double round_to(double v, at::ScalarType dtype) {
  return dtype == at::kDouble ? v : double(static_cast<float>(v));
}

// a new tensor of dtype holding v, rounded as Tensor.to rounds; a 0-dimensional one with scalar
Tensor from(const std::vector<double>& v, at::ScalarType dtype, bool scalar = false) {
  Tensor out = scalar ? at::empty({}, at::TensorOptions().dtype(dtype))
                      : at::empty({static_cast<int64_t>(v.size())}, at::TensorOptions().dtype(dtype));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dtype, "from", [&] {
    scalar_t* p = out.data_ptr<scalar_t>();
    for (size_t i = 0; i < v.size(); ++i) p[i] = static_cast<scalar_t>(v[i]);
  });
  return out;
}

// the statistics dtype of activations of type T
template <typename T>
at::ScalarType stat_dtype() {
  return std::is_same_v<T, double> ? at::kDouble : at::kFloat;
}

// Element loads and stores in the math's type A (float for bfloat16): a
// bfloat16 by its bits, rounded to nearest even with NaN kept, as c10 does,
// in plain integer steps that vectorize.
template <typename T>
inline at::opmath_type<T> val(T v) { return at::opmath_type<T>(v); }
inline float val(c10::BFloat16 v) { return c10::detail::f32_from_bits(v.x); }
template <typename T, typename A>
inline T put(A v) { return T(v); }
template <>
inline c10::BFloat16 put<c10::BFloat16, float>(float v) {
  uint32_t u;
  std::memcpy(&u, &v, sizeof u);
  const uint32_t r = (u & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;
  return c10::BFloat16(static_cast<uint16_t>(r), c10::BFloat16::from_bits());
}

// sum over c in [0, n) of f(c), as one vectorized reduction
template <typename A, typename F>
inline A reduce(int64_t n, F f) {
  A s = 0;
#pragma omp simd reduction(+ : s)
  for (int64_t c = 0; c < n; ++c) s += f(c);
  return s;
}

// a group's scale, 1 / rms, from the sum of its Cg squares
template <typename A>
inline A group_scale(A squares, int64_t Cg, double eps) {
  return A(1.0 / std::sqrt(double(squares) / Cg + eps));
}

// 1 / rms of each of G groups of a row (eps gs_eps), into r
template <typename T, typename A>
void group_scales(const T* xr, int64_t Cg, int64_t G, double eps, A* r) {
  for (int64_t g = 0; g < G; ++g) {
    const T* __restrict__ xg = xr + g * Cg;
    r[g] = group_scale(reduce<A>(Cg, [&](int64_t j) { return val(xg[j]) * val(xg[j]); }), Cg, eps);
  }
}

// Runs body(n, is_real) over the rows [begin, end), is_real a compile-time
// constant: no channel loop tests whether its row is real.
template <typename Body>
void each_row(int64_t begin, int64_t end, const Real& real, Body body) {
  for (int64_t n = begin; n < end; ++n) real(n) ? body(n, std::true_type{}) : body(n, std::false_type{});
}

// body(a) with a fact of the call known at compile time (std::true_type or std::false_type),
// so that a loop does no work that a zero would cancel
template <typename Body>
void with_fact(bool a, Body body) {
  a ? body(std::true_type{}) : body(std::false_type{});
}

// body(a, b) with two such facts
template <typename Body>
void with_facts(bool a, bool b, Body body) {
  with_fact(a, [&](auto fa) { with_fact(b, [&](auto fb) { body(fa, fb); }); });
}

// The forward's pass (contract "forward") over row n: with its group scales
// r, per group and channel y = (x * r - mean) * mul + bias and (kStats: a
// real row) the sums of d = x * r - shift and d^2. A group's scale multiplies
// the raw row in each loop, so no scaled copy is written.
template <typename T>
struct ForwardPass {
  using A = at::opmath_type<T>;
  const RowsOf<T>& xp;
  int64_t C, Cg, G, groups;
  double gs_eps;
  A* sp;    // (N, G) group scales, or null
  T* yp;    // (N, C) y, or null
  const A *mul, *add, *sub, *shift;

  // kCenter: the sums are centred (s1 and the shift; else s2 = sum xs^2); kMean: y subtracts a mean.
  // kGrouped: r holds row n's group scales, and the same loops sum the squares
  // of row `next`'s groups, whose scales go into rn: each row's scales come
  // from the pass over the row before it, not from a reduction of their own
  // that the row's work would wait for.
  template <bool kY, bool kStats, bool kCenter, bool kMean, bool kGrouped>
  void row(int64_t n, int64_t next, A* __restrict__ s1, A* __restrict__ s2, const A* r, A* rn) const {
    const T* __restrict__ xr = xp(n);
    const T* __restrict__ xn = kGrouped ? xp(next) : nullptr;
    T* __restrict__ yr = kY ? yp + n * C : nullptr;
    const A *__restrict__ mp = mul, *__restrict__ ap = add, *__restrict__ bp = sub, *__restrict__ kp = shift;
    if constexpr (kGrouped)
      for (int64_t g = 0; g < G; ++g) sp[n * G + g] = r[g];
    for (int64_t g = 0; g < groups; ++g) {
      const A rg = kGrouped ? r[g] : A(1);
      A ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) {
        const A v = val(xr[c]) * rg;
        if constexpr (kStats && kCenter) {
          const A d = v - kp[c];
          s1[c] += d;
          s2[c] += d * d;
        } else if constexpr (kStats) {
          s2[c] += v * v;
        }
        if constexpr (kY) yr[c] = put<T>((kMean ? v - bp[c] : v) * mp[c] + ap[c]);
        if constexpr (kGrouped) ss += val(xn[c]) * val(xn[c]);
      }
      if constexpr (kGrouped) rn[g] = group_scale(ss, Cg, gs_eps);
    }
  }
};

// Forward (contract "forward").
template <typename T>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& mask, int64_t G, double gs_eps,
                                 const Tensor& mean, const Tensor& inv, double inv_eps, const Tensor& weight,
                                 const Tensor& bias, bool want_y, bool want_stats, bool center) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1), Cg = G > 0 ? C / G : C, groups = std::max<int64_t>(G, 1);
  const Real real(mask);
  const RowsOf<T> xp(x);
  Tensor y = want_y ? at::empty({N, C}, x.options()) : at::empty({0}, x.options());
  Tensor scale = G > 0 ? at::empty({N, G}, x.options().dtype(stat_dtype<T>())) : at::empty({0}, x.options());
  std::vector<A> mul(C), add(C), sub(C, A(0)), shift(C, A(0));
  if (want_y) {  // y = (xs - mean) * mul + bias: centred first, which no contraction into an FMA can cancel
    std::vector<double> iv = doubles(inv);
    if (inv_eps >= 0)  // a running second moment: its scale rounded as finish_stats returns it
      for (auto& v : iv) v = round_to(1.0 / std::sqrt(v + inv_eps), inv.scalar_type());
    const std::vector<double> mv = mean.numel() ? doubles(mean) : std::vector<double>(C, 0.0);
    const std::vector<double> wv = doubles(weight), bv = doubles(bias);
    for (int64_t c = 0; c < C; ++c) {
      mul[c] = A(iv[c] * wv[c]);
      add[c] = A(bv[c]);
      sub[c] = A(mv[c]);
    }
  }
  int64_t first = 0;  // the first real row: with centring, sums of xs minus it keep the variance free of cancellation
  while (first < N && !real(first)) ++first;
  if (want_stats && center && first < N) {
    std::vector<A> r(groups, A(1));
    if (G > 0) group_scales(xp(first), Cg, G, gs_eps, r.data());
    for (int64_t c = 0; c < C; ++c) shift[c] = val(xp(first)[c]) * r[c / Cg];
  }
  int64_t count = 0;
  for (int64_t n = 0; n < N; ++n) count += real(n);
  const ForwardPass<T> pass{xp, C, Cg, G, groups, gs_eps, G > 0 ? scale.data_ptr<A>() : nullptr,
                            want_y ? y.data_ptr<T>() : nullptr, mul.data(), add.data(), sub.data(), shift.data()};
  Sums<A> sums(want_stats ? 2 * C : 0);
  with_facts(center, mean.numel() > 0, [&](auto centred, auto has_mean) {
    constexpr bool kC = decltype(centred)::value, kM = decltype(has_mean)::value;
    with_fact(G > 0, [&](auto grouped) {
      constexpr bool kG = decltype(grouped)::value;
      at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
        std::vector<A> stage(want_stats ? 2 * C : 0, A(0)), r(groups), rn(groups);
        A *s1 = stage.data(), *s2 = s1 + (want_stats ? C : 0);
        double* dst = want_stats ? sums.local() : nullptr;
        int64_t rows = 0;
        if (kG) group_scales(xp(begin), Cg, G, gs_eps, r.data());
        each_row(begin, end, real, [&](int64_t n, auto is_real) {
          constexpr bool kReal = decltype(is_real)::value;
          const int64_t next = std::min(n + 1, end - 1);
          if (want_y && want_stats) pass.template row<true, kReal, kC, kM, kG>(n, next, s1, s2, r.data(), rn.data());
          else if (want_y) pass.template row<true, false, kC, kM, kG>(n, next, s1, s2, r.data(), rn.data());
          else pass.template row<false, kReal, kC, kM, kG>(n, next, s1, s2, r.data(), rn.data());
          if (kG) r.swap(rn);
          if (want_stats && kReal && ++rows % kFlush == 0) flush(stage, dst);
        });
        if (want_stats) flush(stage, dst);
      });
    });
  });
  Tensor part = at::empty({0}, x.options().dtype(at::kDouble));
  if (want_stats) {  // (1, 3, C): count, then mean and sum of squared deviations, or 0 and the sum of xs^2
    const std::vector<double> s = sums.total();
    part = at::zeros({1, 3, C}, at::kDouble);
    double* p = part.data_ptr<double>();
    const double n = double(count), ns = std::max(n, 1.0);
    for (int64_t c = 0; c < C; ++c) {
      p[c] = n;
      if (center) {
        const double m = s[c] / ns;
        p[C + c] = double(shift[c]) + m;
        p[2 * C + c] = s[C + c] - s[c] * m;
      } else {
        p[2 * C + c] = s[C + c];
      }
    }
  }
  return {y, scale, part};
}

// The backward's pass (contract "backward") over row n, with
// xh = (xs - mean) * inv_fwd and g = gy * w (centred first: xs * inv - mean * inv
// under FMA contraction cancels badly where the variance is tiny, as for a
// single real token):
//   dL/dxs = (g - m * (A + b_scale * B * xh)) * inv_bwd,  m = 1 at real rows,
//   and at padding only if correct_pads; then back through a group's scaling r:
//   dL/dx = r * (dL/dxs - xs * mean_group(dL/dxs * xs)).
// Sums (per channel): gy * xh, gy and xh^2, over the real rows (0-2) and the padded ones (3-5).
template <typename T>
struct BackwardPass {
  using A = at::opmath_type<T>;
  RowsOf<T> xp;
  const T* gp;
  Real real;
  int64_t C, Cg, G, groups;
  const A* sp;  // (N, G) group scales, or null
  T* op;        // (N, C) dL/dx, or null
  const A *inv, *mean, *wj, *aj, *bj;
  bool correct_pads;

  // kMean: xh subtracts a mean; kA: the gradient has the exact mode's A term
  template <bool kGx, bool kSums, bool kReal, bool kMean, bool kA>
  void row(int64_t n, A* __restrict__ s) const {
    const T* __restrict__ xr = xp(n);
    const T* __restrict__ gr = gp + n * C;
    T* __restrict__ out = kGx ? op + n * C : nullptr;
    const A m = (kReal || correct_pads) ? A(1) : A(0);
    A *__restrict__ s0 = s + (kReal ? 0 : 3 * C), *__restrict__ s1 = s0 + C, *__restrict__ s2 = s0 + 2 * C;
    const A *__restrict__ mp = mean, *__restrict__ ip = inv, *__restrict__ wp = wj, *__restrict__ ap = aj,
            *__restrict__ bp = bj;
    for (int64_t g = 0; g < groups; ++g) {
      const A r = sp ? sp[n * G + g] : A(1);
#pragma omp simd
      for (int64_t c = g * Cg; c < (g + 1) * Cg; ++c) {
        const A xs = val(xr[c]) * r, xh = (kMean ? xs - mp[c] : xs) * ip[c], gc = val(gr[c]);
        if constexpr (kSums) {
          s0[c] += gc * xh;
          s1[c] += gc;
          s2[c] += xh * xh;
        }
        if constexpr (kGx) out[c] = put<T>(gc * wp[c] - m * (kA ? ap[c] + bp[c] * xh : bp[c] * xh));
      }
    }
  }

  // One row through group scaling: each group's dL/dxs and its sum of
  // dL/dxs * xs, then dL/dx = r (dL/dxs - xs mean(dL/dxs xs)), while the row
  // after next is fetched: the hardware's prefetcher loses the stream where
  // each group is read twice. Without a mean, dL/dxs is made again from the
  // group, still in cache (cheaper than storing and reloading it). With one it
  // is kept in buf: xs - mean, which cancels where the variance is tiny, could
  // round otherwise in another loop (FMA contraction).
  template <bool kSums, bool kReal, bool kMean, bool kA>
  void grouped_row(int64_t n, A* __restrict__ s, A* __restrict__ buf) const {
    const T* __restrict__ xr = xp(n);
    const T* __restrict__ gr = gp + n * C;
    const int64_t nq = std::min<int64_t>(n + 2, xp.offset.size() - 1);
    const T *xq = xp(nq), *gq = gp + nq * C;
    T* __restrict__ out = op + n * C;
    const A m = (kReal || correct_pads) ? A(1) : A(0);
    A *__restrict__ s0 = s + (kReal ? 0 : 3 * C), *__restrict__ s1 = s0 + C, *__restrict__ s2 = s0 + 2 * C;
    const A *__restrict__ mp = mean, *__restrict__ ip = inv, *__restrict__ wp = wj, *__restrict__ ap = aj,
            *__restrict__ bp = bj;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t lo = g * Cg, hi = lo + Cg;
      const A r = sp[n * G + g];
      A* __restrict__ gv = buf - lo;
      A dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = lo; c < hi; ++c) {
        const A xs = val(xr[c]) * r, xh = (kMean ? xs - mp[c] : xs) * ip[c], gc = val(gr[c]);
        if constexpr (kSums) {
          s0[c] += gc * xh;
          s1[c] += gc;
          s2[c] += xh * xh;
        }
        const A d = gc * wp[c] - m * (kA ? ap[c] + bp[c] * xh : bp[c] * xh);
        if constexpr (kMean) gv[c] = d;
        dot += d * xs;
      }
      const A k = dot / A(Cg) * r;
      for (int64_t c = lo; c < hi; c += 64 / sizeof(T)) {
        __builtin_prefetch(xq + c);
        __builtin_prefetch(gq + c);
      }
#pragma omp simd
      for (int64_t c = lo; c < hi; ++c) {
        const A xv = val(xr[c]);
        if constexpr (kMean) {
          out[c] = put<T>(r * (gv[c] - xv * k));
        } else {
          const A xs = xv * r, xh = xs * ip[c], gc = val(gr[c]);
          out[c] = put<T>(r * (gc * wp[c] - m * (kA ? ap[c] + bp[c] * xh : bp[c] * xh) - xv * k));
        }
      }
    }
  }
};

// Backward (contract "backward").
template <typename T>
std::vector<Tensor> backward_impl(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& gy,
                                  const Tensor& weight, const Tensor& mean, const Tensor& inv_fwd,
                                  const Tensor& inv_bwd, const Tensor& Ac, const Tensor& Bc, double b_scale,
                                  int64_t G, bool correct_pads, bool want_gx, bool want_sums) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1), Cg = G > 0 ? C / G : C, groups = std::max<int64_t>(G, 1);
  Tensor gx = want_gx ? at::empty({N, C}, x.options()) : at::empty({0}, x.options());
  const std::vector<A> ip = channels<A>(inv_fwd, C), mp = channels<A>(mean, C);
  std::vector<A> wj = channels<A>(weight, C), aj = channels<A>(Ac, C), bj = channels<A>(Bc, C, b_scale);
  const std::vector<A> jp = channels<A>(inv_bwd, C);
  for (int64_t c = 0; c < C; ++c) {  // the backward's scale folded into its per-channel factors
    wj[c] *= jp[c];
    aj[c] *= jp[c];
    bj[c] *= jp[c];
  }
  const BackwardPass<T> pass{RowsOf<T>(x), gy.data_ptr<T>(), Real(mask), C, Cg, G, groups,
                             G > 0 ? scale.data_ptr<A>() : nullptr, want_gx ? gx.data_ptr<T>() : nullptr,
                             ip.data(), mp.data(), wj.data(), aj.data(), bj.data(), correct_pads};
  Sums<A> sums(want_sums ? 6 * C : 0);
  with_facts(mean.numel() > 0, Ac.numel() > 0, [&](auto has_mean, auto has_a) {
    constexpr bool kM = decltype(has_mean)::value, kA = decltype(has_a)::value;
    at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
      std::vector<A> stage(want_sums ? 6 * C : 0, A(0)), buf(G > 0 ? Cg : 0);
      double* dst = want_sums ? sums.local() : nullptr;
      int64_t rows = 0;
      each_row(begin, end, pass.real, [&](int64_t n, auto is_real) {
        constexpr bool kReal = decltype(is_real)::value;
        A *s = stage.data(), *b = buf.data();
        if (!want_gx) pass.template row<false, true, kReal, kM, kA>(n, s);
        else if (G > 0) want_sums ? pass.template grouped_row<true, kReal, kM, kA>(n, s, b)
                                  : pass.template grouped_row<false, kReal, kM, kA>(n, s, b);
        else if (want_sums) pass.template row<true, true, kReal, kM, kA>(n, s);
        else pass.template row<true, false, kReal, kM, kA>(n, s);
        if (want_sums && ++rows % kFlush == 0) flush(stage, dst);
      });
      if (want_sums) flush(stage, dst);
    });
  });
  Tensor part = at::empty({0}, x.options().dtype(at::kDouble));
  if (want_sums) {  // (1, 5, C): gy*xh and gy over every row, gy*xh and xh^2 over real rows, xh^2 over every row
    const std::vector<double> s = sums.total();
    part = at::empty({1, 5, C}, at::kDouble);
    double* p = part.data_ptr<double>();
    for (int64_t c = 0; c < C; ++c) {
      p[c] = s[c] + s[3 * C + c];
      p[C + c] = s[C + c] + s[4 * C + c];
      p[2 * C + c] = s[c];
      p[3 * C + c] = s[2 * C + c];
      p[4 * C + c] = s[2 * C + c] + s[5 * C + c];
    }
  }
  return {gx, part};
}

// contract.py's Update and Mode, value for value (a test reads them here)
enum Update : int64_t { BN = 0, PN_V = 1, PN_WARM = 2, PN = 3, REFERENCE_WARM = 4, REFERENCE_RUN = 5 };
enum Mode : int64_t { EXACT = 0, PAPER = 1, REFERENCE = 2, FIXED = 3 };

// v written into t (a per-channel buffer), as Tensor.copy_ rounds: in place
// where t is a contiguous float32 or float64 tensor on the CPU
void store(const std::vector<double>& v, const Tensor& t) {
  if (t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kDouble) {
    std::memcpy(t.data_ptr<double>(), v.data(), v.size() * sizeof(double));
  } else if (t.is_cpu() && t.is_contiguous() && t.scalar_type() == at::kFloat) {
    float* q = t.data_ptr<float>();
    for (size_t i = 0; i < v.size(); ++i) q[i] = static_cast<float>(v[i]);
  } else {
    t.copy_(from(v, t.scalar_type()));
  }
}

// Contract "finish_stats": the batch's statistics from forward's part (P, 3, C)
// added in order, and the running statistics' update (an Update), all
// channels or none: a batch of padding or a non-finite statistic leaves them.
// Each step is a loop of its own over the channels, so that each vectorizes.
std::vector<Tensor> finish_stats(const Tensor& part, const Tensor& mean_buf, const Tensor& second_buf,
                                 const Tensor& steps, int64_t update, double momentum, double eps, int64_t warmup) {
  TORCH_CHECK(update >= BN && update <= REFERENCE_RUN, "unknown update ", update, " (contract.py's Update: 0 to 5)");
  const Tensor pt = as_double(part);
  const int64_t P = pt.size(0), C = pt.size(2);
  const double* p = pt.data_ptr<double>();
  const bool bn = update == BN;
  const auto sd = second_buf.scalar_type();
  double n = 0;
  for (int64_t i = 0; i < P; ++i) n += p[i * 3 * C];
  const double ns = std::max(n, 1.0);
  const bool real = n > 0;
  const double k = steps.numel() ? double(steps.data_ptr<int64_t>()[0]) + 1 : 1.0;
  const std::vector<double> old = doubles(second_buf), old_mean = bn ? doubles(mean_buf) : std::vector<double>();
  std::vector<double> mean(C, 0.0), second(C, 0.0), inv(C), inv_batch(C), next(C), next_mean(bn ? C : 0);
  if (bn) {  // Chan et al.'s pairwise formula: each part's M2 plus its mean's spread; parts added in order
    for (int64_t i = 0; i < P; ++i) {
      const double *cnt = p + i * 3 * C, *mu = cnt + C;
      for (int64_t c = 0; c < C; ++c) mean[c] += cnt[c] * mu[c];
    }
    for (int64_t c = 0; c < C; ++c) mean[c] = mean[c] / ns;
    for (int64_t i = 0; i < P; ++i) {
      const double *cnt = p + i * 3 * C, *mu = cnt + C, *m2 = mu + C;
      for (int64_t c = 0; c < C; ++c) {
        const double dm = mu[c] - mean[c];
        second[c] += m2[c] + cnt[c] * dm * dm;
      }
    }
    for (int64_t c = 0; c < C; ++c) second[c] = std::max(second[c] / ns, 0.0);
    for (int64_t c = 0; c < C; ++c) next_mean[c] = old_mean[c] + momentum * (mean[c] - old_mean[c]);
  } else {
    for (int64_t i = 0; i < P; ++i) {
      const double* m2 = p + (i * 3 + 2) * C;
      for (int64_t c = 0; c < C; ++c) second[c] += m2[c];
    }
    for (int64_t c = 0; c < C; ++c) second[c] = second[c] / ns;
  }
  bool finite = true;
  for (int64_t c = 0; c < C; ++c) finite &= std::isfinite(second[c]) && (!bn || std::isfinite(mean[c]));
  switch (update) {
    case BN:
      for (int64_t c = 0; c < C; ++c)
        next[c] = n > 1 ? old[c] + momentum * (second[c] * n / std::max(n - 1, 1.0) - old[c]) : old[c];
      break;
    case PN_V:
    case PN:  // Algorithm 2: psi_t^2 = alpha psi_{t-1}^2 + (1 - alpha) psi_B^2
      for (int64_t c = 0; c < C; ++c) next[c] = old[c] + momentum * (second[c] - old[c]);
      break;
    case PN_WARM:  // cumulative mean
      for (int64_t c = 0; c < C; ++c) next[c] = old[c] * ((k - 1) / k) + second[c] / k;
      break;
    case REFERENCE_WARM:
    case REFERENCE_RUN:  // the released code's: a cumulative mean before its warmup ends, an EMA on top
      for (int64_t c = 0; c < C; ++c) {
        const double cm = k < warmup ? old[c] * ((k - 1) / k) + second[c] / k : old[c];
        next[c] = cm + momentum * (second[c] - cm);
      }
      break;
    default:
      TORCH_CHECK(false, "finish_stats: unknown update ", update);
  }
  const bool running = update == PN || update == REFERENCE_RUN;
  for (int64_t c = 0; c < C; ++c) inv[c] = 1.0 / std::sqrt(old[c] + eps);  // the running scale
  if (real)
    for (int64_t c = 0; c < C; ++c) inv_batch[c] = 1.0 / std::sqrt(second[c] + eps);
  else
    inv_batch = inv;
  if (!running) inv = inv_batch;
  if (bn && !real) mean = old_mean;
  if (real && finite) {
    store(next, second_buf);
    if (bn) store(next_mean, mean_buf);
  }
  if (steps.numel() && real) steps.data_ptr<int64_t>()[0] += 1;
  return {bn ? from(mean, sd) : at::empty({0}, second_buf.options()), from(inv, sd), from(inv_batch, sd),
          at::full({1}, n, at::kDouble)};
}

// Contract "finish_backward": from backward's part (P, 5, C), the weight and
// bias gradients, the exact gradient's A and B, and nu's update.
std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, const Tensor& n_t, const Tensor& nu,
                                    double rate, int64_t kind, bool center, int64_t rows) {
  TORCH_CHECK(kind >= EXACT && kind <= FIXED, "unknown mode ", kind, " (contract.py's Mode: 0 to 3)");
  const Tensor pt = as_double(part);
  const int64_t P = pt.size(0), C = pt.size(2);
  const double* p = pt.data_ptr<double>();
  std::vector<std::vector<double>> s(5, std::vector<double>(C, 0.0));
  for (int64_t i = 0; i < P; ++i)
    for (int64_t j = 0; j < 5; ++j)
      for (int64_t c = 0; c < C; ++c) s[j][c] += p[(i * 5 + j) * C + c];
  const std::vector<double> w = doubles(weight);
  const double n = as_double(n_t).data_ptr<double>()[0], ns = std::max(n, 1.0);
  const auto sd = nu.numel() ? nu.scalar_type()
                             : (weight.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  const bool exact = kind == EXACT;
  std::vector<double> a(C), b(C);
  for (int64_t c = 0; c < C; ++c) {  // means over the real tokens of sums over every position
    b[c] = w[c] * s[0][c] / ns;
    a[c] = w[c] * s[1][c] / ns;
  }
  if (nu.numel()) {
    const std::vector<double> old = doubles(nu);
    std::vector<double> next(C);
    bool ok = n > 0;
    if (kind == REFERENCE) {  // mean over every position of g' * xh, g' = g - (1 - a) nu xh
      for (int64_t c = 0; c < C; ++c) next[c] = old[c] + (w[c] * s[0][c] - rate * old[c] * s[4][c]) / double(rows);
    } else {  // Algorithm 2: Lambda_t = mean(g xh), Gamma_t = mean(xh^2) over the real tokens
      for (int64_t c = 0; c < C; ++c) {
        const double lam = w[c] * s[2][c] / ns, gam = s[3][c] / ns;
        ok &= std::isfinite(lam) && std::isfinite(gam);
        next[c] = old[c] * (1 - rate * gam) + rate * lam;
      }
    }
    if (ok) store(next, nu);
  }
  const auto wd = weight.scalar_type();
  const auto none = [&] { return at::empty({0}, at::TensorOptions().dtype(sd)); };
  return {from(s[0], wd), from(s[1], wd), exact && center ? from(a, sd) : none(), exact ? from(b, sd) : none()};
}

// The per-token norms, one row at a time: y = x * f * w with f = 1 / rms(x)
// (RMSNorm, dims = C, eps inside the root) or 1 / max(||x||, eps) (ScaleNorm,
// dims = 1, w = its scalar g). Returns {y, per-row statistic}: RMSNorm's f,
// ScaleNorm's clamped norm 1 / f.
template <typename T>
std::vector<Tensor> rows_forward(const Tensor& x, const std::vector<at::opmath_type<T>>& w, double eps,
                                 bool scalenorm) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  Tensor y = at::empty({N, C}, x.options()), stat = at::empty({N}, x.options().dtype(stat_dtype<T>()));
  const RowsOf<T> xp(x);
  T* yp = y.data_ptr<T>();
  A* st = stat.data_ptr<A>();
  const A* __restrict__ wp = w.data();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      T* __restrict__ yr = yp + n * C;
      const A ss = reduce<A>(C, [&](int64_t c) { return val(xr[c]) * val(xr[c]); });
      const double norm = scalenorm ? std::max(std::sqrt(double(ss)), eps) : 0.0;
      const A f = A(scalenorm ? 1.0 / norm : 1.0 / std::sqrt(double(ss) / C + eps));
      st[n] = scalenorm ? A(norm) : f;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = put<T>(val(xr[c]) * f * wp[c]);
    }
  });
  return {y, stat};
}

// dL/dx = f * (g - x * f^2 <g, x> / dims), g = gy * w (no correction where
// ScaleNorm's norm is clamped); and the parameter's gradient: the sum of
// <gy, x> f over rows (ScaleNorm's g), or per channel of gy * x * f (RMSNorm's w).
template <typename T>
std::vector<Tensor> rows_backward(const Tensor& x, const Tensor& stat, const Tensor& gy,
                                  const std::vector<at::opmath_type<T>>& w, double eps, bool scalenorm,
                                  at::ScalarType param_dtype) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  Tensor gx = at::empty({N, C}, x.options());
  Sums<A> sums(scalenorm ? 1 : C);
  const RowsOf<T> xp(x);
  const T* gp = gy.data_ptr<T>();
  const A *st = stat.data_ptr<A>(), *__restrict__ wp = w.data();
  T* op = gx.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<A> stage(scalenorm ? 0 : C, A(0));
    A* __restrict__ sw = stage.data();
    double* dst = sums.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      const T* __restrict__ gr = gp + n * C;
      const A* __restrict__ w1 = wp;  // a local copy: a pointer read through a capture is reloaded per element
      T* __restrict__ out = op + n * C;
      const A f = scalenorm ? A(1) / st[n] : st[n];
      A k;
      if (scalenorm) {  // one g: <gy, x> is the row's whole contribution
        const A dot = reduce<A>(C, [&](int64_t c) { return val(gr[c]) * val(xr[c]); });
        dst[0] += double(dot) * f;
        k = double(st[n]) <= eps ? A(0) : dot * w1[0] * f * f;
      } else {
        k = reduce<A>(C, [&](int64_t c) { return val(gr[c]) * w1[c] * val(xr[c]); }) * f * f / A(C);
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) sw[c] += val(gr[c]) * val(xr[c]) * f;
        if ((n - begin) % kFlush == kFlush - 1) flush(stage, dst);
      }
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = put<T>(f * (val(gr[c]) * w1[c] - val(xr[c]) * k));
    }
    flush(stage, dst);
  });
  // the parameter's gradient in its dtype, made here (a `to` or `sum` is a dispatcher call each):
  // ScaleNorm's one g as a 0-dimensional tensor, RMSNorm's per channel
  return {gx, from(sums.total(), param_dtype, scalenorm)};
}

#define DISPATCH(x, name, ...) AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, (x).scalar_type(), name, __VA_ARGS__)

void check_rows(const Tensor& x) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x must be (N, C) or (T, B, C) rows with unit column stride");
}

std::vector<Tensor> forward(const Tensor& x, const Tensor& mask, int64_t groups, double gs_eps,
                            const Tensor& mean, const Tensor& inv, double inv_eps, const Tensor& weight,
                            const Tensor& bias, bool want_y, bool want_stats, bool center) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "powernorm_forward", [&] {
    out = forward_impl<scalar_t>(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats,
                                 center);
  });
  return out;
}

std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                             const Tensor& weight, const Tensor& mean, const Tensor& inv_fwd,
                             const Tensor& inv_bwd, const Tensor& A, const Tensor& B, double b_scale,
                             int64_t groups, bool correct_pads, bool want_gx, bool want_sums) {
  check_rows(x);
  TORCH_CHECK(grad_y.is_contiguous(), "grad_y must be contiguous");
  std::vector<Tensor> out;
  DISPATCH(x, "powernorm_backward", [&] {
    out = backward_impl<scalar_t>(x, mask, scale.contiguous(), grad_y, weight, mean, inv_fwd, inv_bwd, A, B,
                                  b_scale, groups, correct_pads, want_gx, want_sums);
  });
  return out;
}

// ScaleNorm's g is read from its tensor's memory, not through an op: reading a
// value through the dispatcher would count as a host wait, and a `to` is a call
template <typename A>
std::vector<A> scalar_weight(const Tensor& scale, int64_t C) {
  TORCH_CHECK(scale.numel() == 1, "scale: one value");
  return std::vector<A>(C, A(doubles(scale)[0]));
}

std::vector<Tensor> scalenorm_forward(const Tensor& x, const Tensor& scale, double eps) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "scalenorm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    out = rows_forward<scalar_t>(x, scalar_weight<A>(scale, x.size(-1)), eps, true);
  });
  return out;
}

std::vector<Tensor> scalenorm_backward(const Tensor& x, const Tensor& norms, const Tensor& grad_y,
                                       const Tensor& scale, double eps) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "scalenorm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    out = rows_backward<scalar_t>(x, norms, grad_y.contiguous(), scalar_weight<A>(scale, x.size(-1)), eps, true,
                                  scale.scalar_type());
  });
  return out;
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "rmsnorm_forward", [&] {
    out = rows_forward<scalar_t>(x, channels<at::opmath_type<scalar_t>>(weight, x.size(-1)), eps, false);
  });
  return out;
}

std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& rstd, const Tensor& grad_y,
                                     const Tensor& weight) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "rmsnorm_backward", [&] {
    out = rows_backward<scalar_t>(x, rstd, grad_y.contiguous(), channels<at::opmath_type<scalar_t>>(weight, x.size(-1)),
                                  0.0, false, weight.scalar_type());
  });
  return out;
}

// tanh for DyT's loops: in float a rational approximation that vectorizes (std::tanh does not, and took
// 10x the rest of a step), x P(x^2) / Q(x^2) on x clamped to where tanh rounds to +-1, and x itself below
// 4e-4: within 6 ulp of tanh over every float (Eigen's generic_fast_tanh_float; torch's is within 1). In
// double (the tests' precision), std::tanh.
inline float tanh_of(float x) {
  const float c = std::min(std::max(x, -7.90531110763549805f), 7.90531110763549805f), x2 = c * c;
  float p = -2.76076847742355e-16f;
  p = p * x2 + 2.00018790482477e-13f;
  p = p * x2 - 8.60467152213735e-11f;
  p = p * x2 + 5.12229709037114e-08f;
  p = p * x2 + 1.48572235717979e-05f;
  p = p * x2 + 6.37261928875436e-04f;
  p = p * x2 + 4.89352455891786e-03f;
  float q = 1.19825839466702e-06f;
  q = q * x2 + 1.18534705686654e-04f;
  q = q * x2 + 2.26843463243900e-03f;
  q = q * x2 + 4.89352518554385e-03f;
  return std::abs(x) < 0.0004f ? x : c * p / q;
}
inline double tanh_of(double x) { return std::tanh(x); }

// DyT (Zhu et al., 2025, Eq. 1), contract "dyt_forward": y = w * tanh(a * x) + b per entry. The ticket is
// the GPU kernels' (gpu.py); none here.
template <typename T>
std::vector<Tensor> dyt_forward_impl(const Tensor& x, const Tensor& alpha, const Tensor& weight, const Tensor& bias) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  const A a = A(doubles(alpha)[0]);
  const std::vector<A> w = channels<A>(weight, C), b = channels<A>(bias, C);
  Tensor y = at::empty({N, C}, x.options());
  const RowsOf<T> xp(x);
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    const A *__restrict__ wp = w.data(), *__restrict__ bp = b.data();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      T* __restrict__ yr = yp + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = put<T>(tanh_of(a * val(xr[c])) * wp[c] + bp[c]);
    }
  });
  return {y, at::empty({0}, x.options().dtype(stat_dtype<T>()))};
}

// Contract "dyt_backward": with t = tanh(a x) and d = dy * w * (1 - t^2), dL/dx = a d, dL/da = the sum of
// d x, dL/dw = the sum over rows of dy t, dL/db = the sum over rows of dy; the sums in doubles, in order.
template <typename T>
std::vector<Tensor> dyt_backward_impl(const Tensor& x, const Tensor& gy, const Tensor& alpha, const Tensor& weight) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  const A a = A(doubles(alpha)[0]);
  const std::vector<A> w = channels<A>(weight, C);
  Tensor gx = at::empty({N, C}, x.options());
  Sums<A> sums(2 * C + 1);  // dL/dw's, dL/db's, then dL/da's
  const RowsOf<T> xp(x);
  const T* gp = gy.data_ptr<T>();
  T* op = gx.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<A> stage(2 * C, A(0));
    A *__restrict__ sw = stage.data(), *__restrict__ sb = sw + C;
    const A* __restrict__ wp = w.data();
    const A al = a;  // a local: read through the closure, it kept the loop below from vectorizing
    double* dst = sums.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      const T* __restrict__ gr = gp + n * C;
      T* __restrict__ out = op + n * C;
      A da = 0;
#pragma omp simd reduction(+ : da)
      for (int64_t c = 0; c < C; ++c) {
        const A xv = val(xr[c]), g = val(gr[c]), t = tanh_of(al * xv), d = g * wp[c] * (A(1) - t * t);
        out[c] = put<T>(al * d);
        sw[c] += g * t;
        sb[c] += g;
        da += d * xv;
      }
      dst[2 * C] += double(da);  // a row's sum, added in doubles: the rows' terms cancel
      if ((n - begin) % kFlush == kFlush - 1) flush(stage, dst);
    }
    flush(stage, dst);
  });
  const std::vector<double> s = sums.total();
  return {gx, from({s[2 * C]}, alpha.scalar_type(), true), from({s.begin(), s.begin() + C}, weight.scalar_type()),
          from({s.begin() + C, s.begin() + 2 * C}, weight.scalar_type())};
}

std::vector<Tensor> dyt_forward(const Tensor& x, const Tensor& alpha, const Tensor& weight, const Tensor& bias) {
  check_rows(x);
  TORCH_CHECK(alpha.numel() == 1, "alpha: one value");
  std::vector<Tensor> out;
  DISPATCH(x, "dyt_forward", [&] { out = dyt_forward_impl<scalar_t>(x, alpha, weight, bias); });
  return out;
}

std::vector<Tensor> dyt_backward(const Tensor& x, const Tensor& grad_y, const Tensor& alpha, const Tensor& weight,
                                 const Tensor& ticket) {
  check_rows(x);
  TORCH_CHECK(alpha.numel() == 1, "alpha: one value");
  std::vector<Tensor> out;
  DISPATCH(x, "dyt_backward", [&] { out = dyt_backward_impl<scalar_t>(x, grad_y.contiguous(), alpha, weight); });
  return out;
}

// The training step of BN, PN-V and PN as one autograd node: the calls of
// functions.py's FusedChannelNorm, mode for mode (see it for the math), made
// here so that an eager step costs one call from Python each way. (The host
// code between the kernels took longer than the kernels of a small layer.)
// Not under --norm-sync, whose all-reduces run between the calls.
//
// The passes are this file's kernels, or another backend's, bound once from
// Python (``bind_passes``: gpu.py's DIRECT, absent tensors None both ways):
// the Triton kernels' host code then runs between the same calls, and the
// step has no autograd code in Python.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// bound_as of the Triton path's passes in C++ (gpu_passes.h), once bind_gpu has bound its kernels
constexpr int64_t GPU = -2;

// the bound backends' passes, in bind_passes' order: the four channel passes (ChannelStep's), then each
// row norm's forward and backward (RowStep's, from ROWS on). Never freed: these are Python objects, and a
// static's destructor could run after the interpreter is gone.
constexpr size_t ROWS = 4;
using Bound = std::array<py::object, ROWS + 6>;
std::vector<Bound>& bound() {
  static auto* passes = new std::vector<Bound>();
  return *passes;
}

int64_t bind_passes(py::object forward, py::object finish_stats, py::object backward, py::object finish_backward,
                    py::object scalenorm_forward, py::object scalenorm_backward, py::object rmsnorm_forward,
                    py::object rmsnorm_backward, py::object dyt_forward, py::object dyt_backward) {
  bound().push_back({forward, finish_stats, backward, finish_backward, scalenorm_forward, scalenorm_backward,
                     rmsnorm_forward, rmsnorm_backward, dyt_forward, dyt_backward});
  return static_cast<int64_t>(bound().size()) - 1;
}

// -1 (this file's kernels) or an index bind_passes gave
void check_bound(int64_t bound_as) {
  TORCH_CHECK((bound_as >= -1 || (bound_as == GPU && !launch::registry().kernels.empty())) &&
                  bound_as < static_cast<int64_t>(bound().size()),
              "no passes bound as ", bound_as);
}

// the C++ passes' results, absent ones (undefined) as `none`
std::vector<Tensor> filled(std::vector<Tensor> results, const Tensor& none) {
  for (auto& t : results)
    if (!t.defined()) t = none;
  return results;
}

// an absent tensor (empty here) as the bound passes take it, None
py::object given(const Tensor& t) { return t.numel() ? py::cast(t) : py::none(); }

// the bound passes' results, None as `none`
std::vector<Tensor> taken(const py::handle& results, const Tensor& none) {
  std::vector<Tensor> out;
  for (const auto& r : results) out.push_back(r.is_none() ? none : r.cast<Tensor>());
  return out;
}

// The contract's four channel passes, this file's (-1) or bound ones (their index).
struct Passes {
  int64_t bound_as;
  Tensor none;

  std::vector<Tensor> forward(const Tensor& x, const Tensor& mask, int64_t groups, double gs_eps,
                              const Tensor& mean, const Tensor& inv, double inv_eps, const Tensor& weight,
                              const Tensor& bias, bool want_y, bool want_stats, bool center) const {
    if (bound_as == GPU)
      return filled(gpu::forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats,
                                 center), none);
    if (bound_as < 0)
      return ::forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, bias, want_y, want_stats, center);
    py::gil_scoped_acquire gil;
    return taken(bound()[bound_as][0](x, given(mask), groups, gs_eps, given(mean), given(inv), inv_eps,
                                      given(weight), given(bias), want_y, want_stats, center), none);
  }

  std::vector<Tensor> finish_stats(const Tensor& part, const Tensor& mean_buf, const Tensor& second_buf,
                                   const Tensor& steps, int64_t update, double momentum, double eps,
                                   int64_t warmup) const {
    if (bound_as == GPU)
      return filled(gpu::finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup), none);
    if (bound_as < 0) return ::finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup);
    py::gil_scoped_acquire gil;
    return taken(bound()[bound_as][1](part, given(mean_buf), second_buf, given(steps), update, momentum, eps,
                                      warmup), none);
  }

  std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                               const Tensor& weight, const Tensor& mean, const Tensor& inv_fwd,
                               const Tensor& inv_bwd, const Tensor& A, const Tensor& B, double b_scale,
                               int64_t groups, bool correct_pads, bool want_gx, bool want_sums) const {
    if (bound_as == GPU)
      return filled(gpu::backward(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups,
                                  correct_pads, want_gx, want_sums), none);
    if (bound_as < 0)
      return ::backward(x, mask, scale, grad_y, weight, mean, inv_fwd, inv_bwd, A, B, b_scale, groups,
                        correct_pads, want_gx, want_sums);
    py::gil_scoped_acquire gil;
    return taken(bound()[bound_as][2](x, given(mask), given(scale), grad_y, weight, given(mean), inv_fwd,
                                      given(inv_bwd), given(A), given(B), b_scale, groups, correct_pads, want_gx,
                                      want_sums), none);
  }

  std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, const Tensor& n, const Tensor& nu,
                                      double rate, int64_t kind, bool center, int64_t rows) const {
    if (bound_as == GPU) return filled(gpu::finish_backward(part, weight, n, nu, rate, kind, center, rows), none);
    if (bound_as < 0) return ::finish_backward(part, weight, n, nu, rate, kind, center, rows);
    py::gil_scoped_acquire gil;
    return taken(bound()[bound_as][3](part, weight, n, given(nu), rate, kind, center, rows), none);
  }
};

struct ChannelStep : torch::autograd::Function<ChannelStep> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask, const Tensor& weight,
                               const Tensor& bias, const Tensor& mean_buf, const Tensor& second_buf,
                               const Tensor& steps, const Tensor& nu, const Tensor& given_mean,
                               const Tensor& given_inv, double gs_eps, int64_t groups, bool center, int64_t update,
                               int64_t mode, double momentum, double eps, int64_t warmup, double rate,
                               int64_t bound_as) {
    const Tensor none = at::empty({0}, x.options());
    const Passes k{bound_as, none};
    Tensor y, scale, mean, inv, inv_batch, n;
    const auto finish = [&](const Tensor& part) {
      return k.finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup);
    };
    if (given_inv.numel()) {  // statistics fixed by the caller: one pass, which still sums the batch's
      auto f = k.forward(x, mask, groups, gs_eps, given_mean, given_inv, /*inv_eps=*/-1.0, weight, bias,
                           /*want_y=*/true, /*want_stats=*/true, center);
      y = f[0], scale = f[1];
      auto s = finish(f[2]);
      mean = given_mean, inv = given_inv, inv_batch = s[2], n = s[3];
    } else if (update == PN || update == REFERENCE_RUN) {  // the running psi^2_{t-1}: one pass
      auto f = k.forward(x, mask, groups, gs_eps, none, second_buf, /*inv_eps=*/eps, weight, bias,
                           /*want_y=*/true, /*want_stats=*/true, /*center=*/false);
      y = f[0], scale = f[1];
      auto s = finish(f[2]);
      mean = s[0], inv = s[1], inv_batch = s[2], n = s[3];
    } else {  // the batch's statistics, then normalising
      auto s = finish(k.forward(x, mask, groups, gs_eps, none, none, /*inv_eps=*/-1.0, none, none,
                                  /*want_y=*/false, /*want_stats=*/true, center)[2]);
      mean = s[0], inv = s[1], inv_batch = s[2], n = s[3];
      auto f = k.forward(x, mask, groups, gs_eps, mean, inv, /*inv_eps=*/-1.0, weight, bias, /*want_y=*/true,
                           /*want_stats=*/false, /*center=*/false);
      y = f[0], scale = f[1];
    }
    ctx->save_for_backward({x, mask, scale, weight, mean, inv, inv_batch, n});
    ctx->saved_data["nu"] = nu;  // a buffer the backward updates, not a saved value
    ctx->saved_data["groups"] = groups;
    ctx->saved_data["center"] = center;
    ctx->saved_data["mode"] = mode;
    ctx->saved_data["rate"] = rate;
    ctx->saved_data["bound_as"] = bound_as;
    ctx->mark_non_differentiable({inv});
    ctx->set_materialize_grads(false);
    return {y, inv};  // (N, C): the caller's view of it is one autograd records (in-place ops on it work)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(20);
    const Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return out;
    TORCH_CHECK(!(at::GradMode::is_enabled() && grad_y.requires_grad()),
                "bn, pn-v and pn have no second derivative here (a backward with create_graph=True went through "
                "one): use ln, layernorm-simple or none for double backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &mask = saved[1], &scale = saved[2], &weight = saved[3], &mean = saved[4],
                 &inv = saved[5], &inv_batch = saved[6], &n = saved[7];
    const Tensor nu = ctx->saved_data["nu"].toTensor(), gy = grad_y.contiguous(), none = at::empty({0}, x.options());
    const int64_t groups = ctx->saved_data["groups"].toInt(), mode = ctx->saved_data["mode"].toInt();
    const bool center = ctx->saved_data["center"].toBool();
    const double rate = ctx->saved_data["rate"].toDouble();
    const Passes k{ctx->saved_data["bound_as"].toInt(), none};
    const int64_t rows = x.numel() / x.size(-1);
    Tensor grad_x;
    std::vector<Tensor> terms;
    if (mode == EXACT) {  // the batch terms of Eq. 3 / Eq. 6 first, then the gradient
      auto part = k.backward(x, mask, scale, gy, weight, mean, inv, none, none, none, /*b_scale=*/1.0, groups,
                               /*correct_pads=*/false, /*want_gx=*/false, /*want_sums=*/true)[1];
      terms = k.finish_backward(part, weight, n, nu, rate, EXACT, center, rows);
      grad_x = k.backward(x, mask, scale, gy, weight, mean, inv, inv, terms[2], terms[3], /*b_scale=*/1.0, groups,
                            /*correct_pads=*/false, /*want_gx=*/true, /*want_sums=*/false)[0];
    } else {  // B = nu_{t-1}, the released code's (1 - alpha_bwd) nu, or none (FIXED)
      const bool reference = mode == REFERENCE;
      auto b = k.backward(x, mask, scale, gy, weight, mean, inv, reference ? inv_batch : inv, none,
                            mode != FIXED ? nu : none, reference ? rate : 1.0, groups, /*correct_pads=*/reference,
                            /*want_gx=*/true, /*want_sums=*/true);
      grad_x = b[0];
      terms = k.finish_backward(b[1], weight, n, nu, rate, mode == FIXED ? PAPER : mode, center, rows);
    }
    out[0] = grad_x.view(x.sizes()), out[2] = terms[0], out[3] = terms[1];
    return out;
  }
};

// Absent tensors come as None (one empty tensor stands for them here): making
// them in Python cost more than this call's host code. x is taken at any
// strides, its channels made adjacent here where they are not (functions.py's
// rows), and the mask made contiguous: each is a call less in Python.
// ``bound_as``: the passes, this file's (-1) or a bound backend's.
variable_list channel_step(const Tensor& x, const std::optional<Tensor>& mask, const Tensor& weight,
                           const Tensor& bias, const std::optional<Tensor>& mean_buf, const Tensor& second_buf,
                           const std::optional<Tensor>& steps, const std::optional<Tensor>& nu,
                           const std::optional<Tensor>& given_mean, const std::optional<Tensor>& given_inv,
                           double gs_eps, int64_t groups, bool center, int64_t update, int64_t mode, double momentum,
                           double eps, int64_t warmup, double rate, int64_t bound_as) {
  TORCH_CHECK(mode >= EXACT && mode <= FIXED, "unknown mode ", mode, " (contract.py's Mode: 0 to 3)");
  check_bound(bound_as);
  const Tensor empty = at::empty({0}, x.options());
  const auto or_empty = [&](const std::optional<Tensor>& t) { return t ? *t : empty; };
  auto out = ChannelStep::apply(x.stride(-1) == 1 ? x : x.contiguous(), mask ? mask->contiguous() : empty, weight,
                                bias, or_empty(mean_buf), second_buf, or_empty(steps), or_empty(nu),
                                or_empty(given_mean), or_empty(given_inv), gs_eps, groups, center, update, mode,
                                momentum, eps, warmup, rate, bound_as);
  out[0] = out[0].view(x.sizes());  // a view autograd records, not one made inside the node
  return out;
}

// The per-row and per-entry norms (ScaleNorm, RMSNorm, DyT) as one autograd
// node each way, as ChannelStep is for the channel norms: the contract's two
// calls of functions.py's FusedScaleNorm, FusedRMSNorm and FusedDyT, on this
// file's kernels or a bound backend's (``bind_passes``).
enum RowKind : int64_t { SCALENORM = 0, RMSNORM = 1, DYT = 2 };

// {y, the statistic the backward reads}: ScaleNorm's p = (g), RMSNorm's (weight), DyT's (alpha, weight, bias)
std::vector<Tensor> row_forward(int64_t kind, const Tensor& x, const Tensor& p0, const Tensor& p1, const Tensor& p2,
                                double eps, int64_t bound_as) {
  if (bound_as == GPU)
    return kind == SCALENORM ? gpu::scalenorm_forward(x, p0, eps)
           : kind == RMSNORM ? gpu::rmsnorm_forward(x, p0, eps)
                             : gpu::dyt_forward(x, p0, p1, p2);
  if (bound_as >= 0) {
    py::gil_scoped_acquire gil;
    const py::object& f = bound()[bound_as][ROWS + 2 * kind];
    return taken(kind == DYT ? f(x, p0, p1, p2) : f(x, p0, eps), Tensor());
  }
  return kind == SCALENORM ? scalenorm_forward(x, p0, eps)
         : kind == RMSNORM ? rmsnorm_forward(x, p0, eps)
                           : dyt_forward(x, p0, p1, p2);
}

// the gradients of x and of each parameter
std::vector<Tensor> row_backward(int64_t kind, const Tensor& x, const Tensor& stat, const Tensor& gy, const Tensor& p0,
                                 const Tensor& p1, double eps, int64_t bound_as) {
  if (bound_as == GPU)
    return kind == SCALENORM ? gpu::scalenorm_backward(x, stat, gy, p0, eps)
           : kind == RMSNORM ? gpu::rmsnorm_backward(x, stat, gy, p0)
                             : gpu::dyt_backward(x, gy, p0, p1, stat);
  if (bound_as >= 0) {
    py::gil_scoped_acquire gil;
    const py::object& f = bound()[bound_as][ROWS + 2 * kind + 1];
    return taken(kind == SCALENORM ? f(x, stat, gy, p0, eps)
                 : kind == RMSNORM ? f(x, stat, gy, p0)
                                   : f(x, gy, p0, p1, stat), Tensor());
  }
  return kind == SCALENORM ? scalenorm_backward(x, stat, gy, p0, eps)
         : kind == RMSNORM ? rmsnorm_backward(x, stat, gy, p0)
                           : dyt_backward(x, gy, p0, p1, stat);
}

struct RowStep : torch::autograd::Function<RowStep> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& p0, const Tensor& p1, const Tensor& p2,
                        int64_t kind, double eps, int64_t bound_as) {
    auto f = row_forward(kind, x, p0, p1, p2, eps, bound_as);
    ctx->save_for_backward({x, f[1], p0, p1});
    ctx->saved_data["kind"] = kind;
    ctx->saved_data["eps"] = eps;
    ctx->saved_data["bound_as"] = bound_as;
    return f[0];  // (N, C), as ChannelStep's y
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &stat = saved[1], &p0 = saved[2], &p1 = saved[3], &gy = grads[0];
    const int64_t kind = ctx->saved_data["kind"].toInt();
    variable_list out(7);
    if (at::GradMode::is_enabled() && gy.requires_grad()) {  // a graph of the gradient
      TORCH_CHECK(kind == DYT, kind == SCALENORM ? "scalenorm" : "rmsnorm",
                  " have no second derivative here (a backward with create_graph=True went through one): use "
                  "ln, layernorm-simple or none for double backward");
      // DyT's in ATen ops, which autograd differentiates again: t = tanh(alpha x), y = w t + b
      const Tensor g = gy.view(x.sizes()), t = at::tanh(p0 * x), d = g * p1 * (1 - t * t);  // y's rows as x
      std::vector<int64_t> rows(x.dim() - 1);
      std::iota(rows.begin(), rows.end(), 0);
      out[0] = d * p0, out[1] = (d * x).sum(), out[2] = (g * t).sum(rows), out[3] = g.sum(rows);
      return out;
    }
    auto g = row_backward(kind, x, stat, gy.contiguous(), p0, p1, ctx->saved_data["eps"].toDouble(),
                          ctx->saved_data["bound_as"].toInt());
    out[0] = g[0].view(x.sizes());
    for (size_t i = 1; i < g.size(); ++i) out[i] = g[i];
    return out;
  }
};

Tensor row_step(int64_t kind, const Tensor& x, const Tensor& p0, const std::optional<Tensor>& p1,
                const std::optional<Tensor>& p2, double eps, int64_t bound_as) {
  TORCH_CHECK(kind >= SCALENORM && kind <= DYT, "unknown row kind ", kind, " (0: scalenorm, 1: rmsnorm, 2: dyt)");
  check_bound(bound_as);
  const Tensor empty = at::empty({0}, x.options());
  return RowStep::apply(x.stride(-1) == 1 ? x : x.contiguous(), p0, p1 ? *p1 : empty, p2 ? *p2 : empty, kind, eps,
                        bound_as).view(x.sizes());
}

}  // namespace

#ifndef POWERNORM_SOURCE  // set by setup.py's build: which version of this file the module was built from
#define POWERNORM_SOURCE jit
#endif
#define POWERNORM_STR2(x) #x
#define POWERNORM_STR(x) POWERNORM_STR2(x)

// The argument names are the contract's (kernels/contract.py), checked when the module loads.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.attr("source") = POWERNORM_STR(POWERNORM_SOURCE);
  m.def("forward", &forward, arg("x"), arg("mask"), arg("groups"), arg("gs_eps"), arg("mean"), arg("inv"),
        arg("inv_eps"), arg("weight"), arg("bias"), arg("want_y"), arg("want_stats"), arg("center"));
  m.def("finish_stats", &finish_stats, arg("part"), arg("mean_buf"), arg("second_buf"), arg("steps"),
        arg("update"), arg("momentum"), arg("eps"), arg("warmup"));
  m.def("backward", &backward, arg("x"), arg("mask"), arg("scale"), arg("grad_y"), arg("weight"), arg("mean"),
        arg("inv_fwd"), arg("inv_bwd"), arg("A"), arg("B"), arg("b_scale"), arg("groups"), arg("correct_pads"),
        arg("want_gx"), arg("want_sums"));
  m.def("finish_backward", &finish_backward, arg("part"), arg("weight"), arg("n"), arg("nu"), arg("rate"),
        arg("kind"), arg("center"), arg("rows"));
  m.def("scalenorm_forward", &scalenorm_forward, arg("x"), arg("scale"), arg("eps"));
  m.def("scalenorm_backward", &scalenorm_backward, arg("x"), arg("norms"), arg("grad_y"), arg("scale"),
        arg("eps"));
  m.def("rmsnorm_forward", &rmsnorm_forward, arg("x"), arg("weight"), arg("eps"));
  m.def("rmsnorm_backward", &rmsnorm_backward, arg("x"), arg("rstd"), arg("grad_y"), arg("weight"));
  m.def("dyt_forward", &dyt_forward, arg("x"), arg("alpha"), arg("weight"), arg("bias"));
  m.def("dyt_backward", &dyt_backward, arg("x"), arg("grad_y"), arg("alpha"), arg("weight"), arg("ticket"));
  m.def("channel_step", &channel_step, arg("x"), arg("mask"), arg("weight"), arg("bias"), arg("mean_buf"),
        arg("second_buf"), arg("steps"), arg("nu"), arg("given_mean"), arg("given_inv"), arg("gs_eps"),
        arg("groups"), arg("center"), arg("update"), arg("mode"), arg("momentum"), arg("eps"), arg("warmup"),
        arg("rate"), arg("bound_as") = -1);
  m.def("row_step", &row_step, arg("kind"), arg("x"), arg("p0"), arg("p1"), arg("p2"), arg("eps"),
        arg("bound_as") = -1);
  m.def("bind_passes", &bind_passes, arg("forward"), arg("finish_stats"), arg("backward"), arg("finish_backward"),
        arg("scalenorm_forward"), arg("scalenorm_backward"), arg("rmsnorm_forward"), arg("rmsnorm_backward"),
        arg("dyt_forward"), arg("dyt_backward"));
  m.def("bind_gpu", [](const py::list& kernels, const py::dict& constants, py::object from_node) {
    gpu::bind(kernels, constants, std::move(from_node));
    return GPU;
  }, arg("kernels"), arg("constants"), arg("from_node"));
  m.def("compare_launches", [](bool on) { launch::registry().compare = on; }, arg("on"));
}
