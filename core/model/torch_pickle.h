// The subset of Python's pickle that torch.save writes for a state dict (data.pkl inside a
// PyTorch zip checkpoint), interpreted without executing anything.
//
// Hand-written because nothing packaged for Debian reads torch pickles from C++ (libtorch is
// not packaged as a C++ library there, and it would be a very large dependency for ~20 tensors).
// The interpreter knows a fixed set of opcodes (protocols 2-5 as torch emits them; see
// torch_pickle.cc) and a fixed set of globals: collections.OrderedDict,
// torch._utils._rebuild_tensor_v2, torch._utils._rebuild_parameter(_with_state) and the
// torch.<Type>Storage classes. Any other global (os.system, builtins.eval, ...) is refused
// before anything is built. It never recurses (the object graph is an arena of indices, so
// cycles are harmless), and its stack, memo, mark depth and object count are bounded.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/base/dtype.h"
#include "core/base/status.h"

namespace specontext {

// A torch.<Type>Storage class and the safetensors-style dtype name of its elements.
struct TorchStorageType {
  const char* class_name;  // "FloatStorage"
  const char* dtype_name;  // "F32" (safetensors spelling, so errors read the same for both formats)
  size_t element_size;
  bool supported;  // maps to a DType this project handles
  DType dtype;     // meaningful only when supported
};

// One tensor of the pickled dict, as _rebuild_tensor_v2 describes it: a view of storage
// `storage_key` (zip entry <archive>/data/<key>) of `storage_numel` elements.
struct TorchTensorRecord {
  std::string name;
  const TorchStorageType* storage_type = nullptr;
  std::string storage_key;
  int64_t storage_numel = 0;
  int64_t storage_offset = 0;  // in elements
  std::vector<int64_t> shape;
  std::vector<int64_t> stride;  // in elements
};

// Runs data.pkl. The pickled object must be a dict (or OrderedDict); its entries with a string
// key and a tensor value are returned in pickle order (a repeated key: the last one counts).
// Other entries (numbers, strings, nested dicts) are skipped. Shapes and strides are returned
// as pickled: the caller checks them against the storage (see TorchZipFile). `source` names the
// file in errors.
[[nodiscard]] Result<std::vector<TorchTensorRecord>> read_torch_pickle(const uint8_t* data, size_t size,
                                                                       const std::string& source);

}  // namespace specontext
