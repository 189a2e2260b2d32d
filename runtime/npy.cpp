#include "npy.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include <fmt/format.h>

#include "file_util.h"

namespace cudagen {

namespace {

// numpy has no bfloat16: a bf16 tensor is stored as the 16-bit patterns
// themselves, an array of uint16 (a.view(np.uint16) of a bf16 array;
// torch.from_numpy(a.view(np.int16)).view(torch.bfloat16) reads it back), and
// a '<u2' file is read as bf16.
const char* descr(DType d) {
  switch (d) {
    case DType::f32: return "<f4";
    case DType::f64: return "<f8";
    case DType::i32: return "<i4";
    case DType::i64: return "<i8";
    case DType::f16: return "<f2";
    case DType::bf16: return "<u2";
  }
  return "";
}

// The value of `key` in the header's Python dict literal, as raw text: a
// parenthesised tuple, a quoted string, or what runs to the next ',' or '}'.
std::string header_field(const std::string& header, const std::string& key, const std::string& path) {
  auto malformed = [&] { return std::runtime_error(fmt::format("{}: .npy header has a malformed '{}' entry", path, key)); };
  size_t at = header.find("'" + key + "'");
  if (at == std::string::npos) throw std::runtime_error(fmt::format("{}: .npy header has no '{}'", path, key));
  at = header.find(':', at + key.size() + 2);
  if (at == std::string::npos) throw malformed();
  const size_t start = header.find_first_not_of(' ', at + 1);
  if (start == std::string::npos) throw malformed();
  const char open = header[start];
  const size_t close = open == '(' ? header.find(')', start) : open == '\'' ? header.find('\'', start + 1)
                                                                           : header.find_first_of(",}", start);
  if (close == std::string::npos) throw malformed();
  const size_t end = open == '(' || open == '\'' ? close + 1 : close;
  return header.substr(start, end - start);
}

}  // namespace

namespace {

// The header's shape: a Python tuple of non-negative integers, "()", "(4,)"
// or "(2, 3)". Anything else ("(4.0,)", "(x,)", a missing parenthesis) is
// an error that names the file and the element.
std::vector<int64_t> parse_shape_tuple(const std::string& text, const std::string& path) {
  auto bad = [&](const std::string& why) {
    return std::runtime_error(
        fmt::format("{}: shape {} in the .npy header is not a tuple of non-negative integers: {}", path, text, why));
  };
  if (text.size() < 2 || text.front() != '(' || text.back() != ')') throw bad("it is not in parentheses");
  std::vector<int64_t> shape;
  const std::string inside = text.substr(1, text.size() - 2);
  size_t i = 0;
  while (i < inside.size()) {
    const size_t comma = std::min(inside.find(',', i), inside.size());
    std::string element = inside.substr(i, comma - i);
    element.erase(0, element.find_first_not_of(' '));
    element.erase(element.find_last_not_of(' ') + 1);
    if (element.empty()) {
      if (comma < inside.size() || shape.empty()) throw bad("an element is empty");
      break;  // the trailing comma of "(4,)"
    }
    if (element.size() > 18 || element.find_first_not_of("0123456789") != std::string::npos)
      throw bad(fmt::format("element '{}'", element));
    shape.push_back(std::stoll(element));
    i = comma + 1;
  }
  return shape;
}

}  // namespace

HostTensor read_npy(const std::string& path) {
  return parse_npy(read_text_file(path, int64_t(1) << 40), path);  // a tensor: up to validation's 1 TiB
}

HostTensor parse_npy(std::string_view bytes, const std::string& path) {
  if (bytes.size() < 10 || bytes.compare(0, 6, "\x93NUMPY") != 0)
    throw std::runtime_error(fmt::format("{}: not a .npy file (no \\x93NUMPY magic)", path));
  const int major = static_cast<unsigned char>(bytes[6]);
  size_t header_len = 0, offset = 0;
  if (major == 1) {
    header_len = static_cast<unsigned char>(bytes[8]) | size_t(static_cast<unsigned char>(bytes[9])) << 8;
    offset = 10;
  } else if (major == 2 || major == 3) {
    if (bytes.size() < 12) throw std::runtime_error(fmt::format("{}: truncated .npy header", path));
    for (int k = 0; k < 4; ++k) header_len |= size_t(static_cast<unsigned char>(bytes[8 + size_t(k)])) << (8 * k);
    offset = 12;
  } else {
    throw std::runtime_error(fmt::format("{}: unsupported .npy version {}", path, major));
  }
  if (offset + header_len > bytes.size()) throw std::runtime_error(fmt::format("{}: truncated .npy header", path));
  std::string header(bytes.substr(offset, header_len));
  std::string type = header_field(header, "descr", path);
  std::string order = header_field(header, "fortran_order", path);
  std::string shape_text = header_field(header, "shape", path);
  if (order != "False") throw std::runtime_error(fmt::format("{}: Fortran-order arrays are not supported; save a C-contiguous array", path));
  HostTensor a;
  int64_t expected_bytes = 0;
  bool known = false;
  for (DType d : {DType::f32, DType::f64, DType::i32, DType::i64, DType::f16, DType::bf16})
    if (type == std::string("'") + descr(d) + "'") {
      a.dtype = d;
      known = true;
    }
  if (!known) throw std::runtime_error(fmt::format("{}: unsupported dtype {} (cudagen reads <f4, <f8, <i4, <i8, <f2, and <u2 as bf16 bit patterns)", path, type));
  a.shape = parse_shape_tuple(shape_text, path);
  int64_t n = 1;
  for (int64_t d : a.shape)
    if (__builtin_mul_overflow(n, d, &n) || __builtin_mul_overflow(n, dtype_bytes(a.dtype), &expected_bytes))
      throw std::runtime_error(fmt::format("{}: shape {} in the .npy header has more bytes than a 64-bit count holds",
                                           path, shape_text));
  size_t expected = size_t(n * dtype_bytes(a.dtype)), data_at = offset + header_len;
  if (bytes.size() - data_at != expected)
    throw std::runtime_error(fmt::format("{}: {} bytes of data, but shape {} of {} needs {}", path, bytes.size() - data_at,
                                         shape_to_string(a.shape), to_string(a.dtype), expected));
  a.data.assign(bytes.begin() + long(data_at), bytes.end());
  return a;
}

void write_npy(const std::string& path, const HostTensor& a) {
  std::string shape = "(";
  for (size_t i = 0; i < a.shape.size(); ++i) shape += std::to_string(a.shape[i]) + (a.shape.size() == 1 ? "," : i + 1 < a.shape.size() ? ", " : "");
  shape += ")";
  std::string header = fmt::format("{{'descr': '{}', 'fortran_order': False, 'shape': {}, }}", descr(a.dtype), shape);
  // The header is padded with spaces to a multiple of 64 bytes and ends with a newline.
  size_t total = 10 + header.size() + 1;
  header.append((64 - total % 64) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += char(header.size() & 0xff);
  out += char(header.size() >> 8);
  out += header;
  out.append(reinterpret_cast<const char*>(a.data.data()), a.data.size());
  write_file_atomic(path, out);
}

}  // namespace cudagen
