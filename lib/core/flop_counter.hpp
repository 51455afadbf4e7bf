#pragma once
// Counts the floating-point operations the project executes, by convention:
//   matrix product C[M,N] (+)= A[M,K]·B[K,N]: 2·M·N·K (a multiply-add is two operations)
//   each elementwise add, subtract, multiply, divide, max or exp: 1 per element
//   row softmax over n values (max, subtract+exp, sum, scale): kSoftmaxFlopsPerElement·n
//   layer normalisation: kLayerNormFlopsPerElement per element; GELU: kGeluFlopsPerElement
// Per-row scalars (one reciprocal per row, say) are not counted. Counts are exact integers.
#include <cstdint>

namespace xfb {

inline constexpr std::int64_t kSoftmaxFlopsPerElement = 5;
inline constexpr std::int64_t kLayerNormFlopsPerElement = 7;  // mean, centre+square+sum, scale+shift
inline constexpr std::int64_t kGeluFlopsPerElement = 5;       // 0.5·x·(1+erf(x/√2))
// GELU'(x)·g = (0.5·(1+erf(x/√2)) + x·exp(−x²/2)/√(2π))·g: 4 + 5 + add + multiply.
inline constexpr std::int64_t kGeluBackwardFlopsPerElement = 11;
// LayerNorm backward per element, as executed: statistics again (4: sum, subtract, square, add),
// x̂ (2), dx̂ (1), the two row sums (3), dx (6: dx̂ again, two subtracts, two multiplies, the
// accumulation); then dgamma (2) and dbeta (1) over the column.
inline constexpr std::int64_t kLayerNormBackwardFlopsPerElement = 19;
inline constexpr std::int64_t kOnlineSoftmaxFlopsPerElement = 4;  // max, subtract+exp, sum
// Softmax backward dS = P·(dP − Σ P·dP): multiply+add of the dot, subtract+multiply.
inline constexpr std::int64_t kSoftmaxBackwardFlopsPerElement = 4;
// A recomputed tile's backward from saved log-sum-exp: subtract+exp (P), subtract+multiply (dS).
inline constexpr std::int64_t kRecomputedSoftmaxBackwardFlopsPerElement = 4;

inline constexpr std::int64_t matmul_flops(std::int64_t m, std::int64_t n, std::int64_t k) { return 2 * m * n * k; }

class FlopCounter {
 public:
  static void add(std::int64_t flops) noexcept;
  static std::int64_t total() noexcept;
  static void reset() noexcept;
};

}  // namespace xfb
