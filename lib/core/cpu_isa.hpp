#pragma once
// Which vector ISA the project's own hand-written kernels run: chosen once at run time from CPUID
// (the way oneDNN and XNNPACK dispatch), capped by XFBENCH_MAX_ISA=avx2|avx512 so every compiled
// path can be tested on one host. Reports record the choice (`kernel_isa` in the context and rows).
// oneDNN's own choice is separate (ONEDNN_MAX_CPU_ISA, `onednn_isa`).
#include <string>
#include <vector>

namespace xfb {

enum class KernelIsa { Avx2, Avx512 };  // ascending: a cap keeps everything at or below it

// An XFBENCH_EMULATE_AVX512 build (tests only): the 512-bit kernels' instructions are emulated
// (lib/core/avx512_emulation.hpp) and the host counts as having AVX-512 and AVX512_BF16 whatever
// its CPUID says. Reports record it (`kernels_emulated` in the context).
#ifdef XFB_EMULATE_AVX512
inline constexpr bool kEmulatedAvx512 = true;
#else
inline constexpr bool kEmulatedAvx512 = false;
#endif

std::string kernel_isa_name(KernelIsa isa);
// The best ISA this CPU and this build support (Avx2 is the floor the project requires).
KernelIsa detected_kernel_isa();
// detected_kernel_isa() capped by XFBENCH_MAX_ISA (InputError on an unknown value), or by a
// force_kernel_isa() call.
KernelIsa kernel_isa();
// Every ISA kernel_isa() could return on this host, ascending (tests run each).
std::vector<KernelIsa> supported_kernel_isas();
// Forces the ISA for this process (tests); must be supported by the host.
void force_kernel_isa(KernelIsa isa);

// The bf16 tile kernels' pair product (lib/core/tile_kernels_bf16.hpp): vdpbf16ps when the kernels
// run 512-bit (kernel_isa()) and the CPU has AVX512_BF16, unless XFBENCH_BF16_DOT=0 (or a
// force_bf16_dot(false) call) holds them to convert-and-FMA; else convert-and-FMA at kernel_isa()'s
// width. Reports record it (`bf16_kernels`: bf16_kernels_name()).
bool bf16_dot_product();
std::string bf16_kernels_name();  // "vdpbf16ps", "avx512-convert" or "avx2-convert"
bool cpu_has_bf16_dot();          // AVX512_BF16 (and AVX-512) on this CPU
// Forces the choice for this process (tests): true needs cpu_has_bf16_dot() and 512-bit kernels.
void force_bf16_dot(bool use);

}  // namespace xfb
