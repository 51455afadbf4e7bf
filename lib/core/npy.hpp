#pragma once
// NumPy .npy (format 1.0) writer and reader for little-endian float32 arrays in C order. A bf16
// tensor is written as float32 values exactly equal to its bf16 ones (widening is exact; the dump's
// manifest says dtype bf16); read_npy always gives fp32.
#include <string>

#include "lib/core/tensor.hpp"

namespace xfb {
void write_npy(const std::string& path, const Tensor& tensor);
Tensor read_npy(const std::string& path);
}  // namespace xfb
