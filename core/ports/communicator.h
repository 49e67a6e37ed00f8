// Collectives among the ranks of one tensor-parallel group: one Engine per rank, each holding
// its slice of the attention heads, KV heads and MLP (core/engine/tensor_parallel.h). Implementations:
// cpu::ThreadCommunicator (ranks are threads of one process; tests and CPU runs) and
// gpu::NcclCommunicator (one GPU per rank).
//
// Contract (as NCCL's): every rank calls the same collectives in the same order with the same
// counts. Buffers are in the calling rank's backend memory. A collective returns once this
// rank's result is complete, or with an error: kUnavailable when a peer failed or did not join
// within the implementation's timeout (never a hang), kInvalidArgument on mismatched counts.
// After an error the communicator is unusable (every later call fails fast).
#pragma once

#include <cstdint>

#include "core/base/status.h"

namespace specontext {

class Communicator {
 public:
  virtual ~Communicator() = default;
  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // data[0, count) = Σ over ranks of each rank's data[0, count), in place.
  virtual Status all_reduce_sum(float* data, int64_t count) = 0;
};

}  // namespace specontext
