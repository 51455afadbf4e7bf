#include "lib/core/contention.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <thread>

#include "lib/core/stats.hpp"

namespace xfb {
namespace {

// Reads a small /proc file from offset 0 into `buffer`; returns the length, 0 on failure.
std::size_t read_proc(int fd, char* buffer, std::size_t size) {
  const ssize_t got = pread(fd, buffer, size - 1, 0);
  if (got <= 0) return 0;
  buffer[got] = '\0';
  return static_cast<std::size_t>(got);
}

double ticks_to_ns(unsigned long long ticks) {
  return static_cast<double>(ticks) * 1e9 / static_cast<double>(sysconf(_SC_CLK_TCK));
}

double process_cpu_ns() {
  timespec ts{};
  clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) * 1e9 + static_cast<double>(ts.tv_nsec);
}

std::vector<int> open_task_schedstats() {
  std::vector<int> fds;
  DIR* dir = opendir("/proc/self/task");
  if (dir == nullptr) return fds;
  while (const dirent* entry = readdir(dir)) {
    if (entry->d_name[0] == '.') continue;
    const std::string path = std::string("/proc/self/task/") + entry->d_name + "/schedstat";
    const int fd = open(path.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd >= 0) fds.push_back(fd);
  }
  closedir(dir);
  // A kernel without schedstats reports zeros for every field: treat as unavailable.
  char buffer[128];
  bool any_runtime = false;
  for (int fd : fds)
    if (read_proc(fd, buffer, sizeof buffer) > 0 && std::strtoull(buffer, nullptr, 10) > 0) any_runtime = true;
  if (!any_runtime) {
    for (int fd : fds) close(fd);
    fds.clear();
  }
  return fds;
}

}  // namespace

bool is_descheduled(double wall_ns, const SampleContention& sample, bool schedstat_available) {
  const double tolerated = std::max(kWaitFloorNs, kWaitFraction * wall_ns);
  if (sample.steal_ns > tolerated) return true;
  if (!schedstat_available) return sample.involuntary_switches > 0;
  return sample.wait_ns > tolerated;
}

ContentionProbe::ContentionProbe()
    : task_fds_(open_task_schedstats()),
      stat_fd_(open("/proc/stat", O_RDONLY | O_CLOEXEC)),
      self_stat_fd_(open("/proc/self/stat", O_RDONLY | O_CLOEXEC)) {}

ContentionProbe::~ContentionProbe() {
  for (int fd : task_fds_) close(fd);
  if (stat_fd_ >= 0) close(stat_fd_);
  if (self_stat_fd_ >= 0) close(self_stat_fd_);
}

ContentionProbe::Snapshot ContentionProbe::snapshot() const {
  Snapshot s;
  char buffer[512];
  for (int fd : task_fds_) {
    if (read_proc(fd, buffer, sizeof buffer) == 0) continue;  // the thread has exited
    char* rest = nullptr;
    std::strtoull(buffer, &rest, 10);  // time on a CPU
    s.wait_ns += static_cast<double>(std::strtoull(rest, nullptr, 10));
  }
  if (stat_fd_ >= 0 && read_proc(stat_fd_, buffer, sizeof buffer) > 0) {
    // "cpu  user nice system idle iowait irq softirq steal …" in ticks.
    unsigned long long field[8] = {};
    if (std::sscanf(buffer, "cpu %llu %llu %llu %llu %llu %llu %llu %llu", &field[0], &field[1], &field[2], &field[3],
                    &field[4], &field[5], &field[6], &field[7]) == 8) {
      const unsigned long long busy = field[0] + field[1] + field[2] + field[5] + field[6] + field[7];
      s.other_busy_ns = ticks_to_ns(busy);
      s.steal_ns = ticks_to_ns(field[7]);
    }
  }
  if (self_stat_fd_ >= 0 && read_proc(self_stat_fd_, buffer, sizeof buffer) > 0) {
    // "pid (comm) state ppid … utime stime …": utime and stime are fields 14 and 15, 12 and 13
    // after the command's closing parenthesis.
    const char* after = std::strrchr(buffer, ')');
    unsigned long long utime = 0, stime = 0;
    if (after != nullptr &&
        std::sscanf(after + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime, &stime) == 2)
      s.other_busy_ns -= ticks_to_ns(utime + stime);
  }
  rusage usage{};
  getrusage(RUSAGE_SELF, &usage);
  s.involuntary_switches = usage.ru_nivcsw;
  s.cpu_ns = process_cpu_ns();
  return s;
}

void ContentionProbe::start() { begin_ = snapshot(); }

SampleContention ContentionProbe::stop(double wall_ns) {
  // The CPU clock before the /proc reads (snapshot() reads it after them, right for start()): the
  // reads take tens of µs, which the sample's wall time does not hold.
  const double cpu_ns = process_cpu_ns();
  const Snapshot end = snapshot();
  SampleContention sample;
  sample.cpu_ns = cpu_ns - begin_.cpu_ns;
  sample.wait_ns = end.wait_ns - begin_.wait_ns;
  sample.involuntary_switches = end.involuntary_switches - begin_.involuntary_switches;
  sample.other_busy_ns = end.other_busy_ns - begin_.other_busy_ns;
  sample.steal_ns = end.steal_ns - begin_.steal_ns;
  sample.descheduled = is_descheduled(wall_ns, sample, schedstat_available());
  return sample;
}

double settle_seconds(std::int64_t peak_rss_bytes) {
  if (peak_rss_bytes < kSettleAfterBytes) return 0;
  return std::min(kSettleMaxS, kSettleSecondsPerGiB * static_cast<double>(peak_rss_bytes) / (1 << 30));
}

double settle_after(std::int64_t peak_rss_bytes) {
  const double seconds = settle_seconds(peak_rss_bytes);
  if (seconds > 0) std::this_thread::sleep_for(std::chrono::duration<double>(seconds));
  return seconds;
}

ContentionSummary summarize_contention(const std::vector<double>& wall_ns, const std::vector<SampleContention>& samples,
                                       int threads) {
  ContentionSummary summary;
  std::vector<double> clean_ratios;
  double wall = 0, other = 0;
  for (std::size_t i = 0; i < samples.size() && i < wall_ns.size(); ++i) {
    wall += wall_ns[i];
    other += samples[i].other_busy_ns;
    if (!samples[i].descheduled && wall_ns[i] > 0 && threads > 0)
      clean_ratios.push_back(samples[i].cpu_ns / (wall_ns[i] * threads));
  }
  if (!clean_ratios.empty()) summary.cpu_ratio = median_of(clean_ratios);
  const long cpus = sysconf(_SC_NPROCESSORS_ONLN);
  if (wall > 0 && cpus > 0) summary.host_busy = std::clamp(other / (wall * static_cast<double>(cpus)), 0.0, 1.0);
  double load[1] = {0};
  if (getloadavg(load, 1) == 1) summary.load_average = load[0];
  return summary;
}

std::string contention_reason(std::int64_t contended, std::int64_t total, const ContentionSummary& summary) {
  char text[160];
  std::snprintf(
      text, sizeof text, "contended: %lld of %lld timed samples waited for a CPU; host busy %.0f%%, load average %.2f",
      static_cast<long long>(contended), static_cast<long long>(total), 100 * summary.host_busy, summary.load_average);
  return text;
}

}  // namespace xfb
