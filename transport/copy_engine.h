// CopyEngine: runs batches of transfers (tickets) on its own thread, so that the engine's loads of
// layer i+1 proceed while layer i computes, and a layer waits only for its own tickets
// (DESIGN.md: "posts all layers' loads now, layer order; signals LayerReady[i]").
//
// Two front ends over one mechanism:
//   - tickets: submit(layer, direction, requests) → CopyTicket; wait(ticket); wait_all();
//     window statistics (reset_window / window_stats) for one decode step;
//   - steps (the first API, kept): submit_step(batches) / wait_layer(layer) / wait_all(); each
//     batch of a step is one ticket.
//
// Concurrency model:
//   - One caller thread (the engine loop) makes every public call. The calls are internally
//     synchronized, so a second thread would not corrupt state, but two threads waiting on one
//     ticket, or submit_step racing wait_layer, are not supported.
//   - submit / submit_step call Transport::prepare on the caller thread, so a bad batch fails
//     synchronously and names its layer.
//   - One copy thread owns every prepared handle after hand-off and makes every post, poll and
//     release call, in submission order. Several tickets are in flight at once; they complete in
//     whatever order the transport finishes them.
//   - mu_ guards the hand-off vector, the ticket table, the current step and all statistics. The
//     copy thread never holds mu_ across a transport call, and the caller holds it only while it
//     is not calling the transport, so there is no lock nesting.
//
// Buffers: the memory named by a ticket's requests must stay valid until wait() (or wait_layer /
// wait_all) has returned for it; after that the transport no longer touches it, whatever the
// status (a ticket that times out is cancelled before the wait returns).
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <thread>
#include <vector>

#include "core/ports/copy_queue.h"
#include "core/ports/transport.h"

namespace specontext::transport {

// The ticket types and the interface the engine drives are core's (core/ports/copy_queue.h).
using specontext::CopyDirection;
using specontext::CopyTicket;
using specontext::CopyWindowStats;
using specontext::kNumCopyDirections;
std::string_view copy_direction_name(CopyDirection direction);  // "load", "store", "migrate"

struct LayerBatch {
  LayerId layer;
  std::vector<TransferRequest> requests;
  CopyDirection direction = CopyDirection::kLoad;
};

struct CopyEngineConfig {
  // Retries of a transfer that failed with kUnavailable (transient); 0 = fail at once.
  int max_retries = 3;
  // Re-posts after NO_RESOURCE; back-pressure is expected, so the bound is high (the ticket
  // timeout bounds it in time as well).
  int max_no_resource_retries = 100000;
  std::chrono::microseconds retry_backoff{50};
  // How often the copy thread polls in-flight transfers.
  std::chrono::microseconds poll_interval{20};
  // A ticket not complete this long after its submission is cancelled and fails with
  // kUnavailable naming its layer (the name says "layer" because the engine's tickets are
  // per-layer batches).
  std::chrono::milliseconds layer_timeout{10000};
  // A wait gives up after this long (a safety net above layer_timeout): the ticket is cancelled
  // on the copy thread, and the wait returns kUnavailable naming the layer once the transport has
  // let go of its buffers.
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
  uint64_t bytes_moved = 0;    // since creation, every ticket completed OK (steps and submits)
  double wait_seconds = 0;     // since creation, every wait
  uint64_t steps = 0;          // submit_step calls accepted
  std::vector<LayerCopyStats> layers;  // of the current (last) step, in layer order
};

class CopyEngine final : public CopyQueue {
 public:
  // `transport` must outlive the engine; its tiers are registered by the caller beforehand.
  static Result<std::unique_ptr<CopyEngine>> create(Transport& transport,
                                                    CopyEngineConfig config = {});
  // Cancels every ticket in flight (releasing its handles) and joins the copy thread. No thread
  // may be blocked in a wait while the destructor runs. Destroy the engine before its transport.
  ~CopyEngine() override;
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  // ---- tickets ----

  // Prepares `requests` now (a bad batch fails here: the transport's error, which names the
  // request index and tier, with "copy engine: layer N" in front; nothing is submitted). The copy
  // thread then posts it in submission order. `layer` must be valid: it names the ticket in
  // errors and statistics. An empty batch gets a ticket that is complete (OK) at once.
  Result<CopyTicket> submit(LayerId layer, CopyDirection direction,
                            std::vector<TransferRequest> requests) override;

  // Blocks until the ticket is terminal and returns its status (after retries: OK, or the
  // transport's error with "copy engine: layer N" context). After wait_timeout the ticket is
  // cancelled and the result is kUnavailable naming the layer and "wait_timeout". Whatever it
  // returns, the transport no longer touches the ticket's buffers, and the ticket is consumed:
  // waiting it again, or waiting an unknown ticket, is kInvalidArgument. (One exception: if the
  // copy thread does not answer the cancellation within another wait_timeout, which only a
  // transport whose calls block can cause, the result is kInternal and the ticket stays
  // outstanding with its buffers possibly in use.)
  Status wait(CopyTicket ticket) override;

  // Non-blocking: whether the ticket is terminal. kInvalidArgument for an unknown or consumed
  // ticket.
  Result<bool> is_complete(CopyTicket ticket) const;

  // Waits for every outstanding ticket (submitted and not yet waited, including the current
  // step's layers), all within one wait_timeout; the first error in submission order. Errors
  // already returned by an earlier wait or wait_layer are not repeated.
  Status wait_all() override;

  // Tickets submitted and not yet waited.
  size_t outstanding() const;

  // Starts a new statistics window (zeroes the window's counters).
  void reset_window() override;
  CopyWindowStats window_stats() const override;

  // ---- steps ----

  // Accepts one step's batches, one ticket each, submitted in increasing layer order. All or
  // nothing: every batch is prepared first; on any error nothing is submitted and the error names
  // the layer. Fails if a layer of the previous step is still in flight (wait for it first); the
  // previous step's results are dropped (its unwaited tickets are consumed).
  Status submit_step(std::vector<LayerBatch> batches);

  // Blocks until `layer` of the current step is terminal; returns its status as wait() does. A
  // layer with no batch in the current step has nothing to wait for: OK. Waiting a layer again
  // returns the same status without blocking.
  Status wait_layer(LayerId layer);

  // Cumulative figures and the current step's per-layer figures.
  CopyStats stats() const;

 private:
  CopyEngine(Transport& transport, CopyEngineConfig config);
  using Clock = std::chrono::steady_clock;

  // One ticket's transfer, owned by the copy thread once handed over.
  struct Work {
    uint64_t ticket = 0;
    LayerId layer;
    CopyDirection direction = CopyDirection::kLoad;
    std::vector<TransferRequest> requests;  // kept for the fresh prepare of a retry
    uint64_t bytes = 0;
    TransferHandle handle;
    bool posted = false;
    bool cancel = false;  // a wait timed out: cancel at the next round
    int retries = 0;
    int no_resource = 0;
    Clock::time_point submitted_at{};
    Clock::time_point next_try{};
  };
  enum class TicketState : uint8_t { kPending, kDone, kConsumed };
  // One ticket as the caller sees it; under mu_.
  struct TicketSlot {
    LayerId layer;
    CopyDirection direction = CopyDirection::kLoad;
    TicketState state = TicketState::kPending;
    bool cancel = false;    // set by a wait that timed out; the copy thread then cancels it
    int32_t step_index = -1;  // index into step_ when the ticket is a layer of the current step
    uint64_t bytes = 0;
    uint64_t requests = 0;
    Status status;
  };
  // One layer of the current step; under mu_.
  struct StepLayer {
    LayerCopyStats stats;
    uint64_t ticket = 0;
    bool consumed = false;  // waited: `status` holds the result
    Status status;
  };

  // Prepares one batch on the caller thread (no lock held).
  Result<Work> prepare_work(LayerId layer, CopyDirection direction,
                            std::vector<TransferRequest>& requests, Clock::time_point now);
  // Adds one ticket per work, hands the works to the copy thread and returns the first ticket's
  // id; with first_step_index >= 0 the works are the current step's layers. Requires mu_.
  uint64_t publish_locked(std::span<Work> works, int32_t first_step_index);
  TicketSlot* find_slot(uint64_t id);  // requires mu_; null when unknown
  const TicketSlot* find_slot(uint64_t id) const;
  StepLayer* find_step_layer(LayerId layer);  // requires mu_
  // Waits for ticket `id` (pending or done, not consumed) until `deadline`, then cancels it;
  // consumes it when terminal. Requires `lock` to hold mu_.
  Status wait_locked(std::unique_lock<std::mutex>& lock, uint64_t id, Clock::time_point deadline);
  void consume_locked(TicketSlot& slot);  // marks consumed and drops consumed slots at the front
  void record_terminal_locked(TicketSlot& slot, Status result, int retries, int no_resource,
                              Clock::time_point submitted_at, Clock::time_point now);

  // Copy thread.
  void copy_loop();
  // One non-blocking step of a ticket's state machine; returns true when terminal.
  bool advance(Work& w, Clock::time_point now, bool cancel, Status& result);
  bool on_failure(Work& w, Status failure, Clock::time_point now, Status& result);
  void finish(Work& w, Status result);

  Transport& transport_;
  const CopyEngineConfig config_;

  mutable std::mutex mu_;
  std::condition_variable cv_;        // to the copy thread: new work, a cancellation, or stop
  std::condition_variable done_cv_;   // to waiters: a ticket reached a terminal state
  std::vector<Work> handoff_;         // submitted, not yet taken by the copy thread
  // Tickets by id: tickets_[i] has id first_ticket_ + i. Consumed slots at the front are popped;
  // ids only grow, so lookup is an index.
  std::deque<TicketSlot> tickets_;
  uint64_t first_ticket_ = 1;
  uint64_t next_ticket_ = 1;
  size_t outstanding_ = 0;            // slots not consumed
  bool cancel_pending_ = false;       // some slot has `cancel` set
  std::vector<StepLayer> step_;       // current step, in layer order
  // Cumulative.
  uint64_t bytes_moved_ = 0;
  double wait_seconds_ = 0;
  uint64_t steps_ = 0;
  // Window.
  CopyWindowStats window_;            // busy_seconds holds closed busy intervals only
  size_t in_flight_ = 0;              // tickets taken by the copy thread, not yet terminal
  Clock::time_point busy_since_{};    // start of the open busy interval (clipped to the window)
  bool stop_ = false;
  std::thread thread_;  // last member: started after everything above exists
};

}  // namespace specontext::transport
