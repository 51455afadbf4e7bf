#pragma once
// Runs this executable again as a child with the given arguments, capturing stdout and stderr,
// killing it after a timeout, and reporting its exit status and peak RSS.
#include <cstdint>
#include <string>
#include <vector>

namespace xfb {

struct ChildResult {
  int exit_code = -1;  // when it exited normally
  int signal = 0;      // when a signal ended it
  bool timed_out = false;
  std::string out, err;
  std::int64_t peak_rss_bytes = 0;
};

// The running executable's path (/proc/self/exe resolved; that link itself if it cannot be read):
// what run_self starts, an input no output may replace.
std::string self_path();
ChildResult run_self(const std::vector<std::string>& args, double timeout_s);
// The same for another executable (a path); exit code 127 when it cannot be started.
ChildResult run_program(const std::string& program, const std::vector<std::string>& args, double timeout_s);

}  // namespace xfb
