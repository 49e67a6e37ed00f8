// CopyEngine: runs one step's per-layer transfer batches on its own thread, so that layer i's
// attention waits only for layer i's loads (DESIGN.md: "posts all layers' loads now, layer order;
// signals LayerReady[i]").
//
// Concurrency model: one copy thread owns every handle and makes every post/poll/release call.
// The caller (the engine loop, one thread) calls submit_step / wait_layer / stats; it calls
// Transport::prepare itself inside submit_step so that a bad batch is rejected synchronously.
// mu_ guards the per-layer results of the current step (read by wait_layer) and the hand-off
// queue; the copy thread never holds mu_ across a transport call.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/transport.h"

namespace specontext::transport {

struct LayerBatch {
  LayerId layer;
  std::vector<TransferRequest> requests;
};

struct CopyEngineConfig {
  // Retries of a transfer that failed with kUnavailable (transient); 0 = fail at once.
  int max_retries = 3;
  // Re-posts after NO_RESOURCE; back-pressure is expected, so the bound is high (the layer
  // timeout bounds it in time as well).
  int max_no_resource_retries = 100000;
  std::chrono::microseconds retry_backoff{50};
  // How often the copy thread polls in-flight transfers.
  std::chrono::microseconds poll_interval{20};
  // A layer not complete this long after submit_step is cancelled and fails with kUnavailable.
  std::chrono::milliseconds layer_timeout{10000};
  // wait_layer gives up after this long with kUnavailable (a safety net above layer_timeout).
  std::chrono::milliseconds wait_timeout{15000};
};

struct LayerCopyStats {
  LayerId layer;
  uint64_t bytes = 0;            // bytes of the layer's batch (moved when status is OK)
  int retries = 0;               // transient-failure retries
  int no_resource = 0;           // NO_RESOURCE re-posts
  double copy_seconds = 0;       // submit_step → terminal
  double wait_seconds = 0;       // time callers spent blocked in wait_layer for this layer
  std::chrono::steady_clock::time_point completed_at{};
};

struct CopyStats {
  uint64_t bytes_moved = 0;    // over all steps, completed layers only
  double wait_seconds = 0;     // over all steps
  uint64_t steps = 0;
  std::vector<LayerCopyStats> layers;  // of the current (last) step, in layer order
};

class CopyEngine {
 public:
  // `transport` must outlive the engine; its tiers are registered by the caller beforehand.
  static Result<std::unique_ptr<CopyEngine>> create(Transport& transport,
                                                    CopyEngineConfig config = {});
  // Cancels the step in flight (releasing its handles) and joins the copy thread. No thread may
  // be blocked in wait_layer while the destructor runs.
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // Accepts one step's batches; they are posted in increasing layer order. All or nothing: every
  // batch is prepared first, and on any error nothing is posted and the error names the layer.
  // Fails if the previous step still has layers in flight (wait for them first). Caller thread.
  Status submit_step(std::vector<LayerBatch> batches);

  // Blocks until `layer` of the current step is complete; returns its error if it failed (after
  // retries) or kUnavailable naming the layer after wait_timeout. A layer with no batch in the
  // current step has nothing to wait for: OK. Caller thread.
  Status wait_layer(LayerId layer);

  // Waits for every layer of the current step; the first error in layer order.
  Status wait_all();

  CopyStats stats() const;

 private:
  CopyEngine(Transport& transport, CopyEngineConfig config);
  using Clock = std::chrono::steady_clock;

  // Owned by the copy thread once handed over.
  struct Work {
    LayerId layer;
    std::vector<TransferRequest> requests;
    TransferHandle handle;
    bool posted = false;
    int retries = 0;
    int no_resource = 0;
    Clock::time_point submitted_at{};
    Clock::time_point next_try{};
  };
  // Shared with the caller under mu_.
  struct LayerResult {
    LayerCopyStats stats;
    bool done = false;
    Status status;
  };

  void copy_loop();
  // One non-blocking step of a layer's state machine; returns true when terminal.
  bool advance(Work& w, Clock::time_point now, Status& result);
  bool on_failure(Work& w, Status failure, Clock::time_point now, Status& result);
  void finish(Work& w, Status result);
  LayerResult* find_result(LayerId layer);  // requires mu_

  Transport& transport_;
  const CopyEngineConfig config_;

  mutable std::mutex mu_;
  std::condition_variable cv_;        // to the copy thread: new work or stop
  std::condition_variable done_cv_;   // to waiters: a layer reached a terminal state
  std::vector<Work> handoff_;         // submitted, not yet taken by the copy thread
  std::vector<LayerResult> results_;  // current step, in layer order
  uint64_t bytes_moved_ = 0;
  double wait_seconds_ = 0;
  uint64_t steps_ = 0;
  bool stop_ = false;
  std::thread thread_;  // last member: started after everything above exists
};

}  // namespace specontext::transport
