// File helpers: reading with a clear error, and writing atomically so that a
// failed run never leaves a half-written output behind.
#pragma once

#include <stdexcept>
#include <string>

namespace cudagen {

// Thrown when a file cannot be read or written; the message names the file
// and the system's reason.
class FileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

std::string read_text_file(const std::string& path);

// Writes `content` to a temporary file beside `path`, then renames it over
// `path`: readers see the old file or the new one, never a partial one.
void write_file_atomic(const std::string& path, const std::string& content);

}  // namespace cudagen
