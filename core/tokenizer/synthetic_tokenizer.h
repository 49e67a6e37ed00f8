// The tokenizer of synthetic models (core/model/synthetic.h).
#pragma once

#include <memory>

#include "core/tokenizer/tokenizer.h"

namespace specontext {

// A stand-in tokenizer for synthetic models (which have none), so that servers and benchmarks can
// run them: token i decodes to " i", and text encodes as whitespace-separated ids ("5 17 3").
// No BOS, no stop ids. Anything else in the text is an InvalidArgument naming the word.
std::unique_ptr<Tokenizer> make_synthetic_tokenizer(int32_t vocab_size);

}  // namespace specontext
