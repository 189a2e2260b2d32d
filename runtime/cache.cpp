#include "cache.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <optional>
#include <sstream>

#include <fmt/format.h>

#include "file_util.h"
#include "hash.h"

namespace cudagen {

namespace {

constexpr std::string_view kMagic = "cudagen-binary/1";

// A second, independent 64-bit hash, so that keys are 128 bits: two graphs
// whose sources collide in one FNV-1a variant would have to collide in both.
uint64_t fnv1a64_alt(std::string_view text) {
  uint64_t h = 0x9ae16a3b2f90404full;
  for (unsigned char c : text) {
    h = (h ^ c) * 0x100000001b3ull;
    h ^= h >> 29;
  }
  return h;
}

std::string entry_bytes(const std::vector<char>& binary) {
  std::string_view payload(binary.data(), binary.size());
  return fmt::format("{} {:016x} {}\n", kMagic, fnv1a64(payload), binary.size()) + std::string(payload);
}

// The entry's binary, or nullopt with `problem` set when it is missing
// (problem empty) or damaged (problem says how).
std::optional<std::vector<char>> read_entry(const std::string& path, std::string* problem) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string header;
  std::getline(in, header);
  std::istringstream fields(header);
  std::string magic, checksum;
  size_t size = 0;
  fields >> magic >> checksum >> size;
  if (magic != kMagic || checksum.size() != 16) {
    *problem = "not a cudagen cache entry (bad header)";
    return std::nullopt;
  }
  std::vector<char> binary(size);
  in.read(binary.data(), std::streamsize(size));
  if (size_t(in.gcount()) != size || in.peek() != std::char_traits<char>::eof()) {
    *problem = fmt::format("its length is wrong (the header says {} bytes)", size);
    return std::nullopt;
  }
  if (fmt::format("{:016x}", fnv1a64(std::string_view(binary.data(), binary.size()))) != checksum) {
    *problem = "its checksum does not match its bytes";
    return std::nullopt;
  }
  return binary;
}

// An exclusive lock on a file beside the entry, held while it lives: the
// processes that miss on one key take turns, so the first builds and the
// others find its entry.
class KeyLock {
 public:
  explicit KeyLock(const std::string& path) : fd_(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644)) {
    if (fd_ < 0) throw FileError(fmt::format("{}: cannot create the cache lock: {}", path, std::strerror(errno)));
    while (::flock(fd_, LOCK_EX) != 0)
      if (errno != EINTR) throw FileError(fmt::format("{}: cannot lock: {}", path, std::strerror(errno)));
  }
  KeyLock(const KeyLock&) = delete;
  KeyLock& operator=(const KeyLock&) = delete;
  ~KeyLock() { ::close(fd_); }  // closing releases the lock

 private:
  int fd_;
};

}  // namespace

const char* to_string(CacheOutcome outcome) {
  switch (outcome) {
    case CacheOutcome::hit: return "hit";
    case CacheOutcome::miss: return "miss";
    case CacheOutcome::rebuilt_corrupt: return "corrupt entry rebuilt";
    case CacheOutcome::built_by_another_process: return "hit (built by another process meanwhile)";
  }
  return "?";
}

std::string cache_key(const std::string& source, const std::string& options, const std::string& compiler_version,
                      const std::string& arch) {
  // Lengths first, so that no shift of text between fields gives the same key.
  std::string all = fmt::format("{}:{}:{}:{}\n", source.size(), options.size(), compiler_version.size(), arch.size()) +
                    source + options + compiler_version + arch;
  return fmt::format("{:016x}{:016x}", fnv1a64(all), fnv1a64_alt(all));
}

std::string default_cache_dir() {
  if (const char* dir = std::getenv("CUDAGEN_CACHE_DIR"); dir && *dir) return dir;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) return std::string(xdg) + "/cudagen";
  if (const char* home = std::getenv("HOME"); home && *home) return std::string(home) + "/.cache/cudagen";
  return fmt::format("/tmp/cudagen-cache-{}", ::getuid());
}

std::string BinaryCache::entry_path(const std::string& key) const { return dir_ + "/" + key + ".bin"; }

CacheResult BinaryCache::get_or_build(const std::string& key, const std::function<std::vector<char>()>& build) const {
  CacheResult result;
  result.path = entry_path(key);
  std::string problem;
  if (auto binary = read_entry(result.path, &problem)) {
    result.binary = std::move(*binary);
    result.outcome = CacheOutcome::hit;
    return result;
  }
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) throw FileError(fmt::format("{}: cannot create the cache folder: {} (set CUDAGEN_CACHE_DIR)", dir_, ec.message()));
  KeyLock lock(dir_ + "/" + key + ".lock");
  // Another process may have built it while this one waited for the lock.
  problem.clear();
  if (auto binary = read_entry(result.path, &problem)) {
    result.binary = std::move(*binary);
    result.outcome = CacheOutcome::built_by_another_process;
    return result;
  }
  result.outcome = problem.empty() ? CacheOutcome::miss : CacheOutcome::rebuilt_corrupt;
  result.problem = problem;
  result.binary = build();
  write_file_atomic(result.path, entry_bytes(result.binary));
  return result;
}

}  // namespace cudagen
