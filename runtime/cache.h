// The disk cache of compiled device code (docs/architecture.md §7): an NVRTC compile
// of a large graph takes seconds, a cache hit a millisecond.
//
// An entry is named by an XXH3-128 hash of everything that decides the binary
// (source, options, NVRTC version, architecture) and carries an XXH3-128
// checksum of its bytes and their count, so a truncated, damaged or planted
// entry is detected and rebuilt rather than loaded.
// Entries are written to a temporary file and renamed, and a process that
// misses takes a lock on the key while it builds, so several processes
// compiling the same graph at once build it once and never read half a file.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace cudagen {

// What a lookup did, for the "cache: hit" lines users see.
enum class CacheOutcome { hit, miss, rebuilt_corrupt, built_by_another_process, uncached };
const char* to_string(CacheOutcome outcome);

struct CacheResult {
  std::vector<char> binary;
  CacheOutcome outcome = CacheOutcome::miss;
  std::string path;     // the entry's file
  std::string problem;  // why an entry was rebuilt (rebuilt_corrupt), or why nothing was cached (uncached;
                        // only the first time a cache cannot be written, so that the warning is given once)
};

// The key of a compiled binary: 32 hex digits of XXH3-128.
std::string cache_key(const std::string& source, const std::string& options, const std::string& compiler_version,
                      const std::string& arch);

// CUDAGEN_CACHE_DIR; else $XDG_CACHE_HOME/cudagen; else $HOME/.cache/cudagen;
// else a folder in /tmp.
std::string default_cache_dir();

class BinaryCache {
 public:
  explicit BinaryCache(std::string dir) : dir_(std::move(dir)) {}
  const std::string& dir() const { return dir_; }
  std::string entry_path(const std::string& key) const;

  // The entry of `key`, or `build()`'s result, stored before it is returned.
  // A damaged entry is a miss (rebuilt); a folder that cannot be created or
  // written gives `build()`'s result uncached (outcome uncached).
  CacheResult get_or_build(const std::string& key, const std::function<std::vector<char>()>& build) const;

 private:
  std::string dir_;
  mutable bool warned_ = false;  // an unwritable folder was reported already
};

}  // namespace cudagen
