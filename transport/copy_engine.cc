#include "transport/copy_engine.h"

#include <algorithm>
#include <string>
#include <system_error>

namespace specontext::transport {

namespace {

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

std::string ticket_text(LayerId layer, CopyDirection direction) {
  return "layer " + std::to_string(layer.value()) + " (" +
         std::string(copy_direction_name(direction)) + ")";
}

size_t direction_index(CopyDirection d) { return static_cast<size_t>(d); }

}  // namespace

std::string_view copy_direction_name(CopyDirection direction) {
  switch (direction) {
    case CopyDirection::kLoad: return "load";
    case CopyDirection::kStore: return "store";
    case CopyDirection::kMigrate: return "migrate";
  }
  return "unknown";
}

Result<std::unique_ptr<CopyEngine>> CopyEngine::create(Transport& transport,
                                                       CopyEngineConfig config) {
  if (config.max_retries < 0 || config.max_no_resource_retries < 0) {
    return invalid_argument("copy engine: negative retry bound");
  }
  if (config.layer_timeout.count() <= 0 || config.wait_timeout.count() <= 0) {
    return invalid_argument("copy engine: timeouts must be positive");
  }
  if (config.retry_backoff.count() < 0 || config.poll_interval.count() < 0) {
    return invalid_argument("copy engine: negative retry_backoff or poll_interval");
  }
  try {
    return std::unique_ptr<CopyEngine>(new CopyEngine(transport, config));
  } catch (const std::system_error& e) {  // std::thread could not start
    return resource_exhausted(std::string("copy engine: cannot start its thread: ") + e.what());
  }
}

CopyEngine::CopyEngine(Transport& transport, CopyEngineConfig config)
    : transport_(transport), config_(config) {
  thread_ = std::thread([this] { copy_loop(); });
}

CopyEngine::~CopyEngine() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  // Work submitted but never taken by the copy thread still holds prepared handles.
  for (Work& w : handoff_) transport_.release(w.handle);
}

// ---- caller thread: submission ----

Result<CopyEngine::Work> CopyEngine::prepare_work(LayerId layer, CopyDirection direction,
                                                  std::vector<TransferRequest>& requests,
                                                  Clock::time_point now) {
  Work w;
  w.layer = layer;
  w.direction = direction;
  w.submitted_at = now;
  for (const TransferRequest& r : requests) w.bytes += r.bytes;
  if (!requests.empty()) {
    Result<TransferHandle> handle = transport_.prepare(requests);
    if (!handle.is_ok()) {
      return handle.status().with_context("copy engine: " + ticket_text(layer, direction));
    }
    w.handle = *handle;
  }
  w.requests = std::move(requests);
  return w;
}

uint64_t CopyEngine::publish_locked(std::span<Work> works, int32_t first_step_index) {
  const uint64_t first = next_ticket_;
  bool handed = false;
  for (size_t i = 0; i < works.size(); ++i) {
    Work& w = works[i];
    w.ticket = next_ticket_++;
    TicketSlot& slot = tickets_.emplace_back();
    slot.layer = w.layer;
    slot.direction = w.direction;
    slot.bytes = w.bytes;
    slot.requests = w.requests.size();
    slot.step_index = first_step_index < 0 ? -1 : first_step_index + static_cast<int32_t>(i);
    ++outstanding_;
    if (w.requests.empty()) {  // nothing to move: complete at once
      record_terminal_locked(slot, Status::ok(), 0, 0, w.submitted_at, w.submitted_at);
      continue;
    }
    handoff_.push_back(std::move(w));
    handed = true;
  }
  if (handed) cv_.notify_all();
  return first;
}

Result<CopyTicket> CopyEngine::submit(LayerId layer, CopyDirection direction,
                                      std::vector<TransferRequest> requests) {
  if (!layer.valid()) return invalid_argument("copy engine: submit with an invalid layer id");
  SPX_ASSIGN_OR_RETURN(Work w, prepare_work(layer, direction, requests, Clock::now()));
  std::lock_guard lock(mu_);
  return CopyTicket{publish_locked(std::span<Work>(&w, 1), -1)};
}

Status CopyEngine::submit_step(std::vector<LayerBatch> batches) {
  std::sort(batches.begin(), batches.end(),
            [](const LayerBatch& a, const LayerBatch& b) { return a.layer < b.layer; });
  for (size_t i = 0; i < batches.size(); ++i) {
    if (!batches[i].layer.valid()) return invalid_argument("copy engine: batch with invalid layer");
    if (i > 0 && batches[i].layer == batches[i - 1].layer) {
      return invalid_argument("copy engine: two batches for layer " +
                              std::to_string(batches[i].layer.value()));
    }
  }
  {
    std::lock_guard lock(mu_);
    for (const StepLayer& l : step_) {
      const TicketSlot* slot = l.consumed ? nullptr : find_slot(l.ticket);
      if (slot != nullptr && slot->state == TicketState::kPending) {
        return invalid_argument("copy engine: previous step still has layer " +
                                std::to_string(l.stats.layer.value()) +
                                " in flight; wait for it first");
      }
    }
  }
  // Prepare everything before publishing anything: a step is accepted whole or not at all.
  const Clock::time_point now = Clock::now();
  std::vector<Work> works;
  works.reserve(batches.size());
  for (LayerBatch& b : batches) {
    Result<Work> w = prepare_work(b.layer, b.direction, b.requests, now);
    if (!w.is_ok()) {
      for (Work& done : works) transport_.release(done.handle);
      return w.status();
    }
    works.push_back(std::move(w).value());
  }
  std::lock_guard lock(mu_);
  // The previous step's results are dropped; its terminal, unwaited tickets are consumed so that
  // wait_all does not report them later.
  for (StepLayer& l : step_) {
    if (l.consumed) continue;
    if (TicketSlot* slot = find_slot(l.ticket)) {
      slot->step_index = -1;
      if (slot->state == TicketState::kDone) consume_locked(*slot);
    }
  }
  step_.clear();
  for (const Work& w : works) {
    StepLayer l;
    l.stats.layer = w.layer;
    l.stats.bytes = w.bytes;
    step_.push_back(std::move(l));
  }
  const uint64_t first = publish_locked(works, 0);
  for (size_t i = 0; i < step_.size(); ++i) step_[i].ticket = first + i;
  ++steps_;
  return Status::ok();
}

// ---- caller thread: waiting ----

CopyEngine::TicketSlot* CopyEngine::find_slot(uint64_t id) {
  if (id < first_ticket_ || id - first_ticket_ >= tickets_.size()) return nullptr;
  return &tickets_[id - first_ticket_];
}

const CopyEngine::TicketSlot* CopyEngine::find_slot(uint64_t id) const {
  if (id < first_ticket_ || id - first_ticket_ >= tickets_.size()) return nullptr;
  return &tickets_[id - first_ticket_];
}

CopyEngine::StepLayer* CopyEngine::find_step_layer(LayerId layer) {
  auto it = std::lower_bound(step_.begin(), step_.end(), layer,
                             [](const StepLayer& l, LayerId id) { return l.stats.layer < id; });
  return it != step_.end() && it->stats.layer == layer ? &*it : nullptr;
}

void CopyEngine::consume_locked(TicketSlot& slot) {
  if (slot.state == TicketState::kConsumed) return;
  slot.state = TicketState::kConsumed;
  slot.status = Status::ok();  // drop the message's memory now
  --outstanding_;
  while (!tickets_.empty() && tickets_.front().state == TicketState::kConsumed) {
    tickets_.pop_front();
    ++first_ticket_;
  }
}

Status CopyEngine::wait_locked(std::unique_lock<std::mutex>& lock, uint64_t id,
                               Clock::time_point deadline) {
  // Only this (caller) thread adds or pops slots, and it is here; deque references survive the
  // copy thread's updates, but look the slot up again after each wake-up anyway (cheap).
  const Clock::time_point start = Clock::now();
  auto terminal = [&] { return find_slot(id)->state != TicketState::kPending; };
  bool done = done_cv_.wait_until(lock, deadline, terminal);
  if (!done) {
    // Cancel on the copy thread so that, when this returns, the transport has let go of the
    // buffers. release() is bounded by one copy, so this second wait is short unless a transport
    // call blocks; it is bounded anyway.
    find_slot(id)->cancel = true;
    cancel_pending_ = true;
    cv_.notify_all();
    done = done_cv_.wait_until(lock, Clock::now() + config_.wait_timeout, terminal);
  }
  const double waited = seconds(Clock::now() - start);
  wait_seconds_ += waited;
  window_.wait_seconds += waited;
  TicketSlot& slot = *find_slot(id);
  StepLayer* step_layer = slot.step_index >= 0 ? &step_[slot.step_index] : nullptr;
  if (step_layer != nullptr) step_layer->stats.wait_seconds += waited;
  if (!done) {
    return internal_error("copy engine: " + ticket_text(slot.layer, slot.direction) +
                          " timed out and was not cancelled within another " +
                          std::to_string(config_.wait_timeout.count()) +
                          " ms: the copy thread is stuck in a transport call; the ticket stays "
                          "outstanding and its buffers may be in use");
  }
  // When cancelled, the copy thread wrote the wait_timeout message into the status.
  Status result = std::move(slot.status);
  if (step_layer != nullptr) {
    step_layer->consumed = true;
    step_layer->status = result;
  }
  consume_locked(slot);
  return result;
}

Status CopyEngine::wait(CopyTicket ticket) {
  std::unique_lock lock(mu_);
  const TicketSlot* slot = find_slot(ticket.id);
  if (slot == nullptr || slot->state == TicketState::kConsumed) {
    return invalid_argument("copy engine: ticket " + std::to_string(ticket.id) +
                            " is unknown or was already waited");
  }
  return wait_locked(lock, ticket.id, Clock::now() + config_.wait_timeout);
}

Result<bool> CopyEngine::is_complete(CopyTicket ticket) const {
  std::lock_guard lock(mu_);
  const TicketSlot* slot = find_slot(ticket.id);
  if (slot == nullptr || slot->state == TicketState::kConsumed) {
    return invalid_argument("copy engine: ticket " + std::to_string(ticket.id) +
                            " is unknown or was already waited");
  }
  return slot->state == TicketState::kDone;
}

Status CopyEngine::wait_layer(LayerId layer) {
  std::unique_lock lock(mu_);
  StepLayer* l = find_step_layer(layer);
  if (l == nullptr) return Status::ok();
  if (l->consumed) return l->status;
  return wait_locked(lock, l->ticket, Clock::now() + config_.wait_timeout);
}

Status CopyEngine::wait_all() {
  std::unique_lock lock(mu_);
  const Clock::time_point deadline = Clock::now() + config_.wait_timeout;
  std::vector<uint64_t> ids;
  ids.reserve(outstanding_);
  for (size_t i = 0; i < tickets_.size(); ++i) {
    if (tickets_[i].state != TicketState::kConsumed) ids.push_back(first_ticket_ + i);
  }
  Status first;
  for (uint64_t id : ids) {
    Status s = wait_locked(lock, id, deadline);
    // kInternal: the copy thread is stuck in a transport call; the rest would only time out too.
    const bool stuck = s.code() == StatusCode::kInternal;
    if (first.is_ok() && !s.is_ok()) first = std::move(s);
    if (stuck) break;
  }
  return first;
}

size_t CopyEngine::outstanding() const {
  std::lock_guard lock(mu_);
  return outstanding_;
}

// ---- statistics ----

void CopyEngine::reset_window() {
  std::lock_guard lock(mu_);
  window_ = CopyWindowStats{};
  if (in_flight_ > 0) busy_since_ = Clock::now();  // clip the open interval to the new window
}

CopyWindowStats CopyEngine::window_stats() const {
  std::lock_guard lock(mu_);
  CopyWindowStats s = window_;
  if (in_flight_ > 0) s.busy_seconds += seconds(Clock::now() - busy_since_);
  return s;
}

CopyStats CopyEngine::stats() const {
  std::lock_guard lock(mu_);
  CopyStats s;
  s.bytes_moved = bytes_moved_;
  s.wait_seconds = wait_seconds_;
  s.steps = steps_;
  s.layers.reserve(step_.size());
  for (const StepLayer& l : step_) s.layers.push_back(l.stats);
  return s;
}

void CopyEngine::record_terminal_locked(TicketSlot& slot, Status result, int retries,
                                        int no_resource, Clock::time_point submitted_at,
                                        Clock::time_point now) {
  slot.state = TicketState::kDone;
  const size_t d = direction_index(slot.direction);
  if (result.is_ok()) {
    window_.bytes[d] += slot.bytes;
    window_.requests[d] += slot.requests;
    bytes_moved_ += slot.bytes;
  } else {
    ++window_.failures;
  }
  window_.retries += retries;
  window_.no_resource += no_resource;
  if (slot.step_index >= 0) {
    LayerCopyStats& st = step_[slot.step_index].stats;
    st.retries = retries;
    st.no_resource = no_resource;
    st.copy_seconds = seconds(now - submitted_at);
    st.completed_at = now;
  }
  slot.status = std::move(result);
}

// ---- copy thread ----

void CopyEngine::copy_loop() {
  std::vector<Work> active;    // owned by this thread, in submission order
  std::vector<Work> incoming;  // swapped with handoff_ so both keep their capacity
  while (true) {
    {
      std::unique_lock lock(mu_);
      if (active.empty()) cv_.wait(lock, [&] { return stop_ || !handoff_.empty(); });
      if (stop_) break;
      if (!handoff_.empty()) {
        incoming.swap(handoff_);
        // A ticket is in flight from here to its terminal state.
        if (in_flight_ == 0) busy_since_ = Clock::now();
        in_flight_ += incoming.size();
        for (Work& w : incoming) active.push_back(std::move(w));
        incoming.clear();
      }
      if (cancel_pending_) {
        cancel_pending_ = false;
        for (Work& w : active) {
          if (const TicketSlot* slot = find_slot(w.ticket); slot != nullptr && slot->cancel) {
            w.cancel = true;
          }
        }
      }
    }
    // Visited in submission order, so the first round posts tickets in submission order.
    const Clock::time_point now = Clock::now();
    size_t kept = 0;
    for (size_t i = 0; i < active.size(); ++i) {
      Status result;
      if (advance(active[i], now, active[i].cancel, result)) {
        finish(active[i], std::move(result));
      } else {
        if (kept != i) active[kept] = std::move(active[i]);
        ++kept;
      }
    }
    active.resize(kept);
    if (!active.empty()) {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, config_.poll_interval,
                       [&] { return stop_ || !handoff_.empty() || cancel_pending_; })) {
        if (stop_) break;
      }
    }
  }
  // Shutdown: cancel what is in flight; release() returns once the transport stopped touching
  // the buffers, so the owner may free them after the destructor.
  for (Work& w : active) {
    transport_.release(w.handle);
    finish(w, unavailable("copy engine: shut down with " + ticket_text(w.layer, w.direction) +
                          " in flight"));
  }
}

bool CopyEngine::advance(Work& w, Clock::time_point now, bool cancel, Status& result) {
  if (cancel) {
    transport_.release(w.handle);
    result = unavailable("copy engine: " + ticket_text(w.layer, w.direction) +
                         " not complete after " + std::to_string(config_.wait_timeout.count()) +
                         " ms (wait_timeout); cancelled");
    return true;
  }
  if (now - w.submitted_at > config_.layer_timeout) {
    transport_.release(w.handle);  // cancels
    result = unavailable("copy engine: " + ticket_text(w.layer, w.direction) +
                         " not complete after " + std::to_string(config_.layer_timeout.count()) +
                         " ms (layer_timeout); cancelled");
    return true;
  }
  if (now < w.next_try) return false;
  if (!w.handle.valid()) {  // retry of a failed transfer: prepare again
    Result<TransferHandle> handle = transport_.prepare(w.requests);
    if (!handle.is_ok()) {
      result = handle.status().with_context("copy engine: " + ticket_text(w.layer, w.direction));
      return true;
    }
    w.handle = *handle;
    w.posted = false;
  }
  Status s;
  if (!w.posted) {
    s = transport_.post(w.handle);
    if (s.code() == StatusCode::kResourceExhausted) {
      if (++w.no_resource > config_.max_no_resource_retries) {
        transport_.release(w.handle);
        result = s.with_context("copy engine: " + ticket_text(w.layer, w.direction) + " after " +
                                std::to_string(config_.max_no_resource_retries) +
                                " NO_RESOURCE re-posts");
        return true;
      }
      w.next_try = now + config_.retry_backoff;
      return false;
    }
    w.posted = true;
  } else {
    s = transport_.poll(w.handle);
  }
  if (s.code() == StatusCode::kInProgress) return false;
  if (s.is_ok()) {
    transport_.release(w.handle);
    result = Status::ok();
    return true;
  }
  return on_failure(w, std::move(s), now, result);
}

bool CopyEngine::on_failure(Work& w, Status failure, Clock::time_point now, Status& result) {
  transport_.release(w.handle);
  w.posted = false;
  if (failure.code() == StatusCode::kUnavailable && w.retries < config_.max_retries) {
    ++w.retries;
    w.next_try = now + config_.retry_backoff;
    return false;
  }
  result = failure.with_context("copy engine: " + ticket_text(w.layer, w.direction) +
                                " failed after " + std::to_string(w.retries) + " retries");
  return true;
}

void CopyEngine::finish(Work& w, Status result) {
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (TicketSlot* slot = find_slot(w.ticket)) {
      record_terminal_locked(*slot, std::move(result), w.retries, w.no_resource, w.submitted_at,
                             now);
    }
    if (--in_flight_ == 0) window_.busy_seconds += seconds(now - busy_since_);
  }
  done_cv_.notify_all();
}

}  // namespace specontext::transport
