// What JSON-constrained decoding (serving/structured/json_constraint.h, response_format json_object) costs per
// decode step: the time JsonObjectConstraint::mask takes over a whole vocabulary, measured along a
// real document (a JSON object encoded with the vocabulary, masked before each of its tokens and
// then advanced by it; tokenized longest match first), for the bundled stories260K vocabulary (512) and GPT-2's BPE vocabulary
// (50257, data/tokenizer-tests). The same for response_format json_schema (JsonSchemaConstraint,
// serving/structured/json_schema.h) with the schema the document is valid against. Also the one-off costs of
// VocabularyBytes::build and of the first constraint (the schema's vocabulary trie).
//
//   build/release/bench/bench_json_mask --out bench_out/json_mask.json --plot
// JSON (and --plot: a PNG via plot_json_mask.py: the mask time at each token of the document).
#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>
#include <functional>
#include <optional>
#include <string_view>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "bench/lib/report.h"
#include "core/model/gguf.h"
#include "core/tokenizer/tokenizer.h"
#include "serving/structured/json_constraint.h"
#include "serving/structured/json_schema.h"

using namespace specontext;

namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

double percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * static_cast<double>(v.size())))];
}

[[noreturn]] void fail(const Status& s) {
  std::fprintf(stderr, "bench_json_mask: %s\n", s.to_string().c_str());
  std::exit(1);
}

constexpr const char* kDocument =
    R"({"name": "Lily", "age": 3, "friends": ["Tom", "Sue"], "likes": {"color": "red", "toy": "ball"},)"
    R"( "height_m": 0.95, "happy": true, "note": "She said, \"let's play!\" and ran to the park."})";

// The schema kDocument is valid against, properties in its order (json_schema mode).
constexpr const char* kSchema =
    R"({"type":"object","properties":{"name":{"type":"string"},"age":{"type":"integer"},)"
    R"("friends":{"type":"array","items":{"type":"string"}},"likes":{"type":"object","properties":)"
    R"({"color":{"type":"string"},"toy":{"type":"string"}},"required":["color","toy"],"additionalProperties":false},)"
    R"("height_m":{"type":"number"},"happy":{"type":"boolean"},"note":{"type":"string"}},)"
    R"("required":["name","age","friends","likes","height_m","happy","note"],"additionalProperties":false})";

// The document as token ids, longest match first over the tokens' bytes as the constraints see
// them. Not encode(): a SentencePiece vocabulary would start with its dummy-prefix space, which a
// schema's grammar does not allow before the document (and a constrained model never draws).
std::optional<std::vector<TokenId>> longest_match(const VocabularyBytes& v, std::string_view text) {
  std::vector<TokenId> ids;
  while (!text.empty()) {
    TokenId best = -1;
    size_t best_len = 0;
    for (size_t id = 0; id < v.bytes.size(); ++id) {
      const std::string& b = v.bytes[id];
      if (b.size() > best_len && text.starts_with(b)) best = static_cast<TokenId>(id), best_len = b.size();
    }
    if (best < 0) return std::nullopt;
    ids.push_back(best);
    text.remove_prefix(best_len);
  }
  return ids;
}

using MakeConstraint =
    std::function<Result<std::unique_ptr<TokenConstraint>>(std::shared_ptr<const VocabularyBytes>)>;

nlohmann::json measure(const std::string& constraint_name, const MakeConstraint& make, const std::string& name,
                       const Tokenizer& tok, int repeats) {
  const auto t0 = Clock::now();
  auto vocabulary = VocabularyBytes::build(tok);
  const double build_s = seconds_since(t0);
  const auto c0 = Clock::now();
  if (auto first = make(vocabulary); !first.is_ok()) fail(first.status());  // builds what is shared (a trie)
  const double create_s = seconds_since(c0);
  const std::optional<std::vector<TokenId>> ids = longest_match(*vocabulary, kDocument);
  if (!ids) fail(internal_error("the vocabulary cannot spell the document"));
  std::vector<double> mask_us;
  std::vector<std::vector<double>> at_step(ids->size());  // each pass's time at each token
  std::vector<int64_t> open_at_step(ids->size());
  std::vector<float> logits(static_cast<size_t>(tok.vocab_size()));
  size_t open_total = 0, steps = 0;
  for (int r = 0; r < repeats; ++r) {
    auto c = make(vocabulary);
    if (!c.is_ok()) fail(c.status());
    for (size_t i = 0; i < ids->size(); ++i) {
      const TokenId id = (*ids)[i];
      std::fill(logits.begin(), logits.end(), 0.0f);
      const auto m0 = Clock::now();
      if (Status s = (*c)->mask(logits); !s.is_ok()) fail(s);
      mask_us.push_back(seconds_since(m0) * 1e6);
      at_step[i].push_back(mask_us.back());
      open_at_step[i] = std::count(logits.begin(), logits.end(), 0.0f);
      open_total += static_cast<size_t>(open_at_step[i]);
      ++steps;
      if (Status s = (*c)->accept(id); !s.is_ok()) fail(s.with_context("the document's own token"));
    }
    if (!(*c)->closed()) fail(internal_error("the document did not close the constraint"));
  }
  nlohmann::json j = {{"constraint", constraint_name},
                      {"vocabulary", name},
                      {"vocab_size", tok.vocab_size()},
                      {"document_tokens", ids->size()},
                      {"build_ms", build_s * 1e3},
                      {"first_create_ms", create_s * 1e3},
                      {"mask_us_p50", percentile(mask_us, 0.5)},
                      {"mask_us_p90", percentile(mask_us, 0.9)},
                      {"mask_us_max", percentile(mask_us, 1.0)},
                      {"open_tokens_mean", static_cast<double>(open_total) / static_cast<double>(steps)}};
  nlohmann::json per_step = nlohmann::json::array();
  for (size_t i = 0; i < ids->size(); ++i) {
    per_step.push_back({{"token", tok.decode_token(i == 0 ? tok.bos_id() : (*ids)[i - 1], (*ids)[i])},
                        {"mask_us_median", percentile(at_step[i], 0.5)},
                        {"open_tokens", open_at_step[i]}});
  }
  j["steps"] = std::move(per_step);
  std::fprintf(
      stderr,
      "%-11s %-12s vocab %6d: build %7.2f ms, mask p50 %8.1f us, p90 %8.1f us, max %8.1f us, %.0f tokens open\n",
      constraint_name.c_str(), name.c_str(), tok.vocab_size(), build_s * 1e3, j["mask_us_p50"].get<double>(),
      j["mask_us_p90"].get<double>(), j["mask_us_max"].get<double>(), j["open_tokens_mean"].get<double>());
  return j;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"bench_json_mask: the per-step cost of JSON-constrained decoding"};
  std::string out_path;
  int repeats = 5;
  app.add_option("--out", out_path, "write the JSON report here too");
  app.add_option("--repeats", repeats, "passes over the document")->check(CLI::PositiveNumber);
  bool plot = false;
  app.add_flag("--plot", plot, "PNG beside --out (plot_json_mask.py)");
  CLI11_PARSE(app, argc, argv);
  const std::string root = SPECONTEXT_SOURCE_DIR;
  nlohmann::json results = nlohmann::json::array();
  auto stories = load_llama2c_tokenizer(root + "/models/stories260K/tok512.bin", 512);
  if (!stories.is_ok()) fail(stories.status());
  const MakeConstraint json_object = [](std::shared_ptr<const VocabularyBytes> v) -> Result<std::unique_ptr<TokenConstraint>> {
    SPX_ASSIGN_OR_RETURN(auto c, JsonObjectConstraint::create(std::move(v)));
    return std::unique_ptr<TokenConstraint>(std::move(c));
  };
  const auto schema = std::make_shared<const Grammar>([] {
    auto g = json_schema_to_grammar(nlohmann::ordered_json::parse(kSchema));
    if (!g.is_ok()) fail(g.status());
    return std::move(*g);
  }());
  const MakeConstraint json_schema = [schema](std::shared_ptr<const VocabularyBytes> v) -> Result<std::unique_ptr<TokenConstraint>> {
    SPX_ASSIGN_OR_RETURN(auto c, JsonSchemaConstraint::create(schema, std::move(v)));
    return std::unique_ptr<TokenConstraint>(std::move(c));
  };
  for (const auto& [label, make] : {std::pair{"json_object", json_object}, std::pair{"json_schema", json_schema}}) {
    results.push_back(measure(label, make, "stories260K", **stories, repeats));
  }
  auto gguf = GgufFile::open(root + "/data/tokenizer-tests/ggml-vocab-gpt-2.gguf");
  if (!gguf.is_ok()) fail(gguf.status());
  auto gpt2 = load_gguf_tokenizer(**gguf);
  if (!gpt2.is_ok()) fail(gpt2.status());
  for (const auto& [label, make] : {std::pair{"json_object", json_object}, std::pair{"json_schema", json_schema}}) {
    results.push_back(measure(label, make, "gpt-2", **gpt2, repeats));
  }
  const nlohmann::json doc = {{"document", kDocument}, {"schema", nlohmann::json::parse(kSchema)}, {"repeats", repeats}, {"results", results}};
  if (out_path.empty()) {
    if (plot) std::fprintf(stderr, "bench_json_mask: --plot needs --out\n");
    std::printf("%s\n", doc.dump().c_str());
    return 0;
  }
  bench::write_report(doc, out_path, plot, root + "/bench/plot_json_mask.py");
  return 0;
}
