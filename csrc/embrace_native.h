// Shared declarations of the native ops (CPU in embrace_native.cpp, CUDA in
// embrace_native_cuda.cu). Kept free of torch/extension.h so nvcc compiles it quickly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace embrace {

// Bump with any change of an op's signature or semantics; embrace_fairseq/native_ops.py
// refuses an extension whose API_VERSION differs from its own.
constexpr int64_t kApiVersion = 1;

struct DedupResult {
  at::Tensor unique;            // int64, ascending
  at::Tensor inverse;           // int64, shaped like the ids
  std::vector<int64_t> counts;  // unique ids per owner
  bool has_bad;
  int64_t bad_id;
};

DedupResult dedup_bucket(const at::Tensor& ids, const std::vector<int64_t>& boundaries, int64_t method);
at::Tensor gather_rows(const at::Tensor& table, const at::Tensor& index);
at::Tensor scatter_add_rows(const at::Tensor& src, const at::Tensor& index, int64_t num_rows, double scale,
                            int64_t zero_row);

#ifdef EMBRACE_WITH_CUDA
DedupResult dedup_bucket_cuda(const at::Tensor& ids, const std::vector<int64_t>& boundaries);
at::Tensor gather_rows_cuda(const at::Tensor& table, const at::Tensor& index);
at::Tensor scatter_add_rows_cuda(const at::Tensor& src, const at::Tensor& index, int64_t num_rows, double scale,
                                 int64_t zero_row);
#endif

}  // namespace embrace
