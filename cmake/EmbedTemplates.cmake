# Writes OUT: a C++ source whose embedded_template(name) returns the text of
# each file in TEMPLATE_DIR (run at build time, so edits to templates rebuild).
file(GLOB files RELATIVE ${TEMPLATE_DIR} ${TEMPLATE_DIR}/*.cuh)
list(SORT files)
set(body "")
set(names "")
foreach(f ${files})
  file(READ ${TEMPLATE_DIR}/${f} text)
  string(APPEND body "  if (name == \"${f}\") return R\"CUDAGEN_TEMPLATE(${text})CUDAGEN_TEMPLATE\";\n")
  string(APPEND names "\"${f}\", ")
endforeach()
file(WRITE ${OUT}.new "// Generated from templates/ by cmake/EmbedTemplates.cmake: do not edit.
#include \"templates_embedded.h\"

namespace cudagen {

std::string_view embedded_template(std::string_view name) {
${body}  return {};
}

std::vector<std::string> embedded_template_names() { return {${names}}; }

}  // namespace cudagen
")
file(COPY_FILE ${OUT}.new ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.new)
