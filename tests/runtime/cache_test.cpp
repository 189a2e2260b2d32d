// The disk cache of compiled code: hits and misses, damaged entries detected
// and rebuilt, keys that change with everything that decides the binary, and
// several processes compiling the same key at once.
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <thread>

#include <gtest/gtest.h>

#include "cache.h"
#include "file_util.h"
#include "runtime_test_util.h"

using namespace cudagen;
using namespace cudagen::testing;
namespace fs = std::filesystem;

namespace {

class Cache : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = fs::temp_directory_path() / ("cudagen_cache_test_" + std::to_string(::getpid()));
    fs::remove_all(dir_);
  }
  void TearDown() override { fs::remove_all(dir_); }

  static std::vector<char> bytes(const std::string& text) { return std::vector<char>(text.begin(), text.end()); }

  fs::path dir_;
};

}  // namespace

TEST_F(Cache, MissBuildsAndStoresThenHitReadsWithoutBuilding) {
  BinaryCache cache(dir_.string());
  int builds = 0;
  auto build = [&] {
    ++builds;
    return bytes(std::string("CUBIN\0bytes", 11));
  };
  CacheResult first = cache.get_or_build("k1", build);
  EXPECT_EQ(first.outcome, CacheOutcome::miss);
  EXPECT_TRUE(fs::exists(first.path));
  CacheResult second = cache.get_or_build("k1", build);
  EXPECT_EQ(second.outcome, CacheOutcome::hit);
  EXPECT_EQ(builds, 1);
  EXPECT_EQ(second.binary, first.binary);
  EXPECT_EQ(second.binary.size(), 11u);  // a NUL inside is kept
  // No temporary file is left beside the entry.
  for (const auto& entry : fs::directory_iterator(dir_))
    EXPECT_EQ(entry.path().string().find(".tmp"), std::string::npos) << entry.path();
}

TEST_F(Cache, DamagedEntriesAreDetectedAndRebuilt) {
  BinaryCache cache(dir_.string());
  const std::vector<char> good = bytes(std::string(1000, 'x') + "end");
  auto build = [&] { return good; };
  const std::string path = cache.get_or_build("k", build).path;
  const std::string entry = read_text_file(path);

  struct Damage {
    std::string name, content, problem;
  };
  std::string flipped = entry;
  flipped[entry.size() - 10] ^= 0x20;
  const std::vector<Damage> damages = {
      {"truncated", entry.substr(0, entry.size() - 7), "length is wrong"},
      {"one byte changed", flipped, "checksum does not match"},
      {"longer", entry + "trailing", "length is wrong"},
      {"not an entry", "hello\n", "bad header"},
      {"empty", "", "bad header"},
      // A planted header claiming 2 GB: refused from the file's size, nothing allocated (issue #34).
      {"planted size", "cudagen-binary/2 " + std::string(32, '0') + " 2000000000\nxyz", "the file holds 3"},
      // An entry of version 1 (FNV-1a keys and checksums, which can be collided on purpose).
      {"version 1", "cudagen-binary/1 0123456789abcdef 3\nxyz", "bad header"},
  };
  for (const Damage& d : damages) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << d.content;
    CacheResult r = cache.get_or_build("k", build);
    EXPECT_EQ(r.outcome, CacheOutcome::rebuilt_corrupt) << d.name;
    EXPECT_NE(r.problem.find(d.problem), std::string::npos) << d.name << ": " << r.problem;
    EXPECT_EQ(r.binary, good) << d.name;
    EXPECT_EQ(read_text_file(path), entry) << d.name << ": the entry is rewritten whole";
  }
}

TEST_F(Cache, KeyChangesWithSourceOptionsCompilerVersionAndArchitecture) {
  const std::string base = cache_key("src", "-O3", "13.0", "sm_90");
  EXPECT_EQ(base.size(), 32u);
  EXPECT_EQ(base, cache_key("src", "-O3", "13.0", "sm_90"));
  EXPECT_NE(base, cache_key("src ", "-O3", "13.0", "sm_90"));
  EXPECT_NE(base, cache_key("src", "-O2", "13.0", "sm_90"));
  EXPECT_NE(base, cache_key("src", "-O3", "13.1", "sm_90"));
  EXPECT_NE(base, cache_key("src", "-O3", "13.0", "sm_80"));
  // Text moved from one field to the next is a different key.
  EXPECT_NE(cache_key("ab", "c", "v", "a"), cache_key("a", "bc", "v", "a"));
}

TEST_F(Cache, LocationFollowsTheEnvironment) {
  const char* saved_dir = std::getenv("CUDAGEN_CACHE_DIR");
  const char* saved_xdg = std::getenv("XDG_CACHE_HOME");
  const std::string keep_dir = saved_dir ? saved_dir : "", keep_xdg = saved_xdg ? saved_xdg : "";
  ::setenv("CUDAGEN_CACHE_DIR", "/somewhere/cache", 1);
  ::setenv("XDG_CACHE_HOME", "/xdg", 1);
  EXPECT_EQ(default_cache_dir(), "/somewhere/cache");
  ::unsetenv("CUDAGEN_CACHE_DIR");
  EXPECT_EQ(default_cache_dir(), "/xdg/cudagen");
  ::unsetenv("XDG_CACHE_HOME");
  if (const char* home = std::getenv("HOME")) EXPECT_EQ(default_cache_dir(), std::string(home) + "/.cache/cudagen");
  if (saved_dir) ::setenv("CUDAGEN_CACHE_DIR", keep_dir.c_str(), 1);
  if (saved_xdg) ::setenv("XDG_CACHE_HOME", keep_xdg.c_str(), 1);
}

// A cache folder that cannot be made or written fails no run: the binary is
// built and used uncached, and the reason is given once (issue #34).
TEST_F(Cache, AnUnwritableFolderRunsUncachedAndSaysSoOnce) {
  std::ofstream(dir_.string() + "-file") << "x";  // a file where the folder's parent should be
  BinaryCache cache(dir_.string() + "-file/cache");
  int builds = 0;
  auto build = [&] {
    ++builds;
    return std::vector<char>{'x'};
  };
  CacheResult first = cache.get_or_build("k", build);
  EXPECT_EQ(first.outcome, CacheOutcome::uncached);
  EXPECT_EQ(first.binary, std::vector<char>{'x'});
  EXPECT_NE(first.problem.find("CUDAGEN_CACHE_DIR"), std::string::npos) << first.problem;
  CacheResult second = cache.get_or_build("k", build);
  EXPECT_EQ(second.outcome, CacheOutcome::uncached);
  EXPECT_EQ(second.problem, "") << "said once";
  EXPECT_EQ(builds, 2);
  EXPECT_STREQ(to_string(CacheOutcome::uncached), "not cached (the cache folder cannot be written)");
  fs::remove(dir_.string() + "-file");
}

// Eight processes miss on the same key at once: one builds (slowly), the
// others wait for its entry, and every one gets the whole binary.
TEST_F(Cache, ConcurrentProcessesBuildOnceAndNeverReadHalfAnEntry) {
  constexpr int kProcesses = 8;
  const std::string builds_log = dir_.string() + "-builds";
  fs::remove(builds_log);
  std::string big(3 << 20, '\0');  // 3 MiB: a partial write would be visible
  for (size_t i = 0; i < big.size(); ++i) big[i] = char(i * 7919 % 251);
  std::vector<pid_t> children;
  for (int p = 0; p < kProcesses; ++p) {
    pid_t pid = ::fork();
    ASSERT_GE(pid, 0);
    if (pid == 0) {
      int status = 0;
      try {
        BinaryCache cache(dir_.string());
        CacheResult r = cache.get_or_build("shared", [&] {
          std::ofstream(builds_log, std::ios::app) << ::getpid() << "\n";
          std::this_thread::sleep_for(std::chrono::milliseconds(300));
          return std::vector<char>(big.begin(), big.end());
        });
        if (r.binary != std::vector<char>(big.begin(), big.end())) status = 3;
      } catch (...) {
        status = 4;
      }
      ::_exit(status);
    }
    children.push_back(pid);
  }
  for (pid_t pid : children) {
    int status = 0;
    ASSERT_EQ(::waitpid(pid, &status, 0), pid);
    EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << "child " << pid << " status " << status;
  }
  std::ifstream log(builds_log);
  int lines = 0;
  for (std::string line; std::getline(log, line);) ++lines;
  EXPECT_EQ(lines, 1) << "the key was built by " << lines << " processes";
  EXPECT_EQ(BinaryCache(dir_.string()).get_or_build("shared", [] { return std::vector<char>(); }).outcome,
            CacheOutcome::hit);
  fs::remove(builds_log);
}
