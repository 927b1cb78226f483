// CPU build_block_table: block_table[b, j] = req_to_token[req_pool_indices[b], j * S] / S for the
// pages a request uses, -1 for the rest of the row.
#include "cpu/cpu_ops.hpp"
#include "cpu/load_index.hpp"
#include "mla/error.hpp"

namespace mla::cpu {

void check_block_table_inputs(const BuildBlockTableArgs& args,
                              const std::function<int64_t(int64_t req, int64_t pos)>& slot_of) {
  constexpr const char* op = "build_block_table";
  const int64_t batch_size = args.req_pool_indices.shape[0];
  const int64_t num_req_slots = args.req_to_token.shape[0];
  const int64_t max_context_len = args.req_to_token.shape[1];
  const int64_t max_blocks = args.block_table.shape[1];
  const int64_t page_size = args.page_size;
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t req = load_index(args.req_pool_indices, b);
    MLA_CHECK(req >= 0 && req < num_req_slots, op, ": req_pool_indices[", b, "] = ", req,
              " is out of range [0, ", num_req_slots, ") (req_to_token has ", num_req_slots,
              " rows)");
    const int64_t seq_len = load_index(args.seq_lens, b);
    MLA_CHECK(seq_len >= 0, op, ": seq_lens[", b, "] = ", seq_len, " must be >= 0");
    MLA_CHECK(seq_len <= max_blocks * page_size, op, ": seq_lens[", b, "] = ", seq_len,
              " needs more pages than block_table holds (max_blocks ", max_blocks,
              " * page_size ", page_size, " = ", max_blocks * page_size, " tokens)");
    MLA_CHECK(seq_len <= max_context_len, op, ": seq_lens[", b, "] = ", seq_len,
              " exceeds req_to_token.shape[1] (max context length) = ", max_context_len);
    const int64_t num_blocks = (seq_len + page_size - 1) / page_size;
    for (int64_t j = 0; j < num_blocks; ++j) {
      const int64_t slot = slot_of(req, j * page_size);
      MLA_CHECK(slot >= 0, op, ": req_to_token[", req, ", ", j * page_size, "] = ", slot,
                " is negative (token ", j * page_size, " of request ", b, ", seq_lens[", b,
                "] = ", seq_len, "); token slots must be >= 0");
    }
  }
}

void build_block_table(const BuildBlockTableArgs& args) {
  const TensorView& req_to_token = args.req_to_token;
  const int64_t batch_size = args.req_pool_indices.shape[0];
  const int64_t max_blocks = args.block_table.shape[1];
  const int64_t page_size = args.page_size;
  const int32_t* token_slots = static_cast<const int32_t*>(req_to_token.data);
  auto slot_of = [&](int64_t req, int64_t pos) {
    return int64_t(token_slots[req * req_to_token.stride[0] + pos]);
  };

  // Validate every value before writing anything.
  check_block_table_inputs(args, slot_of);

  int32_t* table = static_cast<int32_t*>(args.block_table.data);
  for (int64_t b = 0; b < batch_size; ++b) {
    const int64_t req = load_index(args.req_pool_indices, b);
    const int64_t num_blocks = (load_index(args.seq_lens, b) + page_size - 1) / page_size;
    int32_t* row = table + b * args.block_table.stride[0];
    for (int64_t j = 0; j < max_blocks; ++j)
      row[j] = j < num_blocks ? int32_t(slot_of(req, j * page_size) / page_size) : -1;
  }
}

}  // namespace mla::cpu
