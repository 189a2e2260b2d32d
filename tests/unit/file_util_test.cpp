// File helpers: private temporary folders, atomic writes of several files.
#include <sys/stat.h>
#include <unistd.h>

#include <filesystem>
#include <string>

#include <gtest/gtest.h>

#include "file_util.h"

TEST(TempDir, IsPrivateAndRemovedWithItsFiles) {
  std::string path;
  {
    cudagen::TempDir dir("cudagen-test-");
    path = dir.path();
    EXPECT_EQ(std::filesystem::status(path).permissions() & std::filesystem::perms::all, std::filesystem::perms::owner_all);
    cudagen::write_file_atomic(path + "/a.txt", "x");
    cudagen::TempDir other("cudagen-test-");
    EXPECT_NE(other.path(), path) << "a fresh name each time";
  }
  EXPECT_FALSE(std::filesystem::exists(path));
}

TEST(WriteFilesAtomic, WritesAllOrNone) {
  cudagen::TempDir dir("cudagen-test-");
  const std::string a = dir.path() + "/a.txt", b = dir.path() + "/b.txt";
  cudagen::write_files_atomic({{a, "one"}, {b, "two"}});
  EXPECT_EQ(cudagen::read_text_file(a), "one");
  EXPECT_EQ(cudagen::read_text_file(b), "two");
  EXPECT_THROW(cudagen::write_files_atomic({{a, "changed"}, {dir.path() + "/missing/c.txt", "three"}}), cudagen::FileError);
  EXPECT_EQ(cudagen::read_text_file(a), "one") << "the first file stays as it was when the second cannot be written";
  int entries = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator(dir.path())) ++entries;
  EXPECT_EQ(entries, 2) << "no temporary file is left";
}

// The temporary file beside the target was named PATH.tmp.PID: a symlink
// planted at that name had the write go through it (issue #34).
TEST(WriteFileAtomic, NeverWritesThroughAPlantedSymlink) {
  cudagen::TempDir dir("cudagen-test-");
  const std::string victim = dir.path() + "/victim.txt", out = dir.path() + "/out.txt";
  cudagen::write_file_atomic(victim, "untouched");
  std::filesystem::create_symlink(victim, out + ".tmp." + std::to_string(::getpid()));
  cudagen::write_file_atomic(out, "new");
  EXPECT_EQ(cudagen::read_text_file(victim), "untouched");
  EXPECT_EQ(cudagen::read_text_file(out), "new");
}

// A FIFO given as a graph hung the reader; a huge file failed as an odd
// syntax error deep in the parser (issue #34). Both are clear errors now.
TEST(ReadTextFile, RefusesPipesFoldersAndFilesOverItsLimit) {
  cudagen::TempDir dir("cudagen-test-");
  const std::string fifo = dir.path() + "/graph.json";
  ASSERT_EQ(::mkfifo(fifo.c_str(), 0600), 0);
  try {
    cudagen::read_text_file(fifo);
    FAIL() << "a FIFO was read";
  } catch (const cudagen::FileError& e) {
    EXPECT_NE(std::string(e.what()).find("not a regular file"), std::string::npos) << e.what();
  }
  EXPECT_THROW(cudagen::read_text_file(dir.path()), cudagen::FileError);
  const std::string big = dir.path() + "/big.json";
  cudagen::write_file_atomic(big, std::string(100, ' '));
  try {
    cudagen::read_text_file(big, 99);
    FAIL() << "a file over the limit was read";
  } catch (const cudagen::FileError& e) {
    EXPECT_NE(std::string(e.what()).find("100 bytes, more than the 99 cudagen reads"), std::string::npos) << e.what();
  }
  EXPECT_EQ(cudagen::read_text_file(big, 100).size(), 100u);
}
