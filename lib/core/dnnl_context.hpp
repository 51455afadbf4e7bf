#pragma once
// The process's oneDNN CPU engine and stream, thread count, primitive cache and user-mode
// scratchpad. Primitives are created on first use of a shape (in untimed warm-up) and found by
// key afterwards; `primitives_created()` lets the harness prove no creation happened while timed.
// The scratchpad is one tracked buffer, sized to the largest cached primitive's need.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>

#include <oneapi/dnnl/dnnl.hpp>

namespace xfb {

class DnnlContext {
 public:
  static DnnlContext& instance();

  dnnl::engine& engine() { return engine_; }
  dnnl::stream& stream() { return stream_; }

  // Governs oneDNN (OpenMP runtime) and the project's own OpenMP loops. Throws std::runtime_error
  // when a team of `threads` cannot be started (a resource limit), before OpenMP would try.
  void set_threads(int threads);
  int threads() const;
  // The team size the process started with (OMP_NUM_THREADS, else every core): the default of
  // --threads, read once before anything sets the team.
  static int default_threads();

  struct CachedPrimitive {
    dnnl::primitive primitive;
    std::int64_t scratchpad_bytes = 0;
  };
  // Returns the primitive cached under `key`, creating it with `make` on a miss.
  const CachedPrimitive& primitive(const std::string& key,
                                   const std::function<std::pair<dnnl::primitive, dnnl::memory::desc>()>& make);
  // Scratchpad memory large enough for every cached primitive.
  dnnl::memory scratchpad_memory(const CachedPrimitive& p);
  // The scratchpad grown to at least `bytes` (library pool), for the project's own stand-ins of
  // primitives oneDNN lacks on this CPU (ops' bf16 matmul below AVX-512). It is shared with the
  // primitives: never in use by two operations at once (each waits on the stream before returning).
  void* reserve_scratchpad(std::int64_t bytes);

  std::int64_t primitives_created() const { return created_; }
  std::int64_t scratchpad_bytes() const { return scratch_bytes_; }
  // Drops every primitive and the scratchpad (tests use it to measure memory from scratch).
  void clear_cache();

 private:
  DnnlContext();
  dnnl::engine engine_;
  dnnl::stream stream_;
  std::unordered_map<std::string, CachedPrimitive> cache_;
  std::int64_t created_ = 0;
  void* scratch_ = nullptr;
  std::int64_t scratch_bytes_ = 0;
};

}  // namespace xfb
