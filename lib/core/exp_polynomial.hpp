#pragma once
// The constants of the project's exp, shared by ops::fast_exp and the tile kernels' exp_lanes so
// that the scalar and vector forms cannot drift apart. Constants only (no functions): the header is
// included by files compiled with AVX-512 flags.
//   x = n·ln 2 + f, n = round(x·log2 e), ln 2 = kLn2High − kLn2Low (kLn2High has few mantissa bits,
//   so n·kLn2High is exact and f is too), |f| <= ln 2 / 2;
//   e^f ≈ ((((((c0·f + c1)·f + c2)·f + c3)·f + c4)·f + c5)·f + c6), c = kCoefficients: the degree-6
//   polynomial interpolating e^f at the Chebyshev nodes of [−ln 2 / 2, ln 2 / 2] (2e-8 relative
//   error with these float values, below ε/2);
//   e^x = 2^n · e^f, and 0 for x < kLowest (e^x below 2^−125).
namespace xfb::exp_polynomial {
inline constexpr float kLog2e = 1.44269504088896341f;
inline constexpr float kLn2High = 0.693359375f;
inline constexpr float kLn2Low = 2.12194440e-4f;
inline constexpr float kLowest = -87.0f;
inline constexpr float kHighest = 88.0f;  // inputs are clamped here where 2^n is built by hand
inline constexpr int kDegree = 6;
inline constexpr float kCoefficients[kDegree + 1] = {
    1.394110848e-3f, 8.375125937e-3f, 4.166635126e-2f, 1.666641533e-1f, 0.5f, 1.0f, 1.0f};
}  // namespace xfb::exp_polynomial
