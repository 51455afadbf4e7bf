#pragma once
// NumPy .npy (format 1.0) writer and reader for little-endian float32 arrays in C order.
#include <string>

#include "lib/core/tensor.hpp"

namespace xfb {
void write_npy(const std::string& path, const Tensor& tensor);
Tensor read_npy(const std::string& path);
}  // namespace xfb
