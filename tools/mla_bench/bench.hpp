// mla-bench: shared types. A benchmark case is described by BenchCase; its host inputs (random,
// pages scattered through the pool) by DecodeProblem / PrefillProblem; a Runner (CPU or CUDA)
// times the library op on them and hands back the output, which verify.cpp checks against a
// float64 naive computation.
#pragma once

#include <algorithm>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "mla/dtype.hpp"
#include "mla/ops.hpp"
#include "mla/tensor.hpp"

namespace mla::bench {

enum class Op : uint8_t { kDecode, kPrefill };
const char* op_name(Op op);

// One benchmark configuration.
struct BenchCase {
  Op op = Op::kDecode;
  int batch = 4;                  // requests
  int heads = 16;                 // query heads
  int kv_len = 1024;              // decode: cached tokens per request, the new ones included
  int kv_min = -1;                // decode: >= 0: request b's length drawn from [kv_min, kv_len]
  int q_len = 1;                  // decode: queries per request
  int page_size = 64;             // decode: tokens per page
  DType kv_dtype = DType::kBF16;  // decode: cache (and query) dtype; prefill: q/k/v dtype
  std::optional<DType> q_dtype;   // decode: the query's dtype where it differs from the cache's
  int64_t tokens = 1024;          // prefill: total new tokens over all requests
};
std::string describe(const BenchCase& c);  // "decode b=64 h=128 kv=4096 q=1 page=64 bf16"

// An owning, contiguous host buffer of `dtype` elements.
struct HostBuffer {
  DType dtype = DType::kFP32;
  std::vector<int64_t> shape;
  std::vector<uint8_t> bytes;

  HostBuffer() = default;
  HostBuffer(DType dt, std::vector<int64_t> s);
  int64_t numel() const;
  size_t size_bytes() const { return bytes.size(); }
  void* data() { return bytes.data(); }
  const void* data() const { return bytes.data(); }
  double get(int64_t i) const { return double(load_as_float(bytes.data(), dtype, i)); }
};

// splitmix64: small, fast, and good enough for benchmark data.
class Rng {
 public:
  explicit Rng(uint64_t seed) : state_(seed) {}
  uint64_t next();
  double uniform();                   // [0, 1)
  int below(int n);                   // [0, n)
 private:
  uint64_t state_;
};

// Absorbed decode: q [T, H, 576] over the paged cache [P, S, 576], out [T, H, 512], T = B * q_len.
struct DecodeProblem {
  BenchCase c;
  DType q_dtype = DType::kBF16;    // --q-dtype, else the cache dtype (an fp8 cache with an fp8 query)
  DType out_dtype = DType::kBF16;
  float softmax_scale = 0;
  float q_scale = 1.0f;            // fp8 query only
  float k_scale = 1.0f;            // fp8 cache only
  int num_pages = 0;               // P: the pages in use plus NaN-filled spare pages
  int max_blocks = 0;              // block_table width
  HostBuffer q;                    // [T, H, 576]
  HostBuffer kv_cache;             // [P, S, 576]; unused slots are NaN
  std::vector<int32_t> block_table;  // [B, max_blocks], -1 past each request's pages
  std::vector<int32_t> kv_lens;      // [B]
  int64_t num_tokens() const { return int64_t(c.batch) * c.q_len; }
  int64_t out_numel() const { return num_tokens() * c.heads * 512; }
};
DecodeProblem make_decode_problem(const BenchCase& c, uint64_t seed);

// Ragged causal non-absorbed prefill (no cached prefix): q/k [T, H, 192], v [T, H, 128],
// out [T, H, 128]; request b owns rows [cu_seq_lens[b], cu_seq_lens[b+1]) of all of them.
struct PrefillProblem {
  BenchCase c;
  DType out_dtype = DType::kBF16;
  float softmax_scale = 0;
  float q_scale = 1.0f, k_scale = 1.0f, v_scale = 1.0f;  // fp8 only
  std::vector<int32_t> cu_seq_lens;  // [B + 1]
  int max_seq_len = 0;
  HostBuffer q, k, v;
  int64_t out_numel() const { return c.tokens * c.heads * 128; }
};
PrefillProblem make_prefill_problem(const BenchCase& c, uint64_t seed);

// The op arguments for a problem whose buffers (same layout as the host ones) live on `device`.
struct DecodeBuffers {
  void* q = nullptr;            // [T, H, 576]
  void* kv_cache = nullptr;     // [P, S, 576]
  void* block_table = nullptr;  // [B, max_blocks] int32
  void* kv_lens = nullptr;      // [B] int32
  void* out = nullptr;          // [T, H, 512]
};
MlaDecodeArgs decode_args(const DecodeProblem& p, const DecodeBuffers& buffers, Device device);
struct PrefillBuffers {
  void* q = nullptr;            // [T, H, 192]
  void* k = nullptr;            // [T, H, 192]
  void* v = nullptr;            // [T, H, 128]
  void* cu_seq_lens = nullptr;  // [B + 1] int32, for both q and kv
  void* out = nullptr;          // [T, H, 128]
};
MhaPrefillArgs prefill_args(const PrefillProblem& p, const PrefillBuffers& buffers, Device device);

// Work and traffic of one run, for TFLOP/s and GB/s.
// decode: flops = 2 * (576 + 512) * H * (keys seen, summed over queries);
//         bytes = cache bytes of every request's tokens (read once per request) + q + out.
// prefill: flops = 2 * (192 + 128) * H * (keys seen, summed over queries); bytes = q + k + v + out.
struct Work {
  double flops = 0;
  double bytes = 0;
};
Work decode_work(const DecodeProblem& p);
Work prefill_work(const PrefillProblem& p);

// Verification against a float64 naive computation on a sample of rows (all rows of small cases).
// Error per element: |out - ref| / (|ref| + rms(ref row)), a relative error floored at the row's
// RMS so that near-zero elements do not dominate; a non-finite output counts as infinite error.
struct Verification {
  double max_rel_err = 0;
  int64_t rows_checked = 0;
  bool full = false;       // every row was checked against the reference
  double tolerance = 0;
  int64_t non_finite = 0;  // output elements (of all rows, sampled or not) that are NaN or inf
  bool passed() const { return max_rel_err <= tolerance && non_finite == 0; }
  // Both outputs of one kernel (eager and graph-replayed): the worse error, the rows checked in
  // each (the same rows), the non-finite elements of both.
  void merge(const Verification& o) {
    max_rel_err = std::max(max_rel_err, o.max_rel_err);
    rows_checked = std::max(rows_checked, o.rows_checked);
    non_finite += o.non_finite;
    full = full && o.full;
  }
};
Verification verify_decode(const DecodeProblem& p, const HostBuffer& out, uint64_t seed);
Verification verify_prefill(const PrefillProblem& p, const HostBuffer& out, uint64_t seed);
double tolerance_for(DType input_dtype);

// One timed kernel: the library op, or a baseline written the way a user would.
struct Measurement {
  std::string kernel;  // "mla-cpu"; decode "mla-sm80-mma" / "mla-sm90-wgmma" (+ "-unsplit" / "-deterministic" / "-deterministic-split"); prefill "mla-cuda"; "naive-cublas"
  double time_us = 0;  // median
  HostBuffer out;      // the kernel's output, copied to the host
  // Decode on the GPU: the output of the CUDA-graph replays (graph_us), written into a buffer
  // poisoned again after the eager runs, so that a graph that writes nothing fails verification.
  std::optional<HostBuffer> graph_out;
  bool is_baseline = false;
  std::optional<double> plan_us;  // median time of plan_decode for this case (scheduled variants)
  std::optional<double> graph_us; // median time of the same call replayed from a CUDA graph
  std::optional<double> plan_graph_us;  // plan_decode replayed from a CUDA graph, median
  std::string error;    // set when this kernel failed (nothing else is then set)
};

struct Ceilings {
  double gemm_tflops = 0;  // large bf16 GEMM (fp32 accumulate) through cuBLAS
  double copy_gbps = 0;    // large device-to-device copy, read + write bytes
  // An empty one-CTA kernel, timed like every row (events, L2 flushed first): the least any
  // event-timed launch here can take, launch included (plan_us and the batch-1 rows sit near it).
  double launch_floor_us = 0;
};

class Runner {
 public:
  virtual ~Runner() = default;
  virtual std::string device() const = 0;   // "cpu" / "cuda"
  virtual std::string card() const = 0;
  virtual std::string driver() const = 0;   // empty when not applicable
  virtual std::optional<Ceilings> ceilings() = 0;
  // The library op first, then any baselines.
  virtual std::vector<Measurement> run_decode(const DecodeProblem& p, int warmup, int iters) = 0;
  virtual std::vector<Measurement> run_prefill(const PrefillProblem& p, int warmup, int iters) = 0;
};

// Which decode rows the CUDA runner times (see --rows).
struct DecodeRows {
  bool portable = true;        // "mla-sm80-mma": the portable kernel with the schedule
  bool hopper = true;          // "mla-sm90-wgmma": the Hopper kernel with the schedule
  bool unsplit = true;         // "...-unsplit": the kernel mla_decode picks, no schedule
  bool deterministic = false;  // "...-deterministic": the deterministic mode
  bool naive = true;           // "naive-cublas": the baseline
  // > 0, with `deterministic`: the deterministic mode on a deterministic schedule cutting every
  // split_keys keys ("...-deterministic-split"), besides the unsplit one.
  int split_keys = 0;
};

std::unique_ptr<Runner> make_cpu_runner();
#if defined(MLA_WITH_CUDA)
bool cuda_device_available();
// How the L2 is emptied before each timed run (see --flush).
enum class L2Flush : uint8_t { kWrite, kRead, kNone };
std::unique_ptr<Runner> make_cuda_runner(L2Flush flush, DecodeRows rows = {});
#endif

// Median of a non-empty sample.
double median(std::vector<double> values);

}  // namespace mla::bench
