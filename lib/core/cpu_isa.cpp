#include "lib/core/cpu_isa.hpp"

#include <cstdlib>
#include <optional>

#include "lib/core/errors.hpp"

namespace xfb {
namespace {
std::optional<KernelIsa> g_forced;
std::optional<bool> g_forced_bf16_dot;

KernelIsa parse_cap(const std::string& text) {
  if (text == "avx2" || text == "AVX2") return KernelIsa::Avx2;
  if (text == "avx512" || text == "AVX512") return KernelIsa::Avx512;
  throw InputError("XFBENCH_MAX_ISA='" + text + "' is not avx2 or avx512");
}
}  // namespace

std::string kernel_isa_name(KernelIsa isa) { return isa == KernelIsa::Avx512 ? "avx512" : "avx2"; }

KernelIsa detected_kernel_isa() {
  if (kEmulatedAvx512) return KernelIsa::Avx512;
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq");
  return avx512 ? KernelIsa::Avx512 : KernelIsa::Avx2;
}

// XFBENCH_BF16_DOT=0: the bf16 kernels convert and FMA even where vdpbf16ps exists. InputError for
// another value than 0 or 1.
static bool bf16_dot_held() {
  static const bool held = [] {
    const char* setting = std::getenv("XFBENCH_BF16_DOT");
    if (setting != nullptr && *setting != '\0' && std::string(setting) != "0" && std::string(setting) != "1")
      throw InputError("XFBENCH_BF16_DOT='" + std::string(setting) + "' is not 0 or 1");
    return setting != nullptr && std::string(setting) == "0";
  }();
  return held;
}

KernelIsa kernel_isa() {
  if (g_forced) return *g_forced;
  static const KernelIsa chosen = [] {
    bf16_dot_held();  // the kernel settings are read together, on every CPU class alike
    KernelIsa isa = detected_kernel_isa();
    if (const char* cap = std::getenv("XFBENCH_MAX_ISA"); cap != nullptr && *cap != '\0') {
      const KernelIsa limit = parse_cap(cap);
      if (limit < isa) isa = limit;
    }
    return isa;
  }();
  return chosen;
}

std::vector<KernelIsa> supported_kernel_isas() {
  std::vector<KernelIsa> isas = {KernelIsa::Avx2};
  if (detected_kernel_isa() == KernelIsa::Avx512) isas.push_back(KernelIsa::Avx512);
  return isas;
}

void force_kernel_isa(KernelIsa isa) {
  if (isa > detected_kernel_isa()) throw InputError(kernel_isa_name(isa) + " is not supported on this CPU");
  g_forced = isa;
}

bool cpu_has_bf16_dot() {
  if (kEmulatedAvx512) return true;
  __builtin_cpu_init();
  return detected_kernel_isa() == KernelIsa::Avx512 && __builtin_cpu_supports("avx512bf16");
}

bool bf16_dot_product() {
  if (kernel_isa() != KernelIsa::Avx512) return false;
  if (g_forced_bf16_dot) return *g_forced_bf16_dot;
  return cpu_has_bf16_dot() && !bf16_dot_held();
}

std::string bf16_kernels_name() {
  if (bf16_dot_product()) return "vdpbf16ps";
  return kernel_isa() == KernelIsa::Avx512 ? "avx512-convert" : "avx2-convert";
}

void force_bf16_dot(bool use) {
  if (use && !cpu_has_bf16_dot()) throw InputError("vdpbf16ps (AVX512_BF16) is not supported on this CPU");
  g_forced_bf16_dot = use;
}

}  // namespace xfb
