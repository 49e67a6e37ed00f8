#include "research/eval.h"

#include <algorithm>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <span>

#include "core/ports/sampler.h"
#include "research/eval_internal.h"

namespace specontext {

// attention_fidelity from the layer's attention weights (attention_weights' output) and a selection.
StepFidelity fidelity_of_weights(std::span<const double> weights, int64_t n_heads, const KvLayerView& kv,
                                 int64_t length, const Selection& selection);

namespace {

using Clock = std::chrono::steady_clock;
using eval_internal::seconds_since;
using eval_internal::splitmix64;

// Collects per-step, per-layer attention fidelity of single-token decode steps, and per step the
// recall of the best selection shared by every layer (shared_oracle_recall).
class FidelityObserver final : public ForwardObserver {
 public:
  FidelityObserver(int64_t n_heads, int64_t n_kv_heads, int64_t head_dim, int64_t n_layers,
                   const SelectionOptions& selection)
      : n_heads_(n_heads), n_kv_heads_(n_kv_heads), head_dim_(head_dim), n_layers_(n_layers), selection_(selection) {}

  void on_attention(LayerId layer, const float* q, std::span<const AttentionItem> items) override {
    flush();
    if (items.size() != 1 || items[0].n_tokens != 1) return;  // prefill or batches: not measured
    pending_ = true;
    q_.assign(q + items[0].token_offset * n_heads_ * head_dim_,
              q + (items[0].token_offset + 1) * n_heads_ * head_dim_);
    item_ = items[0];
    layer_ = layer;
  }

  void on_sparse_selection(LayerId layer, std::span<const AttentionItem> items,
                           std::span<const Selection* const> selections) override {
    if (!pending_ || layer != layer_ || items.size() != 1 || selections.size() != 1) return;
    const int64_t length = items[0].start_pos + 1;
    pending_ = false;
    if (selections[0] == nullptr) {
      add(attention_fidelity(q_.data(), n_heads_, items[0].kv, length, nullptr));
      return;
    }
    std::vector<double> w;  // the layer's attention, for its fidelity and the step's shared oracle
    attention_weights(q_.data(), n_heads_, items[0].kv, length, w);
    add(fidelity_of_weights(w, n_heads_, items[0].kv, length, *selections[0]));
    if (step_weights_.empty()) step_length_ = length;
    if (length == step_length_) step_weights_.push_back(std::move(w));
  }

  // Ends a forward: the shared oracle of the step when every layer decoded sparsely.
  void end_step() {
    flush();
    if (static_cast<int64_t>(step_weights_.size()) == n_layers_) {
      shared_recall_sum += shared_oracle_recall(step_weights_, n_heads_, n_kv_heads_, step_length_, selection_);
      ++shared_steps;
    }
    step_weights_.clear();
  }

  // Ends a forward: a layer that saw no selection attended densely.
  void flush() {
    if (!pending_) return;
    add(attention_fidelity(q_.data(), n_heads_, item_.kv, item_.start_pos + 1, nullptr));
    pending_ = false;
  }

  double recall_sum = 0.0, rel_l2_sum = 0.0;
  int64_t head_samples = 0;
  int64_t attended_tokens = 0;
  double shared_recall_sum = 0.0;
  int64_t shared_steps = 0;

 private:
  void add(const StepFidelity& f) {
    recall_sum += f.recall_sum;
    rel_l2_sum += f.rel_l2_sum;
    head_samples += f.heads;
    attended_tokens += f.attended_tokens;
  }
  int64_t n_heads_, n_kv_heads_, head_dim_, n_layers_;
  SelectionOptions selection_;
  std::vector<std::vector<double>> step_weights_;  // this step's sparse layers' attention weights
  int64_t step_length_ = 0;
  bool pending_ = false;
  std::vector<float> q_;
  AttentionItem item_;
  LayerId layer_{0};
};

// Log-softmax in double.
void log_softmax(std::span<const float> logits, std::vector<double>& out) {
  out.resize(logits.size());
  double mx = -INFINITY;
  for (float x : logits) mx = std::max(mx, static_cast<double>(x));
  double sum = 0.0;
  for (float x : logits) sum += std::exp(static_cast<double>(x) - mx);
  const double lse = mx + std::log(sum);
  for (size_t i = 0; i < logits.size(); ++i) out[i] = static_cast<double>(logits[i]) - lse;
}

// KL(p ‖ q) from log-probabilities.
double kl_divergence(const std::vector<double>& lp, const std::vector<double>& lq) {
  double kl = 0.0;
  for (size_t i = 0; i < lp.size(); ++i) {
    const double p = std::exp(lp[i]);
    if (p > 0.0) kl += p * (lp[i] - lq[i]);
  }
  return std::max(kl, 0.0);
}

// Everything one engine configuration produced.
struct RunOutput {
  std::vector<float> logits;  // [positions][vocab]
  double recall = 1.0, rel_l2 = 0.0;
  std::optional<double> shared_oracle_recall;
  double attended_tokens_per_step = 0.0;  // Σ over layers and KV heads, per decode step
  SparseStats stats;
  std::vector<TokenId> greedy;                    // divergence continuation
  std::vector<std::vector<TokenId>> needle_answers;
  double seconds = 0.0;
};

struct NeedleTrial {
  std::vector<TokenId> prompt;
  std::string digits;
  double depth = 0.0;
  int64_t needle_at = 0;  // token index of the needle's first token
  int64_t answer_tokens = 0;
};

using eval_internal::prefill;

// Greedy continuation of `prompt` (n tokens, no stop tokens: the comparison wants equal lengths).
Result<std::vector<TokenId>> greedy_continuation(Engine& e, std::span<const TokenId> prompt, int64_t n,
                                                 int64_t chunk) {
  SPX_ASSIGN_OR_RETURN(SeqId seq, e.memory().add_sequence());
  auto body = [&]() -> Result<std::vector<TokenId>> {
    SPX_ASSIGN_OR_RETURN(std::vector<float> logits, prefill(e, seq, prompt, chunk, true));
    std::vector<TokenId> out;
    TokenId t = argmax(logits);
    out.push_back(t);
    while (static_cast<int64_t>(out.size()) < n) {
      StepRequest r{seq, std::span<const TokenId>(&t, 1), LogitsMode::kLast};
      SPX_ASSIGN_OR_RETURN(StepOutput so, e.forward(std::span<const StepRequest>(&r, 1)));
      t = argmax(so.row(0));
      out.push_back(t);
    }
    return out;
  };
  auto result = body();
  SPX_RETURN_IF_ERROR(e.memory().remove_sequence(seq));
  return result;
}

std::string method_label(SparseMethod m) { return std::string(sparse_method_name(m)); }

// Encoding of `text` as it appears in the middle of running text: one leading space, no BOS.
// SentencePiece-style vocabularies add that space themselves (dummy prefix), byte-level BPE
// needs it written; the candidate whose decoding reads " " + text wins.
Result<std::vector<TokenId>> encode_inline(const Tokenizer& tok, const std::string& text, TokenId context_token) {
  for (const std::string& cand : {text, " " + text}) {
    SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ids, tok.encode(cand, /*add_bos=*/false));
    std::string decoded;
    TokenId prev = context_token;
    for (TokenId id : ids) {
      decoded += tok.decode_token(prev, id);
      prev = id;
    }
    if (decoded == " " + text) return ids;
  }
  return invalid_argument("tokenizer cannot represent \"" + text + "\" exactly (characters missing from its vocabulary)");
}

// Needle prompts: [BOS] filler[0, a) needle filler[a, n) question, each short enough that
// prompt + answer fits the context.
Result<std::vector<NeedleTrial>> build_needles(const Tokenizer& tok, const std::vector<TokenId>& filler,
                                               const EvalOptions& o, int64_t context, std::string* note,
                                               int64_t* prompt_tokens) {
  std::vector<NeedleTrial> trials;
  if (o.needles <= 0) return trials;
  if (filler.empty()) {
    *note = "needle test skipped: no filler text";
    return trials;
  }
  // Any ordinary token works as left context for decode_token (only BOS strips the space).
  const TokenId ctx_tok = filler.front() == tok.bos_id() && filler.size() > 1 ? filler[1] : filler.front();
  uint64_t rng = o.seed * 0x2545F4914F6CDD1Dull + 17;
  struct Raw { std::string digits; std::vector<TokenId> needle, answer; };
  std::vector<Raw> raws;
  int64_t max_needle = 0, max_answer = 0;
  for (size_t d = 0; d < o.needle_depths.size(); ++d) {
    for (int64_t k = 0; k < o.needles; ++k) {
      Raw r;
      r.digits = std::to_string(1000 + splitmix64(rng) % 9000);  // four digits, no leading zero
      auto needle = encode_inline(tok, "The secret number is " + r.digits + ".", ctx_tok);
      auto answer = encode_inline(tok, r.digits + ".", ctx_tok);
      if (!needle.is_ok() || !answer.is_ok()) {
        *note = "needle test skipped: " + (needle.is_ok() ? answer.status() : needle.status()).message();
        return std::vector<NeedleTrial>{};
      }
      r.needle = std::move(*needle);
      r.answer = std::move(*answer);
      max_needle = std::max<int64_t>(max_needle, static_cast<int64_t>(r.needle.size()));
      max_answer = std::max<int64_t>(max_answer, static_cast<int64_t>(r.answer.size()));
      raws.push_back(std::move(r));
    }
  }
  SPX_ASSIGN_OR_RETURN(std::vector<TokenId> question, encode_inline(tok, "The secret number is", ctx_tok));
  const int64_t bos = tok.bos_id() >= 0 ? 1 : 0;
  const int64_t prompt_len = context - max_answer;
  // Prompts are at most prompt_len long: the filler absorbs the needle's length differences.
  const int64_t min_filler = prompt_len - bos - max_needle - static_cast<int64_t>(question.size());
  if (min_filler < 16) {
    *note = "needle test skipped: context " + std::to_string(context) + " leaves no room for filler";
    return std::vector<NeedleTrial>{};
  }
  // Sentence ends of the filler (cycled when shorter than needed): insertion points.
  const int64_t n_fill_max = min_filler + max_needle;
  std::vector<TokenId> fill(static_cast<size_t>(n_fill_max));
  for (int64_t i = 0; i < n_fill_max; ++i) fill[static_cast<size_t>(i)] = filler[static_cast<size_t>(i) % filler.size()];
  std::vector<char> boundary(static_cast<size_t>(n_fill_max + 1), 0), word_start(static_cast<size_t>(n_fill_max + 1), 0);
  boundary[0] = word_start[0] = 1;
  for (int64_t i = 1; i <= n_fill_max; ++i) {
    const std::string piece = tok.decode_token(ctx_tok, fill[static_cast<size_t>(i - 1)]);
    const char c = piece.empty() ? '\0' : piece.back();
    boundary[static_cast<size_t>(i)] = c == '.' || c == '!' || c == '?' || c == '\n';
    if (i < n_fill_max) {
      const std::string next = tok.decode_token(ctx_tok, fill[static_cast<size_t>(i)]);
      word_start[static_cast<size_t>(i)] = boundary[static_cast<size_t>(i)] || (!next.empty() && next[0] == ' ');
    }
  }
  size_t r_idx = 0;
  for (size_t d = 0; d < o.needle_depths.size(); ++d) {
    for (int64_t k = 0; k < o.needles; ++k, ++r_idx) {
      const Raw& r = raws[r_idx];
      int64_t n_fill = prompt_len - bos - static_cast<int64_t>(r.needle.size() + question.size());
      // The question starts a sentence: the filler ends at its last sentence end when one is near.
      for (int64_t i = n_fill; i > n_fill - 64 && i > 0; --i) {
        if (boundary[static_cast<size_t>(i)]) {
          n_fill = i;
          break;
        }
      }
      const double want = o.needle_depths[d] * static_cast<double>(n_fill);
      auto nearest = [&](const std::vector<char>& ok) {
        int64_t best = 0;
        for (int64_t i = 0; i <= n_fill; ++i) {
          if (ok[static_cast<size_t>(i)] && std::abs(static_cast<double>(i) - want) <
                                                 std::abs(static_cast<double>(best) - want)) {
            best = i;
          }
        }
        return best;
      };
      // A sentence end near the depth, else a word start (short fillers have few sentences).
      int64_t at = nearest(boundary);
      if (std::abs(static_cast<double>(at) - want) > 0.05 * static_cast<double>(n_fill)) at = nearest(word_start);
      NeedleTrial t;
      if (bos) t.prompt.push_back(tok.bos_id());
      t.prompt.insert(t.prompt.end(), fill.begin(), fill.begin() + at);
      t.prompt.insert(t.prompt.end(), r.needle.begin(), r.needle.end());
      t.prompt.insert(t.prompt.end(), fill.begin() + at, fill.begin() + n_fill);
      t.prompt.insert(t.prompt.end(), question.begin(), question.end());
      t.digits = r.digits;
      t.depth = o.needle_depths[d];
      t.needle_at = bos + at;
      t.answer_tokens = max_answer;
      trials.push_back(std::move(t));
    }
  }
  *prompt_tokens = 0;
  for (const NeedleTrial& t : trials) *prompt_tokens = std::max<int64_t>(*prompt_tokens, static_cast<int64_t>(t.prompt.size()));
  return trials;
}

using eval_internal::decode_inline;

// The answer's leading digits (after spaces).
std::string leading_digits(const Tokenizer& tok, const std::vector<TokenId>& answer, TokenId ctx_tok) {
  const std::string text = decode_inline(tok, answer, ctx_tok);
  size_t i = 0;
  while (i < text.size() && text[i] == ' ') ++i;
  size_t j = i;
  while (j < text.size() && text[j] >= '0' && text[j] <= '9') ++j;
  return text.substr(i, j - i);
}

}  // namespace

void attention_weights(const float* q, int64_t n_heads, const KvLayerView& kv, int64_t length,
                       std::vector<double>& out) {
  const int64_t hd = kv.head_dim, group = n_heads / kv.kv_heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  std::vector<float> row(static_cast<size_t>(hd));
  out.assign(static_cast<size_t>(n_heads * length), 0.0);
  for (int64_t h = 0; h < n_heads; ++h) {
    const float* qh = q + h * hd;
    double* w = out.data() + h * length;
    double mx = -INFINITY;
    for (int64_t t = 0; t < length; ++t) {
      const float* k = kv_row_f32(kv, /*values=*/false, h / group, t, row.data());
      double d = 0.0;
      for (int64_t i = 0; i < hd; ++i) d += static_cast<double>(qh[i]) * k[i];
      w[t] = d * scale;
      mx = std::max(mx, w[t]);
    }
    double sum = 0.0;
    for (int64_t t = 0; t < length; ++t) sum += (w[t] = std::exp(w[t] - mx));
    for (int64_t t = 0; t < length; ++t) w[t] /= sum;
  }
}

double selection_recall(std::span<const std::vector<double>> layer_weights, int64_t n_heads, int64_t n_kv_heads,
                        int64_t length, const Selection& selection) {
  const int64_t group = n_heads / n_kv_heads;
  double mass = 0.0;
  for (const std::vector<double>& w : layer_weights) {
    for (int64_t h = 0; h < n_heads; ++h) {
      for (int32_t t : selection.head(h / group)) {
        if (t >= 0 && t < length) mass += w[static_cast<size_t>(h * length + t)];
      }
    }
  }
  const auto samples = static_cast<double>(layer_weights.size()) * static_cast<double>(n_heads);
  return samples > 0 ? mass / samples : 0.0;
}

double shared_oracle_recall(std::span<const std::vector<double>> layer_weights, int64_t n_heads, int64_t n_kv_heads,
                            int64_t length, const SelectionOptions& options, Selection* selection) {
  const int64_t group = n_heads / n_kv_heads;
  // Per KV head, the weight summed over layers and the group's query heads: the recall of a
  // selection is the sum of this over its tokens (÷ layers·heads), so the top tokens maximise it.
  std::vector<float> score(static_cast<size_t>(n_kv_heads * length), 0.0f);
  std::vector<double> sum(static_cast<size_t>(length));
  for (int64_t g = 0; g < n_kv_heads; ++g) {
    std::fill(sum.begin(), sum.end(), 0.0);
    for (const std::vector<double>& w : layer_weights) {
      for (int64_t h = g * group; h < (g + 1) * group; ++h) {
        for (int64_t t = 0; t < length; ++t) sum[static_cast<size_t>(t)] += w[static_cast<size_t>(h * length + t)];
      }
    }
    for (int64_t t = 0; t < length; ++t) score[static_cast<size_t>(g * length + t)] = static_cast<float>(sum[static_cast<size_t>(t)]);
  }
  Selection local;
  Selection& sel = selection != nullptr ? *selection : local;
  select_from_group_scores(score, n_kv_heads, length, options, sel);
  return selection_recall(layer_weights, n_heads, n_kv_heads, length, sel);
}

StepFidelity fidelity_of_weights(std::span<const double> weights, int64_t n_heads, const KvLayerView& kv,
                                 int64_t length, const Selection& selection) {
  StepFidelity f;
  const int64_t hd = kv.head_dim, group = n_heads / kv.kv_heads;
  std::vector<double> o(static_cast<size_t>(hd)), os(static_cast<size_t>(hd));
  std::vector<char> in_sel(static_cast<size_t>(length));
  std::vector<float> row(static_cast<size_t>(hd));  // a widened V row (f16 / bf16 caches)
  f.heads = n_heads;
  for (int64_t g = 0; g < kv.kv_heads; ++g) f.attended_tokens += static_cast<int64_t>(selection.head(g).size());
  for (int64_t h = 0; h < n_heads; ++h) {
    const int64_t g = h / group;
    const double* w = weights.data() + h * length;
    std::fill(o.begin(), o.end(), 0.0);
    std::fill(os.begin(), os.end(), 0.0);
    std::fill(in_sel.begin(), in_sel.end(), 0);
    for (int32_t t : selection.head(g)) {
      if (t >= 0 && t < length) in_sel[static_cast<size_t>(t)] = 1;
    }
    double mass = 0.0;
    for (int64_t t = 0; t < length; ++t) {
      const double p = w[t];
      const float* v = kv_row_f32(kv, /*values=*/true, g, t, row.data());
      for (int64_t i = 0; i < hd; ++i) o[static_cast<size_t>(i)] += p * v[i];
      if (in_sel[static_cast<size_t>(t)]) {
        mass += p;
        for (int64_t i = 0; i < hd; ++i) os[static_cast<size_t>(i)] += p * v[i];
      }
    }
    double num = 0.0, den = 0.0;
    for (int64_t i = 0; i < hd; ++i) {
      const double s = mass > 0.0 ? os[static_cast<size_t>(i)] / mass : 0.0;  // renormalised over S
      num += (s - o[static_cast<size_t>(i)]) * (s - o[static_cast<size_t>(i)]);
      den += o[static_cast<size_t>(i)] * o[static_cast<size_t>(i)];
    }
    f.recall_sum += mass;
    f.rel_l2_sum += den > 0.0 ? std::sqrt(num / den) : std::sqrt(num);
  }
  return f;
}

StepFidelity attention_fidelity(const float* q, int64_t n_heads, const KvLayerView& kv, int64_t length,
                                const Selection* selection) {
  if (selection == nullptr) {  // dense: every token, exactly the dense output
    StepFidelity f;
    f.heads = n_heads;
    f.attended_tokens = kv.kv_heads * length;
    f.recall_sum = static_cast<double>(n_heads);
    return f;
  }
  std::vector<double> w;
  attention_weights(q, n_heads, kv, length, w);
  return fidelity_of_weights(w, n_heads, kv, length, *selection);
}

Result<std::vector<TokenId>> encode_stories(const Tokenizer& tokenizer, std::string_view text) {
  static constexpr std::string_view kSep = "<|endoftext|>";
  std::vector<TokenId> out;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(kSep, pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view story = text.substr(pos, end - pos);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.front()))) story.remove_prefix(1);
    while (!story.empty() && std::isspace(static_cast<unsigned char>(story.back()))) story.remove_suffix(1);
    if (!story.empty()) {
      SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ids, tokenizer.encode(story, tokenizer.add_bos_by_default()));
      out.insert(out.end(), ids.begin(), ids.end());
    }
    pos = end + kSep.size();
  }
  return out;
}

Result<std::vector<TokenId>> encode_filler(const Tokenizer& tokenizer, std::string_view text) {
  static constexpr std::string_view kSep = "<|endoftext|>";
  std::string joined;
  size_t pos = 0;
  while (pos <= text.size()) {
    size_t end = text.find(kSep, pos);
    if (end == std::string_view::npos) end = text.size();
    std::string_view part = text.substr(pos, end - pos);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.front()))) part.remove_prefix(1);
    while (!part.empty() && std::isspace(static_cast<unsigned char>(part.back()))) part.remove_suffix(1);
    if (!part.empty()) {
      if (!joined.empty()) joined += ' ';
      joined += part;
    }
    pos = end + kSep.size();
  }
  // Line breaks inside stories become spaces too: the needle's sentence boundaries are '.', '!', '?'.
  std::replace(joined.begin(), joined.end(), '\n', ' ');
  return tokenizer.encode(joined, /*add_bos=*/false);
}

std::vector<TokenId> synthetic_tokens(int64_t n, int64_t vocab, uint64_t seed) {
  std::vector<TokenId> out(static_cast<size_t>(std::max<int64_t>(n, 0)));
  uint64_t state = seed * 0x9E3779B97F4A7C15ull + 3;
  const int64_t lo = vocab > 3 ? 3 : 0;
  for (auto& t : out) t = static_cast<TokenId>(lo + static_cast<int64_t>(splitmix64(state) % static_cast<uint64_t>(vocab - lo)));
  return out;
}

Result<EvalReport> run_eval(std::shared_ptr<const Model> model, std::shared_ptr<Backend> backend,
                            const EvalInputs& inputs, const EvalOptions& o) {
  const auto t_all = Clock::now();
  if (!model || !backend) return invalid_argument("run_eval: model and backend are required");
  const ModelConfig& c = model->config;
  EvalReport rep;
  rep.context = o.context > 0 ? o.context : c.max_seq_len;
  if (rep.context > c.max_seq_len) {
    return out_of_range("eval: --context " + std::to_string(rep.context) + " is beyond the model's max_seq_len " +
                        std::to_string(c.max_seq_len));
  }
  if (o.positions < 1 || o.positions >= rep.context) {
    return invalid_argument("eval: --positions " + std::to_string(o.positions) + " must be in [1, context " +
                            std::to_string(rep.context) + ")");
  }
  if (static_cast<int64_t>(inputs.tokens.size()) < rep.context) {
    return invalid_argument("eval: the text has " + std::to_string(inputs.tokens.size()) + " tokens, fewer than --context " +
                            std::to_string(rep.context));
  }
  if (o.divergence_tokens < 1) return invalid_argument("eval: divergence tokens must be at least 1");
  if (o.prefill_chunk < 1 || o.page_size < 1) return invalid_argument("eval: prefill chunk and page size must be positive");
  for (int64_t b : o.budgets) {
    if (b < 1) return invalid_argument("eval: --budgets entries must be positive (got " + std::to_string(b) + ")");
  }
  for (double d : o.needle_depths) {
    if (!(d >= 0.0 && d <= 1.0)) return invalid_argument("eval: needle depths must lie in [0, 1]");
  }
  rep.positions = o.positions;
  rep.prefix = rep.context - o.positions;
  rep.divergence_tokens = o.divergence_tokens;
  rep.divergence_prefix = std::min(rep.prefix, c.max_seq_len - o.divergence_tokens);
  if (rep.divergence_prefix < 1) {
    return invalid_argument("eval: " + std::to_string(o.divergence_tokens) + " divergence tokens do not fit max_seq_len " +
                            std::to_string(c.max_seq_len));
  }
  rep.budgets = o.budgets;
  rep.sinks = o.sinks;
  rep.window = o.window;
  rep.quest_page_size = o.quest_page_size;
  const int64_t vocab = c.vocab_size;
  const int64_t P = rep.prefix;
  const std::span<const TokenId> text(inputs.tokens.data(), static_cast<size_t>(rep.context));

  // ---- needle prompts (shared by every configuration) ----
  std::vector<NeedleTrial> needles;
  TokenId needle_ctx_tok = 0;
  if (o.needles > 0) {
    if (inputs.tokenizer == nullptr) {
      rep.notes.push_back("needle test skipped: no tokenizer");
    } else {
      std::vector<TokenId> filler = inputs.filler;
      if (filler.empty()) {
        for (TokenId t : inputs.tokens) {
          if (t != inputs.tokenizer->bos_id()) filler.push_back(t);
        }
      }
      std::string note;
      SPX_ASSIGN_OR_RETURN(needles, build_needles(*inputs.tokenizer, filler, o, rep.context, &note,
                                                  &rep.needle_prompt_tokens));
      if (!note.empty()) rep.notes.push_back(note);
      if (!filler.empty()) needle_ctx_tok = filler.front();
    }
  }
  rep.needle_trials = static_cast<int64_t>(needles.size());

  auto run_config = [&](const SparseOptions& sp) -> Result<RunOutput> {
    const auto t0 = Clock::now();
    RunOutput out;
    SPX_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine,
                         eval_internal::make_eval_engine(model, backend, sp, o.page_size, o.head));
    Engine& e = *engine;

    // Teacher forcing.
    {
      SPX_ASSIGN_OR_RETURN(SeqId seq, e.memory().add_sequence());
      FidelityObserver obs(c.n_heads, c.n_kv_heads, c.head_dim, c.n_layers, sp.selection);
      auto body = [&]() -> Status {
        SPX_RETURN_IF_ERROR(prefill(e, seq, text.first(static_cast<size_t>(P)), o.prefill_chunk, false).status());
        e.reset_sparse_stats();
        e.set_observer(&obs);
        out.logits.resize(static_cast<size_t>(o.positions * vocab));
        for (int64_t i = 0; i < o.positions; ++i) {
          StepRequest r{seq, text.subspan(static_cast<size_t>(P + i), 1), LogitsMode::kLast};
          auto so = e.forward(std::span<const StepRequest>(&r, 1));
          obs.end_step();
          if (!so.is_ok()) return so.status();
          auto row = so->row(0);
          std::copy(row.begin(), row.end(), out.logits.begin() + i * vocab);
        }
        return Status::ok();
      };
      Status st = body();
      e.set_observer(nullptr);
      out.stats = e.sparse_stats();
      SPX_RETURN_IF_ERROR(e.memory().remove_sequence(seq));
      SPX_RETURN_IF_ERROR(st);
      if (obs.head_samples > 0) {
        out.recall = obs.recall_sum / static_cast<double>(obs.head_samples);
        out.rel_l2 = obs.rel_l2_sum / static_cast<double>(obs.head_samples);
      }
      out.attended_tokens_per_step = static_cast<double>(obs.attended_tokens) / static_cast<double>(o.positions);
      if (obs.shared_steps > 0)
        out.shared_oracle_recall = obs.shared_recall_sum / static_cast<double>(obs.shared_steps);
    }
    // First divergence.
    SPX_ASSIGN_OR_RETURN(out.greedy, greedy_continuation(e, text.first(static_cast<size_t>(rep.divergence_prefix)),
                                                         o.divergence_tokens, o.prefill_chunk));
    // Needles.
    for (const NeedleTrial& t : needles) {
      SPX_ASSIGN_OR_RETURN(std::vector<TokenId> ans, greedy_continuation(e, t.prompt, t.answer_tokens, o.prefill_chunk));
      out.needle_answers.push_back(std::move(ans));
    }
    out.seconds = seconds_since(t0);
    return out;
  };

  const int64_t token_bytes = 2 * c.head_dim * 4;  // K + V of one KV head, f32
  auto make_record = [&](SparseMethod m, int64_t budget, const RunOutput& run, const RunOutput& ref) {
    EvalRecord r;
    r.method = m;
    r.budget = budget;
    r.attention_recall = run.recall;
    if (m != SparseMethod::kDense) r.shared_oracle_recall = run.shared_oracle_recall;
    r.output_rel_l2 = run.rel_l2;
    std::vector<double> lp, lq;
    double kl_sum = 0.0;
    int64_t agree = 0;
    for (int64_t i = 0; i < o.positions; ++i) {
      const std::span<const float> a(ref.logits.data() + i * vocab, static_cast<size_t>(vocab));
      const std::span<const float> b(run.logits.data() + i * vocab, static_cast<size_t>(vocab));
      log_softmax(a, lp);
      log_softmax(b, lq);
      const double kl = kl_divergence(lp, lq);
      kl_sum += kl;
      r.kl_max = std::max(r.kl_max, kl);
      agree += argmax(a) == argmax(b) ? 1 : 0;
    }
    r.kl = kl_sum / static_cast<double>(o.positions);
    r.top1_agreement = static_cast<double>(agree) / static_cast<double>(o.positions);
    r.first_divergence = o.divergence_tokens;
    for (int64_t i = 0; i < o.divergence_tokens; ++i) {
      if (run.greedy[static_cast<size_t>(i)] != ref.greedy[static_cast<size_t>(i)]) {
        r.first_divergence = i;
        break;
      }
    }
    if (!needles.empty()) {
      int64_t correct = 0, same = 0;
      for (size_t k = 0; k < needles.size(); ++k) {
        correct += leading_digits(*inputs.tokenizer, run.needle_answers[k], needle_ctx_tok) == needles[k].digits;
        same += run.needle_answers[k] == ref.needle_answers[k];
      }
      r.needle_trials = static_cast<int64_t>(needles.size());
      r.needle_accuracy = static_cast<double>(correct) / static_cast<double>(needles.size());
      r.needle_agreement = static_cast<double>(same) / static_cast<double>(needles.size());
    }
    r.sparse_steps = run.stats.sparse_steps;
    r.mean_overlap = run.stats.overlap();
    r.bytes_loaded_per_token = static_cast<double>(run.stats.bytes_loaded) / static_cast<double>(o.positions);
    r.attended_bytes_per_token = run.attended_tokens_per_step * static_cast<double>(token_bytes);
    r.seconds = run.seconds;
    return r;
  };
  auto report_progress = [&](const EvalRecord& r) {
    if (!o.on_progress) return;
    char line[256];
    std::snprintf(line, sizeof(line), "%-10s budget %4lld  recall %.4f  KL %.5f  top1 %.3f  (%.1f s)",
                  method_label(r.method).c_str(), static_cast<long long>(r.budget), r.attention_recall, r.kl,
                  r.top1_agreement, r.seconds);
    o.on_progress(line);
  };

  // ---- dense reference ----
  SparseOptions dense;
  SPX_ASSIGN_OR_RETURN(RunOutput ref, run_config(dense));
  for (size_t k = 0; k < needles.size(); ++k) {
    rep.needle_examples.push_back({needles[k].depth, needles[k].digits, needles[k].needle_at,
                                   decode_inline(*inputs.tokenizer, ref.needle_answers[k], needle_ctx_tok)});
  }
  if (!needles.empty()) rep.needle_example_prompt = inputs.tokenizer->decode(needles[0].prompt);
  if (std::find(o.methods.begin(), o.methods.end(), SparseMethod::kDense) != o.methods.end()) {
    rep.records.push_back(make_record(SparseMethod::kDense, 0, ref, ref));
    report_progress(rep.records.back());
  }

  // ---- sparse methods × budgets ----
  for (const eval_internal::SweepPoint& pt :
       eval_internal::sparse_sweep(o.methods, o.budgets, o.sinks, o.window, o.quest_page_size, o.head != nullptr,
                                   "specontext skipped: no retrieval head (give --head, or put "
                                   "retrieval_head.safetensors beside the model)",
                                   rep.notes)) {
    auto run = run_config(pt.options);
    if (!run.is_ok()) {
      return run.status().with_context(std::string("eval ") + method_label(pt.method) + " budget " +
                                       std::to_string(pt.budget));
    }
    rep.records.push_back(make_record(pt.method, pt.budget, *run, ref));
    report_progress(rep.records.back());
  }
  if (!rep.records.empty() && rep.records.front().method == SparseMethod::kDense) {
    rep.notes.push_back(
        "dense (budget 0 = every cached token) has no working set: its mean_overlap and bytes_loaded_per_token are "
        "0; attended_bytes_per_token is the K+V every method's attention reads per decode token (all layers).");
  }
  if (!needles.empty()) {
    rep.notes.push_back(
        "needle_accuracy: share of needle trials whose greedy answer starts with the inserted digits. Tiny "
        "TinyStories-trained models never learnt this retrieval task and score near 0 even with dense attention, "
        "so needle_agreement is reported too: the share of trials whose greedy answer tokens equal the dense "
        "engine's answer to the same prompt (dense: 1 by definition). It measures how much the sparse method "
        "changes the answer, not retrieval skill.");
  }
  rep.seconds = seconds_since(t_all);
  return rep;
}

nlohmann::json eval_report_to_json(const EvalReport& rep) {
  nlohmann::json records = nlohmann::json::array();
  auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  for (const EvalRecord& r : rep.records) {
    records.push_back({
        {"method", method_label(r.method)},
        {"budget", r.budget},
        {"attention_recall", r.attention_recall},
        {"shared_oracle_recall", opt(r.shared_oracle_recall)},
        {"output_rel_l2", r.output_rel_l2},
        {"kl", r.kl},
        {"kl_max", r.kl_max},
        {"top1_agreement", r.top1_agreement},
        {"first_divergence", r.first_divergence},
        {"needle_accuracy", opt(r.needle_accuracy)},
        {"needle_agreement", opt(r.needle_agreement)},
        {"needle_trials", r.needle_trials},
        {"sparse_steps", r.sparse_steps},
        {"mean_overlap", r.mean_overlap},
        {"bytes_loaded_per_token", r.bytes_loaded_per_token},
        {"attended_bytes_per_token", r.attended_bytes_per_token},
        {"seconds", r.seconds},
    });
  }
  nlohmann::json needle_examples = nlohmann::json::array();
  for (const auto& e : rep.needle_examples) {
    needle_examples.push_back(
        {{"depth", e.depth}, {"digits", e.digits}, {"needle_at", e.needle_at}, {"dense_answer", e.dense_answer}});
  }
  return {
      {"context", rep.context},
      {"positions", rep.positions},
      {"prefix", rep.prefix},
      {"divergence_tokens", rep.divergence_tokens},
      {"divergence_prefix", rep.divergence_prefix},
      {"budgets", rep.budgets},
      {"sinks", rep.sinks},
      {"window", rep.window},
      {"quest_page_size", rep.quest_page_size},
      {"needle_trials", rep.needle_trials},
      {"needle_prompt_tokens", rep.needle_prompt_tokens},
      {"records", records},
      {"needle_examples", needle_examples},
      {"needle_example_prompt", rep.needle_example_prompt},
      {"notes", rep.notes},
      {"seconds", rep.seconds},
  };
}

std::string format_eval_table(const EvalReport& rep) {
  std::string s;
  char line[320];
  std::snprintf(line, sizeof(line), "%-10s %6s %7s %7s %8s %9s %9s %5s %4s %6s %6s %7s %10s %10s %6s\n", "method",
                "budget", "recall", "sh_orc", "out_l2", "KL", "KL_max", "top1", "div", "needle", "agree", "overlap", "loaded_B/t",
                "attend_B/t", "sec");
  s += line;
  for (const EvalRecord& r : rep.records) {
    auto opt = [](const std::optional<double>& v) {
      char b[16];
      std::snprintf(b, sizeof(b), "%.2f", v.value_or(0.0));
      return v ? std::string(b) : std::string("-");
    };
    char shared[16] = "-";
    if (r.shared_oracle_recall) std::snprintf(shared, sizeof(shared), "%.4f", *r.shared_oracle_recall);
    std::snprintf(line, sizeof(line), "%-10s %6lld %7.4f %7s %8.4f %9.5f %9.5f %5.3f %4lld %6s %6s %7.3f %10.0f %10.0f %6.1f\n",
                  method_label(r.method).c_str(), static_cast<long long>(r.budget), r.attention_recall, shared,
                  r.output_rel_l2,
                  r.kl, r.kl_max, r.top1_agreement, static_cast<long long>(r.first_divergence),
                  opt(r.needle_accuracy).c_str(), opt(r.needle_agreement).c_str(), r.mean_overlap,
                  r.bytes_loaded_per_token, r.attended_bytes_per_token, r.seconds);
    s += line;
  }
  return s;
}

// Prefills `prompt` into a fresh sequence in chunks; the last chunk returns its last logits row.
Result<std::vector<float>> eval_internal::prefill(Engine& e, SeqId seq, std::span<const TokenId> prompt, int64_t chunk,
                                   bool want_logits) {
  std::vector<float> last;
  for (size_t off = 0; off < prompt.size(); off += static_cast<size_t>(chunk)) {
    const size_t n = std::min(prompt.size() - off, static_cast<size_t>(chunk));
    const bool is_last = off + n == prompt.size();
    StepRequest r{seq, prompt.subspan(off, n), is_last && want_logits ? LogitsMode::kLast : LogitsMode::kNone};
    SPX_ASSIGN_OR_RETURN(StepOutput out, e.forward(std::span<const StepRequest>(&r, 1)));
    if (is_last && want_logits) {
      auto row = out.row(0);
      last.assign(row.begin(), row.end());
    }
  }
  return last;
}

std::string eval_internal::decode_inline(const Tokenizer& tok, const std::vector<TokenId>& ids, TokenId ctx_tok) {
  std::string text;
  TokenId prev = ctx_tok;
  for (TokenId id : ids) {
    text += tok.decode_token(prev, id);
    prev = id;
  }
  return text;
}

Result<std::unique_ptr<Engine>> eval_internal::make_eval_engine(std::shared_ptr<const Model> model,
                                                                std::shared_ptr<Backend> backend,
                                                                const SparseOptions& sparse, int64_t page_size,
                                                                std::shared_ptr<const RetrievalHead> head) {
  EngineOptions eo;
  eo.max_sequences = 1;
  eo.max_context = model->config.max_seq_len;
  eo.page_size = page_size;
  eo.sparse = sparse;
  eo.retrieval_head = std::move(head);
  return Engine::create(std::move(model), std::move(backend), eo);
}

std::vector<eval_internal::SweepPoint> eval_internal::sparse_sweep(
    const std::vector<SparseMethod>& methods, const std::vector<int64_t>& budgets, int64_t sinks, int64_t window,
    int64_t quest_page_size, bool have_head, const std::string& skip_note, std::vector<std::string>& notes) {
  std::vector<SweepPoint> out;
  for (SparseMethod m : methods) {
    if (m == SparseMethod::kDense) continue;
    if (m == SparseMethod::kSpeContext && !have_head) {
      notes.push_back(skip_note);
      continue;
    }
    for (int64_t b : budgets) {
      SweepPoint pt;
      pt.method = m;
      pt.budget = b;
      pt.options.method = m;
      pt.options.selection.budget = b;
      pt.options.selection.sinks = sinks;
      pt.options.selection.window = window;
      pt.options.quest_page_size = quest_page_size;
      out.push_back(pt);
    }
  }
  return out;
}

}  // namespace specontext
