# Writes OUT: a C++ source whose builtin_registry_json() returns the registry
# that cudagen-index made from templates/ (the file IN).
file(READ ${IN} text)
file(WRITE ${OUT}.new "// Generated from templates/ by cudagen-index and cmake/EmbedRegistry.cmake: do not edit.
#include \"registry.h\"

namespace cudagen {

std::string_view builtin_registry_json() {
  return R\"CUDAGEN_REGISTRY(${text})CUDAGEN_REGISTRY\";
}

OpRegistry builtin_registry() { return OpRegistry::from_json(builtin_registry_json(), \"<builtin registry>\"); }

}  // namespace cudagen
")
file(COPY_FILE ${OUT}.new ${OUT} ONLY_IF_DIFFERENT)
file(REMOVE ${OUT}.new)
