#pragma once
// The context every report carries: machine, ISA, threads, oneDNN, compiler, build, commit, time.
// `measure_machine` adds this machine's fp32 FMA peak and memory bandwidth (a few seconds).
#include <string>

#include <nlohmann/json.hpp>

namespace xfb {

nlohmann::json capture_context(int threads);

struct MachineMeasurement {
  double fma_peak_gflops = 0;       // fp32, all threads, 12 independent 8-wide FMA chains per thread
  double triad_bandwidth_gbs = 0;   // STREAM triad a = b + s·c over 3×64 MiB arrays
};
MachineMeasurement measure_machine(int threads);

}  // namespace xfb
