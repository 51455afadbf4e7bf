#include "lib/core/dnnl_context.hpp"

#include <omp.h>

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

void DnnlContext::set_threads(int threads) {
  if (threads > 0) omp_set_num_threads(threads);
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
