// The norms' compiled module (kernels._C): the CPU kernels of the contract
// (powernorm_fairseq/norms/kernels/contract.py), the Triton path's passes and
// driver launches, and the training steps as autograd nodes, one file each,
// included here into one translation unit. The math is documented beside
// the Python callers in powernorm_fairseq/norms/kernels/functions.py.

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
#include <ATen/ops/erf.h>
#include <ATen/ops/exp.h>
#include <ATen/ops/tanh.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/autograd/custom_function.h>
#include <ATen/PythonTorchFunctionTLS.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <cmath>
#include <array>
#include <cstring>
#include <numeric>
#include <set>
#include <type_traits>
#include <vector>

using at::Tensor;
namespace py = pybind11;

#include "cpu_common.h"   // the CPU kernels' shared parts
#include "cpu_channel.h"  // the CPU kernels of BN, PN-V and PN
#include "cpu_rows.h"     // the CPU kernels of the per-row and per-entry kinds
#include "launch.h"       // the driver launcher of the Triton kernels
#include "gpu_passes.h"   // the Triton path's passes (their plans: plans.py)
#include "steps.h"        // the training steps as autograd nodes

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
        arg("inv_eps"), arg("weight"), arg("w_offset"), arg("bias"), arg("want_y"), arg("want_stats"), arg("center"));
  m.def("finish_stats", &finish_stats, arg("part"), arg("mean_buf"), arg("second_buf"), arg("steps"),
        arg("update"), arg("momentum"), arg("eps"), arg("warmup"));
  m.def("backward", &backward, arg("x"), arg("mask"), arg("scale"), arg("grad_y"), arg("weight"), arg("w_offset"),
        arg("mean"),
        arg("inv_fwd"), arg("inv_bwd"), arg("A"), arg("B"), arg("b_scale"), arg("groups"), arg("correct_pads"),
        arg("want_gx"), arg("want_sums"));
  m.def("finish_backward", &finish_backward, arg("part"), arg("weight"), arg("w_offset"), arg("n"), arg("nu"),
        arg("rate"), arg("kind"), arg("center"), arg("rows"));
  // the per-row and per-entry kinds by name (cpu_rows.h's kRowKinds; their descriptors: contract.RowKind)
  m.def("row_forward", [](const std::string& kind, const Tensor& x, const std::vector<Tensor>& params,
                          double w_offset, double eps) {
    return row_kind(kRowKinds, kind).forward(x, row_params(params), w_offset, eps);
  }, arg("kind"), arg("x"), arg("params"), arg("w_offset"), arg("eps"));
  m.def("row_backward", [](const std::string& kind, const Tensor& x, const Tensor& stat, const Tensor& grad_y,
                           const std::vector<Tensor>& params, double w_offset, double eps) {
    return row_kind(kRowKinds, kind).backward(x, stat, grad_y, row_params(params), w_offset, eps);
  }, arg("kind"), arg("x"), arg("stat"), arg("grad_y"), arg("params"), arg("w_offset"), arg("eps"));
  m.def("row_kind_index", [](const std::string& kind) { return &row_kind(kRowKinds, kind) - kRowKinds.data(); },
        arg("kind"));
  py::class_<StepConfig>(m, "StepConfig")
      .def(py::init([](std::optional<Tensor> mean_buf, Tensor second_buf, std::optional<Tensor> steps,
                       std::optional<Tensor> nu, double gs_eps, int64_t groups, bool center, double momentum,
                       double eps, int64_t warmup, double rate, double w_offset, int64_t bound_as) {
             check_bound(bound_as);
             const auto held = [](const std::optional<Tensor>& t) { return t ? *t : Tensor(); };
             return StepConfig{held(mean_buf), std::move(second_buf), held(steps), held(nu), gs_eps, momentum,
                               eps, rate, w_offset, groups, warmup, bound_as, center};
           }),
           arg("mean_buf"), arg("second_buf"), arg("steps"), arg("nu"), arg("gs_eps"), arg("groups"), arg("center"),
           arg("momentum"), arg("eps"), arg("warmup"), arg("rate"), arg("w_offset"), arg("bound_as"));
  m.def("channel_step", &channel_step, arg("x"), arg("mask"), arg("weight"), arg("bias"), arg("config"),
        arg("update"), arg("mode"), arg("given_mean"), arg("given_inv"));
  m.def("row_step", &row_step, arg("kind"), arg("x"), arg("p0"), arg("p1"), arg("p2"), arg("p3"), arg("eps"),
        arg("w_offset") = 0.0, arg("bound_as") = -1);
  m.def("bind_gpu", [](const py::dict& kernels, py::object planner, py::object from_node) {
    gpu::bind(kernels, std::move(planner), std::move(from_node));
    return GPU;
  }, arg("kernels"), arg("planner"), arg("from_node"));
  m.def("watch_launches", [](bool on) { launch::registry().watched = on; }, arg("on"));
  m.def("forget_plans", &gpu::forget);
  // the Triton path's passes, for the ops (ops.py's triton implementation, gpu.py): absent tensors empty,
  // absent results None
  m.def("gpu_forward", &gpu::forward, arg("x"), arg("mask"), arg("groups"), arg("gs_eps"), arg("mean"), arg("inv"),
        arg("inv_eps"), arg("weight"), arg("w_offset"), arg("bias"), arg("want_y"), arg("want_stats"), arg("center"));
  m.def("gpu_finish_stats", &gpu::finish_stats, arg("part"), arg("mean_buf"), arg("second_buf"), arg("steps"),
        arg("update"), arg("momentum"), arg("eps"), arg("warmup"));
  m.def("gpu_backward", &gpu::backward, arg("x"), arg("mask"), arg("scale"), arg("grad_y"), arg("weight"),
        arg("w_offset"), arg("mean"), arg("inv_fwd"), arg("inv_bwd"), arg("A"), arg("B"), arg("b_scale"),
        arg("groups"), arg("correct_pads"), arg("want_gx"), arg("want_sums"));
  m.def("gpu_finish_backward", &gpu::finish_backward, arg("part"), arg("weight"), arg("w_offset"), arg("n"),
        arg("nu"), arg("rate"), arg("kind"), arg("center"), arg("rows"));
  m.def("gpu_row_forward", [](const std::string& kind, const Tensor& x, const std::vector<Tensor>& params,
                              double w_offset, double eps) {
    return row_kind(gpu::kRowKinds, kind).forward(x, row_params(params), w_offset, eps);
  }, arg("kind"), arg("x"), arg("params"), arg("w_offset"), arg("eps"));
  m.def("gpu_row_backward", [](const std::string& kind, const Tensor& x, const Tensor& stat, const Tensor& grad_y,
                               const std::vector<Tensor>& params, double w_offset, double eps) {
    return row_kind(gpu::kRowKinds, kind).backward(x, stat, grad_y, row_params(params), w_offset, eps);
  }, arg("kind"), arg("x"), arg("stat"), arg("grad_y"), arg("params"), arg("w_offset"), arg("eps"));
  m.def("observed", &observed, arg("values"));
  m.def("compare_launches", [](bool on) { launch::registry().compare = on; }, arg("on"));
  m.def("triton_changed", &launch::triton_changed);
  m.def("check_grid", &launch::check_grid, arg("name"), arg("grid"));  // every launch's check, for its test
}
