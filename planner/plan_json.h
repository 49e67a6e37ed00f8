// Plans and snapshots as JSON (nlohmann-json), so a plan can be a test fixture or a CLI answer.
// Parsing never throws: malformed input comes back as an InvalidArgument naming the field.
#pragma once

#include <nlohmann/json.hpp>
#include <string_view>

#include "core/base/status.h"
#include "planner/plan.h"
#include "planner/snapshot.h"

namespace specontext::planner {

nlohmann::json snapshot_to_json(const PlannerSnapshot& s);
Result<PlannerSnapshot> snapshot_from_json(const nlohmann::json& j);

nlohmann::json plan_to_json(const Plan& p);
Result<Plan> plan_from_json(const nlohmann::json& j);

// Text → json without exceptions; `what` names the source in the message.
Result<nlohmann::json> parse_json_text(std::string_view text, std::string_view what);

}  // namespace specontext::planner
