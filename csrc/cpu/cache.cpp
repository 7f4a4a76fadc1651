// A caching layer over torch's CPU allocator for large blocks, installed by fastops.accelerate on the CPU.
//
// torch's CPU allocator is glibc's malloc, which maps every block above its mmap threshold (at most 32 MiB)
// afresh and unmaps it on free, and trims its heap once twice that threshold lies free at the top, so a
// training step page-faults its large activations back in every time: a 64 MiB fp32 copy of the BERT-like
// benchmark's logits took 15.3 ms into a fresh buffer against 3.0 ms into a reused one. This layer keeps
// freed blocks of 8 MiB and more, rounded up to 2 MiB, and hands the smallest one that fits (wasting at
// most a quarter of the request) to a later allocation, as torch's CUDA caching allocator does on the GPU.
// Smaller blocks go to torch's allocator untouched. The cache holds at most `limit` bytes (oldest blocks are
// released first) and is emptied and retried once when an allocation fails.
//
// Measured on the BERT-like step (2-core Xeon): 291-304 ms without, 240-256 ms with; caching only blocks
// above 32 MiB gave 265 ms (the 8-32 MiB ones still churn through glibc's heap). Each block stays its own
// mapping, so nothing fragments: glibc's own remedy (mallopt M_MMAP_MAX=0, every block on the heap) was as
// fast on fixed shapes, but over 120 steps of varying shapes it held 30% more memory than plain malloc and
// kept growing, while this cache stays within its limit there and ran as fast as plain malloc.
//
// fork() copies only the calling thread, so a lock another thread held at that moment stays locked in the
// child for good: with a thread allocating 9 MiB blocks next to a loop forking DataLoader-style workers, 6
// of 300 children hung in take() (issue 10). As glibc's malloc does for its arenas, pthread_atfork handlers
// make fork wait until no thread is inside the cache, and release the locks again on both sides. A block
// between the two locked sections of allocate or give_back belongs to a thread the child does not have;
// the child never sees it, and it costs nothing there (the child never writes it).
#include <cstddef>
#include <cstdint>
#include <list>
#include <mutex>
#include <unordered_map>

#include <pthread.h>

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include "fastops.h"

namespace fastops {
namespace cpu {
namespace {

constexpr size_t kMinCached = size_t(8) << 20;
constexpr size_t kGranule = size_t(2) << 20;

class CachingCPUAllocator final : public c10::Allocator {
 public:
  explicit CachingCPUAllocator(c10::Allocator* base) : base_(base) {}

  c10::DataPtr allocate(size_t n) override {
    if (n < kMinCached) return base_->allocate(n);
    size_t size = (n + kGranule - 1) / kGranule * kGranule;
    void* p = take(size, &size);
    if (p == nullptr) {
      try {
        p = c10::alloc_cpu(size);
      } catch (const c10::Error&) {
        release(0);
        p = c10::alloc_cpu(size);
      }
      std::lock_guard<std::mutex> lock(mu_);
      live_.emplace(p, size);
      ++stats_.misses;
    }
    c10::profiledCPUMemoryReporter().New(p, size);
    return {p, p, &Delete, c10::Device(c10::DeviceType::CPU)};
  }

  // One deleter for everything raw_allocate hands out: blocks of this cache, and small ones that came from
  // the base allocator (passed back to it).
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }

  void copy_data(void* dest, const void* src, size_t count) const override { default_copy_data(dest, src, count); }

  void set_limit(size_t limit) {
    std::lock_guard<std::mutex> lock(mu_);
    limit_ = limit;
    trim_locked(limit_);
  }

  // Frees cached blocks until at most `keep` bytes stay cached.
  void release(size_t keep) {
    std::lock_guard<std::mutex> lock(mu_);
    trim_locked(keep);
  }

  CacheStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    CacheStats s = stats_;
    s.cached_bytes = cached_bytes_;
    s.limit_bytes = limit_;
    return s;
  }

  static CachingCPUAllocator* instance;

  void fork_prepare() { mu_.lock(); }
  void fork_parent() { mu_.unlock(); }

  // The child's cached blocks are copy-on-write views of memory the parent keeps and will reuse, so they
  // are given back here rather than kept. Kept, each page the parent rewrites is copied for it while the
  // child holds the old one: with 256 MiB cached and one child alive, the parent's reuse of those blocks
  // took 354-478 ms instead of 226-299 ms, and the child's private memory grew by 256 MiB (by 0 when
  // dropped), so every worker would hold up to `limit` of the parent's stale free blocks. The child gains
  // nothing from keeping them: its first write to a kept page is a copy fault, no cheaper than the
  // zero-fill fault of a fresh block. Blocks live at the fork stay in live_: the child frees the ones its
  // own thread still holds through give_back as usual. glibc's malloc is usable again when this runs.
  void fork_child() {
    trim_locked(0);
    mu_.unlock();  // locked by fork_prepare in the thread the child is a copy of
  }

 private:
  struct Block {
    size_t size;
    void* ptr;
  };

  static void Delete(void* p) { instance->give_back(p); }

  // The smallest cached block that holds `size` and wastes at most a quarter of it, or null.
  void* take(size_t size, size_t* got) {
    std::lock_guard<std::mutex> lock(mu_);
    auto best = cached_.end();
    for (auto it = cached_.begin(); it != cached_.end(); ++it) {  // at most limit / 8 MiB blocks
      if (it->size >= size && it->size <= size + size / 4 && (best == cached_.end() || it->size < best->size)) {
        best = it;
      }
    }
    if (best == cached_.end()) return nullptr;
    void* p = best->ptr;
    *got = best->size;
    cached_bytes_ -= best->size;
    live_.emplace(p, best->size);
    cached_.erase(best);
    ++stats_.hits;
    return p;
  }

  void give_back(void* p) {
    size_t size = 0;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = live_.find(p);
      if (it != live_.end()) {
        size = it->second;
        live_.erase(it);
      }
    }
    if (size == 0) {  // not one of ours: a small block from the base allocator, reaching us through raw_deleter
      c10::DeleterFnPtr base_delete = base_->raw_deleter();
      TORCH_CHECK(base_delete != nullptr, "fastops CPU cache: no raw deleter to return a block of the base allocator");
      base_delete(p);
      return;
    }
    c10::profiledCPUMemoryReporter().Delete(p);
    std::lock_guard<std::mutex> lock(mu_);
    if (size > limit_) {
      c10::free_cpu(p);
      return;
    }
    trim_locked(limit_ - size);
    cached_.push_front(Block{size, p});
    cached_bytes_ += size;
  }

  void trim_locked(size_t keep) {
    while (cached_bytes_ > keep) {
      const Block& b = cached_.back();
      c10::free_cpu(b.ptr);
      cached_bytes_ -= b.size;
      ++stats_.released;
      cached_.pop_back();
    }
  }

  c10::Allocator* base_;
  std::mutex mu_;
  std::list<Block> cached_;  // front: the most recently freed
  std::unordered_map<void*, size_t> live_;
  size_t cached_bytes_ = 0;
  size_t limit_ = 0;
  CacheStats stats_{};
};

CachingCPUAllocator* CachingCPUAllocator::instance = nullptr;

// Guards installing the cache, and so `instance`; taken before the cache's own lock, here and in the fork
// handlers.
std::mutex install;

void ForkPrepare() {
  install.lock();
  if (CachingCPUAllocator::instance != nullptr) CachingCPUAllocator::instance->fork_prepare();
}

void ForkParent() {
  if (CachingCPUAllocator::instance != nullptr) CachingCPUAllocator::instance->fork_parent();
  install.unlock();
}

void ForkChild() {
  if (CachingCPUAllocator::instance != nullptr) CachingCPUAllocator::instance->fork_child();
  install.unlock();
}

}  // namespace

bool cpu_cache_enable(int64_t limit_bytes) {
  TORCH_CHECK(limit_bytes >= 0, "fastops CPU cache: limit_bytes must be >= 0, got ", limit_bytes);
  std::lock_guard<std::mutex> lock(install);
  if (CachingCPUAllocator::instance == nullptr) {
    // Registered once (twice, fork would take `install` twice) and before the cache exists, so that a
    // failure leaves nothing installed that forks unsafely.
    static const int atfork_error = pthread_atfork(&ForkPrepare, &ForkParent, &ForkChild);
    TORCH_CHECK(atfork_error == 0, "fastops CPU cache: pthread_atfork failed (error ", atfork_error, ")");
    // Never destroyed: tensors freed during interpreter shutdown still call into it.
    auto* cache = new CachingCPUAllocator(c10::GetCPUAllocator());
    cache->set_limit(static_cast<size_t>(limit_bytes));
    CachingCPUAllocator::instance = cache;
    c10::SetCPUAllocator(cache, /*priority=*/0);
  } else {
    CachingCPUAllocator::instance->set_limit(static_cast<size_t>(limit_bytes));
  }
  // An allocator registered with a higher priority (an extension's own) keeps precedence over this one.
  return c10::GetCPUAllocator() == CachingCPUAllocator::instance;
}

CacheStats cpu_cache_stats() {
  return CachingCPUAllocator::instance == nullptr ? CacheStats{} : CachingCPUAllocator::instance->stats();
}

bool cpu_cache_active() {
  return CachingCPUAllocator::instance != nullptr && c10::GetCPUAllocator() == CachingCPUAllocator::instance;
}

void cpu_cache_empty() {
  if (CachingCPUAllocator::instance != nullptr) CachingCPUAllocator::instance->release(0);
}

}  // namespace cpu
}  // namespace fastops
