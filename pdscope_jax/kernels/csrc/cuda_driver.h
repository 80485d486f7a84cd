// The CUDA driver entry points the bridge uses, looked up once through dlopen (libcuda.so.1), so the bridge
// builds without the CUDA toolkit. `driver().problem` is empty when every entry point was found.
#pragma once

#include <dlfcn.h>

#include <cstdint>
#include <initializer_list>
#include <string>

struct CUstream_st;
struct CUctx_st;

namespace pdscope_cuda {

using CUstream = CUstream_st*;
using CUcontext = CUctx_st*;
using CUresult = int;
using CUdeviceptr = unsigned long long;

constexpr unsigned kHostAllocPortable = 1, kHostAllocDeviceMap = 2;
constexpr unsigned kWaitGeq = 1;  // CU_STREAM_WAIT_VALUE_GEQ: (int32_t)(*addr - value) >= 0
constexpr unsigned kWriteDefault = 0;
constexpr unsigned kStreamNonBlocking = 1;

// The driver entry points used, looked up once.
struct Driver {
  CUresult (*init)(unsigned) = nullptr;
  CUresult (*device_get)(int*, int) = nullptr;
  CUresult (*primary_ctx_retain)(CUcontext*, int) = nullptr;
  CUresult (*ctx_push)(CUcontext) = nullptr;
  CUresult (*ctx_pop)(CUcontext*) = nullptr;
  CUresult (*host_alloc)(void**, size_t, unsigned) = nullptr;
  CUresult (*host_free)(void*) = nullptr;
  CUresult (*host_device_pointer)(CUdeviceptr*, void*, unsigned) = nullptr;
  CUresult (*dtoh)(void*, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*htod)(CUdeviceptr, const void*, size_t, CUstream) = nullptr;
  CUresult (*dtod)(CUdeviceptr, CUdeviceptr, size_t, CUstream) = nullptr;
  CUresult (*write32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*wait32)(CUstream, CUdeviceptr, uint32_t, unsigned) = nullptr;
  CUresult (*ctx_set_current)(CUcontext) = nullptr;
  CUresult (*stream_create)(CUstream*, unsigned) = nullptr;
  CUresult (*stream_destroy)(CUstream) = nullptr;
  CUresult (*error_string)(CUresult, const char**) = nullptr;
  std::string problem;  // empty when every entry point was found
};

template <typename F>
inline void find(void* lib, F& fn, std::initializer_list<const char*> names, std::string& problem) {
  for (const char* name : names)
    if (void* sym = dlsym(lib, name)) {
      fn = reinterpret_cast<F>(sym);
      return;
    }
  if (problem.empty()) problem = std::string("libcuda.so.1 has no ") + *names.begin();
}

inline const Driver& driver() {
  static const Driver d = [] {
    Driver d;
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
      d.problem = "no CUDA driver (libcuda.so.1)";
      return d;
    }
    std::string& p = d.problem;
    find(lib, d.init, {"cuInit"}, p);
    find(lib, d.device_get, {"cuDeviceGet"}, p);
    find(lib, d.primary_ctx_retain, {"cuDevicePrimaryCtxRetain"}, p);
    find(lib, d.ctx_push, {"cuCtxPushCurrent_v2", "cuCtxPushCurrent"}, p);
    find(lib, d.ctx_pop, {"cuCtxPopCurrent_v2", "cuCtxPopCurrent"}, p);
    find(lib, d.host_alloc, {"cuMemHostAlloc"}, p);
    find(lib, d.host_free, {"cuMemFreeHost"}, p);
    find(lib, d.host_device_pointer, {"cuMemHostGetDevicePointer_v2", "cuMemHostGetDevicePointer"}, p);
    find(lib, d.dtoh, {"cuMemcpyDtoHAsync_v2", "cuMemcpyDtoHAsync"}, p);
    find(lib, d.htod, {"cuMemcpyHtoDAsync_v2", "cuMemcpyHtoDAsync"}, p);
    find(lib, d.dtod, {"cuMemcpyDtoDAsync_v2", "cuMemcpyDtoDAsync"}, p);
    find(lib, d.write32, {"cuStreamWriteValue32_v2", "cuStreamWriteValue32"}, p);
    find(lib, d.wait32, {"cuStreamWaitValue32_v2", "cuStreamWaitValue32"}, p);
    find(lib, d.error_string, {"cuGetErrorString"}, p);
    find(lib, d.ctx_set_current, {"cuCtxSetCurrent"}, p);
    find(lib, d.stream_create, {"cuStreamCreate"}, p);
    find(lib, d.stream_destroy, {"cuStreamDestroy_v2", "cuStreamDestroy"}, p);
    return d;
  }();
  return d;
}

inline std::string cu_message(CUresult r) {
  const char* s = nullptr;
  if (driver().error_string) driver().error_string(r, &s);
  return s ? s : ("CUDA error " + std::to_string(r));
}

}  // namespace pdscope_cuda
