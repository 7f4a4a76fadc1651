// The cache of the CUDA ops' device tables (args.h's layout): built once per set of pointers, uploaded from pinned
// memory with a non-blocking copy, kept in a small LRU; a table a CUDA graph captured is never freed.
#include "cuda/tables.h"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>

#include <algorithm>
#include <list>
#include <mutex>
#include <unordered_map>
#include <utility>

namespace fastops {
namespace cuda {
namespace {

using Key = std::vector<int64_t>;

std::shared_ptr<DeviceTable> build_table(const std::vector<int64_t>& flat, int64_t cols, const at::Device& device,
                                         cudaStream_t stream) {
  auto t = std::make_shared<DeviceTable>();
  t->cols = cols;
  t->n_rows = static_cast<int64_t>(flat.size()) / cols;
  const std::vector<int64_t> chunks = chunk_list(flat, cols);
  t->n_chunks = static_cast<int64_t>(chunks.size()) / 2;
  const int64_t total = static_cast<int64_t>(flat.size() + chunks.size());
  t->host = at::empty({total}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  int64_t* h = t->host.mutable_data_ptr<int64_t>();
  std::copy(chunks.begin(), chunks.end(), std::copy(flat.begin(), flat.end(), h));
  t->device = at::empty({total}, at::TensorOptions().dtype(at::kLong).device(device));
  t->device.copy_(t->host, /*non_blocking=*/true);
  t->streams.push_back(stream);
  return t;
}

struct KeyHash {
  size_t operator()(const Key& k) const noexcept {
    uint64_t h = 0x9e3779b97f4a7c15ull;
    for (int64_t x : k) h ^= static_cast<uint64_t>(x) + 0x9e3779b97f4a7c15ull + (h << 6) + (h >> 2);
    return static_cast<size_t>(h);
  }
};

// A small LRU of device tables keyed by everything a table holds (device, layout, pointers, numels), so
// an entry is right whenever its key matches. A steady training loop builds each table once and then only
// hashes pointers. A table used during CUDA-graph capture leaves the LRU and is never freed: the graph
// reads it on every replay.
class TableCache {
 public:
  std::shared_ptr<DeviceTable> get(const Key& key, const std::vector<int64_t>& flat, int64_t cols,
                                   const at::Device& device, cudaStream_t stream, bool capturing) {
    std::lock_guard<std::mutex> lock(mu_);
    std::shared_ptr<DeviceTable> t;
    auto pinned = pinned_.find(key);
    if (pinned != pinned_.end()) {
      t = pinned->second;
    } else {
      auto it = index_.find(key);
      if (it != index_.end()) {
        t = it->second->second;
        if (capturing) {
          lru_.erase(it->second);
          index_.erase(it);
          pinned_.emplace(key, t);
        } else {
          lru_.splice(lru_.begin(), lru_, it->second);
        }
      } else {
        t = build_table(flat, cols, device, stream);
        if (capturing) {
          pinned_.emplace(key, t);
        } else {
          lru_.emplace_front(key, t);
          index_.emplace(key, lru_.begin());
          while (lru_.size() > kCapacity) {
            index_.erase(lru_.back().first);
            lru_.pop_back();
          }
        }
      }
    }
    // The caching allocator ties a block to the stream it was allocated on; used on another stream and then
    // evicted, it could be handed out while that stream's kernel still reads it.
    if (std::find(t->streams.begin(), t->streams.end(), stream) == t->streams.end()) {
      t->device.record_stream(at::cuda::getCurrentCUDAStream());
      t->streams.push_back(stream);
    }
    return t;
  }

 private:
  static constexpr size_t kCapacity = 64;
  std::mutex mu_;
  std::list<std::pair<Key, std::shared_ptr<DeviceTable>>> lru_;
  std::unordered_map<Key, std::list<std::pair<Key, std::shared_ptr<DeviceTable>>>::iterator, KeyHash> index_;
  std::unordered_map<Key, std::shared_ptr<DeviceTable>, KeyHash> pinned_;
};

}  // namespace

std::shared_ptr<DeviceTable> table(int64_t tag, const std::vector<int64_t>& flat, int64_t cols,
                                   const at::Device& device, cudaStream_t stream, bool capturing) {
  static TableCache cache;
  Key key;
  key.reserve(flat.size() + 3);
  key.push_back(tag);
  key.push_back(device.index());
  key.push_back(kChunkSize);
  key.insert(key.end(), flat.begin(), flat.end());
  return cache.get(key, flat, cols, device, stream, capturing);
}

}  // namespace cuda
}  // namespace fastops
