// `--templates DIR`: a user's own op templates, indexed on demand. The CLI
// runs cudagen-index (the only program that links Clang) over the bundled
// templates and the user's folders, and uses the registry it writes.
#pragma once

#include "file_util.h"

#include <string>
#include <vector>

namespace cudagen {

// A registry file made from the bundled templates plus `dirs`, in a
// temporary folder that lives as long as this object.
class UserTemplateRegistry {
 public:
  // Throws std::runtime_error when cudagen-index cannot be found or fails
  // (its diagnostics, with the user's file:line, are on stderr by then).
  explicit UserTemplateRegistry(const std::vector<std::string>& dirs);
  ~UserTemplateRegistry();
  UserTemplateRegistry(const UserTemplateRegistry&) = delete;
  UserTemplateRegistry& operator=(const UserTemplateRegistry&) = delete;

  const std::string& registry_file() const { return registry_file_; }

 private:
  TempDir work_dir_{"cudagen-templates-"};  // removed also when the constructor throws
  std::string registry_file_;
};

}  // namespace cudagen
