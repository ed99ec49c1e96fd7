// The CPU kernels' shared parts: per-thread sums flushed into doubles, the
// real rows of a padding mask, the rows of x where they lie, element loads
// and stores in the math's type, and the dispatch over dtypes.
//
// Rows are tokens (N = T * B, row r = t * B + b), columns are channels (C).
// x is read where it lies, (N, C) or (T, B, C) with any row strides (fairseq's
// residual stream is the transposed view of a (B, T, C) tensor); what the
// kernels write (y, dL/dx) is contiguous (N, C). Activations are bfloat16,
// float32 or float64, with float math for bfloat16 (the callers upcast
// float16 ones). Every kernel makes one pass over its inputs: a row is read
// once, its group scaling (the released code's) is done per group while the
// group is in cache, and the per-channel sums a norm needs are accumulated
// on the way, per thread, and flushed into doubles every few rows.
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

// a per-channel vector as A values, (t + plus) * times (zeros where absent): ``plus`` is a unit-offset
// gain's 1, added in doubles (the contract's w_offset)
template <typename A>
std::vector<A> channels(const Tensor& t, int64_t C, double times = 1.0, double plus = 0.0) {
  std::vector<A> out(C, A(0));
  if (t.numel() == 0) return out;
  const std::vector<double> d = doubles(t);
  for (int64_t c = 0; c < C; ++c) out[c] = A((d[c] + plus) * times);
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


#define DISPATCH(x, name, ...) AT_DISPATCH_FLOATING_TYPES_AND(at::kBFloat16, (x).scalar_type(), name, __VA_ARGS__)

void check_rows(const Tensor& x) {
  TORCH_CHECK((x.dim() == 2 || x.dim() == 3) && x.stride(-1) == 1,
              "x must be (N, C) or (T, B, C) rows with unit column stride");
}

// A per-row or per-entry kind's parameters, in its descriptor's order (contract.RowKind, in the kind's
// module), undefined past its own
using RowParams = std::array<Tensor, 4>;

// A per-row or per-entry kind's passes, found by its name: {y, the statistic its backward reads}, and
// {dL/dx, one gradient per parameter}, its gain (parameter ``gain``) read as gain + w_offset; the GPU's
// (gpu_passes.h) are found by the CPU's names
struct RowKind {
  const char* name;
  int reads;  // how many of its parameters, from the first, its backward (and twice) reads: 1 to 3
  int gain;  // which parameter is its gain (contract.RowKind.gain)
  std::vector<Tensor> (*forward)(const Tensor& x, const RowParams& p, double w_offset, double eps);
  std::vector<Tensor> (*backward)(const Tensor& x, const Tensor& stat, const Tensor& grad_y, const RowParams& p,
                                  double w_offset, double eps);
  // the gradients in ATen ops, which autograd differentiates again (nullptr: first derivatives only)
  std::vector<Tensor> (*twice)(const Tensor& x, const Tensor& grad_y, const RowParams& p);
};

template <size_t K>
const RowKind* find_row_kind(const std::array<RowKind, K>& kinds, const std::string& name) {
  for (const RowKind& k : kinds)
    if (name == k.name) return &k;
  return nullptr;
}

// The row kind `name` of `kinds`, or one line naming the kinds there are
template <size_t K>
const RowKind& row_kind(const std::array<RowKind, K>& kinds, const std::string& name) {
  const RowKind* k = find_row_kind(kinds, name);
  if (k == nullptr) {
    std::string known;
    for (const RowKind& each : kinds) known += (known.empty() ? "" : ", ") + std::string(each.name);
    TORCH_CHECK(false, "unknown row kind ", name, " (the compiled module's: ", known, ")");
  }
  return *k;
}

// A list of parameters as a kind's passes take them
RowParams row_params(const std::vector<Tensor>& params) {
  TORCH_CHECK(params.size() <= 4, "a row kind takes at most 4 parameters, got ", params.size());
  RowParams p;
  for (size_t i = 0; i < params.size(); ++i) p[i] = params[i];
  return p;
}

}  // namespace
