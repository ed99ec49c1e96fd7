// The Triton path's passes in C++: gpu.py's plans and passes, call for call,
// launching through launch.h. Each pass allocates what it writes and
// launches; the plan (grid, rows per program, block sizes, the variant's
// constexprs) is gpu.py's arithmetic (_layout, _plan, _row_layout), with its
// constants as gpu.py binds them (``bind_gpu``). tests/test_launches.py runs
// every step both ways under a stand-in driver and compares the launches.
namespace gpu {

using launch::Arg;

// the kernels, in bind_gpu's order
enum KernelId : int {
  CH_FWD, FIN_STATS, CH_BWD, FIN_BWD, SN_FWD, SN_BWD, RMS_FWD, RMS_BWD, DYT_FWD, DYT_BWD, SUM_COLS, KERNELS
};

// each kernel's constexprs (and launch options), in the order the passes below give them; true: a bool
const std::vector<std::pair<std::string, bool>>& constexprs_of(int kernel) {
  using V = std::vector<std::pair<std::string, bool>>;
  static const V common = {{"HAS_MASK", true}, {"GROUPED", true}, {"F64", true}, {"WIDE", true},
                           {"BLOCK_N", false}, {"BLOCK_C", false}, {"CW", false}, {"num_warps", false},
                           {"maxnreg", false}};
  static const auto with = [](V head, const V& tail) {
    head.insert(head.end(), tail.begin(), tail.end());
    return head;
  };
  static const V rows = {{"F64", true}, {"WIDE", true}, {"BLOCK_N", false}, {"BLOCK_C", false},
                         {"num_warps", false}, {"maxnreg", false}};
  static const std::array<V, KERNELS> all = {
      with({{"HAS_MEAN", true}, {"INV_RUNNING", true}, {"WANT_Y", true}, {"WANT_STATS", true}, {"CENTER", true}},
           common),
      V{{"UPDATE", false}, {"HAS_STEPS", true}, {"BLOCK_R", false}, {"BLOCK", false}, {"num_warps", false},
        {"maxnreg", false}},
      with({{"HAS_MEAN", true}, {"HAS_A", true}, {"HAS_B", true}, {"CORRECT_PADS", true}, {"WANT_GX", true},
            {"WANT_SUMS", true}}, common),
      V{{"MODE", false}, {"CENTER", true}, {"HAS_NU", true}, {"BLOCK_R", false}, {"BLOCK", false},
        {"num_warps", false}, {"maxnreg", false}},
      rows, rows, rows, with({{"SUM_HERE", true}}, rows), rows, with({{"SUM_HERE", true}}, rows), V{{"TWO", true}, {"BLOCK_R", false}, {"BLOCK", false}, {"num_warps", false},
                                       {"maxnreg", false}}};
  return all[kernel];
}

// gpu.py's constants, as bound
struct Config {
  std::array<int64_t, KERNELS> programs_per_sm{};
  int64_t warps = 4, warp = 32, registers_per_sm = 65536, tile = 1024, row_tile = 2048, widest_group = 1024,
          widest_row = 2048, sub_chunk = 1024, max_rows = 1024, finish_block = 64, sum_rows = 32;
};

Config& config() {
  static Config c;
  return c;
}

int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }
int64_t pow2(int64_t n) { return n <= 1 ? 1 : int64_t(1) << (64 - __builtin_clzll(static_cast<uint64_t>(n - 1))); }

int64_t programs_per_sm(int kernel, bool f64) {
  const int64_t p = config().programs_per_sm[kernel];
  return f64 ? std::max<int64_t>(1, p / 2) : p;
}

// gpu.registers: the registers per thread with which programs_per_sm programs are resident at once
int64_t registers(int kernel, bool f64) {
  const Config& c = config();
  return std::min<int64_t>(255, c.registers_per_sm / (programs_per_sm(kernel, f64) * c.warps * c.warp)) / 8 * 8;
}

// gpu._rows: (N, C, B, row stride of t, row stride of b) of x, unit column stride
std::array<int64_t, 5> rows_of(const Tensor& x) {
  const int64_t C = x.size(-1), N = x.numel() / C;
  if (x.dim() == 3 && !x.is_contiguous()) return {N, C, x.size(1), x.stride(0), x.stride(1)};
  return {N, C, 1, x.dim() == 2 ? x.stride(0) : C, 0};
}

bool absent(const Tensor& t) { return !t.defined() || t.numel() == 0; }
at::ScalarType acc_of(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// the argument list of one launch
struct Args {
  const launch::Target& to;
  std::vector<Arg> list = reserved();
  static std::vector<Arg> reserved() {
    std::vector<Arg> v;
    v.reserve(24);  // the most a kernel takes
    return v;
  }
  void ptr(const Tensor& t, int64_t offset = 0) { list.push_back({Arg::PTR, &t, offset, 0, 0.0}); }
  void ptr_or_none(const Tensor& t) { ptr(absent(t) ? to.nothing : t); }
  void i(int64_t v) { list.push_back({Arg::INT, nullptr, 0, v, 0.0}); }
  void f(double v) { list.push_back({Arg::FLOAT, nullptr, 0, 0, v}); }
};

// gpu._plan of a channel kernel: the grid, the integer arguments after the tensors, the common constexprs
struct ChannelPlan {
  int64_t N, C, progs, chunks;
  std::array<int64_t, 9> scalars;  // N, C, XB, XST, XSB, nb, nt, per_prog, cw
  std::vector<int64_t> constexprs;  // HAS_MASK .. maxnreg
};

ChannelPlan channel_plan(int kernel, const Tensor& x, const Tensor& mask, int64_t groups, bool tall,
                         const launch::Target& to) {
  const Config& c = config();
  const auto [N, C, XB, XST, XSB] = rows_of(x);
  const bool f64 = x.scalar_type() == at::kDouble;
  const int64_t cw = groups > 0 ? C / groups : std::min<int64_t>(pow2(C), 128);
  int64_t block_c = pow2(cw);
  if (block_c > c.widest_group) block_c = c.sub_chunk;
  const int64_t chunks = cdiv(C, cw);
  const int64_t block_n = std::max<int64_t>(1, std::min<int64_t>(32, (tall && block_c >= cw ? 2 : 1) * c.tile / block_c));
  const int64_t programs = programs_per_sm(kernel, f64) * launch::multiprocessors(to);
  const int64_t progs = std::max(cdiv(programs, chunks), cdiv(N, c.max_rows));
  const int64_t per_prog = cdiv(cdiv(N, progs), block_n) * block_n;
  const bool wide = block_c < cw, has_mask = !absent(mask);
  return {N, C, progs, chunks,
          {N, C, XB, XST, XSB, has_mask ? mask.size(0) : 1, has_mask ? mask.size(1) : 1, per_prog, cw},
          {has_mask, groups > 0, f64, wide, block_n, block_c, wide ? 0 : cw, c.warps, registers(kernel, f64)}};
}

std::vector<int64_t> joined(std::vector<int64_t> head, const std::vector<int64_t>& tail) {
  head.insert(head.end(), tail.begin(), tail.end());
  return head;
}

// A new tensor of ``dtype`` on like's device, from the device's allocator directly (as at::empty's
// kernels make theirs): no dispatcher round trip, a dozen of which a step made. CUDA's caching allocator
// allocates on the current device: the passes hold a guard of theirs.
Tensor empty(at::IntArrayRef shape, at::ScalarType dtype, const Tensor& like) {
  const auto type = like.device().type();
  return at::detail::empty_generic(shape, c10::GetAllocator(type),
                                   c10::DispatchKeySet(c10::computeDispatchKey(dtype, c10::kStrided, like.device())),
                                   dtype, std::nullopt);
}

Tensor empty(at::IntArrayRef shape, const Tensor& like) { return empty(shape, like.scalar_type(), like); }

// gpu._forward_pass: {y, group scales, part}, absent ones undefined
std::vector<Tensor> forward(const Tensor& x, const Tensor& mask, int64_t groups, double gs_eps, const Tensor& mean,
                            const Tensor& inv, double inv_eps, const Tensor& weight, const Tensor& bias, bool want_y,
                            bool want_stats, bool center) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const ChannelPlan p = channel_plan(CH_FWD, x, mask, groups, !want_y, to);
  const auto acc = acc_of(x);
  Tensor y = want_y ? empty(x.sizes(), x) : Tensor();  // x's shape: its rows, contiguous
  Tensor scale = groups > 0 ? empty({p.N, groups}, acc, x) : Tensor();
  Tensor part = want_stats ? empty({p.progs + 1, 3, p.C}, acc, x) : Tensor();
  Args a{to};
  a.ptr(x);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&mask, &mean, &inv, &weight, &bias, &y, &scale, &part}) a.ptr_or_none(*t);
  for (int64_t s : p.scalars) a.i(s);
  a.f(gs_eps), a.f(inv_eps);
  launch::run(CH_FWD, {p.progs + want_stats, p.chunks, 1}, a.list,
              joined({!absent(mean), inv_eps >= 0, want_y, want_stats, center}, p.constexprs), to);
  return {y, scale, part};
}

// gpu._finish_stats_pass: {mean (BN's), inv, inv of the batch, n}
std::vector<Tensor> finish_stats(const Tensor& part, const Tensor& mean_buf, const Tensor& second_buf,
                                 const Tensor& steps, int64_t update, double momentum, double eps, int64_t warmup) {
  const launch::Target to = launch::target_of(part);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const int64_t P = part.size(0) - 1, C = part.size(2), progs = cdiv(C, config().finish_block);
  const auto sd = second_buf.scalar_type();
  Tensor mean = update == 0 ? empty({C}, sd, part) : Tensor();  // Update.BN
  Tensor inv = empty({C}, sd, part), inv_batch = empty({C}, sd, part), n = empty({1}, at::kDouble, part);
  Tensor scratch = empty({2, C}, sd, part), flags = empty({progs}, at::kInt, part);
  Args a{to};
  a.ptr(part), a.ptr_or_none(mean_buf), a.ptr(second_buf), a.ptr_or_none(steps), a.ptr_or_none(mean);
  a.ptr(inv), a.ptr(inv_batch), a.ptr(n), a.ptr(scratch), a.ptr(flags), a.ptr(part, P * 3 * C);
  a.i(P), a.i(C), a.f(momentum), a.f(eps), a.i(warmup);
  launch::run(FIN_STATS, {progs, 1, 1}, a.list, {update, !absent(steps), config().sum_rows, config().finish_block, config().warps,
               registers(FIN_STATS, part.scalar_type() == at::kDouble)}, to);
  return {mean, inv, inv_batch, n};
}

// gpu._backward_pass: {dL/dx, part}
std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                             const Tensor& weight, const Tensor& mean, const Tensor& inv_fwd, const Tensor& inv_bwd,
                             const Tensor& A, const Tensor& B, double b_scale, int64_t groups, bool correct_pads,
                             bool want_gx, bool want_sums) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const ChannelPlan p = channel_plan(CH_BWD, x, mask, groups, /*tall=*/false, to);  // its sums pass spills when taller
  const auto acc = acc_of(x);
  const bool wide = p.constexprs[3] != 0;
  Tensor gx = want_gx ? empty(x.sizes(), x) : Tensor();
  Tensor part = want_sums ? empty({p.progs + 1, 5, p.C}, acc, x) : Tensor();
  // a wide group: each row's dot product with its group's gradient, from a first pass
  Tensor dots = wide && want_gx && groups > 0 ? empty({p.N, groups}, acc, x) : Tensor();
  Args a{to};
  a.ptr(x), a.ptr_or_none(mask), a.ptr_or_none(scale), a.ptr(grad_y), a.ptr(weight), a.ptr_or_none(mean);
  a.ptr(inv_fwd);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&inv_bwd, &A, &B, &gx, &part, &dots}) a.ptr_or_none(*t);
  for (int64_t s : p.scalars) a.i(s);
  a.f(b_scale);
  launch::run(CH_BWD, {p.progs + want_sums, p.chunks, 1}, a.list,
              joined({!absent(mean), !absent(A), !absent(B), correct_pads, want_gx, want_sums}, p.constexprs), to);
  return {gx, part};
}

// gpu._finish_backward_pass: {dL/dw, dL/db, A, B}
std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, const Tensor& n, const Tensor& nu,
                                    double rate, int64_t kind, bool center, int64_t rows) {
  const launch::Target to = launch::target_of(part);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const int64_t P = part.size(0) - 1, C = part.size(2), progs = cdiv(C, config().finish_block);
  const bool has_nu = !absent(nu), exact = kind == 0;  // Mode.EXACT
  const auto sd = has_nu ? nu.scalar_type() : acc_of(part);
  Tensor grad_w = empty(weight.sizes(), weight), grad_b = empty(weight.sizes(), weight);
  Tensor A = exact && center ? empty({C}, sd, part) : Tensor(), B = exact ? empty({C}, sd, part) : Tensor();
  Tensor scratch = has_nu ? empty({C}, sd, part) : Tensor(), flags = empty({progs}, at::kInt, part);
  Args a{to};
  a.ptr(part), a.ptr(weight), a.ptr(n), a.ptr_or_none(nu), a.ptr(grad_w), a.ptr(grad_b), a.ptr_or_none(A);
  a.ptr_or_none(B), a.ptr_or_none(scratch), a.ptr(flags), a.ptr(part, P * 5 * C);
  a.i(P), a.i(C), a.f(rate), a.i(rows);
  launch::run(FIN_BWD, {progs, 1, 1}, a.list, {kind, center, has_nu, config().sum_rows, config().finish_block, config().warps,
               registers(FIN_BWD, part.scalar_type() == at::kDouble)}, to);
  return {grad_w, grad_b, A, B};
}

// gpu._row_plan of a per-row kernel
struct RowPlan {
  int64_t N, C, progs;
  std::array<int64_t, 6> shape;  // N, C, XB, XST, XSB, per_prog
  std::vector<int64_t> constexprs;  // F64, WIDE, BLOCK_N, BLOCK_C, num_warps, maxnreg
  at::ScalarType acc;
};

RowPlan row_plan(int kernel, const Tensor& x, const launch::Target& to) {
  const Config& c = config();
  const auto [N, C, XB, XST, XSB] = rows_of(x);
  const bool f64 = x.scalar_type() == at::kDouble;
  int64_t block_c = pow2(C);
  if (block_c > c.widest_row) block_c = c.sub_chunk;
  const int64_t block_n = std::max<int64_t>(1, std::min<int64_t>(32, c.row_tile / block_c));
  const int64_t programs = programs_per_sm(kernel, f64) * launch::multiprocessors(to);
  const int64_t progs = std::max<int64_t>(1, std::min(cdiv(N, block_n), std::max(programs, cdiv(N, c.max_rows))));
  const int64_t per_prog = cdiv(cdiv(N, progs), block_n) * block_n;
  return {N, C, cdiv(N, per_prog), {N, C, XB, XST, XSB, per_prog},
          {f64, block_c < C, block_n, block_c, c.warps, registers(kernel, f64)}, acc_of(x)};
}

// gpu._sum_columns_of: out (and out2, from the block after) the sums over ``rows`` rows of part's (rows, C) block
void sum_columns(const Tensor& part, const Tensor& out, const Tensor& out2, int64_t rows, int64_t C,
                 const launch::Target& to) {
  Args a{to};
  a.ptr(part), a.ptr(out), a.ptr_or_none(out2), a.i(rows), a.i(C);
  launch::run(SUM_COLS, {cdiv(C, config().finish_block), 1, 1}, a.list,
              {!absent(out2), config().sum_rows, config().finish_block, config().warps,
               registers(SUM_COLS, part.scalar_type() == at::kDouble)}, to);
}

// gpu._sums_here: whether a row backward's last program adds the programs' parameter sums itself
bool sums_here(const RowPlan& p) { return p.progs <= 3 * p.shape[5]; }

// the launch of a row kernel: its tensors, then the plan's integers and any scalar (and SUM_HERE's value)
void run_rows(int kernel, const RowPlan& p, const launch::Target& to, Args& a, std::optional<double> scalar,
              std::optional<bool> sum_here = std::nullopt) {
  for (int64_t s : p.shape) a.i(s);
  if (scalar) a.f(*scalar);
  launch::run(kernel, {p.progs, 1, 1}, a.list, sum_here ? joined({*sum_here}, p.constexprs) : p.constexprs, to);
}

// ScaleNorm's and RMSNorm's forward (``kernel``): {y, the per-row statistic, the backward's ticket past it}
std::vector<Tensor> statistic_forward(int kernel, const Tensor& x, const Tensor& param, double eps) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan p = row_plan(kernel, x, to);
  Tensor y = empty(x.sizes(), x), statistic = empty({p.N + 1}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(param), a.ptr(y), a.ptr(statistic);
  run_rows(kernel, p, to, a, eps);
  return {y, statistic};
}

std::vector<Tensor> scalenorm_forward(const Tensor& x, const Tensor& scale, double eps) {
  return statistic_forward(SN_FWD, x, scale, eps);
}

std::vector<Tensor> scalenorm_backward(const Tensor& x, const Tensor& norms, const Tensor& grad_y,
                                       const Tensor& scale, double eps) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan p = row_plan(SN_BWD, x, to);
  Tensor gx = empty(x.sizes(), x), grad_scale = empty(scale.sizes(), scale);
  Tensor part = empty({p.progs}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(norms), a.ptr(grad_y), a.ptr(scale), a.ptr(gx), a.ptr(part), a.ptr(grad_scale);
  a.ptr(norms, p.N);
  run_rows(SN_BWD, p, to, a, eps);
  return {gx, grad_scale};
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const Tensor& weight, double eps) {
  return statistic_forward(RMS_FWD, x, weight, eps);
}

std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& rstd, const Tensor& grad_y,
                                     const Tensor& weight) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan p = row_plan(RMS_BWD, x, to);
  Tensor gx = empty(x.sizes(), x), grad_w = empty(weight.sizes(), weight);
  Tensor part = empty({p.progs, p.C}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(rstd), a.ptr(grad_y), a.ptr(weight), a.ptr(gx), a.ptr(part), a.ptr(grad_w), a.ptr(rstd, p.N);
  const bool here = sums_here(p);
  run_rows(RMS_BWD, p, to, a, std::nullopt, here);
  if (!here) sum_columns(part, grad_w, Tensor(), p.progs, p.C, to);
  return {gx, grad_w};
}

std::vector<Tensor> dyt_forward(const Tensor& x, const Tensor& alpha, const Tensor& weight, const Tensor& bias) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan p = row_plan(DYT_FWD, x, to);
  Tensor y = empty(x.sizes(), x), ticket = empty({1}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(alpha), a.ptr(weight), a.ptr(bias), a.ptr(y), a.ptr(ticket);
  run_rows(DYT_FWD, p, to, a, std::nullopt);
  return {y, ticket};
}

std::vector<Tensor> dyt_backward(const Tensor& x, const Tensor& grad_y, const Tensor& alpha, const Tensor& weight,
                                 const Tensor& ticket) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan p = row_plan(DYT_BWD, x, to);
  Tensor gx = empty(x.sizes(), x), grad_alpha = empty(alpha.sizes(), alpha);
  Tensor grad_w = empty(weight.sizes(), weight), grad_b = empty(weight.sizes(), weight);
  Tensor part = empty({p.progs * (2 * p.C + 1)}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(grad_y), a.ptr(alpha), a.ptr(weight), a.ptr(gx), a.ptr(grad_alpha), a.ptr(grad_w), a.ptr(grad_b);
  a.ptr(part), a.ptr(ticket);
  const bool here = sums_here(p);
  run_rows(DYT_BWD, p, to, a, std::nullopt, here);
  if (!here) sum_columns(part, grad_w, grad_b, p.progs, p.C, to);
  return {gx, grad_alpha, grad_w, grad_b};
}

// Bind gpu.py's kernels (in KernelId's order), its constants and launcher.from_node; checks each
// kernel's constexprs here against its own parameters.
void bind(const py::list& kernels, const py::dict& constants, py::object from_node) {
  TORCH_CHECK(kernels.size() == KERNELS, "bind_gpu: ", KERNELS, " kernels, not ", kernels.size());
  Config c;
  for (const auto& item : constants) {
    const auto name = item.first.cast<std::string>();
    if (name == "programs_per_sm") {
      const auto v = item.second.cast<std::vector<int64_t>>();
      TORCH_CHECK(v.size() == KERNELS, "bind_gpu: programs_per_sm of ", KERNELS, " kernels");
      std::copy(v.begin(), v.end(), c.programs_per_sm.begin());
      continue;
    }
    const int64_t v = item.second.cast<int64_t>();
    if (name == "warps") c.warps = v;
    else if (name == "warp") c.warp = v;
    else if (name == "registers_per_sm") c.registers_per_sm = v;
    else if (name == "tile") c.tile = v;
    else if (name == "row_tile") c.row_tile = v;
    else if (name == "widest_group") c.widest_group = v;
    else if (name == "widest_row") c.widest_row = v;
    else if (name == "sub_chunk") c.sub_chunk = v;
    else if (name == "sum_rows") c.sum_rows = v;
    else if (name == "max_rows") c.max_rows = v;
    else if (name == "finish_block") c.finish_block = v;
    else TORCH_CHECK(false, "bind_gpu: no constant ", name);
  }
  auto& r = launch::registry();
  std::vector<launch::Kernel> bound;
  for (int i = 0; i < KERNELS; ++i) {
    py::object k = kernels[i];
    launch::Kernel kernel{k, k.attr("__name__").cast<std::string>(), {}, constexprs_of(i)};
    std::set<std::string> constexpr_params{"num_warps", "maxnreg"};
    for (const auto& param : k.attr("params")) {
      if (param.attr("is_constexpr").cast<bool>()) constexpr_params.insert(param.attr("name").cast<std::string>());
      else kernel.fixed.push_back(param.attr("do_not_specialize").cast<bool>());
    }
    std::set<std::string> given{"num_warps", "maxnreg"};  // the launch options, which every kernel takes
    for (const auto& [name, is_bool] : kernel.constexprs) given.insert(name);
    TORCH_CHECK(given == constexpr_params, "bind_gpu: the node gives ", kernel.name,
                " other constexprs than the kernel's own");
    bound.push_back(std::move(kernel));
  }
  std::lock_guard<std::mutex> hold(r.lock);
  config() = c;
  r.kernels = std::move(bound);
  r.from_node = std::move(from_node);
  r.held.clear();
}

}  // namespace gpu
