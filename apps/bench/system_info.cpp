#include "apps/bench/system_info.hpp"

#include <immintrin.h>
#include <omp.h>
#include <unistd.h>

#include <chrono>
#include <ctime>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include <spdlog/spdlog.h>
#include <oneapi/dnnl/dnnl.hpp>

#include "apps/report/report.hpp"
#include "git_commit.hpp"
#include "lib/core/contention.hpp"
#include "lib/core/cpu_isa.hpp"
#include "lib/core/tensor.hpp"

namespace xfb {
namespace {

std::string cpuinfo_field(const std::string& field) {
  std::ifstream in("/proc/cpuinfo");
  std::string line;
  while (std::getline(in, line))
    if (line.rfind(field, 0) == 0) {
      const auto colon = line.find(':');
      if (colon != std::string::npos) return line.substr(colon + 2);
    }
  return "unknown";
}

std::vector<std::string> isa_flags() {
  static const std::set<std::string> relevant = {"sse4_2",      "avx",         "avx2",     "fma",
                                                 "f16c",        "avx512f",     "avx512bw", "avx512vl",
                                                 "avx512_bf16", "avx512_vnni", "avx_vnni", "amx_tile"};
  std::istringstream flags(cpuinfo_field("flags"));
  std::vector<std::string> out;
  std::string flag;
  while (flags >> flag)
    if (relevant.count(flag)) out.push_back(flag);
  return out;
}

std::string dnnl_isa_name(dnnl::cpu_isa isa) {
  switch (isa) {
    case dnnl::cpu_isa::sse41:
      return "sse41";
    case dnnl::cpu_isa::avx:
      return "avx";
    case dnnl::cpu_isa::avx2:
      return "avx2";
    case dnnl::cpu_isa::avx512_mic:
      return "avx512_mic";
    case dnnl::cpu_isa::avx512_core:
      return "avx512_core";
    case dnnl::cpu_isa::avx512_core_vnni:
      return "avx512_core_vnni";
    case dnnl::cpu_isa::avx512_core_bf16:
      return "avx512_core_bf16";
    case dnnl::cpu_isa::avx512_core_amx:
      return "avx512_core_amx";
    case dnnl::cpu_isa::avx2_vnni:
      return "avx2_vnni";
    default:
      return "other";
  }
}

std::string compiler_name() {
#if defined(__clang__)
  return "clang " __clang_version__;
#elif defined(__GNUC__)
  return "gcc " __VERSION__;
#else
  return "unknown";
#endif
}

std::string utc_now() {
  const std::time_t now = std::time(nullptr);
  char text[32];
  std::strftime(text, sizeof text, "%Y-%m-%dT%H:%M:%SZ", std::gmtime(&now));
  return text;
}

using v8f = float __attribute__((vector_size(32)));
using v16f = float __attribute__((vector_size(64)));

// 12 independent FMA chains of 8 floats; returns FLOPs executed.
__attribute__((target("avx2,fma"), noinline)) double fma_chains(long iterations, float* sink) {
  v8f acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = v8f{} + static_cast<float>(i) * 1e-3f;
  const v8f mul = v8f{} + 0.999999f, add = v8f{} + 1e-7f;
  // Unrolled at every optimisation level: a rolled loop keeps acc[] on the stack (store-forwarding
  // bound, under half the peak at -O2).
  for (long it = 0; it < iterations; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * mul + add;
  v8f total = v8f{};
  for (int i = 0; i < 12; ++i) total += acc[i];
  *sink = total[0];
  return 2.0 * 8 * 12 * static_cast<double>(iterations);
}

// The same with 16-float (512-bit) vectors: 12 chains fit AVX-512's 32 registers.
__attribute__((target("avx512f,fma"), noinline)) double fma_chains_512(long iterations, float* sink) {
  v16f acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = v16f{} + static_cast<float>(i) * 1e-3f;
  const v16f mul = v16f{} + 0.999999f, add = v16f{} + 1e-7f;
  // Unrolled at every optimisation level: a rolled loop keeps acc[] on the stack (store-forwarding
  // bound, under half the peak at -O2).
  for (long it = 0; it < iterations; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = acc[i] * mul + add;
  v16f total = v16f{};
  for (int i = 0; i < 12; ++i) total += acc[i];
  *sink = total[0];
  return 2.0 * 16 * 12 * static_cast<double>(iterations);
}

// 12 independent chains of vdpbf16ps (AVX512_BF16): each instruction multiplies 32 bf16 pairs and adds
// them pairwise into 16 fp32 lanes, 64 FLOPs (a multiply-add counts 2, as everywhere).
__attribute__((target("avx512f,avx512bf16"), noinline)) double bf16_dot_chains(long iterations, float* sink) {
  __m512 acc[12];
  for (int i = 0; i < 12; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512bh one = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80));   // bf16 1.0
  const __m512bh tiny = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3380));  // bf16 2⁻²⁴
  for (long it = 0; it < iterations; ++it)
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], one, tiny);
  __m512 total = _mm512_setzero_ps();
  for (int i = 0; i < 12; ++i) total = _mm512_add_ps(total, acc[i]);
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, total);
  *sink = lanes[0];
  return 64.0 * 12 * static_cast<double>(iterations);
}

// A figure from timed trials, judged as timed samples are (lib/core/contention.hpp): the best of
// kWantedTrials undisturbed trials, running at most kMaxTrials; when none was undisturbed, the best
// of all, flagged: on a busy machine a peak reads low, so shares of it read high.
struct TrialFigure {
  double value = 0;
  bool contended = false;
};
constexpr int kWantedTrials = 3;
constexpr int kMaxTrials = 10;

// `trial` runs once and returns {figure, wall ns}. Its first run is untimed: the thread team the
// probe watches must exist.
template <class Trial>
TrialFigure best_undisturbed(Trial trial) {
  trial();
  ContentionProbe probe;
  double clean_best = 0, any_best = 0;
  int clean = 0;
  for (int i = 0; i < kMaxTrials && clean < kWantedTrials; ++i) {
    probe.start();
    const auto [figure, wall_ns] = trial();
    any_best = std::max(any_best, figure);
    if (!probe.stop(wall_ns).descheduled) {
      clean_best = std::max(clean_best, figure);
      ++clean;
    }
  }
  return clean > 0 ? TrialFigure{clean_best, false} : TrialFigure{any_best, true};
}

// GFLOP/s of `chains` on every thread at once.
TrialFigure fma_peak(int threads, double (*chains)(long, float*)) {
  std::vector<float> sinks(static_cast<std::size_t>(threads));
  return best_undisturbed([&] {
    const long iterations = 20'000'000;
    double flops = 0;
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : flops)
    flops += chains(iterations, &sinks[static_cast<std::size_t>(omp_get_thread_num())]);
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    return std::pair{flops / ns, ns};
  });
}

// GB/s of the STREAM triad a = b + 3·c over three 64 MiB arrays on every thread.
TrialFigure triad_bandwidth(int threads) {
  const std::int64_t n = 16 * 1024 * 1024;
  Tensor a(Shape{n}), b(Shape{n}), c(Shape{n});
  b.fill(1.0f);
  c.fill(2.0f);
  float* pa = a.data();
  const float* pb = b.data();
  const float* pc = c.data();
  return best_undisturbed([&] {
    const auto start = std::chrono::steady_clock::now();
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::int64_t i = 0; i < n; ++i) pa[i] = pb[i] + 3.0f * pc[i];
    const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - start).count();
    return std::pair{3.0 * static_cast<double>(n) * sizeof(float) / ns, ns};
  });
}

}  // namespace

nlohmann::json capture_context(int threads) {
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  const dnnl_version_t* version = dnnl_version();
  std::ostringstream dnnl_version_text;
  dnnl_version_text << version->major << "." << version->minor << "." << version->patch;
  return {
      {"cpu_model", cpuinfo_field("model name")},
      {"isa_flags", isa_flags()},
      {"logical_cores", std::thread::hardware_concurrency()},
      {"threads", threads},
      {"onednn_version", dnnl_version_text.str()},
      {"onednn_commit", version->hash},
      {"onednn_isa", dnnl_isa_name(dnnl::get_effective_cpu_isa())},
      {"kernel_isa", kernel_isa_name(kernel_isa())},
      {"bf16_kernels", bf16_kernels_name()},
      {"kernels_emulated", kEmulatedAvx512},
      {"compiler", compiler_name()},
      {"cxx_flags", XFBENCH_CXX_FLAGS},
      {"build_type", XFBENCH_BUILD_TYPE},
      {"xfbench_version", XFBENCH_VERSION},
      {"git_commit", XFBENCH_GIT_COMMIT},
      {"date", utc_now()},
      {"host", host},
  };
}

nlohmann::json machine_figures(const MachineMeasurement& m) {
  return {{"fma_peak_gflops", m.fma_peak_gflops},         {"fma_peak_256_gflops", m.fma_peak_256_gflops},
          {"fma_peak_512_gflops", m.fma_peak_512_gflops}, {"bf16_dot_peak_gflops", m.bf16_dot_peak_gflops},
          {"triad_bandwidth_gbs", m.triad_bandwidth_gbs}, {kMachineContendedField, m.contended}};
}

MachineMeasurement measure_machine(int threads) {
  MachineMeasurement m;
  const auto take = [&m](double& figure, const TrialFigure& measured) {
    figure = measured.value;
    m.contended = m.contended || measured.contended;
  };
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
    take(m.fma_peak_256_gflops, fma_peak(threads, fma_chains));
  if (__builtin_cpu_supports("avx512f")) take(m.fma_peak_512_gflops, fma_peak(threads, fma_chains_512));
  m.fma_peak_gflops = std::max(m.fma_peak_256_gflops, m.fma_peak_512_gflops);
  if (__builtin_cpu_supports("avx512bf16")) take(m.bf16_dot_peak_gflops, fma_peak(threads, bf16_dot_chains));
  take(m.triad_bandwidth_gbs, triad_bandwidth(threads));
  if (m.contended)
    spdlog::warn(
        "the machine's peaks were measured while other work ran (no undisturbed trial of {}): they may read "
        "low, and GFLOP/s shares of them high (tables print ≤)",
        kMaxTrials);
  return m;
}

std::string version_text() {
  return std::string("xfbench ") + XFBENCH_VERSION + " (commit " + XFBENCH_GIT_COMMIT + ", " + XFBENCH_BUILD_TYPE +
         " build)";
}

std::int64_t available_memory_bytes() {
  std::ifstream meminfo("/proc/meminfo");
  std::string name, unit;
  long long kib = 0;
  while (meminfo >> name >> kib >> unit)
    if (name == "MemAvailable:") return static_cast<std::int64_t>(kib) * 1024;
  return 0;
}

}  // namespace xfb
