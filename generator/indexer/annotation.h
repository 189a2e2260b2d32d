// The annotation language of op templates (docs/templates.md): the strings of
// one CG_OP("name", "key: value", ...) turned into the op's registry entry.
// No Clang here: the indexer hands over the strings it read from the AST.
#pragma once

#include <stdexcept>
#include <string>
#include <vector>

#include "json.h"

namespace cudagen {

// Which string of the annotation is wrong (0 is the op name), and why.
struct AnnotationError : std::runtime_error {
  AnnotationError(size_t index_, const std::string& message) : std::runtime_error(message), index(index_) {}
  size_t index;
};

// The op's registry object: name, pattern, types, tensors, args, shape,
// may_alias, links, smem, doc, and "variants": the names of other entry
// functions of the op (a tensor-core tile beside the portable one), which the
// caller resolves to closures; the caller adds where its source lives.
// Throws AnnotationError.
JsonValue parse_op_annotation(const std::vector<std::string>& strings);

}  // namespace cudagen
