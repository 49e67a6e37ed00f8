// Constrained decoding against a JSON Schema (the OpenAI API's response_format
// {"type":"json_schema"}, vLLM's guided_json, llama.cpp's json-schema-to-grammar):
//   json_schema_to_grammar  compiles a schema into a Grammar (serving/structured/grammar.h) whose sentences are
//                           JSON documents valid against it.
//   JsonSchemaConstraint    a TokenConstraint: a GrammarMatcher over a vocabulary's token bytes,
//                           the mask computed by walking a byte trie of the vocabulary.
//
// Supported subset (anything else is kInvalidArgument naming the keyword and its JSON pointer,
// e.g. "response_format json_schema: unsupported keyword 'pattern' at /properties/name"):
//   type (a name or a list), enum (at most kMaxEnumValues = 1023 distinct values), const (values
//   written as nlohmann's compact dump(); with `type` only the values of those types are kept;
//   with any other keyword: unsupported), true / false
//   schemas (false: "no value can match"), properties, required, additionalProperties, items,
//   prefixItems, minItems, maxItems, minLength, maxLength (characters; an escape is one; a
//   surrogate pair one), anyOf, oneOf (generated as anyOf: the exclusivity is not enforced),
//   allOf of one schema, $ref to "#", "#/$defs/NAME" or "#/definitions/NAME" (recursion allowed).
//   Descriptive keywords are ignored: title, description, $schema, $id, $anchor, examples,
//   default, $comment, deprecated, readOnly, writeOnly; $defs / definitions hold definitions.
//   anyOf / oneOf / allOf / $ref with a sibling keyword that restricts values are unsupported.
// Choices:
//   - Whitespace: none, except one optional space after ':' and after ',' (the model cannot
//     loop on blanks; compact and ", " / ": " styles both fit).
//   - Objects: properties in the schema's order; required ones always, optional ones may be
//     skipped. Extra keys come after the declared ones and only when additionalProperties is
//     true or a schema, or when the schema declares neither properties nor required (an absent
//     additionalProperties is otherwise taken as false: OpenAI's strict mode requires false
//     anyway). An extra key never equals a declared one: it is refused byte-wise while it spells
//     a declared key's prefix, where \/ and \u escapes are not allowed (they could spell a
//     declared key's character); extra keys beside declared keys holding characters other than
//     printable ASCII are unsupported. A required name missing from properties is declared
//     with the additionalProperties schema (or refused when that is false).
//   - Keywords of one kind without `type` narrow the value to that kind ({"properties":..} is an
//     object); no type and no keyword: any JSON value (depth bounded by the matcher's stacks).
//   - Numbers: integers -?(0|[1-9][0-9]{0,15}); numbers add .[0-9]{1,16} and [eE][+-]?[0-9]{1,2},
//     so every number ends (and nlohmann reads it as a double).
//   - Tokens with no bytes (EOS, control tokens) are never allowed: the request ends when the
//     matcher is closed, so a document that is a bare number ends only at its digit cap.
//   - Bounds (minLength, maxLength, minItems, maxItems) above GrammarBuilder::kMaxRepeat (4096)
//     are refused; a schema nested deeper than 64 levels or growing past 200000 rules is refused.
#pragma once

#include <memory>
#include <mutex>
#include <nlohmann/json_fwd.hpp>
#include <span>

#include "core/base/status.h"
#include "serving/structured/grammar.h"
#include "serving/structured/json_constraint.h"

namespace specontext {

// Each enum value is one parse stack of the matcher where the value begins, beside one for the
// optional space before a value (GrammarMatcher::kMaxStacks = 1024): more is refused naming the
// limit. (An enum beside other alternatives at one position, inside anyOf, can still exhaust the
// matcher while generating.)
inline constexpr size_t kMaxEnumValues = GrammarMatcher::kMaxStacks - 1;

// nlohmann::json keeps object keys sorted, so properties are generated in that order; parse the
// schema as nlohmann::ordered_json to keep the schema's own order.
[[nodiscard]] Result<Grammar> json_schema_to_grammar(const nlohmann::ordered_json& schema);
[[nodiscard]] Result<Grammar> json_schema_to_grammar(const nlohmann::json& schema);

// The vocabulary's token bytes as a trie (children by byte, tokens at the node their bytes end
// at), built once per VocabularyBytes and shared (VocabularyTrie::of).
struct VocabularyTrie {
  struct Node {
    uint8_t byte = 0;
    uint32_t children_begin = 0, children_end = 0;  // into nodes
    uint32_t tokens_begin = 0, tokens_end = 0;      // into tokens
  };
  std::vector<Node> nodes;  // nodes[0] is the root (the empty prefix)
  std::vector<TokenId> tokens;
  size_t max_depth = 0;
  static std::shared_ptr<const VocabularyTrie> build(const VocabularyBytes& vocabulary);
  // The trie of `vocabulary`, built on first use and kept while the vocabulary lives.
  static std::shared_ptr<const VocabularyTrie> of(const std::shared_ptr<const VocabularyBytes>& vocabulary);
};

class JsonSchemaConstraint final : public TokenConstraint {
 public:
  // kInvalidArgument for a schema outside the subset (see above) or no vocabulary.
  [[nodiscard]] static Result<std::unique_ptr<JsonSchemaConstraint>> create(
      const nlohmann::ordered_json& schema, std::shared_ptr<const VocabularyBytes> vocabulary);
  [[nodiscard]] static Result<std::unique_ptr<JsonSchemaConstraint>> create(
      const nlohmann::json& schema, std::shared_ptr<const VocabularyBytes> vocabulary);
  // Over a grammar already compiled (shared between requests).
  [[nodiscard]] static Result<std::unique_ptr<JsonSchemaConstraint>> create(
      std::shared_ptr<const Grammar> grammar, std::shared_ptr<const VocabularyBytes> vocabulary);
  // kOutOfRange when no token continues the document, kResourceExhausted when the grammar's
  // parse stacks explode.
  Status mask(std::span<float> logits) const override;
  Status accept(TokenId token) override;
  bool closed() const override { return matcher_.closed(); }
  std::unique_ptr<TokenConstraint> clone() const override;
  const GrammarMatcher& matcher() const { return matcher_; }

 private:
  // The tokens each recent matcher state allows, shared by a constraint and its clones: inside a
  // string without length bounds every position is the same state, so its mask is computed once.
  struct MaskCache {
    static constexpr size_t kEntries = 32;
    std::mutex mu;
    std::vector<std::pair<std::vector<uint32_t>, std::vector<uint8_t>>> entries;  // oldest first
  };
  JsonSchemaConstraint(std::shared_ptr<const VocabularyBytes> vocabulary,
                       std::shared_ptr<const VocabularyTrie> trie, GrammarMatcher matcher)
      : vocabulary_(std::move(vocabulary)),
        trie_(std::move(trie)),
        matcher_(std::move(matcher)),
        cache_(std::make_shared<MaskCache>()) {}
  // open[id] = 1 for each token that continues the document; false when the stacks explode.
  bool compute_open(std::vector<uint8_t>& open) const;
  std::shared_ptr<const VocabularyBytes> vocabulary_;
  std::shared_ptr<const VocabularyTrie> trie_;
  GrammarMatcher matcher_;
  std::shared_ptr<MaskCache> cache_;
};

}  // namespace specontext
