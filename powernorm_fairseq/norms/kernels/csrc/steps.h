// The training steps as C++ autograd nodes: ChannelStep (BN, PN-V, PN) and
// RowStep (the per-row and per-entry kinds), on the CPU kernels or the Triton path's
// passes (gpu_passes.h).
namespace {

// An empty tensor standing for an absent one, of x's device and dtype: made once per thread, device and
// dtype (a step took three, each from the allocator), and never written to (no pass writes an absent
// tensor). Kept for the life of the process: no destructor runs after a device's runtime is gone.
Tensor nothing_like(const Tensor& x) {
  using Made = std::vector<std::pair<std::pair<c10::Device, at::ScalarType>, Tensor>>;
  thread_local Made* made = new Made();
  const auto key = std::make_pair(x.device(), x.scalar_type());
  for (const auto& entry : *made)
    if (entry.first == key) return entry.second;
  made->emplace_back(key, gpu::empty({0}, x));
  return made->back().second;
}

// t with contiguous memory: t itself, without a call, where it has it
Tensor dense(const Tensor& t) { return t.is_contiguous() ? t : t.contiguous(); }

// a pass's (N, C) rows in x's shape: as they are where the pass made them so (the Triton path's)
Tensor shaped(const Tensor& rows, const Tensor& x) { return rows.sizes() == x.sizes() ? rows : rows.view(x.sizes()); }

// The training step of BN, PN-V and PN as one autograd node: the calls of
// functions.py's FusedChannelNorm, mode for mode (see it for the math), made
// here so that an eager step costs one call from Python each way. (The host
// code between the kernels took longer than the kernels of a small layer.)
// Not under --norm-sync, whose all-reduces run between the calls.
//
// The passes are this file's CPU kernels (``bound_as`` -1) or the Triton
// path's (gpu_passes.h, ``GPU``), once bind_gpu has bound its kernels.
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr int64_t GPU = -2;

// -1 (the CPU kernels) or GPU
void check_bound(int64_t bound_as) {
  TORCH_CHECK(bound_as == -1 || (bound_as == GPU && !launch::registry().kernels.empty()), "no passes bound as ",
              bound_as);
}

// the C++ passes' results, absent ones (undefined) as `none`
std::vector<Tensor> filled(std::vector<Tensor> results, const Tensor& none) {
  for (auto& t : results)
    if (!t.defined()) t = none;
  return results;
}

// The contract's four channel passes, the CPU kernels' or the Triton path's.
struct Passes {
  int64_t bound_as;
  Tensor none;
  double w_offset;  // the gain is read as weight + w_offset (a unit-offset gain's 1)

  std::vector<Tensor> forward(const Tensor& x, const Tensor& mask, int64_t groups, double gs_eps,
                              const Tensor& mean, const Tensor& inv, double inv_eps, const Tensor& weight,
                              const Tensor& bias, bool want_y, bool want_stats, bool center) const {
    if (bound_as == GPU)
      return filled(gpu::forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y,
                                 want_stats, center), none);
    return ::forward(x, mask, groups, gs_eps, mean, inv, inv_eps, weight, w_offset, bias, want_y, want_stats, center);
  }

  std::vector<Tensor> finish_stats(const Tensor& part, const Tensor& mean_buf, const Tensor& second_buf,
                                   const Tensor& steps, int64_t update, double momentum, double eps,
                                   int64_t warmup) const {
    if (bound_as == GPU)
      return filled(gpu::finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup), none);
    return ::finish_stats(part, mean_buf, second_buf, steps, update, momentum, eps, warmup);
  }

  std::vector<Tensor> backward(const Tensor& x, const Tensor& mask, const Tensor& scale, const Tensor& grad_y,
                               const Tensor& weight, const Tensor& mean, const Tensor& inv_fwd,
                               const Tensor& inv_bwd, const Tensor& A, const Tensor& B, double b_scale,
                               int64_t groups, bool correct_pads, bool want_gx, bool want_sums) const {
    if (bound_as == GPU)
      return filled(gpu::backward(x, mask, scale, grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B, b_scale,
                                  groups, correct_pads, want_gx, want_sums), none);
    return ::backward(x, mask, scale, grad_y, weight, w_offset, mean, inv_fwd, inv_bwd, A, B, b_scale, groups,
                      correct_pads, want_gx, want_sums);
  }

  std::vector<Tensor> finish_backward(const Tensor& part, const Tensor& weight, const Tensor& n, const Tensor& nu,
                                      double rate, int64_t kind, bool center, int64_t rows) const {
    if (bound_as == GPU)
      return filled(gpu::finish_backward(part, weight, w_offset, n, nu, rate, kind, center, rows), none);
    return ::finish_backward(part, weight, w_offset, n, nu, rate, kind, center, rows);
  }
};

struct ChannelStep : torch::autograd::Function<ChannelStep> {
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& mask, const Tensor& weight,
                               const Tensor& bias, const Tensor& mean_buf, const Tensor& second_buf,
                               const Tensor& steps, const Tensor& nu, const Tensor& given_mean,
                               const Tensor& given_inv, double gs_eps, int64_t groups, bool center, int64_t update,
                               int64_t mode, double momentum, double eps, int64_t warmup, double rate,
                               double w_offset, int64_t bound_as) {
    const Tensor none = nothing_like(x);
    const Passes k{bound_as, none, w_offset};
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
    // one integer: each entry costs a hash, and a list an allocation
    ctx->saved_data["step"] = ((groups * 2 + center) * 4 + mode) * 2 + (bound_as == GPU);
    ctx->saved_data["rate"] = rate;
    if (w_offset != 0.0) ctx->saved_data["w_offset"] = w_offset;  // none saved for the usual 0: an entry a hash
    ctx->mark_non_differentiable({inv});
    ctx->set_materialize_grads(false);
    return {y, inv};  // (N, C): the caller's view of it is one autograd records (in-place ops on it work)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(21);
    const Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return out;
    TORCH_CHECK(!(at::GradMode::is_enabled() && grad_y.requires_grad()),
                "bn, pn-v and pn have no second derivative here (a backward with create_graph=True went through "
                "one): use ln, layernorm-simple or none for double backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &mask = saved[1], &scale = saved[2], &weight = saved[3], &mean = saved[4],
                 &inv = saved[5], &inv_batch = saved[6], &n = saved[7];
    const Tensor nu = ctx->saved_data["nu"].toTensor(), gy = dense(grad_y), none = nothing_like(x);
    const int64_t step = ctx->saved_data["step"].toInt();
    const int64_t groups = step / 16, mode = step / 2 % 4, bound_as = step % 2 ? GPU : -1;
    const bool center = step / 8 % 2 != 0;
    const double rate = ctx->saved_data["rate"].toDouble();
    const auto offset = ctx->saved_data.find("w_offset");
    const Passes k{bound_as, none, offset == ctx->saved_data.end() ? 0.0 : offset->second.toDouble()};
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
    out[0] = shaped(grad_x, x), out[2] = terms[0], out[3] = terms[1];
    return out;
  }
};

// A norm module's step configuration, made once (functions.py's ChannelConfig: again when the module's
// buffers, settings or device change): its running buffers (absent ones empty), its constants and the
// passes it runs on.
struct StepConfig {
  Tensor mean_buf, second_buf, steps, nu;
  double gs_eps, momentum, eps, rate, w_offset;
  int64_t groups, warmup, bound_as;
  bool center;
};

// One training step of a module with ``config``: x, its padding mask, the parameters, and what changes
// from step to step (the update and backward mode of PN's phase, statistics given by the caller). Absent
// tensors come as None (one empty tensor stands for them here): making them in Python cost more than
// this call's host code. x is taken at any strides, its channels made adjacent here where they are not
// (functions.py's rows), and the mask made contiguous: each is a call less in Python.
variable_list channel_step(const Tensor& x, const std::optional<Tensor>& mask, const Tensor& weight,
                           const Tensor& bias, const StepConfig& c, int64_t update, int64_t mode,
                           const std::optional<Tensor>& given_mean, const std::optional<Tensor>& given_inv) {
  TORCH_CHECK(mode >= EXACT && mode <= FIXED, "unknown mode ", mode, " (contract.py's Mode: 0 to 3)");
  check_bound(c.bound_as);
  const Tensor empty = nothing_like(x);
  const auto or_empty = [&](const std::optional<Tensor>& t) { return t ? *t : empty; };
  const auto given = [&](const Tensor& t) { return t.defined() ? t : empty; };
  auto out = ChannelStep::apply(x.stride(-1) == 1 ? x : x.contiguous(), mask ? dense(*mask) : empty, weight,
                                bias, given(c.mean_buf), c.second_buf, given(c.steps), given(c.nu),
                                or_empty(given_mean), or_empty(given_inv), c.gs_eps, c.groups, c.center, update,
                                mode, c.momentum, c.eps, c.warmup, c.rate, c.w_offset, c.bound_as);
  out[0] = shaped(out[0], x);  // where a view: one autograd records, not one made inside the node
  return out;
}

// The per-row and per-entry kinds (cpu_rows.h's kRowKinds, by index) as one
// autograd node each way, as ChannelStep is for the channel norms: the
// contract's two calls of functions.py's FusedRowNorm, on the CPU kernels or
// the Triton path's.
const RowKind& row_passes(int64_t kind, int64_t bound_as) {
  return bound_as == GPU ? *gpu::rows_by_index[kind] : kRowKinds[kind];
}

struct RowStep : torch::autograd::Function<RowStep> {
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& p0, const Tensor& p1, const Tensor& p2,
                        const Tensor& p3, int64_t kind, double eps, double w_offset, int64_t bound_as) {
    auto f = row_passes(kind, bound_as).forward(x, {p0, p1, p2, p3}, w_offset, eps);
    // the parameters its backward reads, and no more: each saved tensor is host time on a small layer
    switch (kRowKinds[kind].reads) {
      case 1: ctx->save_for_backward({x, f[1], p0}); break;
      case 2: ctx->save_for_backward({x, f[1], p0, p1}); break;
      default: ctx->save_for_backward({x, f[1], p0, p1, p2});
    }
    ctx->saved_data["step"] = kind * 2 + (bound_as == GPU);  // one integer, as ChannelStep's
    ctx->saved_data["eps"] = eps;
    if (w_offset != 0.0) ctx->saved_data["w_offset"] = w_offset;
    return f[0];  // (N, C), as ChannelStep's y
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &stat = saved[1], &gy = grads[0];
    RowParams p;
    for (size_t i = 2; i < saved.size(); ++i) p[i - 2] = saved[i];
    const int64_t step = ctx->saved_data["step"].toInt(), kind = step / 2, bound_as = step % 2 ? GPU : -1;
    const RowKind& k = kRowKinds[kind];
    const auto offset = ctx->saved_data.find("w_offset");
    const double w_offset = offset == ctx->saved_data.end() ? 0.0 : offset->second.toDouble();
    variable_list out(9);
    std::vector<Tensor> g;
    if (at::GradMode::is_enabled() && gy.requires_grad()) {  // a graph of the gradient
      TORCH_CHECK(k.twice != nullptr, k.name, " has no second derivative here (a backward with create_graph=True "
                  "went through one): use ln, layernorm-simple or none for double backward");
      RowParams shifted = p;  // the gain as read, at least in float32 (contract.RowKind.shifted)
      if (w_offset != 0.0)
        shifted[k.gain] = p[k.gain].to(at::promote_types(p[k.gain].scalar_type(), at::kFloat)) + w_offset;
      g = k.twice(x, gy, shifted);
      if (w_offset != 0.0) g[k.gain + 1] = g[k.gain + 1].to(p[k.gain].scalar_type());
    } else {
      g = row_passes(kind, bound_as).backward(x, stat, dense(gy), p, w_offset, ctx->saved_data["eps"].toDouble());
    }
    out[0] = shaped(g[0], x);
    for (size_t i = 1; i < g.size(); ++i) out[i] = g[i];
    return out;
  }
};

Tensor row_step(int64_t kind, const Tensor& x, const Tensor& p0, const std::optional<Tensor>& p1,
                const std::optional<Tensor>& p2, const std::optional<Tensor>& p3, double eps, double w_offset,
                int64_t bound_as) {
  TORCH_CHECK(kind >= 0 && kind < int64_t(kRowKinds.size()), "unknown row kind ", kind, " (0 to ",
              kRowKinds.size() - 1, ": row_kind_index gives one)");
  check_bound(bound_as);
  const Tensor empty = nothing_like(x);
  return shaped(RowStep::apply(x.stride(-1) == 1 ? x : x.contiguous(), p0, p1 ? *p1 : empty, p2 ? *p2 : empty,
                               p3 ? *p3 : empty, kind, eps, w_offset, bound_as), x);
}

// ops.py's ``observed``, but for torch.compile's test: whether something may watch or transform the ops
// of a call with ``values``: a dispatch or function mode, functorch, the JIT tracer, the profiler, or
// a value other than a plain tensor, parameter or None. One call, where Python's test is a call each.
bool observed(const py::tuple& values) {
  static PyObject* parameter = py::object(py::module_::import("torch.nn").attr("Parameter")).release().ptr();
  for (const auto& v : values) {
    const PyObject* type = reinterpret_cast<PyObject*>(Py_TYPE(v.ptr()));
    if (v.ptr() != Py_None && type != THPVariableClass && type != parameter) return true;
  }
  const auto included = c10::impl::tls_local_dispatch_key_set().included_;
  return c10::impl::TorchDispatchModeTLS::stack_len() > 0 || at::impl::torch_function_mode_enabled() ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerFrontMode) ||
         included.has(c10::DispatchKey::FuncTorchDynamicLayerBackMode) ||
         included.has(c10::DispatchKey::Tracer) || torch::profiler::impl::profilerEnabled();
}


}  // namespace
