// libFuzzer target for the planner's inputs: JSON snapshots and plans (fixtures, `specontext plan`
// answers) and the size syntax of the CLI (--hbm 80GiB, --host 64GiB,64GiB). Parsing must never
// crash or throw; a snapshot that parses and validates must plan, re-plan and serialise without
// overflow (UBSan) or a crash, and a plan must survive a JSON round trip unchanged.
//
// The first byte picks the mode: 0 snapshot JSON, 1 plan JSON, 2 size / size list / number list.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "planner/plan.h"
#include "planner/plan_json.h"
#include "planner/snapshot.h"
#include "planner/units.h"

namespace {

using namespace specontext;
using namespace specontext::planner;

void snapshot_mode(std::string_view text) {
  auto j = parse_json_text(text, "fuzz snapshot");
  if (!j.is_ok()) return;
  auto s = snapshot_from_json(*j);
  if (!s.is_ok() || !validate_snapshot(*s).is_ok()) return;
  (void)snapshot_to_json(*s).dump();
  auto t = thresholds(*s);
  if (t.is_ok()) (void)layers_to_offload(*t, effective_seq_len(*s));
  auto p = plan(*s);
  if (!p.is_ok()) return;
  // A longer and a shorter trace from the same state: re-planning walks both directions.
  for (int64_t factor : {2, 0}) {
    PlannerSnapshot next = *s;
    for (auto& len : next.seq_lens) len = factor == 0 ? len / 3 : len * factor;
    if (!validate_snapshot(next).is_ok()) continue;
    (void)replan(*p, next);
  }
  auto back = plan_from_json(plan_to_json(*p));
  if (!back.is_ok() || !(*back == *p)) std::abort();  // a plan must round-trip
}

void plan_mode(std::string_view text) {
  auto j = parse_json_text(text, "fuzz plan");
  if (!j.is_ok()) return;
  auto p = plan_from_json(*j);
  if (p.is_ok()) (void)plan_to_json(*p).dump();
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string_view text(reinterpret_cast<const char*>(data + 1), size - 1);
  switch (data[0] % 3) {
    case 0: snapshot_mode(text); break;
    case 1: plan_mode(text); break;
    default: {
      auto one = parse_size(text);
      if (one.is_ok()) (void)format_bytes(*one);
      (void)parse_size_list(text);
      (void)parse_number_list(text);
      break;
    }
  }
  return 0;
}
