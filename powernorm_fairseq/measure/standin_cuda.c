/* A stand-in for the CUDA driver (libcuda.so.1) on a machine without a GPU.
 *
 * It implements the driver entry points that Triton's launcher uses, with an
 * H100's device attributes, and returns at once: no kernel runs. Every launch
 * is recorded (the function's name, grid, block, dynamic shared memory,
 * stream and each parameter's bytes), so that a test can hold what a
 * launcher would send a GPU, and a benchmark can time the host code around
 * it. A parameter's size is the one registered for the kernel's name
 * (standin_set_params, from the kernel's PTX .entry); without one, the
 * launch records no parameter bytes. Each function a module gives is one
 * compiled variant, with the sizes registered for its name just before.
 *
 * As the driver: the current context is the calling thread's (none in a new
 * thread until a context is made current; standin_set_context makes a wrong
 * one current), and a function whose module was unloaded is an invalid
 * handle (CUDA_ERROR_INVALID_HANDLE, counted by standin_invalid).
 *
 * Built by powernorm_fairseq/measure/standin.py with `cc -shared -fPIC`, as libcuda.so.1.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "cuda.h"

#define MAX_LAUNCHES 4096
#define MAX_PARAMS 64
#define MAX_KERNELS 256
#define MAX_BYTES 1024

typedef struct {
  int loaded;
} module_t;

typedef struct {
  char name[128];
  int n;
  int sizes[MAX_PARAMS];
  module_t *module;
} kernel_t;

typedef struct {
  kernel_t *kernel;
  unsigned grid[3], block[3], shared;
  uint64_t stream;
  int n;
  unsigned char bytes[MAX_BYTES];
  int size;
} launch_t;

static kernel_t kernels[MAX_KERNELS];
static int n_kernels = 0;
static launch_t launches[MAX_LAUNCHES];
static int n_launches = 0;
static int dropped = 0;
static int invalid = 0;
static int context_dummy, other_context;
static __thread CUcontext current = NULL;  /* each thread's current context */
static module_t modules[MAX_KERNELS];
static int n_modules = 0;

static kernel_t pending[MAX_KERNELS];  /* parameter sizes registered by name, for the next function of that name */
static int n_pending = 0;

static kernel_t *pending_named(const char *name, int make) {
  for (int i = 0; i < n_pending; i++)
    if (strcmp(pending[i].name, name) == 0) return &pending[i];
  if (!make || n_pending == MAX_KERNELS) return NULL;
  kernel_t *k = &pending[n_pending++];
  strncpy(k->name, name, sizeof(k->name) - 1);
  k->n = -1;
  return k;
}

/* ---- what the harness calls ---- */

/* The sizes of the parameters of the next function named `name` that a module gives (a compiled variant's own). */
int standin_set_params(const char *name, int n, const int *sizes) {
  kernel_t *k = pending_named(name, 1);
  if (k == NULL || n > MAX_PARAMS) return -1;
  k->n = n;
  memcpy(k->sizes, sizes, n * sizeof(int));
  return 0;
}

int standin_launches(void) { return n_launches; }
int standin_dropped(void) { return dropped; }
int standin_invalid(void) { return invalid; }
void standin_clear(void) { n_launches = 0; dropped = 0; invalid = 0; }
/* This thread's current context: 0 none, 1 the device's primary context, 2 another one. */
void standin_set_context(int which) {
  current = which == 0 ? NULL : which == 1 ? (CUcontext)&context_dummy : (CUcontext)&other_context;
}

/* The i-th launch: its kernel's name and function (one per compiled variant, numbered as the modules gave
 * them), grid, block, shared memory, stream, parameter count, sizes and bytes. */
int standin_launch(int i, char *name, int *function, unsigned *grid, unsigned *block, unsigned *shared,
                   uint64_t *stream, int *n, int *sizes, unsigned char *bytes, int *size) {
  if (i < 0 || i >= n_launches) return -1;
  launch_t *l = &launches[i];
  strcpy(name, l->kernel ? l->kernel->name : "?");
  *function = l->kernel ? (int)(l->kernel - kernels) : -1;
  if (l->n > 0) memcpy(sizes, l->kernel->sizes, l->n * sizeof(int));
  memcpy(grid, l->grid, sizeof(l->grid));
  memcpy(block, l->block, sizeof(l->block));
  *shared = l->shared;
  *stream = l->stream;
  *n = l->n;
  memcpy(bytes, l->bytes, l->size);
  *size = l->size;
  return 0;
}

static CUresult record(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by, unsigned bz,
                       unsigned shared, CUstream stream, void **params) {
  kernel_t *k = (kernel_t *)f;
  if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
  if (k != NULL && k->module != NULL && !k->module->loaded) {
    invalid++;
    return CUDA_ERROR_INVALID_HANDLE;
  }
  if (n_launches == MAX_LAUNCHES) {
    dropped++;
    return CUDA_SUCCESS;
  }
  launch_t *l = &launches[n_launches++];
  l->kernel = (kernel_t *)f;
  l->grid[0] = gx, l->grid[1] = gy, l->grid[2] = gz;
  l->block[0] = bx, l->block[1] = by, l->block[2] = bz;
  l->shared = shared;
  l->stream = (uint64_t)(uintptr_t)stream;
  l->n = l->kernel ? l->kernel->n : -1;
  l->size = 0;
  for (int p = 0; p < l->n && params != NULL; p++) {
    int s = l->kernel->sizes[p];
    if (l->size + s > MAX_BYTES) break;
    memcpy(l->bytes + l->size, params[p], s);
    l->size += s;
  }
  return CUDA_SUCCESS;
}

/* ---- the driver ---- */

CUresult CUDAAPI cuInit(unsigned int flags) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuDriverGetVersion(int *version) { *version = 12080; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGetCount(int *count) { *count = 1; return CUDA_SUCCESS; }
CUresult CUDAAPI cuDeviceGet(CUdevice *device, int ordinal) { *device = ordinal; return CUDA_SUCCESS; }

CUresult CUDAAPI cuDeviceGetAttribute(int *pi, CUdevice_attribute attrib, CUdevice dev) {
  switch ((int)attrib) {  /* an H100 SXM */
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: *pi = 9; break;
    case CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: *pi = 0; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN: *pi = 232448; break;
    case CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK: *pi = 49152; break;
    case CU_DEVICE_ATTRIBUTE_MAX_REGISTERS_PER_BLOCK: *pi = 65536; break;
    case CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT: *pi = 132; break;
    case CU_DEVICE_ATTRIBUTE_WARP_SIZE: *pi = 32; break;
    case CU_DEVICE_ATTRIBUTE_CLOCK_RATE: *pi = 1980000; break;
    case CU_DEVICE_ATTRIBUTE_MEMORY_CLOCK_RATE: *pi = 2619000; break;
    case CU_DEVICE_ATTRIBUTE_GLOBAL_MEMORY_BUS_WIDTH: *pi = 5120; break;
    case CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_BLOCK: *pi = 1024; break;
    default: *pi = 0;
  }
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuDevicePrimaryCtxRetain(CUcontext *pctx, CUdevice dev) {
  *pctx = (CUcontext)&context_dummy;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuCtxGetCurrent(CUcontext *pctx) { *pctx = current; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetCurrent(CUcontext ctx) { current = ctx; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetDevice(CUdevice *device) { *device = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxGetLimit(size_t *pvalue, CUlimit limit) { *pvalue = 0; return CUDA_SUCCESS; }
CUresult CUDAAPI cuCtxSetLimit(CUlimit limit, size_t value) { return CUDA_SUCCESS; }

CUresult CUDAAPI cuModuleLoadData(CUmodule *module, const void *image) {
  if (current == NULL) return CUDA_ERROR_INVALID_CONTEXT;
  if (n_modules == MAX_KERNELS) return CUDA_ERROR_OUT_OF_MEMORY;
  module_t *m = &modules[n_modules++];
  m->loaded = 1;
  *module = (CUmodule)m;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleUnload(CUmodule hmod) {
  ((module_t *)hmod)->loaded = 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuModuleGetFunction(CUfunction *hfunc, CUmodule hmod, const char *name) {
  if (n_kernels == MAX_KERNELS) return CUDA_ERROR_OUT_OF_MEMORY;
  kernel_t *k = &kernels[n_kernels++];  /* a function of its own per module: each compiled variant */
  kernel_t *sizes = pending_named(name, 0);
  if (sizes != NULL) *k = *sizes;
  else {
    strncpy(k->name, name, sizeof(k->name) - 1);
    k->n = -1;
  }
  k->module = (module_t *)hmod;
  *hfunc = (CUfunction)k;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncGetAttribute(int *pi, CUfunction_attribute attrib, CUfunction hfunc) {
  *pi = attrib == CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK ? 1024 : 0;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuFuncSetAttribute(CUfunction hfunc, CUfunction_attribute attrib, int value) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuFuncSetCacheConfig(CUfunction hfunc, CUfunc_cache config) { return CUDA_SUCCESS; }
CUresult CUDAAPI cuOccupancyMaxActiveClusters(int *n, CUfunction func, const CUlaunchConfig *config) {
  *n = 1;
  return CUDA_SUCCESS;
}

CUresult CUDAAPI cuPointerGetAttribute(void *data, CUpointer_attribute attribute, CUdeviceptr ptr) {
  if (attribute == CU_POINTER_ATTRIBUTE_DEVICE_POINTER) *(CUdeviceptr *)data = ptr;  /* host memory stands in */
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuPointerGetAttributes(unsigned int n, CUpointer_attribute *attributes, void **data,
                                        CUdeviceptr ptr) {
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuStreamIsCapturing(CUstream stream, CUstreamCaptureStatus *status) {
  *status = CU_STREAM_CAPTURE_STATUS_NONE;
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuGetErrorString(CUresult error, const char **str) {
  *str = "stand-in driver";
  return CUDA_SUCCESS;
}
CUresult CUDAAPI cuTensorMapEncodeTiled(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank, void *address,
                                        const cuuint64_t *dim, const cuuint64_t *strides, const cuuint32_t *box,
                                        const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
                                        CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                        CUtensorMapFloatOOBfill fill) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
CUresult CUDAAPI cuTensorMapEncodeIm2col(CUtensorMap *map, CUtensorMapDataType type, cuuint32_t rank, void *address,
                                         const cuuint64_t *dim, const cuuint64_t *strides, const int *lower,
                                         const int *upper, cuuint32_t channels, cuuint32_t pixels,
                                         const cuuint32_t *element_strides, CUtensorMapInterleave interleave,
                                         CUtensorMapSwizzle swizzle, CUtensorMapL2promotion l2,
                                         CUtensorMapFloatOOBfill fill) {
  return CUDA_ERROR_NOT_SUPPORTED;
}

CUresult CUDAAPI cuLaunchKernelEx(const CUlaunchConfig *c, CUfunction f, void **params, void **extra) {
  return record(f, c->gridDimX, c->gridDimY, c->gridDimZ, c->blockDimX, c->blockDimY, c->blockDimZ,
                c->sharedMemBytes, c->hStream, params);
}
CUresult CUDAAPI cuLaunchKernel(CUfunction f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                unsigned bz, unsigned shared, CUstream stream, void **params, void **extra) {
  return record(f, gx, gy, gz, bx, by, bz, shared, stream, params);
}
