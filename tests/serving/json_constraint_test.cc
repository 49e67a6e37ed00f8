// JSON-constrained decoding: the byte grammar against nlohmann::json (an independent parser) on
// fixed and random documents and their mutations; the token constraint on a toy vocabulary; and
// stories260K through the Scheduler, whose constrained outputs nlohmann must read as an object
// (or, cut by max_new_tokens, as the start of one).
#include "serving/structured/json_constraint.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>
#include <random>

#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "serving/scheduler.h"
#include "tests/core/tier_test_util.h"

namespace specontext {
namespace {

using nlohmann::json;

// Bytes the grammar takes before refusing one (the whole text when it takes all).
size_t taken(JsonGrammar g, std::string_view text) {
  for (size_t i = 0; i < text.size(); ++i) {
    if (!g.feed(static_cast<uint8_t>(text[i]))) return i;
  }
  return text.size();
}

bool grammar_accepts_document(std::string_view text, bool require_object) {
  JsonGrammar g(require_object);
  return taken(g, text) == text.size() && [&] {
    (void)g.feed(text);
    return g.complete();
  }();
}

TEST(JsonGrammar, TakesWholeObjectsAndClosesAfterThem) {
  for (std::string_view doc : {
           R"({})",
           R"( {"a":1})",
           R"({"a":[1,-2.5e+3,0,0.25,true,false,null,{}],"b":{"c":"x\"y\\z\/\b\f\n\r\t\u00e9"}})",
           "{\n  \"k\" : [ ] ,\"s\":\"\xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80\"}",
           R"({"pair":"\ud83d\ude00","E":1E5,"e":-0e-0})",
       }) {
    SCOPED_TRACE(doc);
    JsonGrammar g;
    ASSERT_TRUE(g.feed(doc));
    EXPECT_TRUE(g.complete());
    EXPECT_TRUE(g.closed());
    EXPECT_FALSE(g.accepts(" "));  // nothing after the object
    EXPECT_TRUE(json::accept(doc));
  }
}

TEST(JsonGrammar, RefusesTheFirstByteThatCannotContinue) {
  const std::pair<std::string_view, size_t> cases[] = {
      {"[1]", 0},  // json_object: the document is an object
      {"\"s\"", 0},
      {"{'a':1}", 1},     // single quotes
      {"{\"a\" 1}", 5},   // no colon
      {"{\"a\":01}", 6},  // leading zero
      {"{\"a\":1.}", 7},  // no fraction digit
      {"{\"a\":-}", 6},
      {"{\"a\":1e}", 7},
      {"{\"a\":tru}", 8},
      {"{\"a\":[1,]}", 8},  // trailing comma
      {"{\"a\":1,}", 7},
      {"{\"a\":1]", 6},         // wrong close
      {"{\"a\":\"x\ny\"}", 7},  // raw control character in a string
      {"{\"a\":\"\\x\"}", 7},   // unknown escape
      {"{\"a\":\"\\u12g4\"}", 10},
      {"{\"a\":\"\\udc00\"}", 9},          // lone low surrogate
      {"{\"a\":\"\\ud800x\"}", 12},        // high surrogate without its low one
      {"{\"a\":\"\\ud800\\u0041\"}", 15},  // followed by a non-low escape
      {"{\"a\":\"\xc0\xaf\"}", 6},         // overlong UTF-8
      {"{\"a\":\"\xe0\x80\x80\"}", 7},
      {"{\"a\":\"\xed\xa0\x80\"}", 7},      // UTF-8 surrogate
      {"{\"a\":\"\xf4\x90\x80\x80\"}", 7},  // past U+10FFFF
      {"{\"a\":\"\xe2\x82x\"}", 8},         // cut sequence
      {"{}{}", 2},
      {"{1:2}", 1},
  };
  for (const auto& [text, at] : cases) {
    SCOPED_TRACE(text);
    EXPECT_EQ(taken(JsonGrammar(), text), at);
    EXPECT_FALSE(json::accept(text) && text.front() == '{') << "the reference parser disagrees";
  }
  // Whitespace runs are bounded; nesting too.
  EXPECT_EQ(taken(JsonGrammar(), "{" + std::string(30, ' ')), 1u + JsonGrammar::kMaxWhitespaceRun);
  EXPECT_EQ(taken(JsonGrammar(false), std::string(200, '[')), 128u);
  std::string deep = "{\"a\":";
  for (int i = 0; i < 126; ++i) deep += "[";
  EXPECT_EQ(taken(JsonGrammar(), deep + "[["), deep.size() + 1);  // depth 128 is the deepest
}

// A random JSON value: nested containers, strings with escapes and non-ASCII, numbers of every form.
json random_value(std::mt19937& rng, int depth) {
  const int kind = static_cast<int>(rng() % (depth > 3 ? 5 : 7));
  switch (kind) {
    case 0:
      return nullptr;
    case 1:
      return rng() % 2 == 0;
    case 2:
      return static_cast<int64_t>(rng()) - (int64_t{1} << 31);
    case 3: {
      const double v = std::ldexp(static_cast<double>(rng()) - 2e9, static_cast<int>(rng() % 120) - 60);
      return v;
    }
    case 4: {
      std::string s;
      const char* pieces[] = {
          "a", "Z",    "\"", "\\", "/", "\n", "\t", "\x01", "\xc3\xa9", "\xe2\x82\xac", "\xf0\x9f\x98\x80",
          " ", "\x7f", "u"};
      for (int i = static_cast<int>(rng() % 8); i > 0; --i) s += pieces[rng() % std::size(pieces)];
      return s;
    }
    case 5: {
      json a = json::array();
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) a.push_back(random_value(rng, depth + 1));
      return a;
    }
    default: {
      json o = json::object();
      for (int i = static_cast<int>(rng() % 4); i > 0; --i) {
        o[random_value(rng, 99).dump()] = random_value(rng, depth + 1);
      }
      return o;
    }
  }
}

TEST(JsonGrammar, AgreesWithNlohmannOnRandomDocumentsAndTheirMutations) {
  std::mt19937 rng(42);
  const char alphabet[] = "{}[]\",:.-+eE0123456789 \n\\utrfnal\x01\xc3\xa9\x80\xff";
  int mutants = 0, refused = 0;
  for (int doc = 0; doc < 400; ++doc) {
    json root = json::object();
    root["v"] = random_value(rng, 0);
    for (const std::string& text :
         {root.dump(), root.dump(1), root.dump(-1, ' ', /*ensure_ascii=*/true), root["v"].dump()}) {
      const bool object = text.front() == '{';
      ASSERT_TRUE(grammar_accepts_document(text, /*require_object=*/false)) << text;
      EXPECT_EQ(grammar_accepts_document(text, true), object) << text;
      for (int m = 0; m < 6; ++m) {
        std::string mutant = text;
        const size_t at = rng() % mutant.size();
        const char c = alphabet[rng() % (sizeof alphabet - 1)];
        switch (rng() % 3) {
          case 0:
            mutant[at] = c;
            break;
          case 1:
            mutant.insert(mutant.begin() + static_cast<std::ptrdiff_t>(at), c);
            break;
          default:
            mutant.erase(at, 1);
            break;
        }
        if (mutant.empty()) continue;
        bool reference = false;
        try {
          const json parsed = json::parse(mutant);
          (void)parsed;
          reference = true;
        } catch (const json::out_of_range&) {
          continue;  // a number beyond double: JSON allows it, nlohmann refuses it
        } catch (const json::parse_error&) {
        }
        ++mutants;
        refused += reference ? 0 : 1;
        EXPECT_EQ(grammar_accepts_document(mutant, false), reference) << "mutant: " << mutant;
      }
    }
  }
  EXPECT_GT(refused, mutants / 4);  // the mutations do break documents
}

std::shared_ptr<const VocabularyBytes> toy_vocabulary(std::vector<std::string> pieces) {
  return VocabularyBytes::from_pieces(std::move(pieces));
}

std::vector<bool> open_tokens(const TokenConstraint& c, size_t vocab) {
  std::vector<float> logits(vocab, 1.0f);
  EXPECT_TRUE(c.mask(logits).is_ok());
  std::vector<bool> open;
  for (float l : logits) open.push_back(l == 1.0f);
  return open;
}

TEST(JsonObjectConstraint, MasksWhatCannotComeNextAndClosesWithTheObject) {
  //                     0    1    2     3    4    5    6    7    8   9           10
  auto vocab = toy_vocabulary({"{", "}", "\"", ":", ",", "a", "1", " ", "", "\"a\":1", "-"});
  auto c = JsonObjectConstraint::create(vocab);
  ASSERT_TRUE(c.is_ok()) << c.status().to_string();
  using V = std::vector<bool>;
  EXPECT_EQ(open_tokens(**c, 11),
            (V{true, false, false, false, false, false, false, true, false, false, false}));
  EXPECT_EQ((*c)->accept(5).code(), StatusCode::kInvalidArgument);  // masked: refused
  ASSERT_TRUE((*c)->accept(0).is_ok());
  EXPECT_EQ(open_tokens(**c, 11),
            (V{false, true, true, false, false, false, false, true, false, true, false}));
  auto copy = (*c)->clone();
  ASSERT_TRUE((*c)->accept(9).is_ok());  // {"a":1
  EXPECT_EQ(open_tokens(**c, 11),
            (V{false, true, false, false, true, false, true, true, false, false, false}));
  EXPECT_FALSE((*c)->closed());
  ASSERT_TRUE((*c)->accept(1).is_ok());
  EXPECT_TRUE((*c)->closed());
  EXPECT_FALSE(copy->closed());  // the clone kept its own state
  // Logits past the vocabulary (a padded output layer) are masked too.
  std::vector<float> wide(14, 1.0f);
  ASSERT_TRUE(copy->mask(wide).is_ok());
  EXPECT_EQ(wide[12], -std::numeric_limits<float>::infinity());
  // A dead end is an error, never a draw from nothing: {"a":- needs a digit, and "1" is gone.
  auto no_digits = toy_vocabulary({"{", "}", "\"", ":", ",", "a", "-"});
  auto d = JsonObjectConstraint::create(no_digits);
  ASSERT_TRUE(d.is_ok());
  for (TokenId t : {0, 2, 5, 2, 3, 6}) ASSERT_TRUE((*d)->accept(t).is_ok()) << t;
  std::vector<float> logits(7, 0.0f);
  EXPECT_EQ((*d)->mask(logits).code(), StatusCode::kOutOfRange);
  // A vocabulary that cannot spell the structure is refused up front, naming what is missing.
  auto bad = JsonObjectConstraint::create(toy_vocabulary({"{", "}", "a"}));
  ASSERT_FALSE(bad.is_ok());
  EXPECT_NE(bad.status().message().find("'\"' ':' ','"), std::string::npos) << bad.status().to_string();
}

// The mask's shortcuts (first byte, plain string tokens) allow exactly what running the grammar
// over each token's bytes allows, at every step of real documents in a real vocabulary.
TEST(JsonObjectConstraint, TheMaskEqualsTheGrammarRunOverEveryToken) {
  auto model = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(model.is_ok());
  auto tok = load_tokenizer_for(**model, testing::repo_path("models/stories260K/tok512.bin"));
  ASSERT_TRUE(tok.is_ok());
  const auto vocabulary = VocabularyBytes::build(**tok);
  std::mt19937 rng(5);
  int steps = 0;
  for (int doc = 0; doc < 40; ++doc) {
    json root = json::object();
    root["k"] = random_value(rng, 0);
    const std::string text = root.dump(doc % 2 == 0 ? -1 : 1);
    auto ids = (*tok)->encode(text, false);
    ASSERT_TRUE(ids.is_ok());
    auto c = JsonObjectConstraint::create(vocabulary);
    ASSERT_TRUE(c.is_ok());
    for (TokenId id : *ids) {
      std::vector<float> logits(vocabulary->bytes.size(), 0.0f);
      ASSERT_TRUE((*c)->mask(logits).is_ok());
      for (size_t t = 0; t < logits.size(); ++t) {
        const bool brute = !vocabulary->bytes[t].empty() && (*c)->grammar().accepts(vocabulary->bytes[t]);
        ASSERT_EQ(logits[t] == 0.0f, brute)
            << "token " << t << " '" << vocabulary->bytes[t] << "' in " << text;
      }
      ASSERT_TRUE((*c)->accept(id).is_ok()) << text;
      ++steps;
    }
    EXPECT_TRUE((*c)->closed()) << text;
  }
  EXPECT_GT(steps, 1000);
}

// nlohmann's verdict on generated text: a whole object, the start of one (cut by the token
// limit: the only error is the end of input), or neither.
enum class Verdict { kObject, kPrefix, kInvalid };
Verdict judge(const std::string& text) {
  try {
    return json::parse(text).is_object() ? Verdict::kObject : Verdict::kInvalid;
  } catch (const json::parse_error& e) {
    if (e.byte == text.size() + 1 &&
        std::string(e.what()).find("unexpected end of input") != std::string::npos) {
      return Verdict::kPrefix;
    }
    // A string cut inside: nlohmann reports the missing closing quote at the end.
    if (e.byte == text.size() + 1 &&
        std::string(e.what()).find("missing closing quote") != std::string::npos) {
      return Verdict::kPrefix;
    }
    return Verdict::kInvalid;
  } catch (const json::out_of_range&) {
    return Verdict::kObject;  // a number beyond double
  }
}

TEST(JsonObjectConstraint, Stories260KWritesJsonThroughTheScheduler) {
  auto model = load_model(testing::repo_path("models/stories260K/stories260K.bin"));
  ASSERT_TRUE(model.is_ok());
  auto tok = load_tokenizer_for(**model, testing::repo_path("models/stories260K/tok512.bin"));
  ASSERT_TRUE(tok.is_ok()) << tok.status().to_string();
  auto engine = testing::stories_engine(4);
  const auto vocabulary = VocabularyBytes::build(**tok);
  auto prototype = JsonObjectConstraint::create(vocabulary);
  ASSERT_TRUE(prototype.is_ok()) << prototype.status().to_string();
  const std::shared_ptr<const TokenConstraint> shared = std::move(*prototype);
  Scheduler s(*engine, GeneratorOptions{});
  auto prompt = (*tok)->encode("Once upon a time", true);
  ASSERT_TRUE(prompt.is_ok());
  std::vector<RequestId> ids;
  std::map<int64_t, std::vector<TokenId>> tokens;
  std::map<int64_t, FinishReason> finish;
  auto id_of = [&](std::string_view piece) {
    for (size_t t = 0; t < vocabulary->bytes.size(); ++t) {
      if (vocabulary->bytes[t] == piece) return static_cast<TokenId>(t);
    }
    return TokenId(-1);
  };
  const std::vector<float> temperatures = {0.0f, 0.8f, 1.0f, 1.2f, 0.0f, 0.0f};
  for (size_t i = 0; i < temperatures.size(); ++i) {
    GenerationRequest r;
    r.prompt = *prompt;
    r.max_new_tokens = 120;
    r.sampling.temperature = temperatures[i];
    r.sampling.seed = 7 + i;
    r.stop_ids = (*tok)->stop_ids();
    // Pushed towards closing its strings and the object; the bias cannot revive masked tokens.
    if (i == 4) r.logit_bias = {{id_of("}"), 8.0f}, {id_of("\""), 4.0f}};
    if (i + 1 < temperatures.size()) r.constraint = shared;  // the last runs unconstrained
    auto id = s.submit(r);
    ASSERT_TRUE(id.is_ok()) << id.status().to_string();
    ids.push_back(*id);
  }
  std::vector<SchedulerEvent> ev;
  for (int i = 0; i < 2000 && !s.idle(); ++i) {
    ev.clear();
    ASSERT_TRUE(s.step(ev).is_ok());
    for (const SchedulerEvent& e : ev) {
      if (e.finished) {
        finish[e.request.value()] = e.finish;
        EXPECT_TRUE(e.error.empty()) << e.error;
      } else {
        tokens[e.request.value()].push_back(e.token);
      }
    }
  }
  ASSERT_TRUE(s.idle());
  int objects = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    const int64_t id = ids[i].value();
    std::string text;
    TokenId prev = prompt->back();
    for (TokenId t : tokens[id]) {
      text += (*tok)->decode_token(prev, t);
      prev = t;
    }
    SCOPED_TRACE("request " + std::to_string(i) + ": " + text);
    const Verdict v = judge(text);
    if (i + 1 == ids.size()) {
      EXPECT_EQ(v, Verdict::kInvalid);  // the model alone writes a story, not JSON
      continue;
    }
    if (finish[id] == FinishReason::kStop) {
      EXPECT_EQ(v, Verdict::kObject);
      ++objects;
    } else {
      EXPECT_EQ(finish[id], FinishReason::kLength);
      EXPECT_EQ(v, Verdict::kPrefix);
    }
  }
  EXPECT_GE(objects, 1);
}

}  // namespace
}  // namespace specontext
