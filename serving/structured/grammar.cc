#include "serving/structured/grammar.h"

#include <algorithm>
#include <cassert>
#include <utility>

namespace specontext {

GrammarElement GrammarElement::byte(uint8_t b) {
  GrammarElement e;
  e.bytes.set(b);
  return e;
}

GrammarElement GrammarElement::range(uint8_t lo, uint8_t hi) {
  GrammarElement e;
  for (int b = lo; b <= hi; ++b) e.bytes.set(static_cast<size_t>(b));
  return e;
}

GrammarElement GrammarElement::set(const std::bitset<256>& bytes) {
  GrammarElement e;
  e.bytes = bytes;
  return e;
}

GrammarElement GrammarElement::not_set(const std::bitset<256>& bytes) { return set(~bytes); }

GrammarElement GrammarElement::ref(uint32_t rule) {
  GrammarElement e;
  e.kind = Kind::kRule;
  e.rule = rule;
  return e;
}

uint32_t GrammarBuilder::declare(std::string name) {
  rules_.push_back(Rule{std::move(name), false, {}});
  return static_cast<uint32_t>(rules_.size() - 1);
}

void GrammarBuilder::define(uint32_t rule, std::vector<GrammarSequence> alternatives) {
  assert(rule < rules_.size());
  rules_[rule].alternatives = std::move(alternatives);
  rules_[rule].defined = true;
}

uint32_t GrammarBuilder::add(std::string name, std::vector<GrammarSequence> alternatives) {
  const uint32_t r = declare(std::move(name));
  define(r, std::move(alternatives));
  return r;
}

GrammarSequence GrammarBuilder::literal(std::string_view bytes) {
  GrammarSequence s;
  for (char c : bytes) s.push_back(GrammarElement::byte(static_cast<uint8_t>(c)));
  return s;
}

uint32_t GrammarBuilder::wrap(const GrammarSequence& x, const std::string& name) {
  if (x.size() == 1 && x[0].kind == GrammarElement::Kind::kRule) return x[0].rule;
  return add(name, {x});
}

Result<uint32_t> GrammarBuilder::repeat(const GrammarSequence& x, uint32_t min, std::optional<uint32_t> max,
                                        const std::string& name) {
  if (max && *max < min) {
    return invalid_argument("grammar: repetition '" + name + "' has max " + std::to_string(*max) + " < min " +
                            std::to_string(min));
  }
  if (min > kMaxRepeat || (max && *max > kMaxRepeat)) {
    return invalid_argument("grammar: repetition '" + name + "' bound above " + std::to_string(kMaxRepeat));
  }
  const uint32_t item = wrap(x, name + "-item");
  GrammarSequence seq(min, GrammarElement::ref(item));
  if (!max) {
    const uint32_t tail = declare(name + "-tail");  // tail ::= item tail | ε (right recursion)
    define(tail, {{GrammarElement::ref(item), GrammarElement::ref(tail)}, {}});
    seq.push_back(GrammarElement::ref(tail));
  } else if (*max > min) {
    // opt_k ::= item opt_{k-1} | ε: at most k more items, the recursion in tail position.
    uint32_t prev = 0;
    for (uint32_t k = 1; k <= *max - min; ++k) {
      GrammarSequence more{GrammarElement::ref(item)};
      if (k > 1) more.push_back(GrammarElement::ref(prev));
      prev = add(name + "-upto" + std::to_string(k), {std::move(more), {}});
    }
    seq.push_back(GrammarElement::ref(prev));
  }
  return add(name, {std::move(seq)});
}

uint32_t GrammarBuilder::star(const GrammarSequence& x, const std::string& name) {
  return *repeat(x, 0, std::nullopt, name);
}
uint32_t GrammarBuilder::plus(const GrammarSequence& x, const std::string& name) {
  return *repeat(x, 1, std::nullopt, name);
}
uint32_t GrammarBuilder::optional(const GrammarSequence& x, const std::string& name) {
  return *repeat(x, 0, 1, name);
}

Result<Grammar> GrammarBuilder::build(uint32_t root) const {
  const size_t n = rules_.size();
  if (root >= n) return invalid_argument("grammar: the root rule does not exist");
  for (const Rule& r : rules_) {
    if (!r.defined) return invalid_argument("grammar: rule '" + r.name + "' is declared but never defined");
    if (r.alternatives.empty()) return invalid_argument("grammar: rule '" + r.name + "' has no alternative");
    for (const GrammarSequence& alt : r.alternatives) {
      for (const GrammarElement& e : alt) {
        if (e.kind == GrammarElement::Kind::kRule && e.rule >= n) {
          return invalid_argument("grammar: rule '" + r.name + "' refers to no rule");
        }
        if (e.kind == GrammarElement::Kind::kBytes && e.bytes.none()) {
          return invalid_argument("grammar: rule '" + r.name + "' holds an empty byte set");
        }
      }
    }
  }
  // Nullable rules (some alternative of only nullable references), to a fixed point.
  std::vector<bool> nullable(n, false);
  for (bool changed = true; changed;) {
    changed = false;
    for (size_t r = 0; r < n; ++r) {
      if (nullable[r]) continue;
      for (const GrammarSequence& alt : rules_[r].alternatives) {
        if (std::all_of(alt.begin(), alt.end(), [&](const GrammarElement& e) {
              return e.kind == GrammarElement::Kind::kRule && nullable[e.rule];
            })) {
          nullable[r] = true;
          changed = true;
          break;
        }
      }
    }
  }
  // Left edges: r -> s when s may come first in r (after nullable references only).
  std::vector<std::vector<uint32_t>> left(n);
  for (size_t r = 0; r < n; ++r) {
    for (const GrammarSequence& alt : rules_[r].alternatives) {
      for (const GrammarElement& e : alt) {
        if (e.kind != GrammarElement::Kind::kRule) break;
        left[r].push_back(e.rule);
        if (!nullable[e.rule]) break;
      }
    }
  }
  // A cycle among left edges is left recursion (iterative DFS: chains of rules can be long).
  std::vector<uint8_t> color(n, 0);  // 0 new, 1 on the path, 2 done
  for (size_t start = 0; start < n; ++start) {
    if (color[start] != 0) continue;
    std::vector<std::pair<uint32_t, size_t>> path{{static_cast<uint32_t>(start), 0}};
    color[start] = 1;
    while (!path.empty()) {
      auto& [r, next] = path.back();
      if (next == left[r].size()) {
        color[r] = 2;
        path.pop_back();
        continue;
      }
      const uint32_t s = left[r][next++];
      if (color[s] == 1) {
        std::string cycle;
        bool on = false;
        for (const auto& [p, unused] : path) {
          on |= p == s;
          if (on) cycle += "'" + rules_[p].name + "' -> ";
        }
        return invalid_argument("grammar: left recursion through " + cycle + "'" + rules_[s].name + "'");
      }
      if (color[s] == 0) {
        color[s] = 1;
        path.emplace_back(s, 0);
      }
    }
  }
  Grammar g;
  g.root_ = root;
  g.rule_alts_.resize(n);
  g.names_.resize(n);
  for (size_t r = 0; r < n; ++r) {
    g.names_[r] = rules_[r].name;
    for (const GrammarSequence& alt : rules_[r].alternatives) {
      g.rule_alts_[r].push_back(static_cast<uint32_t>(g.elements_.size()));
      for (const GrammarElement& e : alt) {
        Grammar::Element f;
        if (e.kind == GrammarElement::Kind::kRule) {
          f.kind = Grammar::Element::Kind::kRule;
          f.index = e.rule;
        } else {
          f.kind = Grammar::Element::Kind::kBytes;
          f.index = static_cast<uint32_t>(g.sets_.size());
          g.sets_.push_back(e.bytes);
        }
        g.elements_.push_back(f);
      }
      g.elements_.push_back(Grammar::Element{});  // end of the alternative
    }
  }
  return g;
}

Result<GrammarMatcher> GrammarMatcher::create(std::shared_ptr<const Grammar> grammar) {
  if (grammar == nullptr) return invalid_argument("grammar matcher: no grammar");
  GrammarMatcher m(std::move(grammar));
  const Grammar& g = *m.grammar_;
  size_t expansions = 0;
  std::vector<uint32_t> work;
  for (uint32_t start : g.rule_alts_[g.root_]) {
    work.clear();
    if (g.elements_[start].kind != Grammar::Element::Kind::kEnd) work.push_back(start);
    if (!m.expand(work, expansions)) {
      return resource_exhausted("grammar: more than " + std::to_string(kMaxStacks) +
                                " parse stacks at the start (an ambiguous grammar)");
    }
  }
  return m;
}

void GrammarMatcher::clear() {
  data_.clear();
  offsets_.assign(1, 0);
  hashes_.clear();
}

bool GrammarMatcher::push_stack(const std::vector<uint32_t>& stack) {
  uint64_t h = 1469598103934665603ull;
  for (uint32_t v : stack) h = (h ^ v) * 1099511628211ull;
  h = (h ^ stack.size()) * 1099511628211ull;
  for (size_t i = 0; i < hashes_.size(); ++i) {
    if (hashes_[i] != h) continue;
    const uint32_t b = offsets_[i], e = offsets_[i + 1];
    if (e - b == stack.size() && std::equal(stack.begin(), stack.end(), data_.begin() + b)) return true;
  }
  if (hashes_.size() >= kMaxStacks) return false;
  hashes_.push_back(h);
  data_.insert(data_.end(), stack.begin(), stack.end());
  offsets_.push_back(static_cast<uint32_t>(data_.size()));
  return true;
}

bool GrammarMatcher::expand(std::vector<uint32_t>& work, size_t& expansions) {
  if (++expansions > kMaxExpansions) return false;
  if (work.empty()) return push_stack(work);  // the sentence may end here
  const Grammar& g = *grammar_;
  const uint32_t top = work.back();
  const Grammar::Element& e = g.elements_[top];
  if (e.kind == Grammar::Element::Kind::kBytes) {
    if (work.size() > kMaxStackDepth) return true;  // too deep: this path is refused
    return push_stack(work);
  }
  // A reference: replace it by its continuation, then each alternative on top.
  work.pop_back();
  const size_t base = work.size();
  if (g.elements_[top + 1].kind != Grammar::Element::Kind::kEnd) work.push_back(top + 1);
  const size_t with_continuation = work.size();
  for (uint32_t start : g.rule_alts_[e.index]) {
    if (g.elements_[start].kind != Grammar::Element::Kind::kEnd) work.push_back(start);
    if (!expand(work, expansions)) return false;
    work.resize(with_continuation);
  }
  work.resize(base);
  work.push_back(top);
  return true;
}

GrammarMatcher::Step GrammarMatcher::advance_to(uint8_t b, GrammarMatcher& out) const {
  if (out.grammar_.get() != grammar_.get()) out.grammar_ = grammar_;
  out.clear();
  const Grammar& g = *grammar_;
  size_t expansions = 0;
  std::vector<uint32_t>& work = out.work_;
  for (size_t i = 0; i + 1 < offsets_.size(); ++i) {
    const uint32_t begin = offsets_[i], end = offsets_[i + 1];
    if (begin == end) continue;
    const uint32_t top = data_[end - 1];
    if (!g.sets_[g.elements_[top].index].test(b)) continue;
    work.assign(data_.begin() + begin, data_.begin() + end - 1);
    if (g.elements_[top + 1].kind != Grammar::Element::Kind::kEnd) work.push_back(top + 1);
    if (!out.expand(work, expansions)) return Step::kExhausted;
  }
  return out.dead() ? Step::kRefused : Step::kOk;
}

GrammarMatcher::Step GrammarMatcher::advance(std::string_view bytes) {
  if (bytes.empty()) return Step::kOk;
  GrammarMatcher a(grammar_), b(grammar_);
  const GrammarMatcher* cur = this;
  for (char c : bytes) {
    const Step s = cur->advance_to(static_cast<uint8_t>(c), a);
    if (s != Step::kOk) return s;
    std::swap(a, b);
    cur = &b;
  }
  data_ = std::move(b.data_);
  offsets_ = std::move(b.offsets_);
  hashes_ = std::move(b.hashes_);
  return Step::kOk;
}

bool GrammarMatcher::accepts(std::string_view bytes) const {
  GrammarMatcher copy = *this;
  return copy.advance(bytes) == Step::kOk;
}

bool GrammarMatcher::accepting() const {
  for (size_t i = 0; i + 1 < offsets_.size(); ++i) {
    if (offsets_[i] == offsets_[i + 1]) return true;
  }
  return false;
}

bool GrammarMatcher::closed() const { return stack_count() == 1 && offsets_[0] == offsets_[1]; }

std::bitset<256> GrammarMatcher::next_bytes() const {
  std::bitset<256> s;
  for (size_t i = 0; i + 1 < offsets_.size(); ++i) {
    if (offsets_[i] == offsets_[i + 1]) continue;
    s |= grammar_->sets_[grammar_->elements_[data_[offsets_[i + 1] - 1]].index];
  }
  return s;
}

std::vector<uint32_t> GrammarMatcher::state_key() const {
  std::vector<uint32_t> key;
  key.reserve(offsets_.size() + data_.size());
  key.insert(key.end(), offsets_.begin(), offsets_.end());
  key.insert(key.end(), data_.begin(), data_.end());
  return key;
}

}  // namespace specontext
