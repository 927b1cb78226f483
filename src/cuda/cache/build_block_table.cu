// build_block_table on the GPU: block_table[b, j] = req_to_token[req_pool_indices[b], j * S] / S
// for the pages request b uses (j < ceil(seq_lens[b] / S)), -1 for the rest of the row.
//
// Algorithm: blockIdx.y walks requests, blockIdx.x and the threads walk the columns of the row
// (grid-stride in both), so a row of any width is written with coalesced stores; the
// req_to_token reads are a strided gather (one token slot per page).
//
// Device-side index handling (no host sync, so no exception): the CPU path throws on each case
// below; here nothing out of bounds is read or written, and no entry keeps what an earlier call
// wrote there (which would hand this request another request's pages):
//   * req_pool_indices[b] outside [0, R), seq_lens[b] < 0, or seq_lens[b] > min(max_blocks * S,
//     req_to_token.shape[1]): every entry of row b is -1 (decode then reads no key of it);
//   * a negative token slot req_to_token[r, j * S]: entry (b, j) is -1.
// With check_metadata the CPU path's check runs first on host copies and throws instead.
//
// History: v1 — one thread per table entry, grid-stride over requests and columns; bad rows and
// slots left untouched. v2 (this version) — bad rows and slots written -1.
#include <vector>

#include "cpu/cpu_ops.hpp"
#include "cuda/common/elementwise.cuh"
#include "cuda/cuda_ops.hpp"
#include "cuda/host_metadata.hpp"

namespace mla::cuda {
namespace {

struct BlockTableParams {
  const int* req_to_token;       // [R, max_context_len] int32, row stride req_to_token_stride
  int64_t req_to_token_stride;
  int64_t num_req_slots;         // R
  int64_t max_context_len;
  const void* req_pool_indices;  // [B] int32/int64
  int64_t req_pool_indices_stride;
  bool req_pool_indices_int64;
  const void* seq_lens;          // [B] int32/int64
  int64_t seq_lens_stride;
  bool seq_lens_int64;
  int* block_table;              // [B, max_blocks] int32, row stride block_table_stride
  int64_t block_table_stride;
  int64_t batch_size;            // B
  int64_t max_blocks;
  int page_shift;                // log2(S)
};

__global__ void __launch_bounds__(128) build_block_table_kernel(const __grid_constant__ BlockTableParams p) {
  const int64_t page_size = int64_t(1) << p.page_shift;
  const int64_t max_len = min(p.max_blocks * page_size, p.max_context_len);
  for (int64_t b = blockIdx.y; b < p.batch_size; b += gridDim.y) {
    const int64_t req = load_index(p.req_pool_indices, p.req_pool_indices_int64,
                                   p.req_pool_indices_stride, b);
    const int64_t seq_len = load_index(p.seq_lens, p.seq_lens_int64, p.seq_lens_stride, b);
    const bool bad_row = req < 0 || req >= p.num_req_slots || seq_len < 0 || seq_len > max_len;
    // A bad row has no pages: all of it is written -1.
    const int64_t num_blocks = bad_row ? 0 : (seq_len + page_size - 1) >> p.page_shift;
    const int* token_slots = p.req_to_token + (bad_row ? 0 : req) * p.req_to_token_stride;
    int* row = p.block_table + b * p.block_table_stride;
    for (int64_t j = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; j < p.max_blocks;
         j += int64_t(gridDim.x) * blockDim.x) {
      int page = -1;
      if (j < num_blocks) {
        const int slot = __ldg(token_slots + (j << p.page_shift));
        if (slot >= 0) page = slot >> p.page_shift;
      }
      row[j] = page;
    }
  }
}

// BuildBlockTableArgs::check_metadata: req_pool_indices and seq_lens (contiguous: checked before)
// copied to the host and checked by the CPU path's check, which asks for a request's token slots
// (one a page: a strided copy of its req_to_token row) once its index and length have passed.
void check_inputs_on_host(const BuildBlockTableArgs& args, cudaStream_t stream) {
  require_not_capturing("build_block_table", "req_pool_indices, seq_lens and token slots", stream);
  const int64_t batch_size = args.req_pool_indices.shape[0];
  std::vector<int64_t> rpi_storage, seq_storage;
  BuildBlockTableArgs host = args;
  host.req_pool_indices = copy_index_vector_to_host(args.req_pool_indices, batch_size, rpi_storage, stream);
  host.seq_lens = copy_index_vector_to_host(args.seq_lens, batch_size, seq_storage, stream);
  MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
  const int64_t page_size = args.page_size;
  const int64_t max_context_len = args.req_to_token.shape[1];
  int64_t row_req = -1;
  std::vector<int32_t> row;  // req_to_token[row_req, j * S] for the pages of the current request
  cpu::check_block_table_inputs(host, [&](int64_t req, int64_t pos) {
    if (req != row_req || pos / page_size >= int64_t(row.size())) {
      // Every page of the row that the context can hold (the check asks in page order, within it).
      const int64_t pages = (max_context_len + page_size - 1) / page_size;
      row.assign(size_t(pages), 0);
      const int32_t* src = static_cast<const int32_t*>(args.req_to_token.data) + req * args.req_to_token.stride[0];
      MLA_CUDA_CHECK(cudaMemcpy2DAsync(row.data(), sizeof(int32_t), src, size_t(page_size) * sizeof(int32_t),
                                       sizeof(int32_t), size_t(pages), cudaMemcpyDeviceToHost, stream));
      MLA_CUDA_CHECK(cudaStreamSynchronize(stream));
      row_req = req;
    }
    return int64_t(row[size_t(pos / page_size)]);
  });
}

}  // namespace

void build_block_table(const BuildBlockTableArgs& args, Stream stream) {
  const DeviceGuard guard(args.block_table.device);
  int page_shift = 0;
  while ((1 << page_shift) < args.page_size) ++page_shift;

  BlockTableParams p{};
  p.req_to_token = static_cast<const int*>(args.req_to_token.data);
  p.req_to_token_stride = args.req_to_token.stride[0];
  p.num_req_slots = args.req_to_token.shape[0];
  p.max_context_len = args.req_to_token.shape[1];
  p.req_pool_indices = args.req_pool_indices.data;
  p.req_pool_indices_stride = args.req_pool_indices.stride[0];
  p.req_pool_indices_int64 = args.req_pool_indices.dtype == DType::kInt64;
  p.seq_lens = args.seq_lens.data;
  p.seq_lens_stride = args.seq_lens.stride[0];
  p.seq_lens_int64 = args.seq_lens.dtype == DType::kInt64;
  p.block_table = static_cast<int*>(args.block_table.data);
  p.block_table_stride = args.block_table.stride[0];
  p.batch_size = args.block_table.shape[0];
  p.max_blocks = args.block_table.shape[1];
  p.page_shift = page_shift;
  if (args.check_metadata && p.batch_size > 0) check_inputs_on_host(args, to_cuda(stream));
  if (p.batch_size == 0 || p.max_blocks == 0) return;

  constexpr int kThreads = 128;
  const int64_t column_blocks = std::min<int64_t>((p.max_blocks + kThreads - 1) / kThreads, 64);
  const int64_t request_blocks = std::min<int64_t>(p.batch_size, 65535);
  const dim3 grid{unsigned(column_blocks), unsigned(request_blocks)};
  build_block_table_kernel<<<grid, kThreads, 0, to_cuda(stream)>>>(p);
  MLA_CUDA_CHECK_LAUNCH();
}

}  // namespace mla::cuda
