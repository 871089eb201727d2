// Native versions of the sparse exchange's local work (embrace_fairseq/exchange.py).
//
// Three operations, each replacing a chain of small torch calls:
//   dedup_bucket     validate ids, sort-dedup them with an inverse index, count the
//                    unique ids per owner of a contiguous ShardPlan (one pass family,
//                    no intermediate tensors, no device syncs);
//   gather_rows      rows of a 2-D table at given indices (index_select along dim 0);
//   scatter_add_rows sum rows into ``num_rows`` destination rows, scale them and zero
//                    one row (zeros + index_add_ + mul_ + row zero_ in one pass).
//
// Bit-exactness with the PyTorch reference is part of the contract. The reference
// sum is torch's CPU index_add_ along dim 0: per destination row, sources are added
// in ascending source position into an accumulator of at::opmath_type (float for
// half/bfloat16, the type itself otherwise) that starts at zero. float/double rows:
// rounded to the row dtype once, then mul_(scale) multiplies and rounds again.
// half/bfloat16 rows: the fp32 sum is multiplied by float(scale) and rounded to the
// row dtype once (the reference sums into an fp32 buffer, scales it, then casts), so
// that a sum over ranks beyond the half range whose average is not stays finite.
// scatter_add_rows follows the same order and the same roundings.
//
// The CUDA versions live in embrace_native_cuda.cu and are compiled only when the
// extension is built with nvcc against a CUDA torch (EMBRACE_WITH_CUDA).
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

#include "embrace_native.h"

#define EMBRACE_STR2(x) #x
#define EMBRACE_STR(x) EMBRACE_STR2(x)
#ifndef EMBRACE_NATIVE_SOURCE_HASH
#define EMBRACE_NATIVE_SOURCE_HASH unknown
#endif

namespace embrace {

using at::Tensor;

namespace {

// Per-thread scratch that only grows: fresh multi-hundred-KB buffers on every call
// would go to mmap and pay page faults each time (measured: 10x slower on a busy VM).
template <typename T, int Tag>
std::vector<T>& scratch(size_t size) {
  thread_local std::vector<T> buf;
  if (buf.size() < size) buf.resize(size);
  return buf;
}

template <typename id_t>
void min_max(const id_t* ids, int64_t n, int64_t& lo, int64_t& hi) {
  int64_t mn = static_cast<int64_t>(ids[0]), mx = mn;
  for (int64_t i = 1; i < n; ++i) {
    const int64_t v = static_cast<int64_t>(ids[i]);
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
  }
  lo = mn;
  hi = mx;
}

// unique ids (ascending) into `uniq`; inverse[i] = position of ids[i] in `uniq`.
template <typename id_t>
void dedup_dense(const id_t* ids, int64_t n, int64_t lo, int64_t range, int64_t* inverse,
                 std::vector<int64_t>& uniq) {
  int32_t* slot = scratch<int32_t, 0>(static_cast<size_t>(range)).data();
  std::fill(slot, slot + range, -1);
  for (int64_t i = 0; i < n; ++i) slot[static_cast<int64_t>(ids[i]) - lo] = 0;
  int32_t next = 0;
  for (int64_t r = 0; r < range; ++r) {
    if (slot[r] == 0) {
      slot[r] = next++;
      uniq.push_back(lo + r);
    }
  }
  at::parallel_for(0, n, 4096, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) inverse[i] = slot[static_cast<int64_t>(ids[i]) - lo];
  });
}

template <typename id_t>
void dedup_sort(const id_t* ids, int64_t n, int64_t* inverse, std::vector<int64_t>& uniq) {
  uniq.assign(ids, ids + n);
  std::sort(uniq.begin(), uniq.end());
  uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
  const int64_t* u = uniq.data();
  const int64_t un = static_cast<int64_t>(uniq.size());
  at::parallel_for(0, n, 2048, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      inverse[i] = std::lower_bound(u, u + un, static_cast<int64_t>(ids[i])) - u;
    }
  });
}

}  // namespace

// Returns (unique_ids int64 ascending, inverse int64 shaped like ids, counts per owner,
// has_bad, bad_id). When some id lies outside [0, boundaries.back()), has_bad is true,
// bad_id is the offending id (the minimum if negative, else the maximum: what
// exchange.validate_ids reports) and the tensors are empty.
// method: 0 = choose by range, 1 = dense, 2 = sort (the last two for tests).
DedupResult dedup_bucket(const Tensor& ids_in, const std::vector<int64_t>& boundaries, int64_t method) {
  TORCH_CHECK(boundaries.size() >= 2, "dedup_bucket: boundaries needs world_size + 1 >= 2 entries");
  for (size_t r = 1; r < boundaries.size(); ++r) {
    TORCH_CHECK(boundaries[r] >= boundaries[r - 1], "dedup_bucket: boundaries must be non-decreasing");
  }
  TORCH_CHECK(!at::isFloatingType(ids_in.scalar_type()) && ids_in.scalar_type() != at::kBool,
              "dedup_bucket: ids must be an integer tensor, got ", ids_in.scalar_type());
#ifdef EMBRACE_WITH_CUDA
  if (ids_in.is_cuda()) return dedup_bucket_cuda(ids_in, boundaries, method);
#endif
  TORCH_CHECK(ids_in.device().is_cpu(), "dedup_bucket: this build handles CPU tensors only, got ",
              ids_in.device());
  const int64_t world = static_cast<int64_t>(boundaries.size()) - 1;
  const int64_t num_embeddings = boundaries.back();
  const Tensor ids = ids_in.contiguous();
  const int64_t n = ids.numel();
  auto long_opts = ids.options().dtype(at::kLong);
  std::vector<int64_t> counts(static_cast<size_t>(world), 0);
  if (n == 0) {
    return {at::empty({0}, long_opts), at::empty(ids.sizes(), long_opts), counts, false, 0};
  }
  Tensor inverse = at::empty(ids.sizes(), long_opts);
  thread_local std::vector<int64_t> uniq_scratch;  // keeps its capacity (see scratch())
  std::vector<int64_t>& uniq = uniq_scratch;
  uniq.clear();
  bool has_bad = false;
  int64_t bad = 0;
  AT_DISPATCH_INTEGRAL_TYPES(ids.scalar_type(), "dedup_bucket", [&] {
    const scalar_t* p = ids.const_data_ptr<scalar_t>();
    int64_t lo = 0, hi = 0;
    min_max(p, n, lo, hi);
    if (lo < 0 || hi >= num_embeddings) {
      has_bad = true;
      bad = lo < 0 ? lo : hi;
      return;
    }
    const int64_t range = hi - lo + 1;
    if (use_dense_dedup(range, n, method)) {
      uniq.reserve(static_cast<size_t>(std::min(n, range)));
      dedup_dense(p, n, lo, range, inverse.data_ptr<int64_t>(), uniq);
    } else {
      dedup_sort(p, n, inverse.data_ptr<int64_t>(), uniq);
    }
  });
  if (has_bad) {
    return {at::empty({0}, long_opts), at::empty({0}, long_opts), counts, true, bad};
  }
  const int64_t un = static_cast<int64_t>(uniq.size());
  Tensor unique = at::empty({un}, long_opts);
  std::memcpy(unique.data_ptr<int64_t>(), uniq.data(), static_cast<size_t>(un) * sizeof(int64_t));
  // Shards are contiguous ranges and the unique ids ascend, so they are already
  // grouped by owner: the counts are distances between the boundary cuts.
  const int64_t* u = uniq.data();
  int64_t prev = 0;
  for (int64_t r = 0; r < world; ++r) {
    const int64_t cut = std::lower_bound(u, u + un, boundaries[r + 1]) - u;
    counts[r] = cut - prev;
    prev = cut;
  }
  return {unique, inverse, counts, false, 0};
}

// table[index] along dim 0 (same result as table.index_select(0, index)).
Tensor gather_rows(const Tensor& table_in, const Tensor& index_in) {
  TORCH_CHECK(table_in.dim() == 2, "gather_rows: table must be 2-D, got ", table_in.dim(), "-D");
  TORCH_CHECK(index_in.dim() == 1, "gather_rows: index must be 1-D, got ", index_in.dim(), "-D");
  TORCH_CHECK(index_in.scalar_type() == at::kLong || index_in.scalar_type() == at::kInt,
              "gather_rows: index must be int32 or int64, got ", index_in.scalar_type());
  TORCH_CHECK(table_in.device() == index_in.device(), "gather_rows: table on ", table_in.device(),
              " but index on ", index_in.device());
#ifdef EMBRACE_WITH_CUDA
  if (table_in.is_cuda()) return gather_rows_cuda(table_in, index_in);
#endif
  TORCH_CHECK(table_in.device().is_cpu(), "gather_rows: this build handles CPU tensors only, got ",
              table_in.device());
  const Tensor table = table_in.contiguous();
  const Tensor index = index_in.contiguous();
  const int64_t n = index.numel(), rows = table.size(0), dim = table.size(1);
  Tensor out = at::empty({n, dim}, table.options());
  if (n == 0 || dim == 0) {
    // still validate: an empty row is no excuse for an out-of-range index
    AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "gather_rows_check", [&] {
      const index_t* ix = index.const_data_ptr<index_t>();
      for (int64_t i = 0; i < n; ++i) {
        TORCH_CHECK_INDEX(ix[i] >= 0 && ix[i] < rows, "gather_rows: index ", ix[i],
                          " out of range for a table of ", rows, " rows");
      }
    });
    return out;
  }
  const size_t row_bytes = static_cast<size_t>(dim) * table.element_size();
  const char* src = static_cast<const char*>(table.const_data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "gather_rows", [&] {
    const index_t* ix = index.const_data_ptr<index_t>();
    const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 16) / static_cast<int64_t>(row_bytes));
    at::parallel_for(0, n, grain, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t r = static_cast<int64_t>(ix[i]);
        TORCH_CHECK_INDEX(r >= 0 && r < rows, "gather_rows: index ", r, " out of range for a table of ",
                          rows, " rows");
        std::memcpy(dst + i * row_bytes, src + r * row_bytes, row_bytes);
      }
    });
  });
  return out;
}

namespace {

template <typename scalar_t, typename index_t>
void scatter_add_cpu(const scalar_t* src, const index_t* ix, int64_t n, int64_t dim, int64_t num_rows,
                     double scale, int64_t zero_row, scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  // Group source positions by destination row, keeping them ascending (a stable
  // counting sort): the summation order of the reference.
  int64_t* start = scratch<int64_t, 1>(static_cast<size_t>(num_rows) + 1).data();
  std::fill(start, start + num_rows + 1, 0);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t r = static_cast<int64_t>(ix[i]);
    TORCH_CHECK_INDEX(r >= 0 && r < num_rows, "scatter_add_rows: index ", r, " out of range for ",
                      num_rows, " rows");
    ++start[r + 1];
  }
  for (int64_t r = 0; r < num_rows; ++r) start[r + 1] += start[r];
  int64_t* order = scratch<int64_t, 2>(static_cast<size_t>(n)).data();
  {
    int64_t* fill = scratch<int64_t, 3>(static_cast<size_t>(num_rows)).data();
    std::copy(start, start + num_rows, fill);
    for (int64_t i = 0; i < n; ++i) order[fill[static_cast<int64_t>(ix[i])]++] = i;
  }
  const bool scaled = scale != 1.0;
  const acc_t s = static_cast<acc_t>(scale);
  // A row nobody wrote is 0 * scale in the reference (signed zero for scale < 0).
  const scalar_t empty_row_value = scaled ? static_cast<scalar_t>(acc_t(0) * s) : scalar_t(0);
  const int64_t grain = std::max<int64_t>(1, 4096 / std::max<int64_t>(dim, 1));
  at::parallel_for(0, num_rows, grain, [&](int64_t begin, int64_t end) {
    // float rows accumulate in place; half/bfloat16 rows in a float buffer
    constexpr bool in_place = std::is_same<acc_t, scalar_t>::value;
    std::vector<acc_t> buffer(in_place ? 0 : static_cast<size_t>(dim));
    for (int64_t r = begin; r < end; ++r) {
      scalar_t* __restrict__ o = out + r * dim;
      if (r == zero_row) {
        std::fill(o, o + dim, scalar_t(0));
        continue;
      }
      if (start[r] == start[r + 1]) {
        std::fill(o, o + dim, empty_row_value);
        continue;
      }
      acc_t* __restrict__ acc = in_place ? reinterpret_cast<acc_t*>(o) : buffer.data();
      {
        // 0 + x, not x: the reference starts from zero (0 + -0.0 is +0.0)
        const scalar_t* __restrict__ row = src + order[start[r]] * dim;
        for (int64_t c = 0; c < dim; ++c) acc[c] = acc_t(0) + static_cast<acc_t>(row[c]);
      }
      for (int64_t k = start[r] + 1; k < start[r + 1]; ++k) {
        const scalar_t* __restrict__ row = src + order[k] * dim;
        for (int64_t c = 0; c < dim; ++c) acc[c] += static_cast<acc_t>(row[c]);
      }
      if (in_place) {
        if (scaled) {
          for (int64_t c = 0; c < dim; ++c) o[c] = static_cast<scalar_t>(acc[c] * s);
        }
      } else if (scaled) {
        // scaled in fp32 before the one rounding to half: a sum over ranks that exceeds
        // the half range but whose 1/N average does not stays finite (DDP divides first)
        for (int64_t c = 0; c < dim; ++c) o[c] = static_cast<scalar_t>(acc[c] * s);
      } else {
        for (int64_t c = 0; c < dim; ++c) o[c] = static_cast<scalar_t>(acc[c]);
      }
    }
  });
}

}  // namespace

// out = zeros(num_rows, D); out.index_add_(0, index, src); out.mul_(scale) unless
// scale == 1; out[zero_row] = 0 when zero_row >= 0. One pass over the output.
Tensor scatter_add_rows(const Tensor& src_in, const Tensor& index_in, int64_t num_rows, double scale,
                        int64_t zero_row) {
  TORCH_CHECK(src_in.dim() == 2, "scatter_add_rows: src must be 2-D, got ", src_in.dim(), "-D");
  TORCH_CHECK(index_in.dim() == 1 && index_in.numel() == src_in.size(0),
              "scatter_add_rows: index must be 1-D with one entry per src row (", src_in.size(0),
              "), got shape ", index_in.sizes());
  TORCH_CHECK(index_in.scalar_type() == at::kLong || index_in.scalar_type() == at::kInt,
              "scatter_add_rows: index must be int32 or int64, got ", index_in.scalar_type());
  TORCH_CHECK(num_rows >= 0, "scatter_add_rows: num_rows must be >= 0");
  TORCH_CHECK(zero_row < num_rows, "scatter_add_rows: zero_row ", zero_row, " outside ", num_rows, " rows");
  TORCH_CHECK(src_in.device() == index_in.device(), "scatter_add_rows: src on ", src_in.device(),
              " but index on ", index_in.device());
#ifdef EMBRACE_WITH_CUDA
  if (src_in.is_cuda()) return scatter_add_rows_cuda(src_in, index_in, num_rows, scale, zero_row);
#endif
  TORCH_CHECK(src_in.device().is_cpu(), "scatter_add_rows: this build handles CPU tensors only, got ",
              src_in.device());
  const Tensor src = src_in.contiguous();
  const Tensor index = index_in.contiguous();
  const int64_t n = index.numel(), dim = src.size(1);
  Tensor out = at::empty({num_rows, dim}, src.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "scatter_add_rows", [&] {
    AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "scatter_add_rows_index", [&] {
      scatter_add_cpu<scalar_t, index_t>(src.const_data_ptr<scalar_t>(), index.const_data_ptr<index_t>(), n,
                                         dim, num_rows, scale, zero_row, out.data_ptr<scalar_t>());
    });
  });
  return out;
}

}  // namespace embrace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "embrace_fairseq native ops (see csrc/embrace_native.cpp)";
  m.attr("API_VERSION") = embrace::kApiVersion;
  m.attr("SOURCE_HASH") = std::string(EMBRACE_STR(EMBRACE_NATIVE_SOURCE_HASH));
#ifdef EMBRACE_WITH_CUDA
  m.attr("WITH_CUDA") = true;
#else
  m.attr("WITH_CUDA") = false;
#endif
  m.def(
      "dedup_bucket",
      [](const at::Tensor& ids, const std::vector<int64_t>& boundaries, int64_t method) {
        auto r = embrace::dedup_bucket(ids, boundaries, method);
        return std::make_tuple(r.unique, r.inverse, r.counts, r.has_bad, r.bad_id);
      },
      pybind11::arg("ids"), pybind11::arg("boundaries"), pybind11::arg("method") = 0,
      "(unique_ids, inverse, counts_per_owner, has_bad, bad_id) of ids under a contiguous shard plan");
  m.def("gather_rows", &embrace::gather_rows, pybind11::arg("table"), pybind11::arg("index"),
        "table.index_select(0, index)");
  m.def("scatter_add_rows", &embrace::scatter_add_rows, pybind11::arg("src"), pybind11::arg("index"),
        pybind11::arg("num_rows"), pybind11::arg("scale") = 1.0, pybind11::arg("zero_row") = -1,
        "zeros(num_rows, D).index_add_(0, index, src), times scale, row zero_row zeroed");
}
