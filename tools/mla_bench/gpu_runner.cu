// mla-bench on a CUDA device: inputs generated on the host and copied, every run timed with CUDA
// events, L2 flushed before each run, median of the timed runs. Decode runs each kernel twice: with
// the split-KV schedule ("mla-sm90-wgmma", "mla-sm80-mma") and without ("...-unsplit"); prefill is
// "mla-cuda". The same run measures the card's
// ceilings (a large cuBLAS bf16 GEMM, a large device-to-device copy) and, for decode, the naive
// way a user would write it by hand:
//   1. gather each request's pages into contiguous keys [B, kv, 576] bf16 (dequantised),
//   2. scores = Q · K^T per request (cuBLAS strided-batched GEMM, fp32 out),
//   3. causal softmax over each score row (bf16 probabilities),
//   4. out = P · V per request, V being the first 512 values of each key (cuBLAS, bf16 out).
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "bench.hpp"
#include "cuda/cuda_check.hpp"
#include "mla/error.hpp"
#include "mla/schedule.hpp"

#define BENCH_CUBLAS_CHECK(expr)                                                          \
  do {                                                                                    \
    cublasStatus_t bench_cublas_status_ = (expr);                                         \
    if (bench_cublas_status_ != CUBLAS_STATUS_SUCCESS)                                    \
      MLA_FAIL("cuBLAS error in ", #expr, ": ", cublasGetStatusName(bench_cublas_status_), \
               " (", cublasGetStatusString(bench_cublas_status_), ")");                   \
  } while (0)

namespace mla::bench {

namespace {

// ---- device memory ---------------------------------------------------------------------------

class DeviceMemory {
 public:
  DeviceMemory() = default;
  explicit DeviceMemory(size_t bytes) : bytes_(bytes) {
    if (bytes_ > 0) MLA_CUDA_CHECK(cudaMalloc(&ptr_, bytes_));
  }
  ~DeviceMemory() {
    if (ptr_) cudaFree(ptr_);
  }
  DeviceMemory(const DeviceMemory&) = delete;
  DeviceMemory& operator=(const DeviceMemory&) = delete;
  DeviceMemory(DeviceMemory&& other) noexcept
      : ptr_(std::exchange(other.ptr_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  DeviceMemory& operator=(DeviceMemory&& other) noexcept {
    std::swap(ptr_, other.ptr_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  void* get() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  template <typename T>
  T* as() const { return static_cast<T*>(ptr_); }

 private:
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

DeviceMemory upload(const void* host, size_t bytes) {
  DeviceMemory d(bytes);
  if (bytes > 0) MLA_CUDA_CHECK(cudaMemcpy(d.get(), host, bytes, cudaMemcpyHostToDevice));
  return d;
}
DeviceMemory upload(const HostBuffer& h) { return upload(h.data(), h.size_bytes()); }
DeviceMemory upload(const std::vector<int32_t>& h) { return upload(h.data(), h.size() * 4); }

HostBuffer download(const DeviceMemory& d, DType dtype, std::vector<int64_t> shape) {
  HostBuffer h(dtype, std::move(shape));
  MLA_CHECK(h.size_bytes() <= d.bytes(), "download: host buffer larger than device buffer");
  if (h.size_bytes() > 0)
    MLA_CUDA_CHECK(cudaMemcpy(h.data(), d.get(), h.size_bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// An output buffer filled with NaN (all bits set), so that rows a kernel never writes show up.
// Every byte 0xff: NaN in fp32, fp16 and bf16 alike.
void poison_nan(void* p, size_t bytes) {
  if (bytes > 0) MLA_CUDA_CHECK(cudaMemset(p, 0xff, bytes));
}

DeviceMemory nan_output(size_t bytes) {
  DeviceMemory d(bytes);
  poison_nan(d.get(), bytes);
  return d;
}

// ---- kernels for the ceilings and the naive baseline ----------------------------------------
__global__ void empty_kernel() {}

// Reads n 16-byte words (the L2 flush by reading): the XOR of what a thread read goes to sink only
// when it is a value the buffer never holds, so that the loads stay and nothing is written.
__global__ void read_flush_kernel(const uint4* data, size_t n, uint32_t* sink) {
  uint32_t x = 0;
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n; i += size_t(gridDim.x) * blockDim.x) {
    const uint4 v = data[i];
    x ^= v.x ^ v.y ^ v.z ^ v.w;
  }
  if (x == 0xdeadbeefu) *sink = x;
}

// data[i] = a pseudo-random value in [-1, 1) hashed from (seed, i).
__global__ void fill_random_bf16_kernel(__nv_bfloat16* data, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x) {
    uint64_t z = seed + 0x9e3779b97f4a7c15ull * (i + 1);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    z ^= z >> 31;
    data[i] = __float2bfloat16(float(z >> 40) * 0x1.0p-23f - 1.0f);
  }
}

__device__ inline float to_f32(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ inline float to_f32(__half x) { return __half2float(x); }
__device__ inline float to_f32(__nv_fp8_e4m3 x) { return float(x); }

// out[i] = bf16(in[i] * scale): queries of another dtype, for the bf16 GEMMs.
template <typename T>
__global__ void convert_to_bf16_kernel(const T* in, size_t n, float scale, __nv_bfloat16* out) {
  for (size_t i = blockIdx.x * size_t(blockDim.x) + threadIdx.x; i < n;
       i += size_t(gridDim.x) * blockDim.x)
    out[i] = __float2bfloat16(to_f32(in[i]) * scale);
}

// keys[b, j, :] = cache[block_table[b, j / S], j % S, :] * k_scale for j < kv_lens[b], else 0.
// Grid (kv_max, B); each block copies one 576-wide entry.
template <typename CacheT>
__global__ void gather_pages_kernel(const CacheT* cache,         // [P, S, 576]
                                    const int32_t* block_table,  // [B, max_blocks]
                                    const int32_t* kv_lens,      // [B]
                                    int page_size, int max_blocks, int kv_max, float k_scale,
                                    __nv_bfloat16* keys) {       // [B, kv_max, 576]
  const int j = blockIdx.x;  // token position in the request
  const int b = blockIdx.y;  // request
  __nv_bfloat16* dst = keys + (size_t(b) * kv_max + j) * kLatentDim;
  if (j >= kv_lens[b]) {
    for (int d = threadIdx.x; d < kLatentDim; d += blockDim.x) dst[d] = __float2bfloat16(0.0f);
    return;
  }
  const int64_t page = block_table[size_t(b) * max_blocks + j / page_size];
  const CacheT* src = cache + (page * page_size + j % page_size) * kLatentDim;
  for (int d = threadIdx.x; d < kLatentDim; d += blockDim.x)
    dst[d] = __float2bfloat16(to_f32(src[d]) * k_scale);
}

// Block-wide max or sum of v (every thread gets the result). blockDim.x is a multiple of 32.
template <bool kMax>
__device__ float block_reduce(float v, float* scratch /* [32] shared */) {
  for (int offset = 16; offset > 0; offset /= 2) {
    const float other = __shfl_xor_sync(0xffffffffu, v, offset);
    v = kMax ? fmaxf(v, other) : v + other;
  }
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int num_warps = blockDim.x / 32;
    v = lane < num_warps ? scratch[lane] : (kMax ? -INFINITY : 0.0f);
    for (int offset = 16; offset > 0; offset /= 2) {
      const float other = __shfl_xor_sync(0xffffffffu, v, offset);
      v = kMax ? fmaxf(v, other) : v + other;
    }
    if (lane == 0) scratch[0] = v;
  }
  __syncthreads();
  const float result = scratch[0];
  __syncthreads();
  return result;
}

// probs[b, m, j] = causal softmax over j of scale * scores[b, m, j]; row m is (query i, head h)
// with m = i * heads + h; query i sees keys j <= kv_lens[b] - q_len + i. One block per row.
__global__ void softmax_rows_kernel(const float* scores,     // [B, q_len * heads, kv_max]
                                    const int32_t* kv_lens,  // [B]
                                    int heads, int q_len, int kv_max, float scale,
                                    __nv_bfloat16* probs) {  // [B, q_len * heads, kv_max]
  __shared__ float scratch[32];
  const size_t row = blockIdx.x;
  const int rows_per_request = q_len * heads;
  const int b = int(row / rows_per_request);
  const int i = int(row % rows_per_request) / heads;
  const int kv = kv_lens[b];
  const int num_keys = max(0, min(kv, kv - q_len + i + 1));
  const float* s = scores + row * kv_max;
  __nv_bfloat16* p = probs + row * kv_max;

  float row_max = -INFINITY;
  for (int j = threadIdx.x; j < num_keys; j += blockDim.x) row_max = fmaxf(row_max, s[j]);
  row_max = block_reduce<true>(row_max, scratch);
  float row_sum = 0.0f;
  for (int j = threadIdx.x; j < num_keys; j += blockDim.x) row_sum += __expf(scale * (s[j] - row_max));
  row_sum = block_reduce<false>(row_sum, scratch);
  for (int j = threadIdx.x; j < kv_max; j += blockDim.x)
    p[j] = __float2bfloat16(j < num_keys ? __expf(scale * (s[j] - row_max)) / row_sum : 0.0f);
}

unsigned grid_for(size_t n, unsigned block) {
  return unsigned(std::min<size_t>((n + block - 1) / block, 65535u * 16u));
}

// ---- the runner ------------------------------------------------------------------------------

class GpuRunner final : public Runner {
 public:
  GpuRunner(L2Flush flush, DecodeRows rows) : flush_mode_(flush), rows_(rows) {
    MLA_CUDA_CHECK(cudaGetDevice(&device_));
    MLA_CUDA_CHECK(cudaGetDeviceProperties(&props_, device_));
    int driver = 0, runtime = 0;
    MLA_CUDA_CHECK(cudaDriverGetVersion(&driver));
    MLA_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    driver_ = "CUDA driver " + version_string(driver) + ", runtime " + version_string(runtime);
    // A blocking stream: it orders itself with the legacy default stream, on which the uploads,
    // memsets and downloads (cudaMemcpy / cudaMemset) run.
    MLA_CUDA_CHECK(cudaStreamCreate(&stream_));
    MLA_CUDA_CHECK(cudaEventCreate(&start_));
    MLA_CUDA_CHECK(cudaEventCreate(&stop_));
    BENCH_CUBLAS_CHECK(cublasCreate(&cublas_));
    BENCH_CUBLAS_CHECK(cublasSetStream(cublas_, stream_));
    // Writing or reading twice the L2 size before each timed run evicts whatever the previous
    // run left (flush_l2); without a flush there is no buffer.
    if (flush_mode_ != L2Flush::kNone)
      flush_ = DeviceMemory(std::max<size_t>(2 * size_t(props_.l2CacheSize), size_t(1) << 20));
    if (flush_mode_ == L2Flush::kRead) {
      // The read flush reads zeros (the XOR of them never matches the sink's guard value).
      MLA_CUDA_CHECK(cudaMemset(flush_.get(), 0, flush_.bytes()));
      MLA_CUDA_CHECK(cudaDeviceSynchronize());
    }
  }
  ~GpuRunner() override {
    cublasDestroy(cublas_);
    cudaEventDestroy(start_);
    cudaEventDestroy(stop_);
    cudaStreamDestroy(stream_);
  }

  std::string device() const override { return "cuda"; }
  std::string card() const override {
    return std::string(props_.name) + " (sm_" + std::to_string(props_.major) +
           std::to_string(props_.minor) + ", " + std::to_string(props_.multiProcessorCount) +
           " SMs)";
  }
  std::string driver() const override { return driver_; }

  std::optional<Ceilings> ceilings() override {
    Ceilings c;
    c.gemm_tflops = gemm_ceiling_tflops();
    c.copy_gbps = copy_ceiling_gbps();
    c.launch_floor_us = time_median_us(5, 20, [&] {
      empty_kernel<<<1, 32, 0, stream_>>>();
      MLA_CUDA_CHECK_LAUNCH();
    });
    return c;
  }

  std::vector<Measurement> run_decode(const DecodeProblem& p, int warmup, int iters) override {
    const BenchCase& c = p.c;
    const DeviceMemory q = upload(p.q);
    const DeviceMemory kv_cache = upload(p.kv_cache);
    const DeviceMemory block_table = upload(p.block_table);
    const DeviceMemory kv_lens = upload(p.kv_lens);
    const size_t out_bytes = size_t(p.out_numel()) * dtype_size(p.out_dtype);
    const std::vector<int64_t> out_shape = {p.num_tokens(), c.heads, kKvLoraRank};
    std::vector<Measurement> results;

    // The library op, with its split-KV schedule (planned once, outside the timed runs, as an
    // engine plans once per step for all layers), and without one (each row tile on one CTA).
    const DeviceMemory workspace(decode_workspace_bytes(c.batch, c.q_len, c.heads));
    const DecodeSchedule schedule = make_decode_schedule(workspace.get(), workspace.bytes(),
                                                         c.batch, c.q_len, c.heads);
    const TensorView kv_lens_view =
        TensorView::contiguous(kv_lens.get(), DType::kInt32, {c.batch}, Device::cuda(device_));
    // The plan's own time (an engine pays it once per step, not once per layer).
    const double plan_us = time_median_us(warmup, iters, [&] {
      plan_decode(schedule, kv_lens_view, TensorView{}, c.q_len, c.q_len, stream_);
    });
    const double plan_graph_us = graph_median_us(warmup, iters, [&] {
      plan_decode(schedule, kv_lens_view, TensorView{}, c.q_len, c.q_len, stream_);
    });
    // The deterministic schedule (--split-keys), for contexts as long as the block table holds:
    // made, planned and timed inside its row's try (its workspace may not fit).
    DeviceMemory fixed_workspace;
    DecodeSchedule fixed_schedule{};
    double fixed_plan_us = 0, fixed_plan_graph_us = 0;
    auto plan_fixed = [&] {
      const int table_keys = std::max(1, p.max_blocks * c.page_size);
      fixed_workspace = DeviceMemory(decode_workspace_bytes_deterministic(
          c.batch, c.q_len, c.heads, table_keys, rows_.split_keys));
      fixed_schedule = make_deterministic_decode_schedule(
          fixed_workspace.get(), fixed_workspace.bytes(), c.batch, c.q_len, c.heads, table_keys,
          rows_.split_keys);
      fixed_plan_us = time_median_us(warmup, iters, [&] {
        plan_decode(fixed_schedule, kv_lens_view, TensorView{}, c.q_len, c.q_len, stream_);
      });
      fixed_plan_graph_us = graph_median_us(warmup, iters, [&] {
        plan_decode(fixed_schedule, kv_lens_view, TensorView{}, c.q_len, c.q_len, stream_);
      });
    };
    // Kernels (those --rows asks for): the portable one and the Hopper one (where it applies),
    // each with the schedule; then the one mla_decode picks without a schedule, and in the
    // deterministic mode. mla_decode_kernel_name throws for a kernel that does not apply to the
    // case or the card.
    struct Variant {
      const DecodeSchedule* schedule;
      DecodeKernel kernel;
      bool deterministic;
    };
    std::vector<Variant> variants;
    if (rows_.portable) variants.push_back({&schedule, DecodeKernel::kPortable, false});
    if (rows_.hopper) variants.push_back({&schedule, DecodeKernel::kHopper, false});
    if (rows_.unsplit) variants.push_back({nullptr, DecodeKernel::kAuto, false});
    if (rows_.deterministic) variants.push_back({nullptr, DecodeKernel::kAuto, true});
    if (rows_.deterministic && rows_.split_keys > 0)
      variants.push_back({&fixed_schedule, DecodeKernel::kAuto, true});
    std::vector<std::string> seen;
    for (const Variant& v : variants) {
      const DeviceMemory out = nan_output(out_bytes);
      DecodeBuffers buffers;
      buffers.q = q.get();
      buffers.kv_cache = kv_cache.get();
      buffers.block_table = block_table.get();
      buffers.kv_lens = kv_lens.get();
      buffers.out = out.get();
      MlaDecodeArgs args = decode_args(p, buffers, Device::cuda(device_));
      const bool fixed = v.schedule == &fixed_schedule;
      args.schedule = fixed ? nullptr : v.schedule;  // (the kernel's name does not depend on it)
      args.kernel = v.kernel;
      args.deterministic = v.deterministic;
      Measurement m;
      const char* name = nullptr;
      try {
        name = mla_decode_kernel_name(args);
      } catch (const Error&) {
        if (v.kernel != DecodeKernel::kHopper) throw;
        continue;  // the Hopper kernel does not apply here
      }
      m.kernel = std::string("mla-") + name +
                 (v.deterministic ? (v.schedule ? "-deterministic-split" : "-deterministic")
                                  : v.schedule ? "" : "-unsplit");
      if (std::find(seen.begin(), seen.end(), m.kernel) != seen.end()) continue;
      seen.push_back(m.kernel);
      // A kernel that fails is reported on its own row; the case's other kernels still run
      // (after a sticky CUDA error they fail too, each with its own message).
      try {
        if (fixed) {
          plan_fixed();
          args.schedule = &fixed_schedule;
        }
        m.time_us = time_median_us(warmup, iters, [&] { mla_decode(args, stream_); });
        if (v.schedule) {
          m.plan_us = fixed ? fixed_plan_us : plan_us;
          m.plan_graph_us = fixed ? fixed_plan_graph_us : plan_graph_us;
        }
        m.out = download(out, p.out_dtype, out_shape);
        // The graph replays write into the output poisoned again: verified on their own.
        poison_nan(out.get(), out_bytes);
        m.graph_us = graph_median_us(warmup, iters, [&] { mla_decode(args, stream_); });
        m.graph_out = download(out, p.out_dtype, out_shape);
      } catch (const std::exception& e) {
        m = Measurement{};
        m.kernel = seen.back();
        m.error = e.what();
      }
      results.push_back(std::move(m));
    }

    // The naive baseline, when its buffers fit.
    const int kv_max = *std::max_element(p.kv_lens.begin(), p.kv_lens.end());
    const int rows_per_request = c.q_len * c.heads;  // M: (query, head) rows of one request
    const size_t keys_bytes = size_t(c.batch) * kv_max * kLatentDim * 2;
    const size_t score_elems = size_t(c.batch) * rows_per_request * kv_max;
    const size_t q_bf16_bytes = p.q_dtype == DType::kBF16 ? 0 : p.q.numel() * 2;
    const size_t naive_bytes = keys_bytes + score_elems * (4 + 2) + q_bf16_bytes + p.out_numel() * 2;
    size_t free_bytes = 0, total_bytes = 0;
    MLA_CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    if (!rows_.naive || kv_max == 0 || naive_bytes > free_bytes / 10 * 9) return results;

    const DeviceMemory keys(keys_bytes), scores(score_elems * 4), probs(score_elems * 2);
    const DeviceMemory q_bf16(q_bf16_bytes);
    const DeviceMemory out = nan_output(size_t(p.out_numel()) * 2);
    const __nv_bfloat16* q_for_gemm = p.q_dtype == DType::kBF16 ? q.as<__nv_bfloat16>()
                                                                : q_bf16.as<__nv_bfloat16>();
    const float q_scale = p.q_dtype == DType::kFP8E4M3 ? p.q_scale : 1.0f;
    const float k_scale = c.kv_dtype == DType::kFP8E4M3 ? p.k_scale : 1.0f;
    auto naive = [&] {
      const size_t q_elems = size_t(p.q.numel());
      if (p.q_dtype == DType::kFP16)
        convert_to_bf16_kernel<<<grid_for(q_elems, 256), 256, 0, stream_>>>(
            q.as<__half>(), q_elems, q_scale, q_bf16.as<__nv_bfloat16>());
      else if (p.q_dtype == DType::kFP8E4M3)
        convert_to_bf16_kernel<<<grid_for(q_elems, 256), 256, 0, stream_>>>(
            q.as<__nv_fp8_e4m3>(), q_elems, q_scale, q_bf16.as<__nv_bfloat16>());
      MLA_CUDA_CHECK_LAUNCH();
      const dim3 gather_grid(unsigned(kv_max), unsigned(c.batch));
      switch (c.kv_dtype) {
        case DType::kBF16:
          gather_pages_kernel<<<gather_grid, 128, 0, stream_>>>(
              kv_cache.as<__nv_bfloat16>(), block_table.as<int32_t>(), kv_lens.as<int32_t>(),
              c.page_size, p.max_blocks, kv_max, k_scale, keys.as<__nv_bfloat16>());
          break;
        case DType::kFP16:
          gather_pages_kernel<<<gather_grid, 128, 0, stream_>>>(
              kv_cache.as<__half>(), block_table.as<int32_t>(), kv_lens.as<int32_t>(),
              c.page_size, p.max_blocks, kv_max, k_scale, keys.as<__nv_bfloat16>());
          break;
        case DType::kFP8E4M3:
          gather_pages_kernel<<<gather_grid, 128, 0, stream_>>>(
              kv_cache.as<__nv_fp8_e4m3>(), block_table.as<int32_t>(), kv_lens.as<int32_t>(),
              c.page_size, p.max_blocks, kv_max, k_scale, keys.as<__nv_bfloat16>());
          break;
        default: MLA_FAIL("naive decode: unsupported cache dtype ", dtype_name(c.kv_dtype));
      }
      MLA_CUDA_CHECK_LAUNCH();
      // Row-major scores[M, kv] = Q[M, 576] · K[kv, 576]^T per request; in cuBLAS's column-major
      // terms: scores^T (kv x M) = K^T' (op T of the 576 x kv matrix K) · Q^T (576 x M).
      const float one = 1.0f, zero = 0.0f;
      BENCH_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          cublas_, CUBLAS_OP_T, CUBLAS_OP_N, kv_max, rows_per_request, kLatentDim, &one,
          keys.get(), CUDA_R_16BF, kLatentDim, (long long)kv_max * kLatentDim,
          q_for_gemm, CUDA_R_16BF, kLatentDim, (long long)rows_per_request * kLatentDim, &zero,
          scores.get(), CUDA_R_32F, kv_max, (long long)rows_per_request * kv_max, c.batch,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      softmax_rows_kernel<<<unsigned(size_t(c.batch) * rows_per_request), 256, 0, stream_>>>(
          scores.as<float>(), kv_lens.as<int32_t>(), c.heads, c.q_len, kv_max, p.softmax_scale,
          probs.as<__nv_bfloat16>());
      MLA_CUDA_CHECK_LAUNCH();
      // Row-major out[M, 512] = P[M, kv] · V[kv, 512], V = the first 512 columns of K (row
      // stride 576); column-major: out^T (512 x M) = V^T (512 x kv, ld 576) · P^T (kv x M).
      BENCH_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
          cublas_, CUBLAS_OP_N, CUBLAS_OP_N, kKvLoraRank, rows_per_request, kv_max, &one,
          keys.get(), CUDA_R_16BF, kLatentDim, (long long)kv_max * kLatentDim,
          probs.get(), CUDA_R_16BF, kv_max, (long long)rows_per_request * kv_max, &zero,
          out.get(), CUDA_R_16BF, kKvLoraRank, (long long)rows_per_request * kKvLoraRank, c.batch,
          CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    };
    Measurement m;
    m.kernel = "naive-cublas";
    m.is_baseline = true;
    try {  // a failed baseline (e.g. a grid past its limits) is its own error row
      m.time_us = time_median_us(warmup, iters, naive);
      m.out = download(out, DType::kBF16, out_shape);
    } catch (const std::exception& e) {
      m = Measurement{};
      m.kernel = "naive-cublas";
      m.is_baseline = true;
      m.error = e.what();
    }
    results.push_back(std::move(m));
    return results;
  }

  std::vector<Measurement> run_prefill(const PrefillProblem& p, int warmup, int iters) override {
    const DeviceMemory q = upload(p.q), k = upload(p.k), v = upload(p.v);
    const DeviceMemory cu_seq_lens = upload(p.cu_seq_lens);
    const DeviceMemory out = nan_output(size_t(p.out_numel()) * dtype_size(p.out_dtype));
    PrefillBuffers buffers;
    buffers.q = q.get();
    buffers.k = k.get();
    buffers.v = v.get();
    buffers.cu_seq_lens = cu_seq_lens.get();
    buffers.out = out.get();
    const MhaPrefillArgs args = prefill_args(p, buffers, Device::cuda(device_));
    Measurement m;
    m.kernel = "mla-cuda";
    m.time_us = time_median_us(warmup, iters, [&] { mha_prefill(args, stream_); });
    m.out = download(out, p.out_dtype, {p.c.tokens, p.c.heads, 128});
    return {std::move(m)};
  }

 private:
  static std::string version_string(int v) {
    return std::to_string(v / 1000) + "." + std::to_string((v % 1000) / 10);
  }

  // Evicts what the previous run left in L2: by writing twice its size (the L2 then holds dirty
  // lines, written back as the timed run's own traffic evicts them) or by reading it (clean
  // lines); or, with kNone, leaves it there.
  void flush_l2() {
    if (flush_mode_ == L2Flush::kNone) return;
    if (flush_mode_ == L2Flush::kWrite) {
      MLA_CUDA_CHECK(cudaMemsetAsync(flush_.get(), flush_value_++ & 0xff, flush_.bytes(), stream_));
      return;
    }
    const size_t words = flush_.bytes() / sizeof(uint4);
    read_flush_kernel<<<4 * props_.multiProcessorCount, 512, 0, stream_>>>(
        static_cast<const uint4*>(flush_.get()), words, static_cast<uint32_t*>(flush_.get()));
    MLA_CUDA_CHECK_LAUNCH();
  }

  // Runs fn() (which enqueues work on stream_) warmup + iters times, each after an L2 flush;
  // returns the median event-timed duration of the timed runs in microseconds.
  template <typename Fn>
  double time_median_us(int warmup, int iters, Fn&& fn) {
    MLA_CUDA_CHECK(cudaDeviceSynchronize());  // inputs in place before the first run
    for (int i = 0; i < warmup; ++i) {
      flush_l2();
      fn();
    }
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<double> times;
    for (int i = 0; i < iters; ++i) {
      flush_l2();
      MLA_CUDA_CHECK(cudaEventRecord(start_, stream_));
      fn();
      MLA_CUDA_CHECK(cudaEventRecord(stop_, stream_));
      MLA_CUDA_CHECK(cudaEventSynchronize(stop_));
      float ms = 0;
      MLA_CUDA_CHECK(cudaEventElapsedTime(&ms, start_, stop_));
      times.push_back(double(ms) * 1e3);
    }
    return median(std::move(times));
  }

  // fn() captured once into a CUDA graph on stream_, then the graph replayed as time_median_us
  // runs fn: the same work without the host's launch gaps (how an engine replays a decode step).
  template <typename Fn>
  double graph_median_us(int warmup, int iters, Fn&& fn) {
    MLA_CUDA_CHECK(cudaStreamSynchronize(stream_));
    cudaGraph_t graph = nullptr;
    MLA_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
    try {
      fn();
    } catch (...) {
      cudaStreamEndCapture(stream_, &graph);
      if (graph) cudaGraphDestroy(graph);
      throw;
    }
    MLA_CUDA_CHECK(cudaStreamEndCapture(stream_, &graph));
    cudaGraphExec_t exec = nullptr;
    const cudaError_t instantiated = cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    MLA_CUDA_CHECK(instantiated);
    double us = 0;
    try {
      us = time_median_us(warmup, iters, [&] { MLA_CUDA_CHECK(cudaGraphLaunch(exec, stream_)); });
    } catch (...) {
      cudaGraphExecDestroy(exec);
      throw;
    }
    MLA_CUDA_CHECK(cudaGraphExecDestroy(exec));
    return us;
  }

  // A 8192^3 bf16 GEMM (fp32 accumulate) on random data: the card's matrix-math ceiling.
  double gemm_ceiling_tflops() {
    constexpr int n = 8192;
    const size_t elems = size_t(n) * n;
    const DeviceMemory a(elems * 2), b(elems * 2), c(elems * 2);
    fill_random_bf16_kernel<<<grid_for(elems, 256), 256, 0, stream_>>>(a.as<__nv_bfloat16>(), elems, 1);
    MLA_CUDA_CHECK_LAUNCH();
    fill_random_bf16_kernel<<<grid_for(elems, 256), 256, 0, stream_>>>(b.as<__nv_bfloat16>(), elems, 2);
    MLA_CUDA_CHECK_LAUNCH();
    const float one = 1.0f, zero = 0.0f;
    const double us = time_median_us(3, 10, [&] {
      BENCH_CUBLAS_CHECK(cublasGemmEx(cublas_, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.get(),
                                      CUDA_R_16BF, n, b.get(), CUDA_R_16BF, n, &zero, c.get(),
                                      CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    return 2.0 * n * double(n) * n / (us * 1e-6) / 1e12;
  }

  // A 1 GiB device-to-device copy; bytes moved = read + write.
  double copy_ceiling_gbps() {
    const size_t bytes = size_t(1) << 30;
    const DeviceMemory src(bytes), dst(bytes);
    MLA_CUDA_CHECK(cudaMemsetAsync(src.get(), 0x3c, bytes, stream_));
    const double us = time_median_us(2, 10, [&] {
      MLA_CUDA_CHECK(cudaMemcpyAsync(dst.get(), src.get(), bytes, cudaMemcpyDeviceToDevice, stream_));
    });
    return 2.0 * double(bytes) / (us * 1e-6) / 1e9;
  }

  int device_ = 0;
  cudaDeviceProp props_{};
  std::string driver_;
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  cublasHandle_t cublas_ = nullptr;
  L2Flush flush_mode_;
  DecodeRows rows_;  // decode: which rows to time
  DeviceMemory flush_;
  unsigned flush_value_ = 0;
};

}  // namespace

bool cuda_device_available() {
  int count = 0;
  const cudaError_t status = cudaGetDeviceCount(&count);
  if (status != cudaSuccess) {
    (void)cudaGetLastError();  // clear the error state
    return false;
  }
  return count > 0;
}

std::unique_ptr<Runner> make_cuda_runner(L2Flush flush, DecodeRows rows) {
  return std::make_unique<GpuRunner>(flush, rows);
}

}  // namespace mla::bench
