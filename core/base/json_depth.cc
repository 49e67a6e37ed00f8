#include "core/base/json_depth.h"

#include <vector>

namespace specontext {

namespace {

// A SAX handler that builds nothing: it counts the open arrays and objects and stops the parser
// (returns false) at the first one past the bound, remembering the path to it.
class DepthCheck {
 public:
  explicit DepthCheck(size_t max_depth) : max_depth_(max_depth) {}

  bool null() { return value(); }
  bool boolean(bool) { return value(); }
  bool number_integer(nlohmann::json::number_integer_t) { return value(); }
  bool number_unsigned(nlohmann::json::number_unsigned_t) { return value(); }
  bool number_float(nlohmann::json::number_float_t, const std::string&) { return value(); }
  bool string(std::string&) { return value(); }
  bool binary(nlohmann::json::binary_t&) { return value(); }
  bool start_object(std::size_t) { return open(false); }
  bool start_array(std::size_t) { return open(true); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& k) {
    if (!frames_.empty()) frames_.back().key = k.substr(0, 64);
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) {
    if (!frames_.empty() && !frames_.front().array)
      error_top_key_ = top_key(frames_.size() == 1 ? frames_[0].key : "");
    return false;
  }

  const std::optional<JsonTooDeep>& too_deep() const { return too_deep_; }
  const std::optional<std::string>& error_top_key() const { return error_top_key_; }

 private:
  static constexpr size_t kPathSteps = 8;  // steps of the path written in full
  struct Frame {
    bool array = false;
    size_t next_index = 0;  // arrays: the index of the next element
    std::string key;        // objects: the last key read
    std::string step;       // how its parent reaches it: "[3]", ".name" ("name" below the outermost)
  };

  // The step from the innermost open container to the value that begins now (arrays count it).
  std::string step_to_next() {
    if (frames_.empty()) return {};
    Frame& f = frames_.back();
    // Appended piece by piece: GCC 12 warns falsely (-Wrestrict) on "[" + std::string.
    std::string step;
    if (f.array) {
      step += '[';
      step += std::to_string(f.next_index++);
      step += ']';
    } else {
      if (frames_.size() > 1) step += '.';
      step += f.key;
    }
    return step;
  }
  // The outermost object's member the parser is in: `step` when that member's value is what begins
  // now (or errs), else the step the open container below the outermost was reached by.
  std::string top_key(const std::string& step) const { return frames_.size() == 1 ? step : frames_[1].step; }
  bool value() {
    if (!frames_.empty() && frames_.back().array) ++frames_.back().next_index;
    return true;
  }
  bool open(bool array) {
    std::string step = step_to_next();
    if (frames_.size() + 1 > max_depth_) {
      JsonTooDeep t;
      if (!frames_.empty() && !frames_.front().array) t.top_key = top_key(step);
      for (size_t i = 1; i < frames_.size() && i <= kPathSteps; ++i) t.path += frames_[i].step;
      t.path += frames_.size() <= kPathSteps ? step : "...";
      too_deep_ = std::move(t);
      return false;  // stops the parser: nothing deeper is read
    }
    frames_.push_back(Frame{array, 0, {}, std::move(step)});
    return true;
  }
  bool close() {
    frames_.pop_back();
    return true;
  }

  size_t max_depth_;
  std::vector<Frame> frames_;  // the open arrays and objects, outermost first (at most max_depth)
  std::optional<JsonTooDeep> too_deep_;
  std::optional<std::string> error_top_key_;
};

template <typename Json>
bool deeper_than(const Json& root, size_t max_depth) {
  if (!root.is_structured()) return false;
  if (max_depth == 0) return true;
  // Iterators of the containers on the path to where the walk is, outermost first.
  struct Level {
    typename Json::const_iterator it, end;
  };
  std::vector<Level> path{{root.cbegin(), root.cend()}};
  while (!path.empty()) {
    Level& l = path.back();
    if (l.it == l.end) {
      path.pop_back();
      continue;
    }
    const Json& v = *l.it;
    ++l.it;
    if (v.is_structured()) {
      if (path.size() + 1 > max_depth) return true;
      path.push_back({v.cbegin(), v.cend()});
    }
  }
  return false;
}

template <typename Json>
Json parse_bounded(std::string_view text, size_t max_depth) {
  if (json_too_deep(text, max_depth)) return Json(nlohmann::json::value_t::discarded);
  return Json::parse(text, nullptr, /*allow_exceptions=*/false);
}

}  // namespace

std::optional<JsonTooDeep> json_too_deep(std::string_view text, size_t max_depth) {
  DepthCheck check(max_depth);
  try {
    (void)nlohmann::json::sax_parse(text, &check, nlohmann::json::input_format_t::json, /*strict=*/true);
  } catch (const std::exception&) {
    // Only allocation can throw here (parse errors go to DepthCheck::parse_error).
  }
  return check.too_deep();
}

std::optional<std::string> json_error_field(std::string_view text) {
  DepthCheck check(kMaxJsonDepth);
  try {
    (void)nlohmann::json::sax_parse(text, &check, nlohmann::json::input_format_t::json, /*strict=*/true);
  } catch (const std::exception&) {
  }
  return check.error_top_key();
}

nlohmann::json parse_json_bounded(std::string_view text, size_t max_depth) {
  return parse_bounded<nlohmann::json>(text, max_depth);
}

nlohmann::ordered_json parse_ordered_json_bounded(std::string_view text, size_t max_depth) {
  return parse_bounded<nlohmann::ordered_json>(text, max_depth);
}

bool json_deeper_than(const nlohmann::json& j, size_t max_depth) { return deeper_than(j, max_depth); }
bool json_deeper_than(const nlohmann::ordered_json& j, size_t max_depth) { return deeper_than(j, max_depth); }

}  // namespace specontext
