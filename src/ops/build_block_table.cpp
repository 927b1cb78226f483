// build_block_table: public entry — validation, then device dispatch.
#include "cpu/cpu_ops.hpp"
#include "mla/error.hpp"
#include "ops/dispatch.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_ops.hpp"
#endif

namespace mla {

void build_block_table(const BuildBlockTableArgs& args, Stream stream) {
  constexpr const char* op = "build_block_table";
  const std::initializer_list<DType> index_dtypes = {DType::kInt32, DType::kInt64};

  check::ndim(op, "req_to_token", args.req_to_token, 2);
  check::dtype(op, "req_to_token", args.req_to_token, DType::kInt32);
  check::inner_contiguous(op, "req_to_token", args.req_to_token);

  check::ndim(op, "req_pool_indices", args.req_pool_indices, 1);
  const int64_t batch_size = args.req_pool_indices.shape[0];
  check::dtype_in(op, "req_pool_indices", args.req_pool_indices, index_dtypes);
  check::inner_contiguous(op, "req_pool_indices", args.req_pool_indices);

  check::ndim(op, "seq_lens", args.seq_lens, 1);
  check::dim(op, "seq_lens", args.seq_lens, 0, batch_size, "requests, as req_pool_indices");
  check::dtype_in(op, "seq_lens", args.seq_lens, index_dtypes);
  check::inner_contiguous(op, "seq_lens", args.seq_lens);

  const int page_size = args.page_size;
  MLA_CHECK(page_size >= 1 && page_size <= kMaxPageSize && (page_size & (page_size - 1)) == 0, op,
            ": page_size must be a power of two in 1..", kMaxPageSize, ", got ", page_size);

  check::ndim(op, "block_table", args.block_table, 2);
  check::dim(op, "block_table", args.block_table, 0, batch_size, "requests, as req_pool_indices");
  check::dtype(op, "block_table", args.block_table, DType::kInt32);
  check::inner_contiguous(op, "block_table", args.block_table);
  check::non_overlapping(op, "block_table", args.block_table);
  check::disjoint(op, "block_table", args.block_table,
                  {{"req_to_token", &args.req_to_token}, {"req_pool_indices", &args.req_pool_indices},
                   {"seq_lens", &args.seq_lens}});

  const Device device = detail::common_device(
      op, {{"req_to_token", &args.req_to_token}, {"req_pool_indices", &args.req_pool_indices},
           {"seq_lens", &args.seq_lens}, {"block_table", &args.block_table}});
  if (batch_size == 0) return;
  detail::run_on(op, device, [&] { cpu::build_block_table(args); },
                 [&] {
#if defined(MLA_WITH_CUDA)
                   cuda::build_block_table(args, stream);
#endif
                 });
  (void)stream;
}

}  // namespace mla
