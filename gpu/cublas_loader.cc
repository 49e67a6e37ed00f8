#include "gpu/cublas_loader.h"

#include <dlfcn.h>

#include <string>

namespace specontext::gpu {

namespace {

struct Loaded {
  CublasApi api;
  Status status;
};

template <typename Fn>
bool bind(void* lib, const char* symbol, Fn* out, std::string* missing) {
  *out = reinterpret_cast<Fn>(dlsym(lib, symbol));
  if (*out == nullptr && missing->empty()) *missing = symbol;
  return *out != nullptr;
}

Loaded load() {
  Loaded l;
  const std::string soname = "libcublas.so." + std::to_string(CUBLAS_VER_MAJOR);
  void* lib = dlopen(soname.c_str(), RTLD_NOW | RTLD_LOCAL);
  std::string first_error = lib == nullptr ? dlerror() : "";
#ifdef SPX_CUDA_LIBRARY_DIR
  if (lib == nullptr) lib = dlopen((std::string(SPX_CUDA_LIBRARY_DIR) + "/" + soname).c_str(), RTLD_NOW | RTLD_LOCAL);
#endif
  if (lib == nullptr) {
    l.status = unavailable("no cuBLAS: cannot open " + soname + " (" + first_error + ")");
    return l;
  }
  std::string missing;
  CublasApi& a = l.api;
  bind(lib, "cublasCreate_v2", &a.create, &missing);
  bind(lib, "cublasDestroy_v2", &a.destroy, &missing);
  bind(lib, "cublasSetStream_v2", &a.set_stream, &missing);
  bind(lib, "cublasSetMathMode", &a.set_math_mode, &missing);
  bind(lib, "cublasSetPointerMode_v2", &a.set_pointer_mode, &missing);
  bind(lib, "cublasGemmEx", &a.gemm_ex, &missing);
  bind(lib, "cublasGetStatusName", &a.status_name, &missing);
  bind(lib, "cublasGetStatusString", &a.status_string, &missing);
  if (!missing.empty()) l.status = unavailable("no cuBLAS: " + soname + " lacks the symbol " + missing);
  return l;  // the library stays open for the process's lifetime
}

}  // namespace

Result<const CublasApi*> cublas_api() {
  static const Loaded loaded = load();  // C++ guarantees one thread-safe initialisation
  if (!loaded.status.is_ok()) return loaded.status;
  return &loaded.api;
}

}  // namespace specontext::gpu
