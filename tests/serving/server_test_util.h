// What the in-process server tests serve: stories260K with its tokenizer on a CPU engine.
#pragma once

#include <gtest/gtest.h>

#include <memory>

#include "core/engine/engine.h"
#include "core/model/model_loader.h"
#include "core/tokenizer/tokenizer_resolve.h"
#include "cpu/cpu_backend.h"
#include "tests/tests_common.h"

namespace specontext::testing {

struct ServedModel {
  std::shared_ptr<Model> model;
  std::unique_ptr<Tokenizer> tokenizer;
  std::unique_ptr<Engine> engine;
};

// stories260K and its tokenizer, an engine of max_sequences sequences on the CPU backend.
inline ServedModel serve_stories260k(int64_t max_sequences) {
  ServedModel f;
  auto m = load_model(repo_path("models/stories260K/stories260K.bin"));
  EXPECT_TRUE(m.is_ok());
  f.model = *m;
  auto t = load_tokenizer_for(*f.model, "");
  EXPECT_TRUE(t.is_ok());
  f.tokenizer = std::move(*t);
  auto b = cpu::create_cpu_backend({});
  EXPECT_TRUE(b.is_ok());
  EngineOptions eo;
  eo.max_sequences = max_sequences;
  auto e = Engine::create(f.model, std::shared_ptr<Backend>(std::move(*b)), eo);
  EXPECT_TRUE(e.is_ok());
  f.engine = std::move(*e);
  return f;
}

}  // namespace specontext::testing
