// CPU append_latent_kv: copies each token's latent (k_nope | k_pe) into its slot of the paged
// pool, converting to the cache dtype (fp8: quantised with k_scale, saturating).
#include "cpu/cpu_ops.hpp"
#include "cpu/load_index.hpp"
#include "mla/error.hpp"

namespace mla::cpu {

void check_append_locs(const AppendLatentKvArgs& args) {
  const int64_t num_tokens = args.loc.shape[0];
  const int64_t num_pages = args.kv_cache.shape[0];
  const int64_t page_size = args.kv_cache.shape[1];
  const int64_t num_slots = num_pages * page_size;
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = load_index(args.loc, t);
    MLA_CHECK(slot >= -1 && slot < num_slots, "append_latent_kv: loc[", t, "] = ", slot,
              " is out of range: slots must be in [0, ", num_slots, ") (kv_cache has ", num_pages,
              " pages of ", page_size, "), or -1 to skip the token");
  }
}

void append_latent_kv(const AppendLatentKvArgs& args) {
  const TensorView& cache = args.kv_cache;
  const int64_t num_tokens = args.k_nope.shape[0];
  const int64_t page_size = cache.shape[1];

  // Every slot is checked before anything is written, so a bad loc leaves the pool untouched.
  check_append_locs(args);

  const bool quantise = cache.dtype == DType::kFP8E4M3;
  const float k_scale = args.k_scale;
  auto copy_row = [&](const TensorView& src, int64_t t, int64_t width, int64_t dst) {
    const int64_t src_row = t * src.stride[0];
    for (int64_t d = 0; d < width; ++d) {
      float x = load_as_float(src.data, src.dtype, src_row + d);
      if (quantise) x = x / k_scale;
      store_from_float(cache.data, cache.dtype, dst + d, x);
    }
  };
  // Sequential in token order: when two tokens name the same slot, the later one wins.
  for (int64_t t = 0; t < num_tokens; ++t) {
    const int64_t slot = load_index(args.loc, t);
    if (slot < 0) continue;
    const int64_t entry = (slot / page_size) * cache.stride[0] + (slot % page_size) * cache.stride[1];
    copy_row(args.k_nope, t, kKvLoraRank, entry);
    copy_row(args.k_pe, t, kRopeDim, entry + kKvLoraRank);
  }
}

}  // namespace mla::cpu
