// The text of templates/*.cuh, embedded at build time so that an installed
// cudagen needs no template folder to find its ops.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace cudagen {

// The content of templates/<name>, or an empty view when there is none.
std::string_view embedded_template(std::string_view name);

// The names of the embedded files ("prelude.cuh", "matmul.cuh", ...), sorted.
std::vector<std::string> embedded_template_names();

}  // namespace cudagen
