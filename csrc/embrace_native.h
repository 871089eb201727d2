// Shared declarations of the native ops (CPU in embrace_native.cpp, CUDA in
// embrace_native_cuda.cu). Kept free of torch/extension.h so nvcc compiles it quickly.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <vector>

namespace embrace {

// Bump with any change of an op's signature or semantics; embrace_fairseq/native_ops.py
// refuses an extension whose API_VERSION differs from its own.
constexpr int64_t kApiVersion = 2;

// Dense dedup (a table of flags over the id range [lo, hi], then a prefix sum) costs
// O(n + range) time and 4 * range bytes; sort dedup costs O(n log n). The dense table
// is chosen when the range is not much larger than the batch (kDenseFactor * n plus a
// small slack), never above kDenseMaxRange slots; sparse ids of a large vocabulary go
// to the sort. method 1 (dense) is still refused above kDenseMaxRange. Shared by the
// CPU and CUDA ops so that both choose alike.
constexpr int64_t kDenseFactor = 16;
constexpr int64_t kDenseSlack = int64_t{1} << 16;
constexpr int64_t kDenseMaxRange = int64_t{1} << 26;

// 0 = choose by range (above), 1 = dense table, 2 = sort (1 and 2 for tests).
inline bool use_dense_dedup(int64_t range, int64_t n, int64_t method) {
  if (method == 2) return false;
  if (method == 1) return range <= kDenseMaxRange;
  const int64_t limit = kDenseFactor * n + kDenseSlack;
  return range <= (limit < kDenseMaxRange ? limit : kDenseMaxRange);
}

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
DedupResult dedup_bucket_cuda(const at::Tensor& ids, const std::vector<int64_t>& boundaries, int64_t method);
at::Tensor gather_rows_cuda(const at::Tensor& table, const at::Tensor& index);
at::Tensor scatter_add_rows_cuda(const at::Tensor& src, const at::Tensor& index, int64_t num_rows, double scale,
                                 int64_t zero_row);
#endif

}  // namespace embrace
