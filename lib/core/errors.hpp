#pragma once
// Error tiers mapped to exit codes in apps/cli/main.cpp (documented in docs/cli.md#exit-codes):
//   0 success · 1 a check or regression failed · 2 usage or input error · 3 runtime error.
#include <stdexcept>

namespace xfb {

inline constexpr int kExitOk = 0;
inline constexpr int kExitCheckFailed = 1;
inline constexpr int kExitUsage = 2;
inline constexpr int kExitRuntime = 3;

// Bad command line, bad parameter, unreadable or malformed input file.
struct InputError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

}  // namespace xfb
