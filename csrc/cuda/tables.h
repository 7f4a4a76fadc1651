// The CUDA ops' device tables (args.h's layout), cached by everything a table holds (tables.cpp).
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include <ATen/core/Tensor.h>
#include <cuda_runtime.h>

#include "cuda/args.h"

namespace fastops {
namespace cuda {

// A per-tensor table (rows x cols, the last column numel) followed by the chunk table (n_chunks x 2:
// tensor index, chunk index), in one device tensor.
struct DeviceTable {
  at::Tensor host;  // pinned source of the upload; a graph captured with this table reads it on replay
  at::Tensor device;
  int64_t n_rows = 0;
  int64_t cols = 0;
  int64_t n_chunks = 0;
  std::vector<cudaStream_t> streams;  // streams the table was used on; the first is the allocating one

  const int64_t* rows() const { return device.const_data_ptr<int64_t>(); }
  const int64_t* chunks() const { return rows() + n_rows * cols; }
};

// Tags that keep the Adam, SGD and grad tables apart in the cache key.
constexpr int64_t kAdamTag = 1;
constexpr int64_t kGradTag = 2;
constexpr int64_t kSgdTag = 3;
constexpr int64_t kLowpTag = 4;

// The table of the per-tensor rows `flat` (cols a row) on `device`, from the cache or built and uploaded on `stream`.
// A table first used while `capturing` a CUDA graph is never freed: the graph reads it on every replay.
std::shared_ptr<DeviceTable> table(int64_t tag, const std::vector<int64_t>& flat, int64_t cols,
                                   const at::Device& device, cudaStream_t stream, bool capturing);

}  // namespace cuda
}  // namespace fastops
