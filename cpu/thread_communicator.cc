#include "cpu/thread_communicator.h"

#include <algorithm>
#include <condition_variable>
#include <mutex>
#include <new>
#include <string>

namespace specontext::cpu {

namespace {

constexpr int kMaxWorld = 4096;
constexpr int64_t kSliceAlign = 16;  // floats: slices start on 64-byte boundaries (no false sharing)
constexpr int64_t kTile = 1024;      // floats summed per pass, so the partial sum stays in L1

// out[begin, end) = src[0] + src[1] + … + src[world−1], left to right for every element.
void reduce_slice(float* const* src, int world, int64_t begin, int64_t end, float* out) {
  for (int64_t t = begin; t < end; t += kTile) {
    const int64_t e = std::min(end, t + kTile);
    std::copy(src[0] + t, src[0] + e, out + t);
    for (int r = 1; r < world; ++r) {
      const float* s = src[r];
      for (int64_t i = t; i < e; ++i) out[i] += s[i];
    }
  }
}

std::string join_list(const std::vector<int>& v) {
  std::string s;
  for (int x : v) s += (s.empty() ? "" : ", ") + std::to_string(x);
  return s;
}

}  // namespace

struct ThreadGroupState {
  explicit ThreadGroupState(int w, std::chrono::milliseconds t)
      : world(w),
        timeout(t),
        joined(static_cast<size_t>(w), 0),
        in_call(static_cast<size_t>(w), 0),
        ptrs(static_cast<size_t>(w), nullptr),
        counts(static_cast<size_t>(w), 0) {}

  // Records the first failure and wakes every waiting rank. Requires mu.
  void fail(Status s) {
    if (failure.is_ok()) failure = std::move(s);
    cv.notify_all();
  }
  Status failed_earlier() const {
    return Status(failure.code(), "communicator group failed earlier: " + failure.message());
  }

  const int world;
  const std::chrono::milliseconds timeout;
  std::mutex mu;
  std::condition_variable cv;
  // All below guarded by mu, except that ptrs and scratch are read without it between the two
  // barriers of a collective (written only while every rank is outside that window).
  uint64_t joined_ops = 0;    // collectives whose join barrier completed
  int joining = 0;            // ranks waiting at the join barrier of collective #joined_ops
  std::vector<char> joined;   // per rank: has joined collective #joined_ops
  uint64_t reduced_ops = 0;   // collectives whose summing phase completed
  int reduced = 0;            // ranks done summing in collective #reduced_ops
  std::vector<char> in_call;  // per rank: inside all_reduce_sum
  std::vector<float*> ptrs;
  std::vector<int64_t> counts;
  std::vector<float> scratch;
  Status failure;  // OK while healthy
};

int ThreadCommunicator::world_size() const { return state_->world; }

Status ThreadCommunicator::all_reduce_sum(float* data, int64_t count) {
  ThreadGroupState& g = *state_;
  const auto r = static_cast<size_t>(rank_);
  std::unique_lock<std::mutex> lk(g.mu);
  if (!g.failure.is_ok()) return g.failed_earlier();
  if (count < 0 || (count > 0 && data == nullptr)) {
    g.fail(invalid_argument("all_reduce_sum: rank " + std::to_string(rank_) + " passed " +
                            (count < 0 ? "count = " + std::to_string(count) : std::string("a null buffer"))));
    return g.failure;
  }
  if (g.in_call[r]) {
    g.fail(invalid_argument("all_reduce_sum: rank " + std::to_string(rank_) +
                            " was called from two threads at once"));
    return g.failure;
  }
  if (g.world == 1) return Status::ok();  // the sum over one rank is its own data

  // ---- join barrier: every rank publishes its buffer ----
  const uint64_t op = g.joined_ops;
  g.in_call[r] = 1;
  g.joined[r] = 1;
  g.ptrs[r] = data;
  g.counts[r] = count;
  if (++g.joining == g.world) {
    // Last to join: check the counts agree and size the scratch before releasing everyone.
    bool same = true;
    for (int64_t c : g.counts) same = same && c == count;
    if (!same) {
      std::string list;
      for (int i = 0; i < g.world; ++i) {
        list += (i ? ", " : "") + std::string("rank ") + std::to_string(i) + ": " +
                std::to_string(g.counts[static_cast<size_t>(i)]);
      }
      g.fail(invalid_argument("all_reduce_sum #" + std::to_string(op) + ": ranks passed different counts (" +
                              list + ")"));
      g.in_call[r] = 0;
      return g.failure;
    }
    if (static_cast<int64_t>(g.scratch.size()) < count) {
      try {
        g.scratch.resize(static_cast<size_t>(count));
      } catch (const std::bad_alloc&) {
        g.fail(resource_exhausted("all_reduce_sum: no memory for a scratch vector of " +
                                  std::to_string(count) + " floats"));
        g.in_call[r] = 0;
        return g.failure;
      }
    }
    g.joining = 0;
    std::fill(g.joined.begin(), g.joined.end(), 0);
    ++g.joined_ops;
    g.cv.notify_all();
  } else {
    const auto deadline = std::chrono::steady_clock::now() + g.timeout;
    while (g.joined_ops == op && g.failure.is_ok()) {
      if (g.cv.wait_until(lk, deadline) == std::cv_status::timeout && g.joined_ops == op &&
          g.failure.is_ok()) {
        std::vector<int> missing;
        for (int i = 0; i < g.world; ++i) {
          if (!g.joined[static_cast<size_t>(i)]) missing.push_back(i);
        }
        g.fail(unavailable("all_reduce_sum #" + std::to_string(op) + " (count " + std::to_string(count) +
                           "): rank" + (missing.size() > 1 ? "s " : " ") + join_list(missing) +
                           " did not join within " + std::to_string(g.timeout.count()) + " ms (rank " +
                           std::to_string(rank_) + " timed out waiting)"));
      }
    }
    // A completed join wins over a later failure: the collective is then committed.
    if (g.joined_ops == op) {
      g.in_call[r] = 0;
      return g.failure;
    }
  }

  // ---- sum this rank's slice over all ranks, in rank order ----
  const int64_t per = ((count + g.world - 1) / g.world + kSliceAlign - 1) / kSliceAlign * kSliceAlign;
  const int64_t begin = std::min(count, static_cast<int64_t>(rank_) * per);
  const int64_t end = std::min(count, begin + per);
  float* const* src = g.ptrs.data();
  float* out = g.scratch.data();
  lk.unlock();
  reduce_slice(src, g.world, begin, end, out);
  lk.lock();
  // No timeout here: every rank past the join barrier reaches this point without blocking, and
  // no rank may return while another may still read its buffer.
  if (++g.reduced == g.world) {
    g.reduced = 0;
    ++g.reduced_ops;
    g.cv.notify_all();
  } else {
    g.cv.wait(lk, [&] { return g.reduced_ops > op; });
  }
  g.in_call[r] = 0;
  lk.unlock();
  // The scratch is rewritten only after every rank has joined the next collective, i.e. after
  // this copy.
  std::copy(out, out + count, data);
  return Status::ok();
}

void ThreadCommunicator::abort(const Status& reason) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->fail(unavailable("rank " + std::to_string(rank_) + " aborted the group: " +
                           (reason.is_ok() ? std::string("no reason given") : reason.to_string())));
}

Status ThreadCommunicator::status() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failure;
}

Result<std::unique_ptr<ThreadCommunicatorGroup>> ThreadCommunicatorGroup::create(
    int world, const ThreadCommunicatorOptions& options) {
  if (world < 1 || world > kMaxWorld) {
    return invalid_argument("ThreadCommunicatorGroup: world = " + std::to_string(world) + " is outside [1, " +
                            std::to_string(kMaxWorld) + "]");
  }
  if (options.timeout.count() <= 0) {
    return invalid_argument("ThreadCommunicatorGroup: timeout = " + std::to_string(options.timeout.count()) +
                            " ms must be positive");
  }
  std::unique_ptr<ThreadCommunicatorGroup> g(new ThreadCommunicatorGroup());
  g->state_ = std::make_shared<ThreadGroupState>(world, options.timeout);
  for (int r = 0; r < world; ++r) {
    g->comms_.push_back(std::shared_ptr<ThreadCommunicator>(new ThreadCommunicator(g->state_, r)));
  }
  return g;
}

std::shared_ptr<ThreadCommunicator> ThreadCommunicatorGroup::communicator(int rank) const {
  if (rank < 0 || rank >= world_size()) return nullptr;
  return comms_[static_cast<size_t>(rank)];
}

void ThreadCommunicatorGroup::abort(const Status& reason) {
  std::lock_guard<std::mutex> lk(state_->mu);
  state_->fail(unavailable("the group was aborted: " +
                           (reason.is_ok() ? std::string("no reason given") : reason.to_string())));
}

Status ThreadCommunicatorGroup::status() const {
  std::lock_guard<std::mutex> lk(state_->mu);
  return state_->failure;
}

}  // namespace specontext::cpu
