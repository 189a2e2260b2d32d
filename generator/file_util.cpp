#include "file_util.h"

#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

namespace cudagen {

std::string read_text_file(const std::string& path, int64_t max_bytes) {
  // A regular file of a sane size only: a FIFO or a device would block or
  // never end, and a huge file would fail its allocation somewhere in the
  // parser as an odd syntax error.
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) throw FileError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  if (!S_ISREG(st.st_mode)) throw FileError(fmt::format("{}: not a regular file (a folder, a pipe or a device)", path));
  if (int64_t(st.st_size) > max_bytes)
    throw FileError(fmt::format("{}: {} bytes, more than the {} cudagen reads from such a file", path,
                                int64_t(st.st_size), max_bytes));
  std::ifstream in(path, std::ios::binary);
  if (!in) throw FileError(fmt::format("{}: cannot open: {}", path, std::strerror(errno)));
  std::ostringstream ss;
  ss << in.rdbuf();
  if (in.bad()) throw FileError(fmt::format("{}: read failed: {}", path, std::strerror(errno)));
  return ss.str();
}

namespace {

// The mode a new file gets: 0666 less the process's umask, read from
// /proc (umask() itself would change it, for every thread, while it looks).
mode_t new_file_mode() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);)
    if (line.rfind("Umask:", 0) == 0) return mode_t(0666) & ~mode_t(std::stoul(line.substr(6), nullptr, 8));
  return 0644;
}

// Writes `content` to a fresh temporary file beside `path` and returns its
// name (mkstemp: created exclusively, so a planted file or symlink of a
// guessable name is never written through). It gets the mode `path` has, or
// a new file's: mkstemp's is 0600.
std::string write_temporary_beside(const std::string& path, const std::string& content) {
  std::string tmp = path + ".tmp.XXXXXX";
  const int fd = ::mkstemp(tmp.data());
  if (fd < 0) throw FileError(fmt::format("{}: cannot write: {}", path, std::strerror(errno)));
  struct stat existing;
  const mode_t mode = ::stat(path.c_str(), &existing) == 0 ? (existing.st_mode & 07777) : new_file_mode();
  bool ok = ::fchmod(fd, mode) == 0;
  for (size_t done = 0; ok && done < content.size();) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    ok = n > 0;
    if (ok) done += size_t(n);
  }
  int err = ok ? 0 : errno;
  if (::close(fd) != 0 && ok) {
    ok = false;
    err = errno;
  }
  if (!ok) {
    std::remove(tmp.c_str());
    throw FileError(fmt::format("{}: cannot write: {}", path, std::strerror(err)));
  }
  return tmp;
}

void rename_over(const std::string& tmp, const std::string& path) {
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    const int err = errno;
    std::remove(tmp.c_str());
    throw FileError(fmt::format("{}: cannot write: {}", path, std::strerror(err)));
  }
}

}  // namespace

void write_file_atomic(const std::string& path, const std::string& content) {
  rename_over(write_temporary_beside(path, content), path);
}

void write_files_atomic(const std::vector<std::pair<std::string, std::string>>& files) {
  std::vector<std::string> written;  // every file's temporary, before any is renamed
  try {
    for (const auto& [path, content] : files) written.push_back(write_temporary_beside(path, content));
  } catch (...) {
    for (const std::string& tmp : written) std::remove(tmp.c_str());
    throw;
  }
  for (size_t i = 0; i < files.size(); ++i) rename_over(written[i], files[i].first);
}

TempDir::TempDir(const std::string& prefix) {
  std::string pattern = (std::filesystem::temp_directory_path() / (prefix + "XXXXXX")).string();
  if (::mkdtemp(pattern.data()) == nullptr)
    throw FileError(fmt::format("{}: cannot make a temporary folder: {}", pattern, std::strerror(errno)));
  path_ = pattern;
}

TempDir::~TempDir() {
  std::error_code ignored;  // a destructor cannot throw; a folder it cannot remove stays
  std::filesystem::remove_all(path_, ignored);
}

}  // namespace cudagen
