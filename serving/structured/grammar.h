// A small context-free grammar engine over bytes, in the manner of llama.cpp's llama-grammar:
//   Grammar         rules; a rule is a list of alternatives, an alternative a sequence of
//                   elements (a set of bytes, negated sets included, or a reference to a rule).
//   GrammarBuilder  declares and defines rules, compiles x*, x+, x?, x{m,n} into helper rules,
//                   and checks the whole (every rule defined, no left recursion) in build().
//   GrammarMatcher  a set of stacks (deduplicated, capped), advanced one byte at a time.
// Left recursion is refused when building (the matcher expands rules before each byte and would
// never stop). Pure CPU code, no threads.
#pragma once

#include <bitset>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "core/base/status.h"

namespace specontext {

struct GrammarElement {
  enum class Kind : uint8_t { kBytes, kRule };
  Kind kind = Kind::kBytes;
  std::bitset<256> bytes;  // kBytes: the bytes this element takes (never empty)
  uint32_t rule = 0;       // kRule

  static GrammarElement byte(uint8_t b);
  static GrammarElement range(uint8_t lo, uint8_t hi);  // lo..hi inclusive
  static GrammarElement set(const std::bitset<256>& bytes);
  static GrammarElement not_set(const std::bitset<256>& bytes);  // every byte but these
  static GrammarElement ref(uint32_t rule);
};
using GrammarSequence = std::vector<GrammarElement>;

// A checked grammar (GrammarBuilder::build). Elements are flattened: every alternative is a run
// of elements ended by an end marker, so a matcher stack entry is one index.
class Grammar {
 public:
  uint32_t root() const { return root_; }
  size_t rule_count() const { return rule_alts_.size(); }
  const std::string& rule_name(uint32_t rule) const { return names_[rule]; }

 private:
  friend class GrammarBuilder;
  friend class GrammarMatcher;
  struct Element {
    enum class Kind : uint8_t { kEnd, kBytes, kRule };
    Kind kind = Kind::kEnd;
    uint32_t index = 0;  // kBytes: into sets_; kRule: the rule
  };
  std::vector<Element> elements_;
  std::vector<std::bitset<256>> sets_;
  std::vector<std::vector<uint32_t>> rule_alts_;  // start index of each alternative
  std::vector<std::string> names_;
  uint32_t root_ = 0;
};

class GrammarBuilder {
 public:
  static constexpr uint32_t kMaxRepeat = 4096;  // bound of x{m,n}: m and n at most this

  // A rule to define later (so that rules may refer to each other, or to themselves).
  uint32_t declare(std::string name);
  // Sets the alternatives of a declared rule (once).
  void define(uint32_t rule, std::vector<GrammarSequence> alternatives);
  uint32_t add(std::string name, std::vector<GrammarSequence> alternatives);
  static GrammarSequence literal(std::string_view bytes);

  // x{min,max} (max absent: unbounded) as helper rules: min copies of x, then a right-recursive
  // tail (unbounded) or a chain of max-min nested optionals, so no stack grows with the count.
  // kInvalidArgument when max < min or a bound exceeds kMaxRepeat.
  [[nodiscard]] Result<uint32_t> repeat(const GrammarSequence& x, uint32_t min, std::optional<uint32_t> max,
                                        const std::string& name);
  uint32_t star(const GrammarSequence& x, const std::string& name);
  uint32_t plus(const GrammarSequence& x, const std::string& name);
  uint32_t optional(const GrammarSequence& x, const std::string& name);

  size_t rule_count() const { return rules_.size(); }
  // kInvalidArgument naming the rule: a rule declared but never defined, one with no alternative,
  // a reference to no rule, an empty byte set, or left recursion (naming the cycle).
  [[nodiscard]] Result<Grammar> build(uint32_t root) const;

 private:
  struct Rule {
    std::string name;
    bool defined = false;
    std::vector<GrammarSequence> alternatives;
  };
  uint32_t wrap(const GrammarSequence& x, const std::string& name);  // x as one rule
  std::vector<Rule> rules_;
};

class GrammarMatcher {
 public:
  static constexpr size_t kMaxStacks = 1024;       // more live stacks: kResourceExhausted
  static constexpr size_t kMaxStackDepth = 1024;   // deeper nesting: the byte is refused
  static constexpr size_t kMaxExpansions = 65536;  // stacks produced by one byte, before dedupe

  enum class Step : uint8_t { kOk, kRefused, kExhausted };

  // The matcher before any byte; kResourceExhausted when the grammar explodes at once.
  [[nodiscard]] static Result<GrammarMatcher> create(std::shared_ptr<const Grammar> grammar);

  // Writes into `out` (reusing its memory) this matcher advanced by `b`; `out` is undefined
  // unless kOk. kExhausted: the stacks would exceed kMaxStacks (or kMaxExpansions).
  Step advance_to(uint8_t b, GrammarMatcher& out) const;
  // All or nothing: unchanged unless every byte is taken.
  Step advance(std::string_view bytes);
  Step advance(uint8_t b) { return advance(std::string_view(reinterpret_cast<const char*>(&b), 1)); }
  bool accepts(std::string_view bytes) const;

  bool accepting() const;                             // the bytes so far are a whole sentence of the grammar
  bool closed() const;                                // accepting, and no byte may follow
  bool dead() const { return offsets_.size() <= 1; }  // no stack at all (never after a kOk)
  size_t stack_count() const { return offsets_.size() - 1; }
  std::bitset<256> next_bytes() const;  // the bytes some stack takes next
  // Whether both hold the same stacks in the same order (then every byte does the same to both).
  bool same_state(const GrammarMatcher& other) const { return offsets_ == other.offsets_ && data_ == other.data_; }
  // The stacks as one key (for caches of what a state allows).
  std::vector<uint32_t> state_key() const;

 private:
  explicit GrammarMatcher(std::shared_ptr<const Grammar> grammar) : grammar_(std::move(grammar)) {}
  void clear();
  // Expands `work` (whose top may be a rule reference) into stacks topped by byte sets, appended
  // to this matcher deduplicated. False on exhaustion.
  bool expand(std::vector<uint32_t>& work, size_t& expansions);
  bool push_stack(const std::vector<uint32_t>& stack);

  std::shared_ptr<const Grammar> grammar_;
  // Stacks flattened: stack i is data_[offsets_[i] .. offsets_[i+1]), its top last.
  std::vector<uint32_t> data_;
  std::vector<uint32_t> offsets_{0};
  std::vector<uint64_t> hashes_;
  std::vector<uint32_t> work_;  // scratch
};

}  // namespace specontext
