// The CPU kernels of the channel-statistics norms (BN, PN-V, PN): the
// contract's forward, backward, finish_stats and finish_backward
// (kernels/contract.py), each one pass over its inputs.
namespace {

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
                                 double w_offset, const Tensor& bias, bool want_y, bool want_stats, bool center) {
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
      mul[c] = A(iv[c] * (wv[c] + w_offset));
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
                                  const Tensor& weight, double w_offset, const Tensor& mean, const Tensor& inv_fwd,
                                  const Tensor& inv_bwd, const Tensor& Ac, const Tensor& Bc, double b_scale,
                                  int64_t G, bool correct_pads, bool want_gx, bool want_sums) {
  using A = at::opmath_type<T>;
  const int64_t N = rows_in(x), C = x.size(-1), Cg = G > 0 ? C / G : C, groups = std::max<int64_t>(G, 1);
  Tensor gx = want_gx ? at::empty({N, C}, x.options()) : at::empty({0}, x.options());
  const std::vector<A> ip = channels<A>(inv_fwd, C), mp = channels<A>(mean, C);
  std::vector<A> wj = channels<A>(weight, C, 1.0, w_offset), aj = channels<A>(Ac, C), bj = channels<A>(Bc, C, b_scale);
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
std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, double w_offset, const Tensor& n_t,
                                    const Tensor& nu, double rate, int64_t kind, bool center, int64_t rows) {
  TORCH_CHECK(kind >= EXACT && kind <= FIXED, "unknown mode ", kind, " (contract.py's Mode: 0 to 3)");
  const Tensor pt = as_double(part);
  const int64_t P = pt.size(0), C = pt.size(2);
  const double* p = pt.data_ptr<double>();
  std::vector<std::vector<double>> s(5, std::vector<double>(C, 0.0));
  for (int64_t i = 0; i < P; ++i)
    for (int64_t j = 0; j < 5; ++j)
      for (int64_t c = 0; c < C; ++c) s[j][c] += p[(i * 5 + j) * C + c];
  std::vector<double> w = doubles(weight);
  for (auto& v : w) v += w_offset;  // a unit-offset gain's 1 + gamma
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

std::vector<Tensor> forward(const Tensor& x, const Tensor& mask, int64_t groups, double gs_eps,
                            const Tensor& mean, const Tensor& inv, double inv_eps, const Tensor& weight,
                            double w_offset, const Tensor& bias, bool want_y, bool want_stats, bool center) {
  check_rows(x);
  std::vector<Tensor> out;
  DISPATCH(x, "powernorm_forward", [&] {
    out = forward_impl<scalar_t>(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y,
                                 want_stats, center);
  });
  return out;
}

std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                             const Tensor& weight, double w_offset, const Tensor& mean, const Tensor& inv_fwd,
                             const Tensor& inv_bwd, const Tensor& A, const Tensor& B, double b_scale,
                             int64_t groups, bool correct_pads, bool want_gx, bool want_sums) {
  check_rows(x);
  TORCH_CHECK(grad_y.is_contiguous(), "grad_y must be contiguous");
  std::vector<Tensor> out;
  DISPATCH(x, "powernorm_backward", [&] {
    out = backward_impl<scalar_t>(x, mask, scale.contiguous(), grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B,
                                  b_scale, groups, correct_pads, want_gx, want_sums);
  });
  return out;
}

}  // namespace
