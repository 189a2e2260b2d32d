# Writes OUT: a C++ source whose FUNCTION() returns the text of IN (run at
# build time, so edits to IN rebuild).
file(READ ${IN} text)
file(WRITE ${OUT}.new "// Generated from ${NAME} by cmake/EmbedFile.cmake: do not edit.
#include <string_view>

namespace cudagen {

std::string_view ${FUNCTION}() {
  return R\"CUDAGEN_EMBEDDED(${text})CUDAGEN_EMBEDDED\";
}

}  // namespace cudagen
")
file(COPY_FILE ${OUT}.new ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.new)
