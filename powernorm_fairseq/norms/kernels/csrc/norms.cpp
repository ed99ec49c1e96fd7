// Fused CPU kernels of the channel-statistics norms (BN, PN-V, PN) and ScaleNorm.
//
// Rows are tokens (N = T * B), columns are channels (C). `keep` holds one
// weight per row, 1 at real tokens and 0 at padding, or is empty when nothing
// is padded. Every kernel makes one pass over its inputs: a row is read once,
// its per-token work (the original code's group scaling) is done while it is in
// cache, and the per-channel sums a norm needs are accumulated on the way, in
// double, per thread. The math is documented beside the Python callers in
// powernorm_fairseq/norms/kernels/functions.py.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <vector>

using torch::Tensor;

namespace {

constexpr int64_t kGrain = 16;  // rows per task

template <typename T>
const T* ptr_or_null(const Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() : nullptr;
}

// Per-thread accumulators of `count` columns each: a row adds into a T-typed
// stage (so the inner loops vectorize), flushed into doubles every kFlush rows
// to keep the sums accurate; the threads' doubles are summed at the end.
constexpr int64_t kFlush = 32;

template <typename T>
struct Accumulators {
  int64_t width;
  std::vector<double> data;
  Accumulators(int64_t count, int64_t columns)
      : width(count * columns), data(static_cast<size_t>(at::get_num_threads() * count * columns), 0.0) {}
  double* local() { return data.data() + at::get_thread_num() * width; }
  Tensor reduce(int64_t count, int64_t columns) const {
    auto out = torch::zeros({count, columns}, torch::kFloat64);
    double* o = out.data_ptr<double>();
    for (size_t t = 0; t < data.size() / std::max<int64_t>(width, 1); ++t)
      for (int64_t i = 0; i < width; ++i) o[i] += data[t * width + i];
    return out;
  }
};

template <typename T>
void flush(std::vector<T>& stage, double* into) {
  for (size_t i = 0; i < stage.size(); ++i) {
    into[i] += stage[i];
    stage[i] = T(0);
  }
}

// zeros where an optional per-channel tensor is absent, so loops need no branch
template <typename T>
const T* or_zeros(const Tensor& t, std::vector<T>& zeros) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<T>() : zeros.data();
}

// xs = the row after group scaling (or the row itself); fills scale[g].
template <typename T>
const T* group_scaled(const T* xr, int64_t C, int64_t G, double eps, T* buf, T* scale) {
  if (G <= 0) return xr;
  const int64_t Cg = C / G;
  for (int64_t g = 0; g < G; ++g) {
    const T* __restrict__ xg = xr + g * Cg;
    T* __restrict__ out = buf + g * Cg;
    T ms = 0;
#pragma omp simd reduction(+ : ms)
    for (int64_t j = 0; j < Cg; ++j) ms += xg[j] * xg[j];
    const T r = T(1.0 / std::sqrt(double(ms) / Cg + eps));
    scale[g] = r;
#pragma omp simd
    for (int64_t j = 0; j < Cg; ++j) out[j] = xg[j] * r;
  }
  return buf;
}

// Forward: y = (xs - mean) * inv * w + b where asked, and per-channel sums of
// d and d^2 over the real tokens where asked, d = xs - shift (shift = 0 when
// absent; a sample of the batch keeps the variance free of cancellation).
// Returns {y, scale, sums (2, C)}.
template <typename T>
std::vector<Tensor> forward_impl(const Tensor& x, const Tensor& keep, int64_t G, double gs_eps,
                                 const Tensor& mean, const Tensor& inv, const Tensor& w,
                                 const Tensor& b, bool want_y, bool want_stats, const Tensor& shift) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor y = want_y ? torch::empty_like(x) : Tensor();
  Tensor scale = G > 0 ? torch::empty({N, G}, x.options()) : Tensor();
  Accumulators<T> acc(2, want_stats ? C : 0);
  std::vector<T> zeros(C, T(0)), mul(C), add(C);
  if (want_y) {  // y = xs * mul + add
    const T *mp = or_zeros<T>(mean, zeros), *ip = inv.data_ptr<T>(), *wp = w.data_ptr<T>(),
            *bp = b.data_ptr<T>();
    for (int64_t c = 0; c < C; ++c) {
      mul[c] = ip[c] * wp[c];
      add[c] = bp[c] - mp[c] * mul[c];
    }
  }
  const T *xp = x.data_ptr<T>(), *kp = ptr_or_null<T>(keep), *mulp = mul.data(), *addp = add.data();
  const T* __restrict__ kv = or_zeros<T>(shift, zeros);
  T *yp = want_y ? y.data_ptr<T>() : nullptr, *sp = G > 0 ? scale.data_ptr<T>() : nullptr;
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(C), s(want_stats ? C : 0), q(want_stats ? C : 0);
    double* dst = want_stats ? acc.local() : nullptr;
    T* __restrict__ sv = s.data();
    T* __restrict__ qv = q.data();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xs = group_scaled(xp + n * C, C, G, gs_eps, buf.data(), sp ? sp + n * G : nullptr);
      if (want_stats && (!kp || kp[n] != T(0))) {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const T d = xs[c] - kv[c];
          sv[c] += d;
          qv[c] += d * d;
        }
        if ((n - begin) % kFlush == kFlush - 1) {
          flush(s, dst);
          flush(q, dst + C);
        }
      }
      if (yp) {
        T* __restrict__ yr = yp + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) yr[c] = xs[c] * mulp[c] + addp[c];
      }
    }
    if (want_stats) {
      flush(s, dst);
      flush(q, dst + C);
    }
  });
  return {y, scale, want_stats ? acc.reduce(2, C) : Tensor()};
}

// Backward with xh = (xs - mean) * inv_fwd and g = gy * w:
//   dL/dxs = (g - m * (A + B * xh)) * inv_bwd,  m = 1 at real tokens, and at
//   padding only if correct_pads; then back through the group scaling:
//   dL/dx = r * (dL/dxs - xs * mean_group(dL/dxs * xs)).
// Per-channel sums on the way (rows 0-4): gy*xh, gy (all positions),
// g*xh and xh^2 (real tokens), xh^2 (all positions).
template <typename T>
std::vector<Tensor> backward_impl(const Tensor& x, const Tensor& keep, const Tensor& scale,
                                  const Tensor& gy, const Tensor& w, const Tensor& mean,
                                  const Tensor& inv_fwd, const Tensor& inv_bwd, const Tensor& A,
                                  const Tensor& B, int64_t G, bool correct_pads, bool want_gx,
                                  bool want_sums) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor gx = want_gx ? torch::empty_like(x) : Tensor();
  // sums of gy*xh, gy and xh^2, kept apart for real (0-2) and padded (3-5) rows
  Accumulators<T> acc(6, C);
  std::vector<T> zeros(C, T(0)), shift(C);
  const T* mp = or_zeros<T>(mean, zeros);
  const T* __restrict__ ip = inv_fwd.data_ptr<T>();
  for (int64_t c = 0; c < C; ++c) shift[c] = mp[c] * ip[c];  // xh = xs * inv - shift
  const T *xp = x.data_ptr<T>(), *kp = ptr_or_null<T>(keep), *sp = ptr_or_null<T>(scale),
          *gp = gy.data_ptr<T>();
  const T* __restrict__ wp = w.data_ptr<T>();
  const T* __restrict__ jp = or_zeros<T>(inv_bwd, zeros);
  const T* __restrict__ ap = or_zeros<T>(A, zeros);
  const T* __restrict__ bp = or_zeros<T>(B, zeros);
  const T* __restrict__ hp = shift.data();
  T* op = want_gx ? gx.data_ptr<T>() : nullptr;
  const int64_t Cg = G > 0 ? C / G : C;
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<T> buf(C), gxs(C), stage(6 * C, T(0));
    double* dst = acc.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp + n * C;
      const T* __restrict__ xs = xr;
      if (sp) {
        T* __restrict__ bv = buf.data();
        for (int64_t g = 0; g < G; ++g) {
          const T r = sp[n * G + g];
#pragma omp simd
          for (int64_t j = g * Cg; j < (g + 1) * Cg; ++j) bv[j] = xr[j] * r;
        }
        xs = bv;
      }
      const T* __restrict__ gr = gp + n * C;
      const bool real = !kp || kp[n] != T(0);
      const T m = (real || correct_pads) ? T(1) : T(0);
      T* __restrict__ s0 = stage.data() + (real ? 0 : 3 * C);
      T* __restrict__ s1 = s0 + C;
      T* __restrict__ s2 = s1 + C;
      if (op && !want_sums) {  // the second pass of an exact gradient: the sums are known
        T* __restrict__ gv = sp ? gxs.data() : op + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const T xh = xs[c] * ip[c] - hp[c];
          gv[c] = (gr[c] * wp[c] - m * (ap[c] + bp[c] * xh)) * jp[c];
        }
      } else if (op) {
        T* __restrict__ gv = sp ? gxs.data() : op + n * C;
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const T xh = xs[c] * ip[c] - hp[c];
          s0[c] += gr[c] * xh;
          s1[c] += gr[c];
          s2[c] += xh * xh;
          gv[c] = (gr[c] * wp[c] - m * (ap[c] + bp[c] * xh)) * jp[c];
        }
      } else {
#pragma omp simd
        for (int64_t c = 0; c < C; ++c) {
          const T xh = xs[c] * ip[c] - hp[c];
          s0[c] += gr[c] * xh;
          s1[c] += gr[c];
          s2[c] += xh * xh;
        }
      }
      if ((n - begin) % kFlush == kFlush - 1) flush(stage, dst);
      if (!op || !sp) continue;
      // back through the group scaling, the row still in cache
      const T* __restrict__ gv = gxs.data();
      T* __restrict__ out = op + n * C;
      for (int64_t g = 0; g < G; ++g) {
        const int64_t lo = g * Cg;
        T dot = 0;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = lo; j < lo + Cg; ++j) dot += gv[j] * xs[j];
        const T mdot = dot / T(Cg), r = sp[n * G + g];
#pragma omp simd
        for (int64_t j = lo; j < lo + Cg; ++j) out[j] = r * (gv[j] - xs[j] * mdot);
      }
    }
    flush(stage, dst);
  });
  // rows: gy*xh and gy over all positions, gy*xh and xh^2 over real tokens, xh^2 over all
  Tensor s = acc.reduce(6, C), out = torch::empty({5, C}, torch::kFloat64);
  out[0] = s[0] + s[3];
  out[1] = s[1] + s[4];
  out[2] = s[0];
  out[3] = s[2];
  out[4] = s[2] + s[5];
  return {gx, out};
}

// ScaleNorm: y = g * x / max(||x||, eps) per row; returns {y, norms}.
template <typename T>
std::vector<Tensor> scalenorm_forward_impl(const Tensor& x, double g, double eps) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor y = torch::empty_like(x), norms = torch::empty({N}, x.options());
  const T* xp = x.data_ptr<T>();
  T *yp = y.data_ptr<T>(), *np = norms.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp + n * C;
      T* __restrict__ yr = yp + n * C;
      T ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
      const double norm = std::max(std::sqrt(double(ss)), eps);
      np[n] = T(norm);
      const T f = T(g / norm);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * f;
    }
  });
  return {y, norms};
}

// dL/dx = g / n * (gy - xhat * <gy, xhat>) with xhat = x / n where n > eps,
// g / eps * gy where the norm is clamped; also dL/dg = sum <gy, x> / n.
template <typename T>
std::vector<Tensor> scalenorm_backward_impl(const Tensor& x, const Tensor& norms, const Tensor& gy,
                                            double g, double eps) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor gx = torch::empty_like(x);
  Accumulators<T> acc(1, 1);
  const T *xp = x.data_ptr<T>(), *np = norms.data_ptr<T>(), *gp = gy.data_ptr<T>();
  T* op = gx.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    double* s = acc.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp + n * C;
      const T* __restrict__ gr = gp + n * C;
      T* __restrict__ out = op + n * C;
      const double norm = np[n];
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; ++c) dot += gr[c] * xr[c];
      s[0] += double(dot) / norm;
      const bool clamped = norm <= eps;
      const T f = T(g / norm), k = clamped ? T(0) : T(double(dot) / (norm * norm));
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = f * (gr[c] - xr[c] * k);
    }
  });
  return {gx, acc.reduce(1, 1)};
}

// RMSNorm: y = x * r * w per row, r = 1 / sqrt(mean(x^2) + eps); returns {y, r}.
template <typename T>
std::vector<Tensor> rmsnorm_forward_impl(const Tensor& x, const Tensor& w, double eps) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor y = torch::empty_like(x), rstd = torch::empty({N}, x.options());
  const T *xp = x.data_ptr<T>(), *wp = w.data_ptr<T>();
  T *yp = y.data_ptr<T>(), *rp = rstd.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp + n * C;
      T* __restrict__ yr = yp + n * C;
      T ss = 0;
#pragma omp simd reduction(+ : ss)
      for (int64_t c = 0; c < C; ++c) ss += xr[c] * xr[c];
      const T r = T(1.0 / std::sqrt(double(ss) / C + eps));
      rp[n] = r;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = xr[c] * r * wp[c];
    }
  });
  return {y, rstd};
}

// dL/dx = r (g - xh mean(g xh)), g = gy * w, xh = x r; dL/dw = sum over rows of gy * xh.
template <typename T>
std::vector<Tensor> rmsnorm_backward_impl(const Tensor& x, const Tensor& rstd, const Tensor& gy,
                                          const Tensor& w) {
  const int64_t N = x.size(0), C = x.size(1);
  Tensor gx = torch::empty_like(x);
  Accumulators<T> acc(1, C);
  const T *xp = x.data_ptr<T>(), *rp = rstd.data_ptr<T>(), *gp = gy.data_ptr<T>(), *wp = w.data_ptr<T>();
  T* op = gx.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<T> stage(C, T(0));
    double* dst = acc.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp + n * C;
      const T* __restrict__ gr = gp + n * C;
      T* __restrict__ out = op + n * C;
      T* __restrict__ sw = stage.data();
      const T r = rp[n];
      T dot = 0;
#pragma omp simd reduction(+ : dot)
      for (int64_t c = 0; c < C; ++c) {
        const T xh = xr[c] * r;
        sw[c] += gr[c] * xh;
        dot += gr[c] * wp[c] * xh;
      }
      const T m = dot / T(C);
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) out[c] = r * (gr[c] * wp[c] - xr[c] * r * m);
      if ((n - begin) % kFlush == kFlush - 1) flush(stage, dst);
    }
    flush(stage, dst);
  });
  return {gx, acc.reduce(1, C)[0]};
}

std::vector<Tensor> forward(const Tensor& x, const Tensor& keep, int64_t G, double gs_eps,
                            const Tensor& mean, const Tensor& inv, const Tensor& w, const Tensor& b,
                            bool want_y, bool want_stats, const Tensor& shift) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (N, C) tensor");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "powernorm_forward", [&] {
    out = forward_impl<scalar_t>(x, keep, G, gs_eps, mean, inv, w, b, want_y, want_stats, shift);
  });
  return out;
}

std::vector<Tensor> backward(const Tensor& x, const Tensor& keep, const Tensor& scale,
                             const Tensor& gy, const Tensor& w, const Tensor& mean,
                             const Tensor& inv_fwd, const Tensor& inv_bwd, const Tensor& A,
                             const Tensor& B, int64_t G, bool correct_pads, bool want_gx,
                             bool want_sums) {
  TORCH_CHECK(x.is_contiguous() && gy.is_contiguous(), "x and gy must be contiguous");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "powernorm_backward", [&] {
    out = backward_impl<scalar_t>(x, keep, scale, gy, w, mean, inv_fwd, inv_bwd, A, B, G,
                                  correct_pads, want_gx, want_sums);
  });
  return out;
}

// the scale is read from the tensor's memory (a CPU tensor of x's dtype), not
// through an op: reading a value through the dispatcher would count as a wait
std::vector<Tensor> scalenorm_forward(const Tensor& x, const Tensor& scale, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous (N, C) tensor");
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == x.scalar_type(), "scale: one value of x's dtype");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scalenorm_forward", [&] {
    out = scalenorm_forward_impl<scalar_t>(x, double(*scale.data_ptr<scalar_t>()), eps);
  });
  return out;
}

std::vector<Tensor> scalenorm_backward(const Tensor& x, const Tensor& norms, const Tensor& gy,
                                       const Tensor& scale, double eps) {
  TORCH_CHECK(scale.numel() == 1 && scale.scalar_type() == x.scalar_type(), "scale: one value of x's dtype");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "scalenorm_backward", [&] {
    out = scalenorm_backward_impl<scalar_t>(x, norms, gy, double(*scale.data_ptr<scalar_t>()), eps);
  });
  return out;
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "x: a contiguous (N, C) tensor, weight of its dtype");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rmsnorm_forward",
                             [&] { out = rmsnorm_forward_impl<scalar_t>(x, w.contiguous(), eps); });
  return out;
}

std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& rstd, const Tensor& gy, const Tensor& w) {
  TORCH_CHECK(x.is_contiguous() && gy.is_contiguous(), "x and gy must be contiguous");
  std::vector<Tensor> out;
  AT_DISPATCH_FLOATING_TYPES(x.scalar_type(), "rmsnorm_backward",
                             [&] { out = rmsnorm_backward_impl<scalar_t>(x, rstd, gy, w.contiguous()); });
  return out;
}

}  // namespace

// The argument names are the contract's (kernels/contract.py), checked when the module loads.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using pybind11::arg;
  m.def("forward", &forward, arg("x"), arg("keep"), arg("groups"), arg("gs_eps"), arg("mean"), arg("inv"),
        arg("weight"), arg("bias"), arg("want_y"), arg("want_stats"), arg("shift"));
  m.def("backward", &backward, arg("x"), arg("keep"), arg("scale"), arg("grad_y"), arg("weight"), arg("mean"),
        arg("inv_fwd"), arg("inv_bwd"), arg("A"), arg("B"), arg("groups"), arg("correct_pads"), arg("want_gx"),
        arg("want_sums"));
  m.def("scalenorm_forward", &scalenorm_forward, arg("x"), arg("scale"), arg("eps"));
  m.def("rmsnorm_forward", &rmsnorm_forward, arg("x"), arg("weight"), arg("eps"));
  m.def("rmsnorm_backward", &rmsnorm_backward, arg("x"), arg("rstd"), arg("grad_y"), arg("weight"));
  m.def("scalenorm_backward", &scalenorm_backward, arg("x"), arg("norms"), arg("grad_y"), arg("scale"),
        arg("eps"));
}
