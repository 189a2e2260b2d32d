// File helpers: reading with a clear error, and writing atomically so that a
// failed run never leaves a half-written output behind.
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

namespace cudagen {

// Thrown when a file cannot be read or written; the message names the file
// and the system's reason.
class FileError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// The whole of a regular file of at most `max_bytes` (1 GiB by default: graphs,
// registries, templates, CSV); anything else is a FileError that says why.
inline constexpr int64_t kMaxTextFileBytes = int64_t(1) << 30;
std::string read_text_file(const std::string& path, int64_t max_bytes = kMaxTextFileBytes);

// Writes `content` to a temporary file beside `path` (a fresh name, created
// exclusively), then renames it over `path`: readers see the old file or the
// new one, never a partial one. A replaced file keeps its mode.
void write_file_atomic(const std::string& path, const std::string& content);

// The same for several files that belong together (a .cu and its manifest):
// all are written to temporaries first, and renamed only when every one was
// written, so that a failure leaves none of them changed.
void write_files_atomic(const std::vector<std::pair<std::string, std::string>>& files);

// A private folder in the system's temporary folder (mkdtemp: an unguessable
// name, mode 0700), removed with everything in it when the object goes, on
// every exit path.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix);
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

}  // namespace cudagen
