#pragma once
// Reading inputs and writing outputs safely: every command that reads a report or writes a file
// goes through these, so no input can hang a command (a FIFO), exhaust memory (a huge file) or
// surface a library's internal text, and no output can clobber an input or leave half a file.
#include <cstdint>
#include <string>
#include <vector>

namespace xfb {

// Inputs larger than this are refused before they are read.
inline constexpr std::uintmax_t kMaxInputBytes = std::uintmax_t{256} << 20;

// The whole content of a regular, non-empty file of at most kMaxInputBytes. Throws InputError
// with a one-line message naming the path (missing, not readable, a directory, a FIFO or device,
// empty, too large). Never blocks on a FIFO.
std::string read_input_file(const std::string& path);

// Refuses, with an InputError naming the path, an output path that is empty; one of `inputs`
// (the same file after resolving symbolic links, hard links included); a directory; something
// that exists and is not a regular file (FIFO, device, socket, a symbolic link to anything but a
// regular file, a dangling one); or a path whose folder does not exist or is not writable.
// "-" (standard output) passes: callers that cannot write to standard output refuse it themselves.
// Call it before any work, so a refused output costs nothing and creates nothing.
void check_output_path(const std::string& path, const std::vector<std::string>& inputs = {});

// Replaces `path` with `content` atomically: a uniquely named temporary in the same folder
// (mkstemp), every byte written, flushed to disk (fsync), then renamed onto the path; a symbolic
// link to a regular file has its target replaced. Readers see the old content or the new one,
// never a mixture. On any failure (disk full, file size limit, permissions) the temporary is
// removed, the old content is untouched and a std::runtime_error names the path. A new file gets
// the permissions 0666 minus the umask; a replaced one keeps its own. A file size limit is a failure
// only where SIGXFSZ is ignored (install_interrupt_cleanup); otherwise the signal kills the process.
void write_file_atomically(const std::string& path, const std::string& content);

// check_output_path, then write_file_atomically (or standard output for "-").
void write_output(const std::string& path, const std::string& content, const std::vector<std::string>& inputs = {});

// Unfinished outputs removed on interruption. install_interrupt_cleanup() (once, in main) makes
// SIGINT, SIGTERM and SIGHUP (unless ignored, as under nohup) remove every output registered with an
// UnfinishedOutput, newest first, before the signal's default action; and ignores SIGXFSZ, so that a
// write past the file size limit (ulimit -f) fails with EFBIG, an error the writer reports, instead
// of killing the process mid-file.
void install_interrupt_cleanup();

// Registers `path` for removal on interruption while the object lives: a file is unlinked; with
// `folder`, the folder's entries (one level: dump folders are flat) and then the folder. Objects
// are destroyed in reverse order of creation (scopes), as the registry is a stack of at most 8
// entries (beyond that, registration is skipped: best effort). Single-threaded use.
class UnfinishedOutput {
 public:
  explicit UnfinishedOutput(const std::string& path, bool folder = false);
  ~UnfinishedOutput();
  UnfinishedOutput(const UnfinishedOutput&) = delete;
  UnfinishedOutput& operator=(const UnfinishedOutput&) = delete;

 private:
  bool registered_ = false;
};

// `text` as a JSON string literal, at most `limit` bytes of it (cut at a character boundary, "…"
// appended): safe to put in a one-line message whatever the text holds.
std::string quoted(const std::string& text, std::size_t limit = 60);

}  // namespace xfb
