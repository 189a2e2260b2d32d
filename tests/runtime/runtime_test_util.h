// Helpers shared by the runtime tests.
#pragma once

#include <string>

namespace cudagen::testing {

inline std::string source_path(const std::string& relative) { return std::string(CUDAGEN_SOURCE_DIR) + "/" + relative; }

// The message of the E that `fn` throws, or "(no error thrown)", so that a
// check on the message fails and shows why. Other exceptions propagate.
template <typename E, typename Fn>
std::string message_of(Fn&& fn) {
  try {
    fn();
  } catch (const E& e) {
    return e.what();
  }
  return "(no error thrown)";
}

}  // namespace cudagen::testing
