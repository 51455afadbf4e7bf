#include "lib/core/npy.hpp"

#include <algorithm>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <vector>

namespace xfb {

void write_npy(const std::string& path, const Tensor& tensor) {
  std::string header = "{'descr': '<f4', 'fortran_order': False, 'shape': (";
  for (std::size_t i = 0; i < tensor.shape().size(); ++i) header += std::to_string(tensor.shape()[i]) + ", ";
  if (tensor.shape().size() > 1) header.resize(header.size() - 2);
  if (tensor.shape().size() == 1) header.resize(header.size() - 1);
  header += "), }";
  const std::size_t preamble = 10;
  const std::size_t total = (preamble + header.size() + 1 + 63) / 64 * 64;
  header.append(total - preamble - header.size() - 1, ' ');
  header += '\n';
  std::ofstream out(path, std::ios::binary);
  if (!out) throw std::runtime_error("cannot write " + path);
  const unsigned char magic[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  out.write(reinterpret_cast<const char*>(magic), 8);
  const auto length = static_cast<std::uint16_t>(header.size());
  const char length_bytes[2] = {static_cast<char>(length & 0xff), static_cast<char>(length >> 8)};
  out.write(length_bytes, 2);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  if (tensor.dtype() == DType::F32) {
    out.write(reinterpret_cast<const char*>(tensor.data()), tensor.bytes());
  } else {  // bf16 widened exactly to float32, a chunk at a time (untracked: written after the measurement)
    constexpr std::int64_t kChunk = 1 << 16;
    std::vector<float> widened(static_cast<std::size_t>(std::min<std::int64_t>(kChunk, tensor.size())));
    for (std::int64_t first = 0; first < tensor.size(); first += kChunk) {
      const std::int64_t count = std::min(kChunk, tensor.size() - first);
      widen(tensor.bf16_data() + first, widened.data(), count);
      out.write(reinterpret_cast<const char*>(widened.data()), count * static_cast<std::int64_t>(sizeof(float)));
    }
  }
  out.close();  // a full disk may show only here
  if (!out) throw std::runtime_error("failed writing " + path);
}

Tensor read_npy(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw std::runtime_error("cannot read " + path);
  char magic[10];
  in.read(magic, 10);
  if (!in || std::memcmp(magic, "\x93NUMPY\x01\x00", 8) != 0) throw std::runtime_error(path + ": not an .npy v1 file");
  const std::size_t length = static_cast<unsigned char>(magic[8]) | (static_cast<unsigned char>(magic[9]) << 8);
  std::string header(length, ' ');
  in.read(header.data(), static_cast<std::streamsize>(length));
  if (header.find("'<f4'") == std::string::npos || header.find("False") == std::string::npos)
    throw std::runtime_error(path + ": expected little-endian float32 in C order");
  const auto open = header.find("'shape': (");
  const auto close = open == std::string::npos ? open : header.find(')', open);
  if (close == std::string::npos) throw std::runtime_error(path + ": no shape");
  Shape shape;
  std::int64_t extent = -1;
  for (std::size_t i = open + 10; i <= close; ++i) {
    const char c = header[i];
    if (c >= '0' && c <= '9') {
      extent = (extent < 0 ? 0 : extent * 10) + (c - '0');
    } else if (extent >= 0) {
      shape.push_back(extent);
      extent = -1;
    }
  }
  Tensor tensor(shape);
  in.read(reinterpret_cast<char*>(tensor.data()), tensor.bytes());
  if (!in) throw std::runtime_error(path + ": truncated data");
  return tensor;
}

}  // namespace xfb
