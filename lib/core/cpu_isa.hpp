#pragma once
// Which vector ISA the project's own hand-written kernels run: chosen once at run time from CPUID
// (the way oneDNN and XNNPACK dispatch), capped by XFBENCH_MAX_ISA=avx2|avx512 so every compiled
// path can be tested on one host. Reports record the choice (`kernel_isa` in the context and rows).
// oneDNN's own choice is separate (ONEDNN_MAX_CPU_ISA, `onednn_isa`).
#include <string>
#include <vector>

namespace xfb {

enum class KernelIsa { Avx2, Avx512 };  // ascending: a cap keeps everything at or below it

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

}  // namespace xfb
