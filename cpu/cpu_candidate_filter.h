// CandidateFilter on the host (core/ports/candidate_filter.h): per-page key summaries kept
// incrementally in NUMA-node memory, shortlists computed by a oneTBB arena pinned to that node.
// Gives exactly the candidates of ReferenceCandidateFilter (core/sparse/candidate_select.h).
//
// Threads: one thread at a time drives a filter (the engine loop). Each call parallelises inside
// the filter's own task_arena (num_threads workers; on machines with more than one NUMA node its
// workers are bound to `numa_node` by a NodePinningObserver, the calling thread is not).
// Ownership: the filter owns the summaries; it keeps no pointer to the keys or queries passed in.
// Errors: Status only (argument checks as core/ports/candidate_filter.h says; allocation failure is
// ResourceExhausted); nothing throws out of a call, and a failed call changes nothing.
#pragma once

#include <memory>

#include "core/base/ids.h"
#include "core/base/status.h"
#include "core/ports/candidate_filter.h"

namespace specontext::cpu {

struct CpuCandidateFilterOptions {
  CandidateFilterOptions filter;
  int numa_node = 0;    // hwloc logical index; summaries live there and workers run there
  int num_threads = 0;  // arena size; 0 = the cores of numa_node
};

class CpuCandidateFilter final : public CandidateFilter {
 public:
  // kInvalidArgument for bad filter options (naming the field), num_threads < 0 or a NUMA node
  // the machine does not have.
  static Result<std::unique_ptr<CpuCandidateFilter>> create(const CpuCandidateFilterOptions& options);
  ~CpuCandidateFilter() override;
  CpuCandidateFilter(const CpuCandidateFilter&) = delete;
  CpuCandidateFilter& operator=(const CpuCandidateFilter&) = delete;

  Status append_keys(SeqId seq, const float* keys, int64_t start, int64_t n) override;
  void drop(SeqId seq) override;
  Status shortlist(SeqId seq, const float* q, int64_t length, int64_t shortlist_tokens,
                   const SelectionOptions& selection, Candidates& out) override;

  // Tokens appended to `seq` (0 for an unknown sequence).
  int64_t length(SeqId seq) const;
  // Summary bytes held for `seq` (allocated chunks; 0 for an unknown sequence).
  int64_t summary_bytes(SeqId seq) const;
  int num_threads() const;
  int numa_node() const;
  // Whether the summaries' memory is bound to numa_node (false where mbind is refused).
  bool memory_bound() const;

 private:
  struct Impl;
  explicit CpuCandidateFilter(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace specontext::cpu
