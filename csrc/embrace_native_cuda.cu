// CUDA versions of the native ops (see embrace_native.cpp for the contract).
//
// Compiled only when setup.py finds nvcc and a CUDA build of torch. Written for
// clarity over peak speed: simple one-purpose kernels, ATen for sort/scan/search.
// Same results as the CPU ops: scatter_add_rows sums each destination row in
// ascending source position with an opmath accumulator (deterministic, no atomics
// on floats), then applies the same roundings as the CPU op (see embrace_native.cpp).
// dedup_bucket chooses dense or sort as the CPU op does (use_dense_dedup), and honours
// a forced method. A bad row index never becomes a device assert (which would leave
// the CUDA context unusable): the kernels record it in a flag that the host reads,
// and the host raises the CPU op's IndexError with the CPU op's message.
#include <ATen/core/Tensor.h>
#include <ATen/Dispatch.h>
#include <ATen/OpMathType.h>
#include <c10/cuda/CUDAStream.h>
#include <ATen/ops/_unique2.h>
#include <ATen/ops/aminmax.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/cumsum.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/full.h>
#include <ATen/ops/searchsorted.h>
#include <ATen/ops/sort.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/tensor.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>

#include "embrace_native.h"

namespace embrace {

using at::Tensor;

namespace {

constexpr int kThreads = 256;

inline int blocks_for(int64_t n) {
  return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, 65535));
}

__global__ void mark_kernel(const int64_t* ids, int64_t n, int64_t lo, int32_t* slot) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{blockDim.x} * gridDim.x) {
    slot[ids[i] - lo] = 1;
  }
}

// pos = inclusive prefix sum of the marks: a marked slot r holds unique id lo + r at
// position pos[r] - 1.
__global__ void compact_kernel(const int32_t* slot, const int32_t* pos, int64_t range, int64_t lo, int64_t* unique) {
  for (int64_t r = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; r < range; r += int64_t{blockDim.x} * gridDim.x) {
    if (slot[r]) unique[pos[r] - 1] = lo + r;
  }
}

__global__ void inverse_kernel(const int64_t* ids, int64_t n, int64_t lo, const int32_t* pos, int64_t* inverse) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{blockDim.x} * gridDim.x) {
    inverse[i] = pos[ids[i] - lo] - 1;
  }
}

// edges[k] = number of unique ids below boundaries[k] (grid-stride: any world size).
__global__ void edges_kernel(const int64_t* bounds, int64_t nb, const int32_t* pos, int64_t range, int64_t lo,
                             int64_t* edges) {
  for (int64_t k = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; k < nb; k += int64_t{blockDim.x} * gridDim.x) {
    const int64_t off = bounds[k] - lo;  // slots [0, off) lie below the boundary
    edges[k] = off <= 0 ? 0 : (off >= range ? pos[range - 1] : pos[off - 1]);
  }
}

// A bad index leaves its output row zero and lowers *first_bad (initially n) to its
// position: the host reads one flag instead of the context dying on an assert.
template <typename word_t, typename index_t>
__global__ void gather_kernel(const word_t* table, const index_t* index, int64_t n, int64_t rows, int64_t dim,
                              word_t* out, unsigned long long* first_bad) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t r = static_cast<int64_t>(index[i]);
    if (r < 0 || r >= rows) {
      if (threadIdx.x == 0) atomicMin(first_bad, static_cast<unsigned long long>(i));
      for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) out[i * dim + c] = word_t(0);
      continue;
    }
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) out[i * dim + c] = table[r * dim + c];
  }
}

template <typename scalar_t>
__global__ void segment_sum_kernel(const scalar_t* src, const int64_t* order, const int64_t* start, int64_t num_rows,
                                   int64_t dim, bool scaled, at::opmath_type<scalar_t> scale, int64_t zero_row,
                                   scalar_t* out) {
  using acc_t = at::opmath_type<scalar_t>;
  for (int64_t r = blockIdx.x; r < num_rows; r += gridDim.x) {
    for (int64_t c = threadIdx.x; c < dim; c += blockDim.x) {
      scalar_t v;
      if (r == zero_row) {
        v = scalar_t(0);
      } else if (start[r] == start[r + 1]) {
        v = scaled ? static_cast<scalar_t>(acc_t(0) * scale) : scalar_t(0);
      } else {
        acc_t acc = acc_t(0);
        for (int64_t k = start[r]; k < start[r + 1]; ++k) acc += static_cast<acc_t>(src[order[k] * dim + c]);
        if (!scaled) {
          v = static_cast<scalar_t>(acc);
        } else if (sizeof(acc_t) != sizeof(scalar_t)) {
          v = static_cast<scalar_t>(acc * scale);  // half/bfloat16: scaled in fp32, rounded once
        } else {
          v = static_cast<scalar_t>(static_cast<acc_t>(static_cast<scalar_t>(acc)) * scale);  // float/double
        }
      }
      out[r * dim + c] = v;
    }
  }
}

}  // namespace

DedupResult dedup_bucket_cuda(const Tensor& ids_in, const std::vector<int64_t>& boundaries, int64_t method) {
  const c10::cuda::CUDAGuard guard(ids_in.device());
  const int64_t world = static_cast<int64_t>(boundaries.size()) - 1;
  const int64_t num_embeddings = boundaries.back();
  const Tensor ids = ids_in.reshape(-1).to(at::kLong).contiguous();
  auto long_opts = ids.options();
  const int64_t n = ids.numel();
  std::vector<int64_t> counts(static_cast<size_t>(world), 0);
  if (n == 0) return {at::empty({0}, long_opts), at::empty(ids_in.sizes(), long_opts), counts, false, 0};

  auto mm = at::aminmax(ids);
  const Tensor lohi = at::stack({std::get<0>(mm), std::get<1>(mm)}).cpu();  // sync 1
  const int64_t lo = lohi[0].item<int64_t>(), hi = lohi[1].item<int64_t>();
  if (lo < 0 || hi >= num_embeddings) {
    return {at::empty({0}, long_opts), at::empty({0}, long_opts), counts, true, lo < 0 ? lo : hi};
  }
  const Tensor bounds = at::tensor(boundaries, long_opts.device(at::kCPU)).to(ids.device());
  const int64_t range = hi - lo + 1;
  if (!use_dense_dedup(range, n, method)) {
    // sparse ids (a table of flags would be large next to the ids): ATen's sort-based unique
    auto u = at::_unique2(ids, /*sorted=*/true, /*return_inverse=*/true, /*return_counts=*/false);
    const Tensor unique = std::get<0>(u);
    const Tensor cuts = at::searchsorted(unique, bounds).cpu();  // sync 2: counts are AlltoAll split sizes
    const int64_t* c = cuts.const_data_ptr<int64_t>();
    for (int64_t r = 0; r < world; ++r) counts[r] = c[r + 1] - c[r];
    return {unique, std::get<1>(u).view(ids_in.sizes()), counts, false, 0};
  }
  auto stream = c10::cuda::getCurrentCUDAStream();
  Tensor slot = at::zeros({range}, ids.options().dtype(at::kInt));
  mark_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ids.const_data_ptr<int64_t>(), n, lo, slot.data_ptr<int32_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Tensor pos = at::cumsum(slot, 0, at::kInt);
  Tensor edges = at::empty({world + 1}, long_opts);
  edges_kernel<<<blocks_for(world + 1), kThreads, 0, stream>>>(
      bounds.const_data_ptr<int64_t>(), world + 1, pos.const_data_ptr<int32_t>(), range, lo, edges.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const Tensor edges_cpu = edges.cpu();  // sync 2: counts and the unique total together
  const int64_t* e = edges_cpu.const_data_ptr<int64_t>();
  for (int64_t r = 0; r < world; ++r) counts[r] = e[r + 1] - e[r];
  Tensor unique = at::empty({e[world]}, long_opts);
  Tensor inverse = at::empty(ids_in.sizes(), long_opts);
  compact_kernel<<<blocks_for(range), kThreads, 0, stream>>>(slot.const_data_ptr<int32_t>(), pos.const_data_ptr<int32_t>(),
                                                            range, lo, unique.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  inverse_kernel<<<blocks_for(n), kThreads, 0, stream>>>(ids.const_data_ptr<int64_t>(), n, lo,
                                                        pos.const_data_ptr<int32_t>(), inverse.data_ptr<int64_t>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {unique, inverse, counts, false, 0};
}

Tensor gather_rows_cuda(const Tensor& table_in, const Tensor& index_in) {
  const c10::cuda::CUDAGuard guard(table_in.device());
  const Tensor table = table_in.contiguous();
  const Tensor index = index_in.contiguous();
  const int64_t n = index.numel(), rows = table.size(0), dim = table.size(1);
  Tensor out = at::empty({n, dim}, table.options());
  if (n == 0) return out;
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>(n, 65535));
  // one thread per row at least: a table of width 0 still has its indices checked
  const int threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(dim, kThreads)));
  Tensor first_bad = at::full({1}, n, index.options().dtype(at::kLong));
  auto* bad_flag = reinterpret_cast<unsigned long long*>(first_bad.data_ptr<int64_t>());
  // rows are copied as raw words of the element size: no dtype dispatch needed
  AT_DISPATCH_INDEX_TYPES(index.scalar_type(), "gather_rows_cuda", [&] {
    const index_t* ix = index.const_data_ptr<index_t>();
    switch (table.element_size()) {
      case 1:
        gather_kernel<uint8_t, index_t><<<blocks, threads, 0, stream>>>(
            static_cast<const uint8_t*>(table.const_data_ptr()), ix, n, rows, dim, static_cast<uint8_t*>(out.data_ptr()), bad_flag);
        break;
      case 2:
        gather_kernel<uint16_t, index_t><<<blocks, threads, 0, stream>>>(
            static_cast<const uint16_t*>(table.const_data_ptr()), ix, n, rows, dim, static_cast<uint16_t*>(out.data_ptr()), bad_flag);
        break;
      case 4:
        gather_kernel<uint32_t, index_t><<<blocks, threads, 0, stream>>>(
            static_cast<const uint32_t*>(table.const_data_ptr()), ix, n, rows, dim, static_cast<uint32_t*>(out.data_ptr()), bad_flag);
        break;
      case 8:
        gather_kernel<uint64_t, index_t><<<blocks, threads, 0, stream>>>(
            static_cast<const uint64_t*>(table.const_data_ptr()), ix, n, rows, dim, static_cast<uint64_t*>(out.data_ptr()), bad_flag);
        break;
      default:
        TORCH_CHECK(false, "gather_rows: unsupported element size ", table.element_size());
    }
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  // the one host sync of this op: an error must be raised where the caller can catch it
  // (only the EMBRACE_NATIVE=1 path runs this kernel on CUDA)
  const int64_t bad_at = first_bad.item<int64_t>();
  if (bad_at < n) {
    const int64_t r = index.select(0, bad_at).item<int64_t>();
    TORCH_CHECK_INDEX(false, "gather_rows: index ", r, " out of range for a table of ", rows, " rows");
  }
  return out;
}

Tensor scatter_add_rows_cuda(const Tensor& src_in, const Tensor& index_in, int64_t num_rows, double scale,
                             int64_t zero_row) {
  const c10::cuda::CUDAGuard guard(src_in.device());
  const Tensor src = src_in.contiguous();
  const Tensor index = index_in.to(at::kLong).contiguous();
  const int64_t dim = src.size(1);
  Tensor out = at::empty({num_rows, dim}, src.options());
  if (num_rows == 0 || dim == 0) return out;
  // A stable sort groups source positions by destination row, ascending within a
  // row; start[r] is where row r's group begins.
  auto sorted = at::sort(index, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const Tensor keys = std::get<0>(sorted);
  const Tensor order = std::get<1>(sorted);
  if (keys.numel() > 0) {
    // host sync: a bad index must raise here, not corrupt rows or assert on the device
    const Tensor kmm = at::stack({keys[0], keys[-1]}).cpu();
    if (kmm[0].item<int64_t>() < 0 || kmm[1].item<int64_t>() >= num_rows) {
      // the error path only: the first bad index by position, as the CPU op reports it
      const Tensor ix = index.cpu();
      const int64_t* p = ix.const_data_ptr<int64_t>();
      int64_t r = 0;
      for (int64_t i = 0; i < ix.numel(); ++i) {
        if (p[i] < 0 || p[i] >= num_rows) {
          r = p[i];
          break;
        }
      }
      TORCH_CHECK_INDEX(false, "scatter_add_rows: index ", r, " out of range for ", num_rows, " rows");
    }
  }
  const Tensor start = at::searchsorted(keys, at::arange(num_rows + 1, index.options()));
  auto stream = c10::cuda::getCurrentCUDAStream();
  const int blocks = static_cast<int>(std::min<int64_t>(num_rows, 65535));
  const int threads = static_cast<int>(std::min<int64_t>(dim, kThreads));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, src.scalar_type(), "scatter_add_rows_cuda", [&] {
    using acc_t = at::opmath_type<scalar_t>;
    segment_sum_kernel<scalar_t><<<blocks, threads, 0, stream>>>(
        src.const_data_ptr<scalar_t>(), order.const_data_ptr<int64_t>(), start.const_data_ptr<int64_t>(), num_rows,
        dim, scale != 1.0, static_cast<acc_t>(scale), zero_row, out.data_ptr<scalar_t>());
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return out;
}

}  // namespace embrace
