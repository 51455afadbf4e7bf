#include "apps/report/files.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <stdexcept>

#include <nlohmann/json.hpp>

#include "lib/core/errors.hpp"

namespace xfb {
namespace fs = std::filesystem;
namespace {

std::string system_error_text(int error) { return std::strerror(error); }

// The file an output path names after checking its type: the path itself, or a symbolic link's
// regular target. Throws InputError for directories and anything that is not a regular file.
fs::path output_target(const std::string& path) {
  if (path.empty()) throw InputError("the output path is empty");
  std::error_code error;
  const fs::file_status link = fs::symlink_status(path, error);
  if (!fs::exists(link)) return path;
  const fs::file_status target = fs::status(path, error);
  const bool via_link = fs::is_symlink(link);
  if (via_link && !fs::exists(target)) throw InputError("output " + path + " is a dangling symbolic link");
  if (fs::is_directory(target)) throw InputError("output " + path + " is a directory");
  if (!fs::is_regular_file(target))
    throw InputError("output " + path + (via_link ? " is a symbolic link to something that is" : " is") +
                     " not a regular file (a FIFO, device or socket)");
  return via_link ? fs::canonical(path, error) : fs::path(path);
}

fs::path folder_of(const fs::path& file) { return file.has_parent_path() ? file.parent_path() : fs::path("."); }

mode_t new_file_mode(const fs::path& target) {
  struct stat existing {};
  if (::stat(target.c_str(), &existing) == 0) return existing.st_mode & 07777;
  const mode_t mask = ::umask(0);
  ::umask(mask);
  return 0666 & ~mask;
}

bool write_all(int fd, const std::string& content) {
  std::size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd, content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      if (n == 0) errno = EIO;
      return false;
    }
    done += static_cast<std::size_t>(n);
  }
  return true;
}

// Creates the temporary next to `target`; throws InputError when the folder is missing or not
// writable (the user's to fix), std::runtime_error otherwise.
int create_temporary(const fs::path& target, std::string& name) {
  const fs::path folder = folder_of(target);
  name = (folder / ("." + target.filename().string() + ".XXXXXX")).string();
  const int fd = ::mkstemp(name.data());
  if (fd >= 0) return fd;
  const int error = errno;
  std::error_code status;
  if ((error == ENOENT || error == ENOTDIR) && !fs::is_directory(folder, status))
    throw InputError("output folder " + folder.string() + " does not exist");
  if (error == ENOENT || error == EACCES || error == EROFS || error == EPERM)  // ENOENT: /proc, say
    throw InputError("cannot write in folder " + folder.string() + ": " + system_error_text(error));
  throw std::runtime_error("cannot create a temporary file in " + folder.string() + ": " + system_error_text(error));
}

// Writes, flushes and closes `fd`; returns 0 or the errno of the first failure.
int fill_and_close(int fd, const std::string& content, mode_t mode) {
  int error = 0;
  if (::fchmod(fd, mode) != 0 || !write_all(fd, content) || ::fsync(fd) != 0) error = errno;
  if (::close(fd) != 0 && error == 0) error = errno;
  return error;
}

// The registry of unfinished outputs the interrupt handler removes: fixed storage, no allocation,
// read by the handler with only async-signal-safe calls. An entry is complete before the depth
// counts it.
struct UnfinishedEntry {
  std::array<char, 4096> path{};
  bool folder = false;
};
std::array<UnfinishedEntry, 8> g_unfinished;
volatile std::sig_atomic_t g_unfinished_depth = 0;

// Unlinks every entry of the folder `fd` (getdents64 and unlinkat: system calls, safe in a handler).
void remove_folder_entries(int fd) {
  alignas(8) std::array<char, 4096> buffer{};
  for (;;) {
    const long n = ::syscall(SYS_getdents64, fd, buffer.data(), buffer.size());
    if (n <= 0) return;
    bool removed = false;
    for (long at = 0; at < n;) {
      const auto* entry = reinterpret_cast<const struct dirent64*>(buffer.data() + at);
      const char* name = entry->d_name;
      const bool dots = name[0] == '.' && (name[1] == '\0' || (name[1] == '.' && name[2] == '\0'));
      if (!dots && ::unlinkat(fd, name, 0) == 0) removed = true;
      at += entry->d_reclen;
    }
    if (!removed) return;  // nothing more this pass could remove
    ::lseek(fd, 0, SEEK_SET);
  }
}

extern "C" void remove_unfinished_and_reraise(int signal_number) {
  for (std::sig_atomic_t i = g_unfinished_depth; i-- > 0;) {
    const UnfinishedEntry& entry = g_unfinished[static_cast<std::size_t>(i)];
    if (!entry.folder) {
      ::unlink(entry.path.data());
      continue;
    }
    const int fd = ::open(entry.path.data(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd >= 0) {
      remove_folder_entries(fd);
      ::close(fd);
    }
    ::rmdir(entry.path.data());
  }
  g_unfinished_depth = 0;
  std::signal(signal_number, SIG_DFL);
  std::raise(signal_number);
}

void sync_folder(const fs::path& folder) {
  const int fd = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;
  ::fsync(fd);  // best effort: the rename is already visible
  ::close(fd);
}

}  // namespace

std::string read_input_file(const std::string& path) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);  // a FIFO opens without a writer
  if (fd < 0) {
    const int error = errno;
    if (error == ENOENT) throw InputError(path + ": no such file");
    throw InputError(path + ": cannot open: " + system_error_text(error));
  }
  struct stat info {};
  std::string problem;
  if (::fstat(fd, &info) != 0)
    problem = "cannot examine: " + system_error_text(errno);
  else if (S_ISDIR(info.st_mode))
    problem = "is a directory, not a file";
  else if (!S_ISREG(info.st_mode))
    problem = "is not a regular file (a FIFO, device or socket)";
  else if (info.st_size == 0)
    problem = "is empty";
  else if (static_cast<std::uintmax_t>(info.st_size) > kMaxInputBytes)
    problem = "is " + std::to_string(info.st_size) + " bytes, more than the " + std::to_string(kMaxInputBytes >> 20) +
              " MiB an input may have";
  std::string content;
  if (problem.empty()) {
    content.resize(static_cast<std::size_t>(info.st_size));
    std::size_t done = 0;
    while (done < content.size()) {
      const ssize_t n = ::read(fd, content.data() + done, content.size() - done);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) problem = "cannot read: " + system_error_text(errno);
      if (n <= 0) break;
      done += static_cast<std::size_t>(n);
    }
    content.resize(done);
  }
  ::close(fd);
  if (!problem.empty()) throw InputError(path + ": " + problem);
  return content;
}

void check_output_path(const std::string& path, const std::vector<std::string>& inputs) {
  if (path == "-") return;
  const fs::path target = output_target(path);
  std::error_code error;
  for (const auto& input : inputs)
    if (fs::equivalent(path, input, error))
      throw InputError("output " + path + " is the input " + input + "; write to another file");
  const fs::path folder = folder_of(target);
  if (!fs::is_directory(folder, error)) throw InputError("output folder " + folder.string() + " does not exist");
  if (::access(folder.c_str(), W_OK) != 0)
    throw InputError("cannot write in folder " + folder.string() + ": " + system_error_text(errno));
}

void write_file_atomically(const std::string& path, const std::string& content) {
  const fs::path target = output_target(path);
  const mode_t mode = new_file_mode(target);
  std::string temporary;
  const int fd = create_temporary(target, temporary);
  int error = 0;
  {
    const UnfinishedOutput unfinished(temporary);
    error = fill_and_close(fd, content, mode);
    if (error == 0 && std::rename(temporary.c_str(), target.c_str()) != 0) error = errno;
  }
  if (error != 0) {
    ::unlink(temporary.c_str());
    throw std::runtime_error("cannot write " + path + ": " + system_error_text(error) + " (the file is unchanged)");
  }
  sync_folder(folder_of(target));
}

void write_output(const std::string& path, const std::string& content, const std::vector<std::string>& inputs) {
  check_output_path(path, inputs);
  if (path != "-") return write_file_atomically(path, content);
  if (std::fwrite(content.data(), 1, content.size(), stdout) != content.size() || std::fflush(stdout) != 0)
    throw std::runtime_error("cannot write to standard output: " + system_error_text(errno));
}

void install_interrupt_cleanup() {
  std::signal(SIGXFSZ, SIG_IGN);
  for (const int signal_number : {SIGINT, SIGTERM, SIGHUP}) {
    struct sigaction current {};
    if (::sigaction(signal_number, nullptr, &current) != 0 || current.sa_handler == SIG_IGN) continue;
    struct sigaction cleanup {};
    cleanup.sa_handler = remove_unfinished_and_reraise;
    sigemptyset(&cleanup.sa_mask);
    for (const int other : {SIGINT, SIGTERM, SIGHUP}) sigaddset(&cleanup.sa_mask, other);  // one cleanup at a time
    ::sigaction(signal_number, &cleanup, nullptr);
  }
}

UnfinishedOutput::UnfinishedOutput(const std::string& path, bool folder) {
  const std::sig_atomic_t depth = g_unfinished_depth;
  if (depth >= static_cast<std::sig_atomic_t>(g_unfinished.size()) || path.size() >= g_unfinished[0].path.size())
    return;
  UnfinishedEntry& entry = g_unfinished[static_cast<std::size_t>(depth)];
  std::memcpy(entry.path.data(), path.c_str(), path.size() + 1);
  entry.folder = folder;
  g_unfinished_depth = depth + 1;
  registered_ = true;
}

UnfinishedOutput::~UnfinishedOutput() {
  if (registered_) g_unfinished_depth = g_unfinished_depth - 1;
}

std::string quoted(const std::string& text, std::size_t limit) {
  std::size_t end = std::min(text.size(), limit);
  while (end > 0 && end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) --end;
  std::string literal =
      nlohmann::json(text.substr(0, end)).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (end < text.size()) literal.insert(literal.size() - 1, "…");
  return literal;
}

}  // namespace xfb
