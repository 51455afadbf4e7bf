// Unfinished outputs on interruption (apps/report/files.hpp): install_interrupt_cleanup() and
// UnfinishedOutput, in forked children that are sent the signal, so the handlers never touch the
// test process; and a write past the file size limit failing instead of killing the process.
#include <doctest/doctest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>

#include "apps/report/files.hpp"
#include "lib/core/npy.hpp"
#include "lib/core/tensor.hpp"

using namespace xfb;
namespace fs = std::filesystem;

namespace {

// A fresh folder under the system's temporary folder, removed with the object.
struct Scratch {
  fs::path root;
  Scratch() {
    std::string pattern = (fs::temp_directory_path() / "xfbench-files-XXXXXX").string();
    REQUIRE(::mkdtemp(pattern.data()) != nullptr);
    root = pattern;
  }
  ~Scratch() {
    std::error_code ignored;
    fs::remove_all(root, ignored);
  }
};

void touch(const fs::path& file) { std::ofstream(file) << "partial"; }

// Runs `body` in a forked child; returns the child's wait status.
int in_child(const std::function<void()>& body) {
  const pid_t pid = ::fork();
  REQUIRE(pid >= 0);
  if (pid == 0) {
    body();
    ::_exit(0);
  }
  int status = 0;
  REQUIRE(::waitpid(pid, &status, 0) == pid);
  return status;
}

}  // namespace

TEST_SUITE("files") {
  TEST_CASE("a signal removes the registered file and folder, then ends the process as the signal does") {
    for (const int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
      CAPTURE(signal_number);
      Scratch scratch;
      const fs::path folder = scratch.root / "dump.partial-1", file = scratch.root / ".report.json.XYZ";
      fs::create_directory(folder);
      touch(folder / "q.npy");
      touch(folder / ".manifest.json.ABC");
      touch(file);
      const fs::path kept = scratch.root / "kept.json";  // not registered: stays
      touch(kept);
      const int status = in_child([&] {
        install_interrupt_cleanup();
        const UnfinishedOutput dump(folder.string(), /*folder=*/true);
        const UnfinishedOutput temporary(file.string());
        std::raise(signal_number);
        ::_exit(0);  // not reached: the signal's default action ends the child
      });
      CHECK(WIFSIGNALED(status));
      CHECK(WTERMSIG(status) == signal_number);
      CHECK_FALSE(fs::exists(folder));
      CHECK_FALSE(fs::exists(file));
      CHECK(fs::exists(kept));
    }
  }

  TEST_CASE("an output no longer registered is left alone, and an ignored signal stays ignored") {
    Scratch scratch;
    const fs::path written = scratch.root / "written.json", pending = scratch.root / ".pending.json.XYZ";
    touch(written);
    touch(pending);
    const int status = in_child([&] {
      std::signal(SIGHUP, SIG_IGN);  // as under nohup
      install_interrupt_cleanup();
      { const UnfinishedOutput finished(written.string()); }
      const UnfinishedOutput unfinished(pending.string());
      std::raise(SIGHUP);  // ignored: nothing removed, the process goes on
      ::_exit(fs::exists(pending) ? 7 : 8);
    });
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 7);
    const int interrupted = in_child([&] {
      install_interrupt_cleanup();
      { const UnfinishedOutput finished(written.string()); }
      std::raise(SIGTERM);
      ::_exit(0);
    });
    CHECK(WIFSIGNALED(interrupted));
    CHECK(fs::exists(written));
  }

  TEST_CASE("past the file size limit a write fails with an error instead of killing the process") {
    Scratch scratch;
    const fs::path file = scratch.root / "q.npy";
    const int status = in_child([&] {
      install_interrupt_cleanup();
      const rlimit limit{4096, 4096};
      ::setrlimit(RLIMIT_FSIZE, &limit);
      try {
        write_npy(file.string(), Tensor::bhnd(1, 1, 64, 64));  // 16 KiB of data
      } catch (const std::runtime_error&) {
        ::_exit(3);
      }
      ::_exit(0);
    });
    REQUIRE(WIFEXITED(status));
    CHECK(WEXITSTATUS(status) == 3);
  }
}
