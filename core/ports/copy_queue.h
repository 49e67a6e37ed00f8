// The engine's view of a copy engine: batches of transfers between registered tiers, run on the
// implementation's own thread(s) (transport::CopyEngine over a Transport), so that the loads of
// layer i+1 proceed while layer i computes and a layer waits only for its own tickets.
// Declared here so that core/ knows no transport implementation (DESIGN.md: core declares the
// interfaces).
//
// Threads: one caller thread (the engine loop) makes every call. Buffers named by a ticket's
// requests must stay valid until wait() on that ticket has returned; after that the copy engine
// no longer touches them, whatever the status.
#pragma once

#include <array>
#include <cstdint>
#include <vector>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/transport.h"

namespace specontext {

enum class CopyDirection : uint8_t { kLoad, kStore, kMigrate };  // home→compute, compute→home, tier→tier
inline constexpr int kNumCopyDirections = 3;

struct CopyTicket {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
};

// Figures of a window the caller delimits with reset_window() (the engine: one forward).
struct CopyWindowStats {
  std::array<uint64_t, kNumCopyDirections> bytes{};     // completed, per direction
  std::array<uint64_t, kNumCopyDirections> requests{};  // completed transfer requests
  double busy_seconds = 0;  // wall time with at least one transfer of the window in flight
  double wait_seconds = 0;  // time the caller was blocked in wait() / wait_all()
  int64_t retries = 0;
  int64_t no_resource = 0;
  int64_t failures = 0;
};

class CopyQueue {
 public:
  virtual ~CopyQueue() = default;
  // Prepares the batch now (a bad batch fails here and names the layer), then posts it in
  // submission order on the copy thread. An empty batch completes at once.
  virtual Result<CopyTicket> submit(LayerId layer, CopyDirection direction,
                                    std::vector<TransferRequest> requests) = 0;
  // Blocks until the ticket is terminal (bounded: kUnavailable naming the layer on timeout) and
  // returns its status. Each ticket is waited once.
  virtual Status wait(CopyTicket ticket) = 0;
  // Every ticket not yet waited; the first error in submission order.
  virtual Status wait_all() = 0;
  virtual void reset_window() = 0;
  virtual CopyWindowStats window_stats() const = 0;
};

}  // namespace specontext
