// The CPU kernels of the per-row and per-entry norms: ScaleNorm, RMSNorm,
// DyT and Derf, one row at a time, forward and backward.
namespace {

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


// ScaleNorm's g is read from its tensor's memory, not through an op: reading a
// value through the dispatcher would count as a host wait, and a `to` is a call
template <typename A>
std::vector<A> scalar_weight(const Tensor& scale, int64_t C, double w_offset) {
  TORCH_CHECK(scale.numel() == 1, "scale: one value");
  return std::vector<A>(C, A(doubles(scale)[0] + w_offset));
}

std::vector<Tensor> scalenorm_forward(const Tensor& x, const RowParams& p, double w_offset, double eps) {  // p: g
  check_rows(x);
  const Tensor& scale = p[0];
  std::vector<Tensor> out;
  DISPATCH(x, "scalenorm_forward", [&] {
    using A = at::opmath_type<scalar_t>;
    out = rows_forward<scalar_t>(x, scalar_weight<A>(scale, x.size(-1), w_offset), eps, true);
  });
  return out;
}

std::vector<Tensor> scalenorm_backward(const Tensor& x, const Tensor& norms, const Tensor& grad_y,
                                       const RowParams& p, double w_offset, double eps) {
  check_rows(x);
  const Tensor& scale = p[0];
  std::vector<Tensor> out;
  DISPATCH(x, "scalenorm_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    out = rows_backward<scalar_t>(x, norms, grad_y.contiguous(), scalar_weight<A>(scale, x.size(-1), w_offset), eps,
                                  true, scale.scalar_type());
  });
  return out;
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const RowParams& p, double w_offset, double eps) {  // p: w
  check_rows(x);
  const Tensor& weight = p[0];
  std::vector<Tensor> out;
  DISPATCH(x, "rmsnorm_forward", [&] {
    out = rows_forward<scalar_t>(x, channels<at::opmath_type<scalar_t>>(weight, x.size(-1), 1.0, w_offset), eps,
                                 false);
  });
  return out;
}

std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& rstd, const Tensor& grad_y,
                                     const RowParams& p, double w_offset, double) {
  check_rows(x);
  const Tensor& weight = p[0];
  std::vector<Tensor> out;
  DISPATCH(x, "rmsnorm_backward", [&] {
    out = rows_backward<scalar_t>(x, rstd, grad_y.contiguous(),
                                  channels<at::opmath_type<scalar_t>>(weight, x.size(-1), 1.0, w_offset), 0.0, false,
                                  weight.scalar_type());
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

// The per-entry kinds, y = w f(a x + s) + b (DyT: f = tanh, s = 0; Derf: f = erf): contract "<kind>_forward",
// no statistic (the GPU's ticket in its place). ``f`` is the kind's float or double function.
template <typename T, typename F>
std::vector<Tensor> entry_forward_impl(const Tensor& x, double a, double sh, const Tensor& weight, double w_offset,
                                       const Tensor& bias, F f) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  const std::vector<A> w = channels<A>(weight, C, 1.0, w_offset), b = channels<A>(bias, C);
  Tensor y = at::empty({N, C}, x.options());
  const RowsOf<T> xp(x);
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    const A *__restrict__ wp = w.data(), *__restrict__ bp = b.data();
    const A al = A(a), s0 = A(sh);  // locals: read through the closure, they kept the loop from vectorizing
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      T* __restrict__ yr = yp + n * C;
#pragma omp simd
      for (int64_t c = 0; c < C; ++c) yr[c] = put<T>(f(al * val(xr[c]) + s0) * wp[c] + bp[c]);
    }
  });
  return {y, at::empty({0}, x.options().dtype(stat_dtype<T>()))};
}

// Contract "<kind>_backward": with u = a x + s, d = dy * w * f'(u), dL/dx = a d, dL/da = the sum of d x, (with
// Shift) dL/ds = the sum of d, dL/dw = the sum over rows of dy f(u), dL/db = the sum over rows of dy; the sums
// in doubles, in order. ``slope(u, &f_u)`` gives f'(u) and sets f(u), from what the two share.
template <typename T, bool Shift, typename S>
std::vector<Tensor> entry_backward_impl(const Tensor& x, const Tensor& gy, const Tensor& alpha, double sh,
                                        const Tensor& weight, double w_offset, at::ScalarType shift_dtype,
                                        S slope) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1);
  const A a = A(doubles(alpha)[0]);
  const std::vector<A> w = channels<A>(weight, C, 1.0, w_offset);
  Tensor gx = at::empty({N, C}, x.options());
  Sums<A> sums(2 * C + 2);  // dL/dw's, dL/db's, then dL/da's and dL/ds's
  const RowsOf<T> xp(x);
  const T* gp = gy.data_ptr<T>();
  T* op = gx.data_ptr<T>();
  at::parallel_for(0, N, kGrain, [&](int64_t begin, int64_t end) {
    std::vector<A> stage(2 * C, A(0));
    A *__restrict__ sw = stage.data(), *__restrict__ sb = sw + C;
    const A* __restrict__ wp = w.data();
    const A al = a, s0 = A(sh);
    double* dst = sums.local();
    for (int64_t n = begin; n < end; ++n) {
      const T* __restrict__ xr = xp(n);
      const T* __restrict__ gr = gp + n * C;
      T* __restrict__ out = op + n * C;
      A da = 0, ds = 0;
#pragma omp simd reduction(+ : da, ds)
      for (int64_t c = 0; c < C; ++c) {
        A fu;
        const A xv = val(xr[c]), g = val(gr[c]), d = g * wp[c] * slope(al * xv + s0, fu);
        out[c] = put<T>(al * d);
        sw[c] += g * fu;
        sb[c] += g;
        da += d * xv;
        if (Shift) ds += d;
      }
      dst[2 * C] += double(da);  // a row's sums, added in doubles: the rows' terms cancel
      if (Shift) dst[2 * C + 1] += double(ds);
      if ((n - begin) % kFlush == kFlush - 1) flush(stage, dst);
    }
    flush(stage, dst);
  });
  const std::vector<double> s = sums.total();
  std::vector<Tensor> grads{gx, from({s[2 * C]}, alpha.scalar_type(), true)};
  if (Shift) grads.push_back(from({s[2 * C + 1]}, shift_dtype, true));
  grads.push_back(from({s.begin(), s.begin() + C}, weight.scalar_type()));
  grads.push_back(from({s.begin() + C, s.begin() + 2 * C}, weight.scalar_type()));
  return grads;
}

// DyT (Zhu et al., 2025, Eq. 1): y = w * tanh(a * x) + b, f'(u) = 1 - tanh(u)^2
std::vector<Tensor> dyt_forward(const Tensor& x, const RowParams& p, double w_offset, double) {  // p: alpha, w, b
  check_rows(x);
  TORCH_CHECK(p[0].numel() == 1, "alpha: one value");
  std::vector<Tensor> out;
  DISPATCH(x, "dyt_forward", [&] {
    out = entry_forward_impl<scalar_t>(x, doubles(p[0])[0], 0.0, p[1], w_offset, p[2],
                                       [](auto u) { return tanh_of(u); });
  });
  return out;
}

std::vector<Tensor> dyt_backward(const Tensor& x, const Tensor&, const Tensor& grad_y, const RowParams& p,
                                 double w_offset, double) {
  check_rows(x);
  TORCH_CHECK(p[0].numel() == 1, "alpha: one value");
  std::vector<Tensor> out;
  DISPATCH(x, "dyt_backward", [&] {
    out = entry_backward_impl<scalar_t, false>(x, grad_y.contiguous(), p[0], 0.0, p[1], w_offset, p[0].scalar_type(),
                                               [](auto u, auto& t) { t = tanh_of(u); return 1 - t * t; });
  });
  return out;
}

// DyT's gradients in ATen ops, which autograd differentiates again: t = tanh(alpha x), y = w t + b
std::vector<Tensor> dyt_twice(const Tensor& x, const Tensor& grad_y, const RowParams& p) {
  const Tensor g = grad_y.view(x.sizes()), t = at::tanh(p[0] * x), d = g * p[1] * (1 - t * t);  // y's rows as x
  std::vector<int64_t> rows(x.dim() - 1);
  std::iota(rows.begin(), rows.end(), 0);
  return {d * p[0], (d * x).sum(), (g * t).sum(rows), g.sum(rows)};
}

// exp(x) of an x <= 0 for Derf's backward, in float: x = n ln2 + r (Cody and Waite's two-part ln2), e^r =
// 1 + r + r^2 P(r) (Cephes' expf polynomial without its r^7 term, under 1.3e-7 relative where |r| <=
// ln2 / 2) and 2^n in the exponent bits, written so that the loop vectorizes (std::exp does not); in
// double, std::exp.
inline float exp_of(float x) {
  x = std::max(x, -87.0f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = (x - n * 0.693359375f) - n * -2.12194440e-4f;
  float p = 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return (p * r * r + r + 1.0f) * scale;
}
inline double exp_of(double x) { return std::exp(x); }

// erf for Derf's loops, in float: x P(x^2) / Q(x^2) on x clamped to [-4, 4], where erf rounds to +-1
// (the rational approximation of Eigen's generic float erf: within 4.3e-7 of erf over every float, and as
// cheap as tanh_of); in double, std::erf.
inline float erf_of(float x) {
  const float c = std::min(std::max(x, -4.0f), 4.0f), x2 = c * c;
  float p = -2.72614225801306e-10f;
  p = p * x2 + 2.77068142495902e-08f;
  p = p * x2 - 2.10102402082508e-06f;
  p = p * x2 - 5.69250639462346e-05f;
  p = p * x2 - 7.34990630326855e-04f;
  p = p * x2 - 2.95459980854025e-03f;
  p = p * x2 - 1.60960333262415e-02f;
  float q = -1.45660718464996e-05f;
  q = q * x2 - 2.13374055278905e-04f;
  q = q * x2 - 1.68282697438203e-03f;
  q = q * x2 - 7.37332916720468e-03f;
  q = q * x2 - 1.42647390514189e-02f;
  return c * p / q;
}
inline double erf_of(double x) { return std::erf(x); }

// erf(u) beside e = exp(-u^2), which Derf's backward has anyway: in float, Abramowitz and Stegun's 7.1.26,
// 1 - t P(t) e with t = 1 / (1 + 0.3275911 |u|) (absolute error under 1.5e-7), one exp for both; in
// double, std::erf.
inline float erf_with(float u, float e) {
  const float t = 1.0f / (1.0f + 0.3275911f * std::abs(u));
  const float one_minus = t * (0.254829592f + t * (-0.284496736f + t * (1.421413741f + t * (-1.453152027f +
                                                                                            t * 1.061405429f)))) * e;
  return u < 0 ? one_minus - 1.0f : 1.0f - one_minus;
}
inline double erf_with(double u, double) { return std::erf(u); }

constexpr double kTwoOverSqrtPi = 1.12837916709551257;

// Derf ("Stronger Normalization-Free Transformers", arXiv 2512.10938): y = w * erf(a x + s) + b, f'(u) =
// (2 / sqrt(pi)) exp(-u^2), whose exp the backward's erf shares (erf_with)
// p: alpha, shift, w, b
std::vector<Tensor> derf_forward(const Tensor& x, const RowParams& p, double w_offset, double) {
  check_rows(x);
  TORCH_CHECK(p[0].numel() == 1 && p[1].numel() == 1, "alpha and shift: one value each");
  std::vector<Tensor> out;
  DISPATCH(x, "derf_forward", [&] {
    out = entry_forward_impl<scalar_t>(x, doubles(p[0])[0], doubles(p[1])[0], p[2], w_offset, p[3],
                                       [](auto u) { return erf_of(u); });
  });
  return out;
}

std::vector<Tensor> derf_backward(const Tensor& x, const Tensor&, const Tensor& grad_y, const RowParams& p,
                                  double w_offset, double) {
  check_rows(x);
  TORCH_CHECK(p[0].numel() == 1 && p[1].numel() == 1, "alpha and shift: one value each");
  std::vector<Tensor> out;
  DISPATCH(x, "derf_backward", [&] {
    using A = at::opmath_type<scalar_t>;
    out = entry_backward_impl<scalar_t, true>(x, grad_y.contiguous(), p[0], doubles(p[1])[0], p[2], w_offset,
                                              p[1].scalar_type(), [](A u, A& f) {
      const A e = exp_of(-u * u);
      f = erf_with(u, e);
      return A(kTwoOverSqrtPi) * e;
    });
  });
  return out;
}

// Derf's gradients in ATen ops, which autograd differentiates again: u = alpha x + s, y = w erf(u) + b
std::vector<Tensor> derf_twice(const Tensor& x, const Tensor& grad_y, const RowParams& p) {
  const Tensor g = grad_y.view(x.sizes()), u = p[0] * x + p[1], d = g * p[2] * (kTwoOverSqrtPi * at::exp(-u * u));
  std::vector<int64_t> rows(x.dim() - 1);
  std::iota(rows.begin(), rows.end(), 0);
  return {d * p[0], (d * x).sum(), d.sum(), (g * at::erf(u)).sum(rows), g.sum(rows)};
}

// The per-row and per-entry kinds by name (their descriptors: contract.RowKind in each kind's module)
const std::array<RowKind, 4> kRowKinds = {{{"scalenorm", 1, 0, scalenorm_forward, scalenorm_backward, nullptr},
                                           {"rmsnorm", 1, 0, rmsnorm_forward, rmsnorm_backward, nullptr},
                                           {"dyt", 2, 1, dyt_forward, dyt_backward, dyt_twice},
                                           {"derf", 3, 2, derf_forward, derf_backward, derf_twice}}};

}  // namespace
