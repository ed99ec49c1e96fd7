// The Triton path's passes in C++, the one home of each pass sequence (the
// contract's forward, finish_stats, backward, finish_backward and the row
// kinds' two passes), launching through launch.h. Each pass allocates what it
// writes and launches; its plan (grid, rows per program, block sizes, the
// variant's constexprs) is plans.py's, the one home of the plan arithmetic and
// its constants: asked once per input layout (``Plans``) and replayed after.
namespace gpu {

using launch::Arg;

// the kernels, bound by name (``bind``)
enum KernelId : int {
  CH_FWD, FIN_STATS, CH_BWD, FIN_BWD, SN_FWD, SN_BWD, RMS_FWD, RMS_BWD, DYT_FWD, DYT_BWD, DERF_FWD, DERF_BWD,
  SUM_COLS, KERNELS
};
const std::array<const char*, KERNELS> kKernelNames = {
    "_channel_forward", "_finish_stats", "_channel_backward", "_finish_backward", "_scalenorm_forward",
    "_scalenorm_backward", "_rmsnorm_forward", "_rmsnorm_backward", "_dyt_forward", "_dyt_backward",
    "_derf_forward", "_derf_backward", "_sum_columns"};

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
  static const V finish = {{"BLOCK_R", false}, {"BLOCK", false}, {"num_warps", false}, {"maxnreg", false}};
  static const std::array<V, KERNELS> all = {
      with({{"HAS_MEAN", true}, {"INV_RUNNING", true}, {"WANT_Y", true}, {"WANT_STATS", true}, {"CENTER", true}},
           common),
      with({{"UPDATE", false}, {"HAS_STEPS", true}}, finish),
      with({{"HAS_MEAN", true}, {"HAS_A", true}, {"HAS_B", true}, {"CORRECT_PADS", true}, {"WANT_GX", true},
            {"WANT_SUMS", true}}, common),
      with({{"MODE", false}, {"CENTER", true}, {"HAS_NU", true}}, finish),
      rows, rows, rows, with({{"SUM_HERE", true}}, rows), rows, with({{"SUM_HERE", true}}, rows),
      rows, with({{"SUM_HERE", true}}, rows), with({{"TWO", true}}, finish)};
  return all[kernel];
}

// A channel kernel's plan (plans.channel_for_node): the grid, the integer arguments after the tensors, the
// common constexprs
struct ChannelPlan {
  int64_t N, C, progs, chunks;
  std::array<int64_t, 9> scalars;  // N, C, XB, XST, XSB, nb, nt, per_prog, cw
  std::array<int64_t, 9> constexprs;  // HAS_MASK .. maxnreg
};

// A per-row kernel's plan (plans.row_for_node)
struct RowPlan {
  int64_t N, C, progs;
  std::array<int64_t, 6> shape;  // N, C, XB, XST, XSB, per_prog
  std::array<int64_t, 6> constexprs;  // F64, WIDE, BLOCK_N, BLOCK_C, num_warps, maxnreg
  at::ScalarType acc;
  bool sums_here;  // a backward's last program adds the programs' parameter sums itself
};

// A finishing kernel's plan (plans.finish_for_node): its programs' columns and its constexprs' tail
struct FinishPlan {
  int64_t block;  // columns per program
  std::array<int64_t, 4> constexprs;  // BLOCK_R, BLOCK, num_warps, maxnreg
};

// The plans asked of plans.py, each once per key (kernel, the input's layout, dtype and device, what
// else the plan reads), kept while the layouts come (at most kKeptPlans, then asked anew); emptied when
// what they read changes (a stand-in's size: ``forget``).
struct Plans {
  py::object planner;  // plans.py
  std::unordered_map<std::string, ChannelPlan> channel;
  std::unordered_map<std::string, RowPlan> row;
  std::unordered_map<std::string, FinishPlan> finish;
  std::mutex lock;
};

Plans& plans() {
  static auto* p = new Plans();  // never freed: it holds a Python object
  return *p;
}

constexpr size_t kKeptPlans = 4096;

// Every plan asked anew: what plans.py reads changed (a stand-in device's size)
void forget() {
  auto& p = plans();
  std::lock_guard<std::mutex> hold(p.lock);
  p.channel.clear(), p.row.clear(), p.finish.clear();
}

void key_add(std::string& key, int64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof(v)); }

// the key of a plan: kept in a buffer of the thread's (a string made each launch cost an allocation), and
// read before the next plan is asked for
std::string& layout_key(int kernel, const Tensor& x) {
  thread_local std::string key;
  key.clear();
  key_add(key, kernel), key_add(key, static_cast<int64_t>(x.scalar_type()));
  key_add(key, x.is_cuda() ? x.device().index() : -1), key_add(key, x.dim());
  for (int64_t d = 0; d < x.dim(); ++d) key_add(key, x.size(d)), key_add(key, x.stride(d));
  return key;
}

template <typename Map, typename Make>
typename Map::mapped_type planned(Map& map, const std::string& key, Make make) {
  auto& p = plans();
  {
    std::lock_guard<std::mutex> hold(p.lock);
    auto it = map.find(key);
    if (it != map.end()) return it->second;
  }
  const std::string kept = key;  // a miss: the key's buffer is the thread's, and the planner is Python
  typename Map::mapped_type made;
  {
    py::gil_scoped_acquire gil;
    TORCH_CHECK(p.planner, "powernorm_fairseq: the Triton path's passes are not bound (gpu.bind_node)");
    made = make(p.planner);
  }
  std::lock_guard<std::mutex> hold(p.lock);
  if (map.size() >= kKeptPlans) map.clear();
  map.emplace(kept, made);  // (a plan another thread made first stays)
  return made;
}

bool absent(const Tensor& t) { return !t.defined() || t.numel() == 0; }
at::ScalarType acc_of(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

// the argument list of one launch
struct Args {
  const launch::Target& to;
  launch::Args list;
  void ptr(const Tensor& t, int64_t offset = 0) { list.push_back({Arg::PTR, &t, offset, 0, 0.0}); }
  void ptr_or_none(const Tensor& t) { ptr(absent(t) ? to.nothing : t); }
  void i(int64_t v) { list.push_back({Arg::INT, nullptr, 0, v, 0.0}); }
  void f(double v) { list.push_back({Arg::FLOAT, nullptr, 0, 0, v}); }
};

ChannelPlan channel_plan(int kernel, const Tensor& x, const Tensor& mask, int64_t groups, bool tall) {
  const bool has_mask = !absent(mask);
  std::string& key = layout_key(kernel, x);
  key_add(key, groups), key_add(key, tall), key_add(key, has_mask ? mask.size(0) : -1);
  key_add(key, has_mask ? mask.size(1) : -1);
  return planned(plans().channel, key, [&](const py::object& planner) {
    const auto t = planner.attr("channel_for_node")(kKernelNames[kernel], x, has_mask ? py::cast(mask) : py::none(),
                                                    groups, tall).cast<py::tuple>();
    ChannelPlan p{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), t[3].cast<int64_t>(), {}, {}};
    const auto scalars = t[4].cast<std::vector<int64_t>>(), constexprs = t[5].cast<std::vector<int64_t>>();
    TORCH_CHECK(scalars.size() == p.scalars.size() && constexprs.size() == p.constexprs.size(),
                "plans.channel_for_node: ", scalars.size(), " scalars and ", constexprs.size(),
                " constexprs, not 9 and 9");
    std::copy(scalars.begin(), scalars.end(), p.scalars.begin());
    std::copy(constexprs.begin(), constexprs.end(), p.constexprs.begin());
    return p;
  });
}

FinishPlan finish_plan(int kernel, bool f64) {
  thread_local std::string key;
  key.clear();
  key_add(key, kernel), key_add(key, f64);
  return planned(plans().finish, key, [&](const py::object& planner) {
    const auto t = planner.attr("finish_for_node")(kKernelNames[kernel], f64).cast<py::tuple>();
    FinishPlan f{t[0].cast<int64_t>(), {}};
    const auto constexprs = t[1].cast<std::vector<int64_t>>();
    TORCH_CHECK(constexprs.size() == f.constexprs.size(), "plans.finish_for_node: ", constexprs.size(),
                " constexprs, not 4");
    std::copy(constexprs.begin(), constexprs.end(), f.constexprs.begin());
    return f;
  });
}

template <typename Tail>
launch::Values joined(launch::Values head, const Tail& tail) {
  for (int64_t v : tail) head.push_back(v);
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
                            const Tensor& inv, double inv_eps, const Tensor& weight, double w_offset,
                            const Tensor& bias, bool want_y, bool want_stats, bool center) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const ChannelPlan& p = channel_plan(CH_FWD, x, mask, groups, !want_y);
  const auto acc = acc_of(x);
  Tensor y = want_y ? empty(x.sizes(), x) : Tensor();  // x's shape: its rows, contiguous
  Tensor scale = groups > 0 ? empty({p.N, groups}, acc, x) : Tensor();
  Tensor part = want_stats ? empty({p.progs + 1, 3, p.C}, acc, x) : Tensor();
  Args a{to};
  a.ptr(x);
  for (const Tensor* t : std::initializer_list<const Tensor*>{&mask, &mean, &inv, &weight, &bias, &y, &scale, &part}) a.ptr_or_none(*t);
  for (int64_t s : p.scalars) a.i(s);
  a.f(gs_eps), a.f(inv_eps), a.f(w_offset);
  launch::run(CH_FWD, {p.progs + want_stats, p.chunks, 1}, a.list,
              joined({!absent(mean), inv_eps >= 0, want_y, want_stats, center}, p.constexprs), to);
  return {y, scale, part};
}

// gpu._finish_stats_pass: {mean (BN's), inv, inv of the batch, n}
std::vector<Tensor> finish_stats(const Tensor& part, const Tensor& mean_buf, const Tensor& second_buf,
                                 const Tensor& steps, int64_t update, double momentum, double eps, int64_t warmup) {
  const launch::Target to = launch::target_of(part);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const FinishPlan& f = finish_plan(FIN_STATS, part.scalar_type() == at::kDouble);
  const int64_t P = part.size(0) - 1, C = part.size(2), progs = (C + f.block - 1) / f.block;
  const auto sd = second_buf.scalar_type();
  Tensor mean = update == 0 ? empty({C}, sd, part) : Tensor();  // Update.BN
  Tensor inv = empty({C}, sd, part), inv_batch = empty({C}, sd, part), n = empty({1}, at::kDouble, part);
  Tensor scratch = empty({2, C}, sd, part), flags = empty({progs}, at::kInt, part);
  Args a{to};
  a.ptr(part), a.ptr_or_none(mean_buf), a.ptr(second_buf), a.ptr_or_none(steps), a.ptr_or_none(mean);
  a.ptr(inv), a.ptr(inv_batch), a.ptr(n), a.ptr(scratch), a.ptr(flags), a.ptr(part, P * 3 * C);
  a.i(P), a.i(C), a.f(momentum), a.f(eps), a.i(warmup);
  launch::run(FIN_STATS, {progs, 1, 1}, a.list, joined({update, !absent(steps)}, f.constexprs), to);
  return {mean, inv, inv_batch, n};
}

// gpu._backward_pass: {dL/dx, part}
std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                             const Tensor& weight, double w_offset, const Tensor& mean, const Tensor& inv_fwd,
                             const Tensor& inv_bwd, const Tensor& A, const Tensor& B, double b_scale, int64_t groups,
                             bool correct_pads, bool want_gx, bool want_sums) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const ChannelPlan& p = channel_plan(CH_BWD, x, mask, groups, /*tall=*/false);  // its sums pass spills when taller
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
  a.f(b_scale), a.f(w_offset);
  launch::run(CH_BWD, {p.progs + want_sums, p.chunks, 1}, a.list,
              joined({!absent(mean), !absent(A), !absent(B), correct_pads, want_gx, want_sums}, p.constexprs), to);
  return {gx, part};
}

// gpu._finish_backward_pass: {dL/dw, dL/db, A, B}
std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, double w_offset, const Tensor& n,
                                    const Tensor& nu, double rate, int64_t kind, bool center, int64_t rows) {
  const launch::Target to = launch::target_of(part);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const FinishPlan& f = finish_plan(FIN_BWD, part.scalar_type() == at::kDouble);
  const int64_t P = part.size(0) - 1, C = part.size(2), progs = (C + f.block - 1) / f.block;
  const bool has_nu = !absent(nu), exact = kind == 0;  // Mode.EXACT
  const auto sd = has_nu ? nu.scalar_type() : acc_of(part);
  Tensor grad_w = empty(weight.sizes(), weight), grad_b = empty(weight.sizes(), weight);
  Tensor A = exact && center ? empty({C}, sd, part) : Tensor(), B = exact ? empty({C}, sd, part) : Tensor();
  Tensor scratch = has_nu ? empty({C}, sd, part) : Tensor(), flags = empty({progs}, at::kInt, part);
  Args a{to};
  a.ptr(part), a.ptr(weight), a.ptr(n), a.ptr_or_none(nu), a.ptr(grad_w), a.ptr(grad_b), a.ptr_or_none(A);
  a.ptr_or_none(B), a.ptr_or_none(scratch), a.ptr(flags), a.ptr(part, P * 5 * C);
  a.i(P), a.i(C), a.f(rate), a.i(rows), a.f(w_offset);
  launch::run(FIN_BWD, {progs, 1, 1}, a.list, joined({kind, center, has_nu}, f.constexprs), to);
  return {grad_w, grad_b, A, B};
}

RowPlan row_plan(int kernel, const Tensor& x) {
  return planned(plans().row, layout_key(kernel, x), [&](const py::object& planner) {
    const auto t = planner.attr("row_for_node")(kKernelNames[kernel], x).cast<py::tuple>();
    RowPlan p{t[0].cast<int64_t>(), t[1].cast<int64_t>(), t[2].cast<int64_t>(), {}, {}, acc_of(x),
              t[5].cast<bool>()};
    const auto shape = t[3].cast<std::vector<int64_t>>(), constexprs = t[4].cast<std::vector<int64_t>>();
    TORCH_CHECK(shape.size() == p.shape.size() && constexprs.size() == p.constexprs.size(), "plans.row_for_node: ",
                shape.size(), " integers and ", constexprs.size(), " constexprs, not 6 and 6");
    std::copy(shape.begin(), shape.end(), p.shape.begin());
    std::copy(constexprs.begin(), constexprs.end(), p.constexprs.begin());
    return p;
  });
}

// gpu._sum_columns_of: out (and out2, from the block after) the sums over ``rows`` rows of part's (rows, C) block
void sum_columns(const Tensor& part, const Tensor& out, const Tensor& out2, int64_t rows, int64_t C,
                 const launch::Target& to) {
  const FinishPlan& f = finish_plan(SUM_COLS, part.scalar_type() == at::kDouble);
  Args a{to};
  a.ptr(part), a.ptr(out), a.ptr_or_none(out2), a.i(rows), a.i(C);
  launch::run(SUM_COLS, {(C + f.block - 1) / f.block, 1, 1}, a.list, joined({!absent(out2)}, f.constexprs), to);
}

// the launch of a row kernel: its tensors, then the plan's integers, any scalar and the gain's offset (and
// SUM_HERE's value)
void run_rows(int kernel, const RowPlan& p, const launch::Target& to, Args& a, std::optional<double> scalar,
              double w_offset, std::optional<bool> sum_here = std::nullopt) {
  for (int64_t s : p.shape) a.i(s);
  if (scalar) a.f(*scalar);
  a.f(w_offset);
  launch::run(kernel, {p.progs, 1, 1}, a.list, joined(sum_here ? launch::Values{*sum_here} : launch::Values{},
                                                          p.constexprs), to);
}

// ScaleNorm's and RMSNorm's forward (``kernel``): {y, the per-row statistic, the backward's ticket past it}
std::vector<Tensor> statistic_forward(int kernel, const Tensor& x, const Tensor& param, double w_offset, double eps) {
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(kernel, x);
  Tensor y = empty(x.sizes(), x), statistic = empty({p.N + 1}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(param), a.ptr(y), a.ptr(statistic);
  run_rows(kernel, p, to, a, eps, w_offset);
  return {y, statistic};
}

std::vector<Tensor> scalenorm_forward(const Tensor& x, const RowParams& p, double w_offset, double eps) {
  return statistic_forward(SN_FWD, x, p[0], w_offset, eps);
}

std::vector<Tensor> scalenorm_backward(const Tensor& x, const Tensor& norms, const Tensor& grad_y,
                                       const RowParams& params, double w_offset, double eps) {
  const Tensor& scale = params[0];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(SN_BWD, x);
  Tensor gx = empty(x.sizes(), x), grad_scale = empty(scale.sizes(), scale);
  Tensor part = empty({p.progs}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(norms), a.ptr(grad_y), a.ptr(scale), a.ptr(gx), a.ptr(part), a.ptr(grad_scale);
  a.ptr(norms, p.N);
  run_rows(SN_BWD, p, to, a, eps, w_offset);
  return {gx, grad_scale};
}

std::vector<Tensor> rmsnorm_forward(const Tensor& x, const RowParams& p, double w_offset, double eps) {
  return statistic_forward(RMS_FWD, x, p[0], w_offset, eps);
}

std::vector<Tensor> rmsnorm_backward(const Tensor& x, const Tensor& rstd, const Tensor& grad_y,
                                     const RowParams& params, double w_offset, double) {
  const Tensor& weight = params[0];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(RMS_BWD, x);
  Tensor gx = empty(x.sizes(), x), grad_w = empty(weight.sizes(), weight);
  Tensor part = empty({p.progs, p.C}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(rstd), a.ptr(grad_y), a.ptr(weight), a.ptr(gx), a.ptr(part), a.ptr(grad_w), a.ptr(rstd, p.N);
  const bool here = p.sums_here;
  run_rows(RMS_BWD, p, to, a, std::nullopt, w_offset, here);
  if (!here) sum_columns(part, grad_w, Tensor(), p.progs, p.C, to);
  return {gx, grad_w};
}

std::vector<Tensor> dyt_forward(const Tensor& x, const RowParams& params, double w_offset, double) {
  const Tensor &alpha = params[0], &weight = params[1], &bias = params[2];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(DYT_FWD, x);
  Tensor y = empty(x.sizes(), x), ticket = empty({1}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(alpha), a.ptr(weight), a.ptr(bias), a.ptr(y), a.ptr(ticket);
  run_rows(DYT_FWD, p, to, a, std::nullopt, w_offset);
  return {y, ticket};
}

std::vector<Tensor> dyt_backward(const Tensor& x, const Tensor& ticket, const Tensor& grad_y, const RowParams& params,
                                 double w_offset, double) {
  const Tensor &alpha = params[0], &weight = params[1];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(DYT_BWD, x);
  Tensor gx = empty(x.sizes(), x), grad_alpha = empty(alpha.sizes(), alpha);
  Tensor grad_w = empty(weight.sizes(), weight), grad_b = empty(weight.sizes(), weight);
  Tensor part = empty({p.progs * (2 * p.C + 1)}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(grad_y), a.ptr(alpha), a.ptr(weight), a.ptr(gx), a.ptr(grad_alpha), a.ptr(grad_w), a.ptr(grad_b);
  a.ptr(part), a.ptr(ticket);
  const bool here = p.sums_here;
  run_rows(DYT_BWD, p, to, a, std::nullopt, w_offset, here);
  if (!here) sum_columns(part, grad_w, grad_b, p.progs, p.C, to);
  return {gx, grad_alpha, grad_w, grad_b};
}

std::vector<Tensor> derf_forward(const Tensor& x, const RowParams& params, double w_offset, double) {
  const Tensor &alpha = params[0], &shift = params[1], &weight = params[2], &bias = params[3];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(DERF_FWD, x);
  Tensor y = empty(x.sizes(), x), ticket = empty({1}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(alpha), a.ptr(shift), a.ptr(weight), a.ptr(bias), a.ptr(y), a.ptr(ticket);
  run_rows(DERF_FWD, p, to, a, std::nullopt, w_offset);
  return {y, ticket};
}

std::vector<Tensor> derf_backward(const Tensor& x, const Tensor& ticket, const Tensor& grad_y,
                                  const RowParams& params, double w_offset, double) {
  const Tensor &alpha = params[0], &shift = params[1], &weight = params[2];
  const launch::Target to = launch::target_of(x);
  const c10::OptionalDeviceGuard guard(launch::guarded(to));
  const RowPlan& p = row_plan(DERF_BWD, x);
  Tensor gx = empty(x.sizes(), x), grad_alpha = empty(alpha.sizes(), alpha), grad_shift = empty(shift.sizes(), shift);
  Tensor grad_w = empty(weight.sizes(), weight), grad_b = empty(weight.sizes(), weight);
  Tensor part = empty({p.progs * (2 * p.C + 2)}, p.acc, x);
  Args a{to};
  a.ptr(x), a.ptr(grad_y), a.ptr(alpha), a.ptr(shift), a.ptr(weight), a.ptr(gx), a.ptr(grad_alpha), a.ptr(grad_shift);
  a.ptr(grad_w), a.ptr(grad_b), a.ptr(part), a.ptr(ticket);
  const bool here = p.sums_here;
  run_rows(DERF_BWD, p, to, a, std::nullopt, w_offset, here);
  if (!here) sum_columns(part, grad_w, grad_b, p.progs, p.C, to);
  return {gx, grad_alpha, grad_shift, grad_w, grad_b};
}

// The per-row and per-entry kinds' passes, found by the CPU kinds' names (cpu_rows.h) when bound
const std::array<RowKind, 4> kRowKinds = {{{"scalenorm", 1, 0, scalenorm_forward, scalenorm_backward, nullptr},
                                           {"rmsnorm", 1, 0, rmsnorm_forward, rmsnorm_backward, nullptr},
                                           {"dyt", 2, 1, dyt_forward, dyt_backward, nullptr},
                                           {"derf", 3, 2, derf_forward, derf_backward, nullptr}}};
// kRowKinds' entry for each of ::kRowKinds, by name
std::array<const RowKind*, ::kRowKinds.size()> rows_by_index{};

// Bind gpu.py's kernels by name ({name: (JIT function, its parameters as (name, is a constexpr,
// do_not_specialize))}: each of kKernelNames, no other), plans.py as the
// planner and launcher.from_node; checks each kernel's constexprs here against its own parameters.
void bind(const py::dict& kernels, py::object planner, py::object from_node) {
  std::set<std::string> given_names;
  for (const auto& item : kernels) given_names.insert(item.first.cast<std::string>());
  for (const char* name : kKernelNames)
    TORCH_CHECK(given_names.erase(name), "bind_gpu: no kernel ", name, " (gpu.py binds ", KERNELS, " by name)");
  TORCH_CHECK(given_names.empty(), "bind_gpu: no kernel of the passes is named ", *given_names.begin());
  auto& r = launch::registry();
  std::vector<launch::Kernel> bound;
  for (int i = 0; i < KERNELS; ++i) {
    const auto given_kernel = kernels[kKernelNames[i]].cast<py::tuple>();  // (JIT function, its parameters)
    launch::Kernel kernel{given_kernel[0], kKernelNames[i], {}, constexprs_of(i)};
    std::set<std::string> constexpr_params{"num_warps", "maxnreg"};
    for (const auto& param : given_kernel[1]) {  // (name, is a constexpr, do_not_specialize)
      const auto t = param.cast<py::tuple>();
      if (t[1].cast<bool>()) constexpr_params.insert(t[0].cast<std::string>());
      else kernel.fixed.push_back(t[2].cast<bool>());
    }
    std::set<std::string> given{"num_warps", "maxnreg"};  // the launch options, which every kernel takes
    for (const auto& [name, is_bool] : kernel.constexprs) given.insert(name);
    TORCH_CHECK(given == constexpr_params, "bind_gpu: the node gives ", kernel.name,
                " other constexprs than the kernel's own");
    bound.push_back(std::move(kernel));
  }
  for (size_t i = 0; i < ::kRowKinds.size(); ++i) {
    rows_by_index[i] = find_row_kind(kRowKinds, ::kRowKinds[i].name);
    TORCH_CHECK(rows_by_index[i] != nullptr, "bind_gpu: no GPU passes of row kind ", ::kRowKinds[i].name);
  }
  forget();
  std::lock_guard<std::mutex> hold(r.lock);
  plans().planner = std::move(planner);
  r.kernels = std::move(bound);
  r.from_node = std::move(from_node);
  r.held.clear();
}

}  // namespace gpu
