#include "host_tensor.h"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include <fmt/format.h>

#include "half.h"

namespace cudagen {

void store_element(unsigned char* at, DType dtype, double v) {
  switch (dtype) {
    case DType::f32: { float f = float(v); std::memcpy(at, &f, 4); return; }
    case DType::f64: std::memcpy(at, &v, 8); return;
    case DType::i32: { int32_t i = int32_t(v); std::memcpy(at, &i, 4); return; }
    case DType::i64: { int64_t i = int64_t(v); std::memcpy(at, &i, 8); return; }
    case DType::f16: { uint16_t h = float_to_f16(float(v)); std::memcpy(at, &h, 2); return; }
    case DType::bf16: { uint16_t b = float_to_bf16(float(v)); std::memcpy(at, &b, 2); return; }
  }
  throw std::runtime_error(fmt::format("cannot store a {} element", to_string(dtype)));
}

double load_element(const unsigned char* at, DType dtype) {
  switch (dtype) {
    case DType::f32: { float f; std::memcpy(&f, at, 4); return f; }
    case DType::f64: { double d; std::memcpy(&d, at, 8); return d; }
    case DType::i32: { int32_t i; std::memcpy(&i, at, 4); return i; }
    case DType::i64: { int64_t i; std::memcpy(&i, at, 8); return double(i); }
    case DType::f16: { uint16_t h; std::memcpy(&h, at, 2); return f16_to_float(h); }
    case DType::bf16: { uint16_t b; std::memcpy(&b, at, 2); return bf16_to_float(b); }
  }
  return NAN;
}

std::vector<double> HostTensor::values() const {
  const int64_t n = int64_t(data.size()) / dtype_bytes(dtype);
  std::vector<double> out(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) out[size_t(i)] = load_element(data.data() + i * dtype_bytes(dtype), dtype);
  return out;
}

HostTensor HostTensor::from_values(DType dtype, Shape shape, const std::vector<double>& values) {
  HostTensor t{dtype, std::move(shape), {}};
  if (int64_t(values.size()) != t.numel())
    throw std::runtime_error(fmt::format("{} values do not fill a tensor of shape {} ({} elements)", values.size(),
                                         shape_to_string(t.shape), t.numel()));
  t.data.resize(values.size() * size_t(dtype_bytes(dtype)));
  for (size_t i = 0; i < values.size(); ++i) store_element(t.data.data() + i * size_t(dtype_bytes(dtype)), dtype, values[i]);
  return t;
}

}  // namespace cudagen
