#include "user_templates.h"

#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <stdexcept>

#include <fmt/format.h>

#include "file_util.h"
#include "templates_embedded.h"

namespace cudagen {

namespace {

namespace fs = std::filesystem;

std::string shell_quote(const std::string& s) {
  std::string out = "'";
  for (char c : s) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
  return out + "'";
}

// CUDAGEN_INDEX, else beside this executable (installed), else in the build
// tree's generator/indexer/.
std::string find_indexer() {
  if (const char* env = std::getenv("CUDAGEN_INDEX"); env && *env) return env;
  std::error_code ec;
  fs::path self = fs::read_symlink("/proc/self/exe", ec);
  std::vector<fs::path> candidates;
  if (!ec) candidates = {self.parent_path() / "cudagen-index", self.parent_path() / "indexer" / "cudagen-index"};
  for (const auto& c : candidates)
    if (fs::exists(c)) return c.string();
  std::string looked;
  for (const auto& c : candidates) looked += " " + c.string();
  throw std::runtime_error(fmt::format(
      "--templates needs cudagen-index, the template indexer, which was not found (looked at:{}); set CUDAGEN_INDEX "
      "to its path",
      looked));
}

}  // namespace

UserTemplateRegistry::UserTemplateRegistry(const std::vector<std::string>& dirs) {
  for (const auto& d : dirs)
    if (!fs::is_directory(d)) throw FileError(fmt::format("--templates {}: not a folder", d));
  const std::string indexer = find_indexer();
  const std::string bundled = work_dir_.path() + "/bundled";
  fs::create_directories(bundled);
  // The bundled templates as files, so the user's may call their helpers.
  for (const auto& name : embedded_template_names())
    write_file_atomic(bundled + "/" + name, std::string(embedded_template(name)));
  registry_file_ = work_dir_.path() + "/registry.json";
  std::string cmd = fmt::format("{} -q --prelude {} -o {} {}", shell_quote(indexer), shell_quote(bundled + "/prelude.cuh"),
                                shell_quote(registry_file_), shell_quote(bundled));
  for (const auto& d : dirs) cmd += " " + shell_quote(d);
  int status = std::system(cmd.c_str());
  if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::string folders;
    for (const auto& d : dirs) folders += " " + d;
    throw std::runtime_error(
        fmt::format("the templates in{} could not be indexed (cudagen-index's errors are above)", folders));
  }
}

UserTemplateRegistry::~UserTemplateRegistry() = default;

}  // namespace cudagen
