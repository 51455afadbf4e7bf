#include "lib/core/dnnl_context.hpp"

#include <omp.h>

#include <mutex>
#include <stdexcept>
#include <string>
#include <system_error>
#include <thread>
#include <vector>

#include "lib/core/memory_tracker.hpp"

namespace xfb {

DnnlContext& DnnlContext::instance() {
  static DnnlContext context;
  return context;
}

DnnlContext::DnnlContext() : engine_(dnnl::engine::kind::cpu, 0), stream_(engine_) { default_threads(); }

int DnnlContext::default_threads() {
  static const int threads = omp_get_max_threads();
  return threads;
}

namespace {
// Starting a team of `threads` can fail (ulimit -u, or ulimit -v against 8 MiB stacks), and libgomp
// then prints its own text and exits with status 1 from inside a parallel region. So, once per
// larger team, threads − 1 threads with the default stack (as libgomp's) are started and held
// together as a team is, and a failure becomes an exception that names --threads.
void check_team_can_start(int threads) {
  static int checked = 1;
  if (threads <= checked) return;
  std::mutex gate;
  gate.lock();
  std::vector<std::thread> team;
  std::string failure;
  try {
    for (int i = 1; i < threads; ++i) team.emplace_back([&gate] { const std::lock_guard<std::mutex> hold(gate); });
  } catch (const std::system_error& e) {
    failure = e.code().message();
  }
  gate.unlock();
  for (auto& thread : team) thread.join();
  if (!failure.empty())
    throw std::runtime_error("cannot start " + std::to_string(threads) + " threads (--threads): " + failure);
  checked = threads;
}
}  // namespace

void DnnlContext::set_threads(int threads) {
  if (threads <= 0) return;
  check_team_can_start(threads);
  omp_set_num_threads(threads);
}

int DnnlContext::threads() const { return omp_get_max_threads(); }

const DnnlContext::CachedPrimitive& DnnlContext::primitive(
    const std::string& key, const std::function<std::pair<dnnl::primitive, dnnl::memory::desc>()>& make) {
  auto found = cache_.find(key);
  if (found != cache_.end()) return found->second;
  auto [prim, scratch_desc] = make();
  ++created_;
  CachedPrimitive entry{std::move(prim), static_cast<std::int64_t>(scratch_desc.get_size())};
  reserve_scratchpad(entry.scratchpad_bytes);
  return cache_.emplace(key, std::move(entry)).first->second;
}

void* DnnlContext::reserve_scratchpad(std::int64_t bytes) {
  if (bytes > scratch_bytes_) {
    auto& tracker = MemoryTracker::instance();
    tracker.release(scratch_, static_cast<std::size_t>(scratch_bytes_), MemoryPool::Library);
    scratch_ = nullptr;
    scratch_ = tracker.allocate(static_cast<std::size_t>(bytes), MemoryPool::Library);
    scratch_bytes_ = bytes;
  }
  return scratch_;
}

dnnl::memory DnnlContext::scratchpad_memory(const CachedPrimitive& p) {
  dnnl::memory::desc desc({std::max<std::int64_t>(p.scratchpad_bytes, 1)}, dnnl::memory::data_type::u8,
                          dnnl::memory::format_tag::a);
  return dnnl::memory(desc, engine_, scratch_);
}

void DnnlContext::clear_cache() {
  cache_.clear();
  MemoryTracker::instance().release(scratch_, static_cast<std::size_t>(scratch_bytes_), MemoryPool::Library);
  scratch_ = nullptr;
  scratch_bytes_ = 0;
}

}  // namespace xfb
