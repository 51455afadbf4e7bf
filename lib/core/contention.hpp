#pragma once
// Contention detection for timed samples: did the point's threads wait for a CPU while timed?
//
// Per sample, the probe reads (outside the timed region, before and after):
//   wall      the sample's wall time (the harness's clock);
//   cpu       process CPU time (CLOCK_PROCESS_CPUTIME_ID), all threads;
//   wait      run-queue wait of the process's threads: the sum over /proc/self/task/*/schedstat
//             of "time spent waiting on a run queue" (runnable, not running), nanoseconds;
//   host      busy time of all CPUs from /proc/stat (user, nice, system, irq, softirq, steal)
//             less this process's own from /proc/self/stat (utime, stime): clock ticks (10 ms),
//             so only meaningful summed over many samples.
//   steal     the hypervisor's steal of all CPUs from /proc/stat (ticks): time a vCPU was ready
//             but the host ran something else — invisible to the guest's run queues.
// A sample is descheduled when wait > max(kWaitFloorNs, kWaitFraction · wall), or steal is: one
// OpenMP thread that waits that long stalls every barrier behind it (steal: see settle_after).
// Where schedstat is unavailable the probe falls back to involuntary context switches
// (getrusage): any during the sample marks it.
//   cpu_ratio  = cpu / (wall · threads)   (below 1 also for serial sections: reported, not used;
//                the CPU clock is read last in start() and first in stop(), so the probe's own
//                reads stay outside; other threads' CPU time is accounted at scheduler ticks, so a
//                µs sample's ratio at 2+ threads is noisy and can exceed 1)
//   host_busy  = Σ other busy / Σ (wall · CPUs) over all samples, clamped to [0, 1]
#include <cstdint>
#include <string>
#include <vector>

namespace xfb {

// Quiet 2-vCPU VMs show run-queue waits of ≤ 65 µs per sample at the 99th percentile (wake-ups
// of idle vCPUs); a busy neighbour costs whole time slices (≈ 4 ms).
inline constexpr double kWaitFloorNs = 100e3;  // run-queue wait always tolerated per sample
inline constexpr double kWaitFraction = 0.05;  // of the sample's wall time

struct SampleContention {
  double cpu_ns = 0;
  double wait_ns = 0;
  std::int64_t involuntary_switches = 0;
  double other_busy_ns = 0;  // all CPUs' busy time less this process's, from clock ticks
  double steal_ns = 0;       // all CPUs' steal, from clock ticks
  bool descheduled = false;
};

// True when a sample with this wall time and these readings counts as descheduled.
bool is_descheduled(double wall_ns, const SampleContention& sample, bool schedstat_available);

class ContentionProbe {
 public:
  // Finds the process's threads now (call after warm-up, once the OpenMP pool exists).
  ContentionProbe();
  ~ContentionProbe();
  ContentionProbe(const ContentionProbe&) = delete;
  ContentionProbe& operator=(const ContentionProbe&) = delete;

  bool schedstat_available() const { return !task_fds_.empty(); }
  void start();                           // snapshot before a sample
  SampleContention stop(double wall_ns);  // readings since start(), judged

 private:
  struct Snapshot {
    double cpu_ns = 0, wait_ns = 0, other_busy_ns = 0, steal_ns = 0;
    std::int64_t involuntary_switches = 0;
  };
  Snapshot snapshot() const;
  std::vector<int> task_fds_;
  int stat_fd_ = -1;       // /proc/stat
  int self_stat_fd_ = -1;  // /proc/self/stat
  Snapshot begin_;
};

// What a whole timing loop saw, for the row.
struct ContentionSummary {
  double cpu_ratio = 0;     // median over clean samples
  double host_busy = 0;     // fraction of all CPUs used by other processes and steal while timed
  double load_average = 0;  // 1-minute load average after timing
};
ContentionSummary summarize_contention(const std::vector<double>& wall_ns, const std::vector<SampleContention>& samples,
                                       int threads);

// After a process that used gigabytes exits, a VM with free page reporting (virtio-balloon) hands
// the memory back to the host over several seconds, and the host's work shows up as steal in
// whatever runs next — only while it runs: an idle guest sees none, so the wait cannot be probed
// for. Measured on the AVX-512 class: after vanilla's 8.4 GB run at N = 16384, a busy guest saw
// steal bursts of up to a third of both CPUs for ~12 s, exact-tiled timed 10–15% slower; after 8 s
// idle still stolen from, after 12 s not. So the child runs of `sweep` and `ab` start only
// kSettleSecondsPerGiB per GiB of the previous child's peak RSS (from kSettleAfterBytes, at most
// kSettleMaxS) after it. settle_after(peak_rss_bytes) sleeps that long and returns the seconds.
inline constexpr std::int64_t kSettleAfterBytes = std::int64_t{1} << 30;
inline constexpr double kSettleSecondsPerGiB = 1.5;
inline constexpr double kSettleMaxS = 30;
double settle_seconds(std::int64_t peak_rss_bytes);
double settle_after(std::int64_t peak_rss_bytes);

// "7 of 12 timed samples waited for a CPU (…); host busy 48%, load 1.9"
std::string contention_reason(std::int64_t contended, std::int64_t total, const ContentionSummary& summary);

}  // namespace xfb
