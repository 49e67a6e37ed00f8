#include "transport/copy_engine.h"

#include <algorithm>
#include <string>
#include <system_error>

namespace specontext::transport {

namespace {

std::string layer_text(LayerId layer) { return "layer " + std::to_string(layer.value()); }

double seconds(std::chrono::steady_clock::duration d) {
  return std::chrono::duration<double>(d).count();
}

}  // namespace

Result<std::unique_ptr<CopyEngine>> CopyEngine::create(Transport& transport,
                                                       CopyEngineConfig config) {
  if (config.max_retries < 0 || config.max_no_resource_retries < 0) {
    return invalid_argument("copy engine: negative retry bound");
  }
  if (config.layer_timeout.count() <= 0 || config.wait_timeout.count() <= 0) {
    return invalid_argument("copy engine: timeouts must be positive");
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

Status CopyEngine::submit_step(std::vector<LayerBatch> batches) {
  std::sort(batches.begin(), batches.end(),
            [](const LayerBatch& a, const LayerBatch& b) { return a.layer < b.layer; });
  for (size_t i = 0; i < batches.size(); ++i) {
    if (!batches[i].layer.valid()) return invalid_argument("copy engine: batch with invalid layer");
    if (i > 0 && batches[i].layer == batches[i - 1].layer) {
      return invalid_argument("copy engine: two batches for " + layer_text(batches[i].layer));
    }
  }
  {
    std::lock_guard lock(mu_);
    for (const LayerResult& r : results_) {
      if (!r.done) {
        return invalid_argument("copy engine: previous step still has " +
                                layer_text(r.stats.layer) + " in flight; wait for it first");
      }
    }
  }
  // Prepare everything before publishing anything: a step is accepted whole or not at all.
  const Clock::time_point now = Clock::now();
  std::vector<Work> works;
  std::vector<LayerResult> results;
  works.reserve(batches.size());
  results.reserve(batches.size());
  for (LayerBatch& b : batches) {
    Result<TransferHandle> handle = transport_.prepare(b.requests);
    if (!handle.is_ok()) {
      for (Work& w : works) transport_.release(w.handle);
      return handle.status().with_context("copy engine: " + layer_text(b.layer));
    }
    LayerResult r;
    r.stats.layer = b.layer;
    for (const TransferRequest& req : b.requests) r.stats.bytes += req.bytes;
    results.push_back(std::move(r));
    Work w;
    w.layer = b.layer;
    w.requests = std::move(b.requests);
    w.handle = *handle;
    w.submitted_at = now;
    works.push_back(std::move(w));
  }
  {
    std::lock_guard lock(mu_);
    results_ = std::move(results);
    handoff_ = std::move(works);
    ++steps_;
  }
  cv_.notify_all();
  return Status::ok();
}

CopyEngine::LayerResult* CopyEngine::find_result(LayerId layer) {
  auto it = std::lower_bound(results_.begin(), results_.end(), layer,
                             [](const LayerResult& r, LayerId l) { return r.stats.layer < l; });
  return it != results_.end() && it->stats.layer == layer ? &*it : nullptr;
}

Status CopyEngine::wait_layer(LayerId layer) {
  const Clock::time_point start = Clock::now();
  std::unique_lock lock(mu_);
  if (find_result(layer) == nullptr) return Status::ok();
  // Look the result up again in the predicate: only submit_step (same caller thread) replaces
  // results_, but a lookup per wake-up is cheap and keeps this safe.
  const bool done = done_cv_.wait_until(lock, start + config_.wait_timeout, [&] {
    LayerResult* r = find_result(layer);
    return r == nullptr || r->done;
  });
  const double waited = seconds(Clock::now() - start);
  wait_seconds_ += waited;
  LayerResult* r = find_result(layer);
  if (r == nullptr) return Status::ok();
  r->stats.wait_seconds += waited;
  if (!done) {
    return unavailable("copy engine: " + layer_text(layer) + " not complete after " +
                       std::to_string(config_.wait_timeout.count()) + " ms (wait_timeout)");
  }
  return r->status;
}

Status CopyEngine::wait_all() {
  std::vector<LayerId> layers;
  {
    std::lock_guard lock(mu_);
    for (const LayerResult& r : results_) layers.push_back(r.stats.layer);
  }
  Status first;
  for (LayerId l : layers) {
    Status s = wait_layer(l);
    if (first.is_ok() && !s.is_ok()) first = s;
  }
  return first;
}

CopyStats CopyEngine::stats() const {
  std::lock_guard lock(mu_);
  CopyStats s;
  s.bytes_moved = bytes_moved_;
  s.wait_seconds = wait_seconds_;
  s.steps = steps_;
  for (const LayerResult& r : results_) s.layers.push_back(r.stats);
  return s;
}

void CopyEngine::copy_loop() {
  std::vector<Work> active;  // owned by this thread
  while (true) {
    {
      std::unique_lock lock(mu_);
      if (active.empty()) cv_.wait(lock, [&] { return stop_ || !handoff_.empty(); });
      if (stop_) break;
      for (Work& w : handoff_) active.push_back(std::move(w));
      handoff_.clear();
    }
    // Layers are visited in layer order, so the first round posts them in layer order.
    const Clock::time_point now = Clock::now();
    for (auto it = active.begin(); it != active.end();) {
      Status result;
      if (advance(*it, now, result)) {
        finish(*it, std::move(result));
        it = active.erase(it);
      } else {
        ++it;
      }
    }
    if (!active.empty()) {
      std::unique_lock lock(mu_);
      if (cv_.wait_for(lock, config_.poll_interval, [&] { return stop_; })) break;
    }
  }
  // Shutdown: cancel what is in flight; release() returns once the transport stopped touching
  // the buffers, so the owner may free them after the destructor.
  for (Work& w : active) {
    transport_.release(w.handle);
    finish(w, unavailable("copy engine: shut down with " + layer_text(w.layer) + " in flight"));
  }
}

bool CopyEngine::advance(Work& w, Clock::time_point now, Status& result) {
  if (now - w.submitted_at > config_.layer_timeout) {
    transport_.release(w.handle);  // cancels
    result = unavailable("copy engine: " + layer_text(w.layer) + " not complete after " +
                         std::to_string(config_.layer_timeout.count()) +
                         " ms (layer_timeout); cancelled");
    return true;
  }
  if (now < w.next_try) return false;
  if (!w.handle.valid()) {  // retry of a failed transfer: prepare again
    Result<TransferHandle> handle = transport_.prepare(w.requests);
    if (!handle.is_ok()) {
      result = handle.status().with_context("copy engine: " + layer_text(w.layer));
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
        result = s.with_context("copy engine: " + layer_text(w.layer) + " after " +
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
  result = failure.with_context("copy engine: " + layer_text(w.layer) + " failed after " +
                                std::to_string(w.retries) + " retries");
  return true;
}

void CopyEngine::finish(Work& w, Status result) {
  const Clock::time_point now = Clock::now();
  {
    std::lock_guard lock(mu_);
    if (LayerResult* r = find_result(w.layer)) {
      r->done = true;
      r->stats.retries = w.retries;
      r->stats.no_resource = w.no_resource;
      r->stats.copy_seconds = seconds(now - w.submitted_at);
      r->stats.completed_at = now;
      if (result.is_ok()) bytes_moved_ += r->stats.bytes;
      r->status = std::move(result);
    }
  }
  done_cv_.notify_all();
}

}  // namespace specontext::transport
