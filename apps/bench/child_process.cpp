#include "apps/bench/child_process.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <stdexcept>

namespace xfb {
namespace {
void close_fd(int& fd) {
  if (fd >= 0) close(fd);
  fd = -1;
}
}  // namespace

std::string self_path() {
  std::error_code error;
  const std::filesystem::path resolved = std::filesystem::read_symlink("/proc/self/exe", error);
  return error ? std::string("/proc/self/exe") : resolved.string();
}

ChildResult run_self(const std::vector<std::string>& args, double timeout_s) {
  return run_program("/proc/self/exe", args, timeout_s);
}

ChildResult run_program(const std::string& program, const std::vector<std::string>& args, double timeout_s) {
  int out_pipe[2], err_pipe[2];
  if (pipe(out_pipe) != 0 || pipe(err_pipe) != 0) throw std::runtime_error("pipe() failed");
  std::vector<std::string> argv_storage = {"xfbench"};
  argv_storage.insert(argv_storage.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& arg : argv_storage) argv.push_back(arg.data());
  argv.push_back(nullptr);

  const pid_t pid = fork();
  if (pid < 0) throw std::runtime_error("fork() failed");
  if (pid == 0) {
    // Bound the child's address space by physical memory: an oversized point fails its allocation
    // (and becomes an error row) instead of waking the kernel's OOM killer.
    // (Not under AddressSanitizer, whose shadow memory needs a huge address space.)
#if !defined(__SANITIZE_ADDRESS__)
    const rlim_t physical = static_cast<rlim_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<rlim_t>(sysconf(_SC_PAGESIZE));
    const rlimit limit{physical, physical};
    setrlimit(RLIMIT_AS, &limit);
#endif
    dup2(out_pipe[1], STDOUT_FILENO);
    dup2(err_pipe[1], STDERR_FILENO);
    close(out_pipe[0]);
    close(err_pipe[0]);
    close(out_pipe[1]);
    close(err_pipe[1]);
    execv(program.c_str(), argv.data());
    _exit(127);
  }
  close(out_pipe[1]);
  close(err_pipe[1]);
  int fds[2] = {out_pipe[0], err_pipe[0]};
  ChildResult result;
  std::string* sinks[2] = {&result.out, &result.err};
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_s);
  while (fds[0] >= 0 || fds[1] >= 0) {
    pollfd polls[2];
    nfds_t count = 0;
    int which[2];
    for (int i = 0; i < 2; ++i)
      if (fds[i] >= 0) {
        polls[count] = {fds[i], POLLIN, 0};
        which[count++] = i;
      }
    const auto remaining =
        std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now());
    if (remaining.count() <= 0) {
      result.timed_out = true;
      kill(pid, SIGKILL);
      break;
    }
    const int ready = poll(polls, count, static_cast<int>(std::min<long>(remaining.count(), 200)));
    if (ready < 0) continue;
    for (nfds_t i = 0; i < count; ++i) {
      if (!(polls[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      char buffer[65536];
      const ssize_t got = read(fds[which[i]], buffer, sizeof buffer);
      if (got > 0)
        sinks[which[i]]->append(buffer, static_cast<std::size_t>(got));
      else
        close_fd(fds[which[i]]);
    }
  }
  close_fd(fds[0]);
  close_fd(fds[1]);
  int status = 0;
  rusage usage{};
  wait4(pid, &status, 0, &usage);
  result.peak_rss_bytes = static_cast<std::int64_t>(usage.ru_maxrss) * 1024;
  if (WIFEXITED(status)) result.exit_code = WEXITSTATUS(status);
  if (WIFSIGNALED(status)) result.signal = WTERMSIG(status);
  return result;
}

}  // namespace xfb
