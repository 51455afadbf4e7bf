#pragma once
// The context every report carries: machine, ISA, threads, oneDNN, compiler, build, commit, time.
// `measure_machine` adds this machine's fp32 FMA peak, its bf16 dot-product peak and memory bandwidth
// (a few seconds).
#include <cstdint>
#include <string>

#include <nlohmann/json.hpp>

namespace xfb {

nlohmann::json capture_context(int threads);
// "xfbench 0.1.0 (commit abc1234, Release build)": what `xfbench --version` prints.
std::string version_text();
// MemAvailable of /proc/meminfo: what a new allocation can take without swapping; 0 if unknown.
std::int64_t available_memory_bytes();

struct MachineMeasurement {
  double fma_peak_gflops = 0;      // the highest of the two below: this machine's fp32 FMA peak
  double fma_peak_256_gflops = 0;  // all threads, 12 independent 8-float FMA chains per thread
  double fma_peak_512_gflops = 0;  // the same with 16-float (512-bit) vectors; 0 without AVX-512
  // All threads, 12 independent vdpbf16ps chains (bf16 products, fp32 sums) per thread: the peak bf16
  // points are quoted against; 0 without AVX512_BF16.
  double bf16_dot_peak_gflops = 0;
  double triad_bandwidth_gbs = 0;  // STREAM triad a = b + s·c over 3×64 MiB arrays
  // Each figure is the best of 3 trials the contention probe saw undisturbed (of at most 10); true
  // when some figure had none and is the best of disturbed trials (it may read low).
  bool contended = false;
};
MachineMeasurement measure_machine(int threads);
// The measurement as a context records it (apps/report/report.hpp's kMachineFigureFields).
nlohmann::json machine_figures(const MachineMeasurement& m);

}  // namespace xfb
