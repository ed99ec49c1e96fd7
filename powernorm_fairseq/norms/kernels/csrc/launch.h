// The Triton kernels launched from C++ through the CUDA driver API.
//
// A launch is a kernel (one of gpu.py's, bound by ``bind_gpu``), a grid, its
// run-time arguments in order and its constexprs. The variant that serves it
// is the one Triton would choose: the key holds what Triton's binder
// specialises on (each pointer's dtype and 16-byte alignment; each
// specialised integer's equality to 1, divisibility by 16 and 32- or 64-bit
// range, a do_not_specialize one's range alone), the constexprs and the
// device. A key not held yet goes through Triton's JIT launch, in Python
// (launcher.py's ``from_node``), which compiles or finds the variant, launches
// it, and gives back its launch ABI as read from the compiled kernel: the
// parameters it takes, in order, with the constexprs removed; the scratch
// pointers after them; its warps (block = 32 x warps) and dynamic shared
// memory. Every later launch of the key is made here: cuLaunchKernel on
// torch's current stream of the tensors' device, with no Python.
//
// What Triton's own launch guarantees, kept: a thread with no current
// context gets the device's primary context made current, as Triton's
// launcher does (a context that is current and not the kernel's is refused in
// one line); a grid dimension beyond a 32-bit int is refused, as Triton's
// launcher refuses it; a held variant keeps its compiled kernel (and so its
// loaded module) alive; and the held variants are dropped whenever something
// Triton's JIT consults at each launch may have changed (a knob, a launch or
// pre-run hook, an environment variable: launcher.py's ``watch`` calls
// ``triton_changed``), so the next launch goes through the JIT again, which
// hooks see and which selects the variant Triton launches now.
//
// libcuda is opened at run time, as Triton opens it: building needs no CUDA
// toolkit. With CPU tensors (measure/standin.py's stand-in driver) the
// launches go to device 0's stand-in on stream 0.
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <dlfcn.h>

#include <atomic>
#include <climits>
#include <memory>
#include <cstring>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>

namespace launch {

using CUresult = int;
using CUfunction = void*;
using CUcontext = void*;
using CUstream = void*;
constexpr int kMaxParams = 64;

// the driver's entry points the launcher uses
struct Driver {
  CUresult (*launch)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned, CUstream,
                     void**, void**);
  CUresult (*current_context)(CUcontext*);
  CUresult (*set_current)(CUcontext);
  CUresult (*primary)(CUcontext*, int);
  CUresult (*device)(int*, int);
  CUresult (*error)(CUresult, const char**);
};

const Driver& driver() {
  static const Driver d = [] {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_GLOBAL);
    TORCH_CHECK(lib != nullptr, "powernorm_fairseq: cannot open the CUDA driver, libcuda.so.1 (", dlerror(), ")");
    const auto get = [&](const char* name) {
      void* f = dlsym(lib, name);
      TORCH_CHECK(f != nullptr, "powernorm_fairseq: the CUDA driver has no ", name);
      return f;
    };
    Driver d;
    d.launch = reinterpret_cast<decltype(d.launch)>(get("cuLaunchKernel"));
    d.current_context = reinterpret_cast<decltype(d.current_context)>(get("cuCtxGetCurrent"));
    d.set_current = reinterpret_cast<decltype(d.set_current)>(get("cuCtxSetCurrent"));
    d.primary = reinterpret_cast<decltype(d.primary)>(get("cuDevicePrimaryCtxRetain"));
    d.device = reinterpret_cast<decltype(d.device)>(get("cuDeviceGet"));
    d.error = reinterpret_cast<decltype(d.error)>(get("cuGetErrorString"));
    return d;
  }();
  return d;
}

void check(CUresult r, const char* what) {
  if (r == 0) return;
  const char* text = nullptr;
  driver().error(r, &text);
  TORCH_CHECK(false, "powernorm_fairseq: ", what, " failed: CUDA error ", r, " (", text ? text : "?", ")");
}

// Where a step's launches go: the tensors' device and torch's current stream on it.
struct Target {
  bool cuda;
  int device;
  CUstream stream;
  const Tensor& nothing;  // the placeholder an absent input's pointer comes from (gpu.py's _nothing)
};

constexpr int kDevices = 64;  // CUDA devices a process addresses at most here

// one zero of float32 per device (index kDevices: the CPU's): the placeholder for inputs a variant does
// not read
struct PerDevice {
  std::array<std::once_flag, kDevices + 1> made;
  std::array<Tensor, kDevices + 1> nothing;
};

PerDevice& per_device() {
  static auto* d = new PerDevice();  // never freed: tensors outlive the interpreter's teardown otherwise
  return *d;
}

int slot_of(bool cuda, int device) {
  TORCH_CHECK(!cuda || (device >= 0 && device < kDevices), "powernorm_fairseq: CUDA device ", device,
              ": the norm kernels launch on devices 0 to ", kDevices - 1);
  return cuda ? device : kDevices;
}

Target target_of(const Tensor& x) {
  const bool cuda = x.is_cuda();
  const int device = cuda ? x.device().index() : 0;
  PerDevice& d = per_device();
  const int slot = slot_of(cuda, device);
  std::call_once(d.made[slot], [&] {
    // from the allocator, not an op: nothing reads it, and no op is launched for it
    d.nothing[slot] = at::detail::empty_generic({1}, c10::GetAllocator(x.device().type()),
                                                c10::DispatchKeySet(c10::computeDispatchKey(at::kFloat, c10::kStrided,
                                                                                            x.device())),
                                                at::kFloat, std::nullopt);
  });
  const Tensor& nothing = d.nothing[slot];  // made once, never replaced
  if (!cuda) return {false, 0, nullptr, nothing};
  const auto* impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::CUDA);
  return {true, device, impl->getStream(x.device()).native_handle(), nothing};
}

// the device a pass makes current while it allocates and launches (none for the stand-in's CPU tensors)
std::optional<c10::Device> guarded(const Target& to) {
  if (!to.cuda) return std::nullopt;
  return c10::Device(c10::DeviceType::CUDA, static_cast<c10::DeviceIndex>(to.device));
}


// A run-time argument: a pointer (a tensor, at an element offset), an integer or a float.
struct Arg {
  enum Kind : uint8_t { PTR, INT, FLOAT } kind;
  const Tensor* tensor;
  int64_t offset;  // elements past the tensor's start (a view such as part[P])
  int64_t i;
  double f;
};

// A list of at most N items that lives where it is made, never on the heap: a launch's arguments and its
// constexprs' values (a std::vector each cost an allocation a launch).
template <typename T, size_t N>
struct Small {
  std::array<T, N> items{};
  size_t n = 0;
  Small() = default;
  Small(std::initializer_list<T> head) {
    for (const T& t : head) push_back(t);
  }
  void push_back(const T& t) {
    TORCH_CHECK(n < N, "powernorm_fairseq: a launch of more than ", N, " arguments or constexprs");
    items[n++] = t;
  }
  size_t size() const { return n; }
  const T& operator[](size_t i) const { return items[i]; }
  const T* begin() const { return items.data(); }
  const T* end() const { return items.data() + n; }
};
using Args = Small<Arg, 24>;      // the most a kernel takes
using Values = Small<int64_t, 16>;

// A compiled variant's launch ABI, as the JIT's launch read it from the kernel (launcher.py's ``abi``).
enum Type : uint8_t { T_PTR, T_I32, T_I64, T_FP32, T_FP64 };
struct Variant {
  CUfunction function = nullptr;  // none: every launch of the key through the JIT (it cannot be held)
  CUcontext context = nullptr;
  unsigned block = 0, shared = 0;
  std::vector<std::pair<int, Type>> params;  // (argument index, type) of each parameter, in order
  int scratch = 0;  // null scratch pointers after them
  std::shared_ptr<py::object> compiled;  // Triton's compiled kernel: its module stays loaded while held
};

// A kernel as bound from Python: its JIT launch (``from_node``), its name, which of its
// run-time parameters Triton does not specialise, and its constexprs' names.
struct Kernel {
  py::object jit;
  std::string name;
  std::vector<bool> fixed;  // do_not_specialize, per run-time parameter
  std::vector<std::pair<std::string, bool>> constexprs;  // (name, a bool), in the order the call sites give them
};

// A variant's key: the kernel, the device, a byte per argument (``specialised``), two per constexpr.
struct Key {
  std::array<uint8_t, 128> bytes{};
  size_t size = 0;
  void add(int v) { bytes[size++] = static_cast<uint8_t>(v); }
  bool operator==(const Key& o) const { return size == o.size && std::memcmp(bytes.data(), o.bytes.data(), size) == 0; }
};

struct KeyHash {
  size_t operator()(const Key& k) const {  // FNV-1a
    uint64_t h = 1469598103934665603ull;
    for (size_t i = 0; i < k.size; ++i) h = (h ^ k.bytes[i]) * 1099511628211ull;
    return h;
  }
};

struct Registry {
  std::vector<Kernel> kernels;
  py::object from_node;  // launcher.from_node(kernel, grid, args, constexprs, hold) -> ABI or None
  std::unordered_map<Key, std::shared_ptr<const Variant>, KeyHash> held;
  std::mutex lock;
  bool compare = false;  // each held launch made again through the JIT: a test compares what the driver got
  std::atomic<uint64_t> changed{0};  // bumped by triton_changed: what the JIT consults may differ now
  //  every launch through launcher.from_node, none held: Triton's interpreter, a launch observer or recorder
  //  (measure/), or POWERNORM_HOLD=0 (launcher.py's ``watching``)
  std::atomic<bool> watched{false};
  uint64_t seen = 0;  // ``changed`` when ``held`` was last emptied
};

Registry& registry() {
  static auto* r = new Registry();  // never freed: it holds Python objects
  return *r;
}

constexpr size_t kKeptVariants = 4096;

// What Triton's binder specialises an argument on, as one byte of the key.
uint8_t specialised(const Arg& a, bool fixed) {
  if (a.kind == Arg::FLOAT) return 255;
  if (a.kind == Arg::PTR) {
    const auto p = reinterpret_cast<uintptr_t>(a.tensor->data_ptr()) + a.offset * a.tensor->element_size();
    return static_cast<uint8_t>(2 * static_cast<int>(a.tensor->scalar_type()) + (p % 16 == 0));
  }
  const int64_t v = a.i;
  const int range = v >= -(int64_t(1) << 31) && v < (int64_t(1) << 31) ? 0 : 1;
  if (fixed) return static_cast<uint8_t>(200 + range);
  return static_cast<uint8_t>(210 + 4 * range + (v == 1 ? 1 : v % 16 == 0 ? 2 : 0));
}

py::object as_python(const Arg& a) {
  if (a.kind == Arg::INT) return py::int_(a.i);
  if (a.kind == Arg::FLOAT) return py::float_(a.f);
  if (a.offset == 0) return py::cast(*a.tensor);
  return py::cast(a.tensor->view(-1).narrow(0, a.offset, a.tensor->numel() - a.offset));
}

// Triton's launcher takes each grid dimension as a C int, and refuses more; so does every launch here.
void check_grid(const std::string& name, const std::array<int64_t, 3>& grid) {
  for (int d = 0; d < 3; ++d)
    TORCH_CHECK(grid[d] >= 0 && grid[d] <= INT_MAX, "powernorm_fairseq: ", name, ": grid dimension ", d, " is ",
                grid[d], ", beyond a 32-bit int (the input is too large for one launch)");
}

// Triton's JIT launch of the call (in Python); with ``hold``, the variant's ABI it gives back, or none.
Variant through_jit(int kernel, const std::array<int64_t, 3>& grid, const Args& args, const Values& values,
                    bool hold) {
  py::gil_scoped_acquire gil;
  auto& r = registry();
  const Kernel& k = r.kernels[kernel];
  py::tuple a(args.size());
  for (size_t i = 0; i < args.size(); ++i) a[i] = as_python(args[i]);
  py::dict c;
  for (size_t i = 0; i < values.size(); ++i) {
    const auto& [name, is_bool] = k.constexprs[i];
    c[py::str(name)] = is_bool ? py::object(py::bool_(values[i] != 0)) : py::object(py::int_(values[i]));
  }
  py::object abi = r.from_node(k.jit, py::make_tuple(grid[0], grid[1], grid[2]), a, c, hold);
  Variant v;
  if (abi.is_none()) return v;
  // (function, warps, shared, [argument index], [type], scratch pointers)
  const auto t = abi.cast<py::tuple>();
  const auto where = t[3].cast<std::vector<int>>();
  const auto types = t[4].cast<std::vector<std::string>>();
  TORCH_CHECK(where.size() == types.size() && where.size() + t[5].cast<int>() <= kMaxParams,
              k.name, ": a launch ABI of ", where.size(), " parameters");
  for (size_t i = 0; i < where.size(); ++i) {
    const std::string& ty = types[i];
    const Type type = ty[0] == '*' ? T_PTR : ty == "i32" ? T_I32 : (ty == "i64" || ty == "u64") ? T_I64
                      : ty == "fp32" ? T_FP32 : ty == "fp64" ? T_FP64 : Type(255);
    const int at = where[i];
    TORCH_CHECK(at >= 0 && at < static_cast<int>(args.size()) && type != Type(255), k.name, ": parameter ", i,
                " of type ", ty, " at argument ", at);
    const auto kind = args[at].kind;
    TORCH_CHECK((type == T_PTR) == (kind == Arg::PTR) && ((type == T_FP32 || type == T_FP64) == (kind == Arg::FLOAT)),
                k.name, ": argument ", at, " does not fit parameter ", i, " of type ", ty);
    v.params.emplace_back(at, type);
  }
  v.function = reinterpret_cast<CUfunction>(t[0].cast<uintptr_t>());
  v.block = 32 * t[1].cast<unsigned>();
  v.shared = t[2].cast<unsigned>();
  v.scratch = t[5].cast<int>();
  v.compiled = std::shared_ptr<py::object>(new py::object(t[6]), [](py::object* o) {
    py::gil_scoped_acquire gil;  // (a variant may be dropped in a thread that does not hold it)
    delete o;
  });
  check(driver().current_context(&v.context), "cuCtxGetCurrent");
  return v;
}

void launch_held(const Kernel& k, const Variant& v, const std::array<int64_t, 3>& grid, const Args& args,
                 const Target& to) {
  CUcontext context = nullptr;
  check(driver().current_context(&context), "cuCtxGetCurrent");
  if (context == nullptr) {  // a thread with none (a backward in autograd's thread, a serving thread): as Triton's
    int dev = 0;             // launcher, the device's primary context made current
    check(driver().device(&dev, to.device), "cuDeviceGet");
    check(driver().primary(&context, dev), "cuDevicePrimaryCtxRetain");
    check(driver().set_current(context), "cuCtxSetCurrent");
  }
  TORCH_CHECK(context == v.context, "powernorm_fairseq: ", k.name, " on device ", to.device,
              ": the current CUDA context is not the one its kernel was loaded in (set the device with "
              "torch.cuda.set_device or torch.cuda.device before the step)");
  std::array<uint64_t, kMaxParams> storage{};
  std::array<void*, kMaxParams> params{};
  size_t n = 0;
  for (const auto& [at, type] : v.params) {
    const Arg& a = args[at];
    void* slot = &storage[n];
    switch (type) {
      case T_PTR: {
        const auto p = reinterpret_cast<uintptr_t>(a.tensor->data_ptr()) + a.offset * a.tensor->element_size();
        *static_cast<uint64_t*>(slot) = p;
        break;
      }
      case T_I32: *static_cast<int32_t*>(slot) = static_cast<int32_t>(a.i); break;
      case T_I64: *static_cast<int64_t*>(slot) = a.i; break;
      case T_FP32: *static_cast<float*>(slot) = static_cast<float>(a.f); break;
      case T_FP64: *static_cast<double*>(slot) = a.f; break;
    }
    params[n] = slot;
    ++n;
  }
  for (int s = 0; s < v.scratch; ++s, ++n) params[n] = &storage[n];  // null scratch pointers
  if (grid[0] * grid[1] * grid[2] == 0) return;  // as Triton's launcher: nothing to run
  check(driver().launch(v.function, grid[0], grid[1], grid[2], v.block, 1, 1, v.shared, to.stream, params.data(),
                        nullptr),
        "cuLaunchKernel");
}

// Launch ``kernel`` over ``grid`` with ``args`` and the constexprs' ``values``, through its held
// variant, or through Triton's JIT, which gives the variant to hold.
void run(int kernel, std::array<int64_t, 3> grid, const Args& args, const Values& values,
         const Target& to) {
  auto& r = registry();
  const Kernel& k = r.kernels[kernel];
  TORCH_CHECK(args.size() == k.fixed.size() && values.size() == k.constexprs.size(), k.name, ": ", args.size(),
              " arguments and ", values.size(), " constexprs, where the kernel takes ", k.fixed.size(), " and ",
              k.constexprs.size());
  TORCH_CHECK(2 + args.size() + 2 * values.size() <= Key().bytes.size(), k.name, ": too many arguments");
  check_grid(k.name, grid);
  if (r.watched.load(std::memory_order_acquire)) {  // each launch through Triton's JIT, which they see
    through_jit(kernel, grid, args, values, false);
    return;
  }
  Key key;
  key.add(kernel);
  key.add(to.cuda ? to.device : kDevices);
  for (size_t i = 0; i < args.size(); ++i) key.add(specialised(args[i], k.fixed[i]));
  for (int64_t v : values) {
    TORCH_CHECK(v >= 0 && v < 65536, k.name, ": a constexpr of ", v);
    key.add(v & 255), key.add(v >> 8);
  }
  std::shared_ptr<const Variant> v;
  decltype(r.held) dropped;  // destroyed after the lock is released (each releases its kernel under the GIL)
  {
    std::lock_guard<std::mutex> hold(r.lock);
    const uint64_t now = r.changed.load(std::memory_order_acquire);
    if (r.seen != now) {  // something the JIT consults changed: every launch through it again, once
      dropped.swap(r.held);
      r.seen = now;
    }
    auto it = r.held.find(key);
    if (it != r.held.end()) v = it->second;
  }
  if (v == nullptr) {  // Triton's JIT launches it, and gives the variant to hold
    const uint64_t before = r.changed.load(std::memory_order_acquire);
    auto made = std::make_shared<const Variant>(through_jit(kernel, grid, args, values, true));
    std::lock_guard<std::mutex> hold(r.lock);
    if (r.changed.load(std::memory_order_acquire) != before) return;  // changed meanwhile: not held
    if (r.held.size() >= kKeptVariants) dropped.swap(r.held);
    r.held.emplace(key, std::move(made));
    return;
  }
  if (v->function == nullptr) {  // a variant the node cannot launch itself
    through_jit(kernel, grid, args, values, false);
    return;
  }
  launch_held(k, *v, grid, args, to);
  if (r.compare) through_jit(kernel, grid, args, values, false);
}

// Something Triton's JIT consults at each launch may have changed: the held variants are dropped.
void triton_changed() { registry().changed.fetch_add(1, std::memory_order_acq_rel); }

}  // namespace launch
