// A file that holds secrets (keys, shared secrets): read whole only when it is a regular file
// readable by its owner alone (as ssh refuses a key others can read), at most `max_bytes`.
#pragma once

#include <cstddef>
#include <string>

#include "core/base/status.h"

namespace specontext {

// kInvalidArgument starting with `what` and the file's name when the file cannot be opened, is
// not regular, can be read by group or others (the message says `chmod 600`), or is too long.
Result<std::string> read_private_file(const std::string& file, size_t max_bytes, const std::string& what);

}  // namespace specontext
