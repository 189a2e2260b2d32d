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

// XXH3 from Debian's libxxhash-dev, compiled into this file (header-only):
// the runtime's users link nothing more.
#define XXH_INLINE_ALL
#include <xxhash.h>

#include "file_util.h"

namespace cudagen {

namespace {

// Version 2: keys and checksums are XXH3-128 (version 1's were FNV-1a, which
// a planted entry could collide with on purpose).
constexpr std::string_view kMagic = "cudagen-binary/2";

// 32 hex digits of XXH3-128.
std::string xxh3_128_hex(std::string_view bytes) {
  const XXH128_hash_t h = XXH3_128bits(bytes.data(), bytes.size());
  return fmt::format("{:016x}{:016x}", h.high64, h.low64);
}

std::string entry_bytes(const std::vector<char>& binary) {
  std::string_view payload(binary.data(), binary.size());
  return fmt::format("{} {} {}\n", kMagic, xxh3_128_hex(payload), binary.size()) + std::string(payload);
}

// The entry's binary, or nullopt with `problem` set when it is missing
// (problem empty) or damaged (problem says how). The header's size is
// checked against the file's before anything is allocated: a planted header
// cannot make a run allocate or read gigabytes.
std::optional<std::vector<char>> read_entry(const std::string& path, std::string* problem) {
  std::error_code ec;
  const uintmax_t file_bytes = std::filesystem::file_size(path, ec);
  if (ec) return std::nullopt;  // missing
  std::ifstream in(path, std::ios::binary);
  if (!in) return std::nullopt;
  std::string header;
  if (!std::getline(in, header) || header.size() > 128) {
    *problem = "not a cudagen cache entry (bad header)";
    return std::nullopt;
  }
  std::istringstream fields(header);
  std::string magic, checksum;
  unsigned long long size = 0;
  fields >> magic >> checksum >> size;
  if (magic != kMagic || checksum.size() != 32 || !fields) {
    *problem = "not a cudagen cache entry of this version (bad header)";
    return std::nullopt;
  }
  if (size != file_bytes - (header.size() + 1)) {
    *problem = fmt::format("its length is wrong (the header says {} bytes, the file holds {})", size,
                           file_bytes - (header.size() + 1));
    return std::nullopt;
  }
  std::vector<char> binary(size);
  in.read(binary.data(), std::streamsize(size));
  if ((unsigned long long)in.gcount() != size) {
    *problem = fmt::format("it was cut short while being read ({} of {} bytes)", in.gcount(), size);
    return std::nullopt;
  }
  if (xxh3_128_hex(std::string_view(binary.data(), binary.size())) != checksum) {
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
    case CacheOutcome::uncached: return "not cached (the cache folder cannot be written)";
  }
  return "?";
}

std::string cache_key(const std::string& source, const std::string& options, const std::string& compiler_version,
                      const std::string& arch) {
  // Lengths first, so that no shift of text between fields gives the same key.
  std::string all = fmt::format("{}:{}:{}:{}\n", source.size(), options.size(), compiler_version.size(), arch.size()) +
                    source + options + compiler_version + arch;
  return xxh3_128_hex(all);
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
  // A folder that cannot be made, locked or written (read-only, full): the
  // run goes on uncached, and says so once per cache.
  auto uncached = [&](const std::string& why) {
    result.outcome = CacheOutcome::uncached;
    result.problem = warned_ ? std::string() : why;
    warned_ = true;
    result.binary = build();
  };
  std::error_code ec;
  std::filesystem::create_directories(dir_, ec);
  if (ec) {
    uncached(fmt::format("{}: cannot create the cache folder: {} (set CUDAGEN_CACHE_DIR)", dir_, ec.message()));
    return result;
  }
  std::optional<KeyLock> lock;
  try {
    lock.emplace(dir_ + "/" + key + ".lock");
  } catch (const FileError& e) {
    uncached(e.what());
    return result;
  }
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
  try {
    write_file_atomic(result.path, entry_bytes(result.binary));
  } catch (const FileError& e) {
    result.outcome = CacheOutcome::uncached;
    result.problem = warned_ ? std::string() : std::string(e.what());
    warned_ = true;
  }
  return result;
}

}  // namespace cudagen
