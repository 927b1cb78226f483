// GPU tests of mla::Backend and mla::MultiStepDraftBackend: the orchestration (planning on the
// device, split-KV schedules, CUDA-graph fixed buffers, chunked prefix loop) running the CUDA ops.
//
// Every batch is run twice: through a CPU Backend over host tensors and through a CUDA Backend
// over device copies of the same contents (same pool, same req_to_token, same queries). Both are
// checked against float64 naive attention (tests/cpu/attention_reference.hpp) built from a block
// table this file derives from req_to_token on its own, and against each other; the cache after
// the backends saved the new tokens must be equal bit for bit (pages no request uses stay NaN).
// CUDA-graph replays and draft steps must equal eager runs of the same batch bit for bit (the
// split-KV schedule depends only on the lengths, so both run the same arithmetic).
//
// Pools hand out pages in random order; every cache entry no request has written holds NaN, so a
// wrong page id or a read past a sequence shows up as NaN or as a mismatch. Outputs are NaN before
// every run. All device work runs on non-blocking streams (as engines use them): test copies are
// synchronised explicitly.
//
// Tolerances (|x - ref| <= atol + rtol * |ref|). bf16 queries and cache; inputs in [-1, 1]. The
// kernels round the softmax weights P to bf16 (2^-9 relative) before P·V, which moves a convex
// combination of values |v| <= 1 by at most 4e-3; the output is then rounded to its dtype (the
// CPU's rounding may land one bf16 ulp, 2^-8 relative, away):
//   out bf16: atol 1.2e-2, rtol 1e-2      out fp32: atol 4e-3, rtol 1e-3
//   lse (fp32 scores; ln of a row sum of rounded weights, 2^-9 relative): atol 5e-3, rtol 1e-3
// The same bounds hold for the chunked EXTEND path (each chunk's partial output, merged by LSE in
// fp32, is a convex combination again).
#include <cuda_runtime.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <memory>
#include <numeric>
#include <random>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "cpu/attention_reference.hpp"
#include "gpu_util.hpp"
#include "mla/backend.hpp"
#include "mla/ops.hpp"
#include "mla/plan.hpp"
#include "mla/schedule.hpp"

namespace mla::test {
namespace {

const float kSoftmaxScale = float(1.0 / std::sqrt(192.0));

struct Tolerance {
  double atol, rtol;
};
Tolerance out_tolerance(DType out_dtype) {
  return out_dtype == DType::kFP32 ? Tolerance{4e-3, 1e-3} : Tolerance{1.2e-2, 1e-2};
}
constexpr Tolerance kLseTolerance{5e-3, 1e-3};

std::vector<double> to_double(const std::vector<float>& v) { return {v.begin(), v.end()}; }

// ---------------------------------------------------------------------------------------------
// Device memory

// An owned device buffer holding a host tensor's dtype and shape. Uploads and downloads wait for
// the whole device, so they are ordered with work on any (non-blocking) stream.
class DeviceCopy {
 public:
  DeviceCopy() = default;
  explicit DeviceCopy(const HostTensor& h) : dtype_(h.dtype), shape_(h.shape), bytes_(h.bytes.size()) {
    if (cudaMalloc(&ptr_, std::max<size_t>(bytes_, 16)) != cudaSuccess)
      throw std::runtime_error("cudaMalloc failed");
    upload(h);
  }
  DeviceCopy(const DeviceCopy&) = delete;
  DeviceCopy& operator=(const DeviceCopy&) = delete;
  DeviceCopy(DeviceCopy&& o) noexcept { swap(o); }
  DeviceCopy& operator=(DeviceCopy&& o) noexcept {
    swap(o);
    return *this;
  }
  ~DeviceCopy() {
    if (ptr_) cudaFree(ptr_);
  }

  // Replaces the contents (the host tensor must have the same byte size).
  void upload(const HostTensor& h) { upload_prefix(h); }
  // Writes h's bytes at the start of the buffer.
  void upload_prefix(const HostTensor& h) {
    if (h.bytes.size() > bytes_) throw std::runtime_error("DeviceCopy: upload larger than the buffer");
    sync();
    if (!h.bytes.empty() &&
        cudaMemcpy(ptr_, h.bytes.data(), h.bytes.size(), cudaMemcpyHostToDevice) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy H2D failed");
    sync();
  }
  // The first `rows` rows (all of them by default) as a host tensor.
  HostTensor download(int64_t rows = -1) const {
    std::vector<int64_t> shape = shape_;
    if (rows >= 0 && !shape.empty()) shape[0] = rows;
    HostTensor h(dtype_, shape);
    sync();
    if (!h.bytes.empty() &&
        cudaMemcpy(h.bytes.data(), ptr_, h.bytes.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
      throw std::runtime_error("cudaMemcpy D2H failed");
    return h;
  }
  // The whole buffer (or its first `rows` rows) as a contiguous CUDA tensor.
  TensorView view(int64_t rows = -1) const {
    TensorView t;
    t.data = ptr_;
    t.dtype = dtype_;
    t.ndim = int(shape_.size());
    t.device = Device::cuda(0);
    int64_t stride = 1;
    for (int d = t.ndim - 1; d >= 0; --d) {
      t.shape[d] = shape_[size_t(d)];
      t.stride[d] = stride;
      stride *= shape_[size_t(d)];
    }
    if (rows >= 0) t.shape[0] = rows;
    return t;
  }
  void* data() const { return ptr_; }
  size_t bytes() const { return bytes_; }
  // NaN in every float element (0xff bytes), in stream order.
  void poison(cudaStream_t stream) const {
    if (cudaMemsetAsync(ptr_, 0xff, bytes_, stream) != cudaSuccess)
      throw std::runtime_error("cudaMemsetAsync failed");
  }

 private:
  static void sync() {
    if (cudaDeviceSynchronize() != cudaSuccess) throw std::runtime_error("cudaDeviceSynchronize failed");
  }
  void swap(DeviceCopy& o) {
    std::swap(ptr_, o.ptr_);
    std::swap(dtype_, o.dtype_);
    std::swap(shape_, o.shape_);
    std::swap(bytes_, o.bytes_);
  }
  void* ptr_ = nullptr;
  DType dtype_ = DType::kFP32;
  std::vector<int64_t> shape_;
  size_t bytes_ = 0;
};

cudaStream_t raw(const CudaStream& s) { return s.stream; }

size_t free_device_memory() {
  size_t free_bytes = 0, total = 0;
  if (cudaMemGetInfo(&free_bytes, &total) != cudaSuccess) throw std::runtime_error("cudaMemGetInfo failed");
  return free_bytes;
}

// The header plan_decode writes at the start of a schedule (src/cuda/decode/decode_params.cuh,
// ScheduleHeader): read here to see whether a long request was split over several CTAs.
struct ScheduleHeaderCopy {
  int magic, num_items, num_split_units, block_m, batch_size, num_heads, num_parts, lanes, num_slots,
      max_pieces;
};
constexpr int kScheduleMagic = 0x4d4c4144;

ScheduleHeaderCopy read_schedule_header(const DecodeSchedule& s) {
  ScheduleHeaderCopy h{};
  if (cudaDeviceSynchronize() != cudaSuccess ||
      cudaMemcpy(&h, static_cast<const char*>(s.workspace) + s.header_offset, sizeof h,
                 cudaMemcpyDeviceToHost) != cudaSuccess)
    throw std::runtime_error("reading the schedule header failed");
  return h;
}

// ---------------------------------------------------------------------------------------------
// A paged latent pool on the host (the CPU backend runs on it) with a device copy (the CUDA
// backend runs on that). Pages are handed out in random order; every unwritten entry is NaN.
struct Pool {
  int page_size, num_pages, max_context_len, num_slots;
  DType dtype;
  float k_scale;
  HostTensor cache;         // [P, S, 576]
  HostTensor req_to_token;  // [R, max_context_len] int32, -1 where unassigned
  std::vector<int32_t> free_pages;
  std::mt19937_64 page_rng;
  DeviceCopy d_cache, d_req_to_token;

  Pool(int s, int p, int max_len, int r, DType dt, uint64_t seed, float scale = 1.0f)
      : page_size(s), num_pages(p), max_context_len(max_len), num_slots(r), dtype(dt),
        k_scale(scale), cache(dt, {p, s, kLatentDim}), req_to_token(DType::kInt32, {r, max_len}),
        page_rng(seed) {
    cache.fill_nan();
    for (int64_t i = 0; i < req_to_token.numel(); ++i) req_to_token.i32(i) = -1;
    free_pages.resize(size_t(p));
    std::iota(free_pages.begin(), free_pages.end(), 0);
    std::shuffle(free_pages.begin(), free_pages.end(), page_rng);
    d_cache = DeviceCopy(cache);
    d_req_to_token = DeviceCopy(req_to_token);
  }
  Pool(const Pool&) = delete;
  Pool& operator=(const Pool&) = delete;

  int32_t& slot(int r, int pos) { return req_to_token.i32(int64_t(r) * max_context_len + pos); }

  // Gives request slot r pages for positions [0, len).
  void reserve(int r, int len) {
    if (len > max_context_len) throw std::runtime_error("Pool: length past max_context_len");
    for (int first = 0; first < len; first += page_size) {
      if (slot(r, first) >= 0) continue;
      if (free_pages.empty()) throw std::runtime_error("Pool: out of pages");
      const int page = free_pages.back();
      free_pages.pop_back();
      for (int o = 0; o < page_size && first + o < max_context_len; ++o)
        slot(r, first + o) = page * page_size + o;
    }
  }
  // Returns request slot r's pages to the pool, NaN again, in a new random order.
  void release(int r) {
    for (int first = 0; first < max_context_len; first += page_size) {
      if (slot(r, first) < 0) continue;
      const int page = slot(r, first) / page_size;
      for (int64_t e = 0; e < int64_t(page_size) * kLatentDim; ++e)
        cache.set(int64_t(page) * page_size * kLatentDim + e, std::numeric_limits<float>::quiet_NaN());
      free_pages.push_back(page);
    }
    for (int pos = 0; pos < max_context_len; ++pos) slot(r, pos) = -1;
    std::shuffle(free_pages.begin(), free_pages.end(), page_rng);
  }
  // A random latent row at (r, pos), as an earlier pass would have written it.
  void write_random(int r, int pos, std::mt19937_64& rng) {
    reserve(r, pos + 1);
    std::uniform_real_distribution<float> unit(-1.0f, 1.0f);
    const int64_t base = int64_t(slot(r, pos)) * kLatentDim;
    const float div = dtype == DType::kFP8E4M3 ? k_scale : 1.0f;
    for (int d = 0; d < kLatentDim; ++d) cache.set(base + d, unit(rng) / div);
  }
  // The dequantised latent row at (r, pos).
  std::vector<float> latent(int r, int pos) const {
    const int64_t base = int64_t(req_to_token.i32(int64_t(r) * max_context_len + pos)) * kLatentDim;
    const float mul = dtype == DType::kFP8E4M3 ? k_scale : 1.0f;
    std::vector<float> row(kLatentDim);
    for (int d = 0; d < kLatentDim; ++d) row[size_t(d)] = cache.get(base + d) * mul;
    return row;
  }
  // Host cache and req_to_token -> device.
  void upload() {
    d_cache.upload(cache);
    d_req_to_token.upload(req_to_token);
  }
  // Block table of `slots` with `kv_lens` tokens, derived here from req_to_token (no library
  // code): entry j = req_to_token[r, j * S] / S, -1 past the request's pages.
  HostTensor block_table(const std::vector<int>& slots, const std::vector<int>& kv_lens) {
    int width = 1;
    for (int len : kv_lens) width = std::max(width, (len + page_size - 1) / page_size);
    HostTensor t(DType::kInt32, {int64_t(slots.size()), width});
    for (size_t b = 0; b < slots.size(); ++b)
      for (int j = 0; j < width; ++j)
        t.i32(int64_t(b) * width + j) =
            j < (kv_lens[b] + page_size - 1) / page_size ? slot(slots[b], j * page_size) / page_size : -1;
    return t;
  }
};

BackendConfig make_config(Pool& pool, int heads, bool gpu, DType out_dtype) {
  BackendConfig c;
  c.num_q_heads = heads;
  c.page_size = pool.page_size;
  c.kv_cache_dtype = pool.dtype;
  c.q_dtype = DType::kBF16;
  c.out_dtype = out_dtype;
  c.req_to_token = gpu ? pool.d_req_to_token.view() : pool.req_to_token.view();
  c.max_context_len = pool.max_context_len;
  c.device = gpu ? Device::cuda(0) : Device::cpu();
  c.workspace_bytes = size_t(16) << 20;
  return c;
}

LayerParams make_layer(Pool& pool, bool gpu) {
  LayerParams layer;
  layer.kv_cache = gpu ? pool.d_cache.view() : pool.cache.view();
  layer.k_scale = pool.k_scale;
  layer.softmax_scale = kSoftmaxScale;
  return layer;
}

HostTensor random_tensor(DType dtype, std::vector<int64_t> shape, std::mt19937_64& rng,
                         float range = 1.0f) {
  HostTensor t(dtype, std::move(shape));
  t.fill_uniform(rng, -range, range);
  return t;
}

HostTensor nan_tensor(DType dtype, std::vector<int64_t> shape) {
  HostTensor t(dtype, std::move(shape));
  t.fill_nan();
  return t;
}

std::vector<int32_t> prefix_sums(const std::vector<int32_t>& lens) {
  std::vector<int32_t> cu(lens.size() + 1, 0);
  for (size_t b = 0; b < lens.size(); ++b) cu[b + 1] = cu[b] + lens[b];
  return cu;
}

// Float64 absorbed attention of `q` (host [T, H, 576]) over the pool as it is now: request b
// (slot slots[b]) has q_lens[b] query rows and kv_lens[b] keys, causal (DESIGN §2).
NaiveAttention naive_absorbed(Pool& pool, const TensorView& q, const std::vector<int>& slots,
                              const std::vector<int>& kv_lens, const std::vector<int32_t>& q_lens) {
  HostTensor table = pool.block_table(slots, kv_lens);
  HostTensor kv = int32_tensor(std::vector<int32_t>(kv_lens.begin(), kv_lens.end()));
  HostTensor cu = int32_tensor(prefix_sums(q_lens));
  MlaDecodeArgs a;
  a.q = q;
  a.kv_cache = pool.cache.view();
  a.block_table = table.view();
  a.kv_lens = kv.view();
  a.cu_q_lens = cu.view();
  a.softmax_scale = kSoftmaxScale;
  a.k_scale = pool.k_scale;
  return naive_mla_decode(a);
}

// Writes what append_latent_kv stores into the host cache (the public CPU op), for tests whose
// only backend runs on the GPU.
void mirror_save(Pool& pool, HostTensor& k_nope, HostTensor& k_pe, HostTensor& loc) {
  AppendLatentKvArgs a;
  a.k_nope = k_nope.view();
  a.k_pe = k_pe.view();
  a.loc = loc.view();
  a.kv_cache = pool.cache.view();
  a.k_scale = pool.k_scale;
  append_latent_kv(a);
}

// ---------------------------------------------------------------------------------------------
// Decode-family batches

// A request: `cached` tokens already in the pool, `q_len` new ones computed (and saved) now.
// kv_len = cached + q_len unless given (edge cases with fewer keys than queries).
struct Request {
  int slot;
  int cached;
  int q_len;
  int kv_len = -1;
  int seq_len() const { return kv_len >= 0 ? kv_len : cached + q_len; }
};

struct AbsorbedBatch {
  ForwardMode mode = ForwardMode::kDecode;
  int heads = 0;
  std::vector<Request> requests;
  int64_t num_tokens = 0;
  HostTensor q;               // [T, H, 576] bf16
  HostTensor k_nope, k_pe;    // [T, 512], [T, 64] the new tokens' latents
  HostTensor out, lse;        // [T, H, 512], [T, H], NaN
  HostTensor req_pool_indices, seq_lens, out_cache_loc, extend_seq_lens;  // index dtype
  std::vector<int32_t> seq_lens_cpu, q_lens;
  DeviceCopy d_q, d_k_nope, d_k_pe, d_out, d_lse, d_rpi, d_seq, d_loc, d_ext;

  std::vector<int> slots() const {
    std::vector<int> s;
    for (const Request& r : requests) s.push_back(r.slot);
    return s;
  }
  std::vector<int> kv_lens() const {
    std::vector<int> s;
    for (const Request& r : requests) s.push_back(r.seq_len());
    return s;
  }
  void upload() {
    d_q = DeviceCopy(q);
    d_k_nope = DeviceCopy(k_nope);
    d_k_pe = DeviceCopy(k_pe);
    d_out = DeviceCopy(out);
    d_lse = DeviceCopy(lse);
    d_rpi = DeviceCopy(req_pool_indices);
    d_seq = DeviceCopy(seq_lens);
    d_loc = DeviceCopy(out_cache_loc);
    d_ext = DeviceCopy(extend_seq_lens);
  }
  // host_lengths: seq_lens_cpu (and for DRAFT_EXTEND extend_seq_lens_cpu instead of the device
  // extend_seq_lens) are given.
  ForwardBatch batch(bool gpu, bool host_lengths) {
    ForwardBatch b;
    b.mode = mode;
    b.batch_size = int(requests.size());
    b.req_pool_indices = gpu ? d_rpi.view() : req_pool_indices.view();
    b.seq_lens = gpu ? d_seq.view() : seq_lens.view();
    b.out_cache_loc = gpu ? d_loc.view() : out_cache_loc.view();
    if (host_lengths) b.seq_lens_cpu = seq_lens_cpu;
    if (mode == ForwardMode::kDraftExtend) {
      if (host_lengths) b.extend_seq_lens_cpu = q_lens;
      else b.extend_seq_lens = gpu ? d_ext.view() : extend_seq_lens.view();
    }
    return b;
  }
  AbsorbedAttentionArgs args(bool gpu, bool save = true) {
    AbsorbedAttentionArgs a;
    a.q = gpu ? d_q.view() : q.view();
    a.save_kv_cache = save;
    a.k_nope = gpu ? d_k_nope.view() : k_nope.view();
    a.k_pe = gpu ? d_k_pe.view() : k_pe.view();
    a.out = gpu ? d_out.view() : out.view();
    a.lse = gpu ? d_lse.view() : lse.view();
    return a;
  }
  NaiveAttention reference(Pool& pool) { return naive_absorbed(pool, q.view(), slots(), kv_lens(), q_lens); }
};

// Reserves the requests' pages, fills their cached tokens with random latents (fill_cache), and
// draws queries and new latents.
AbsorbedBatch make_absorbed_batch(Pool& pool, ForwardMode mode, const std::vector<Request>& requests,
                                  int heads, DType index_dtype, std::mt19937_64& rng,
                                  bool fill_cache = true, DType latent_dtype = DType::kFP32,
                                  DType out_dtype = DType::kBF16) {
  AbsorbedBatch p;
  p.mode = mode;
  p.heads = heads;
  p.requests = requests;
  std::vector<int64_t> rpi, seq, loc, q_lens;
  for (const Request& r : requests) {
    pool.reserve(r.slot, std::max(r.seq_len(), r.cached + r.q_len));
    if (fill_cache)
      for (int pos = 0; pos < r.cached; ++pos) pool.write_random(r.slot, pos, rng);
    rpi.push_back(r.slot);
    seq.push_back(r.seq_len());
    q_lens.push_back(r.q_len);
    p.seq_lens_cpu.push_back(r.seq_len());
    p.q_lens.push_back(r.q_len);
    for (int i = 0; i < r.q_len; ++i) loc.push_back(pool.slot(r.slot, r.cached + i));
    p.num_tokens += r.q_len;
  }
  const int64_t t = p.num_tokens;
  p.q = random_tensor(DType::kBF16, {t, heads, kLatentDim}, rng);
  p.k_nope = random_tensor(latent_dtype, {t, kKvLoraRank}, rng);
  p.k_pe = random_tensor(latent_dtype, {t, kRopeDim}, rng);
  p.out = nan_tensor(out_dtype, {t, heads, kKvLoraRank});
  p.lse = nan_tensor(DType::kFP32, {t, heads});
  p.req_pool_indices = index_tensor(index_dtype, rpi);
  p.seq_lens = index_tensor(index_dtype, seq);
  p.out_cache_loc = index_tensor(index_dtype, loc);
  p.extend_seq_lens = index_tensor(index_dtype, q_lens);
  return p;
}

// Compares out/lse of a run with a float64 reference.
void expect_close(const HostTensor& out, const HostTensor& lse, const NaiveAttention& ref,
                  const char* what) {
  const Tolerance tol = out_tolerance(out.dtype);
  EXPECT_TRUE(all_close(out.to_float(), ref.out, tol.atol, tol.rtol)) << what << ": out";
  EXPECT_TRUE(all_close(lse.to_float(), ref.lse, kLseTolerance.atol, kLseTolerance.rtol)) << what << ": lse";
}
void expect_close(const HostTensor& out, const HostTensor& lse, const HostTensor& ref_out,
                  const HostTensor& ref_lse, const char* what) {
  NaiveAttention ref{to_double(ref_out.to_float()), to_double(ref_lse.to_float())};
  expect_close(out, lse, ref, what);
}

struct DecodeFamilyCase {
  int page_size = 64;
  int heads = 16;
  ForwardMode mode = ForwardMode::kDecode;
  std::vector<Request> requests;
  bool host_lengths = true;
  DType index_dtype = DType::kInt32;
  DType kv_dtype = DType::kBF16;
  float k_scale = 1.0f;
  DType out_dtype = DType::kBF16;
  int num_draft_tokens = 3;  // BackendConfig: TARGET_VERIFY rows, DRAFT_EXTEND bound
  int max_context_len = 512;
  bool save = true;
  bool expect_split = false;
  bool deterministic = false;  // BackendConfig::deterministic on the CUDA backend
  int split_keys = 0;          // BackendConfig::deterministic_split_keys
  uint64_t seed = 1;

  std::string describe() const {
    return std::string(forward_mode_name(mode)) + (deterministic ? " deterministic" : "") +
           (split_keys > 0 ? " split_keys " + std::to_string(split_keys) : "") + " page " + std::to_string(page_size) + " heads " +
           std::to_string(heads) + (host_lengths ? " host" : " device") + " lengths, " +
           std::string(dtype_name(index_dtype)) + " indices, " + std::string(dtype_name(kv_dtype)) +
           " cache, " + std::string(dtype_name(out_dtype)) + " out";
  }
};

// The batch through a CPU Backend and a CUDA Backend; both against the float64 naive and
// against each other, caches bit for bit.
void check_decode_family(const DecodeFamilyCase& c) {
  SCOPED_TRACE(c.describe());
  std::mt19937_64 rng(c.seed);
  int pages = 4, slots = 1;
  for (const Request& r : c.requests) {
    pages += (std::max(r.seq_len(), r.cached + r.q_len) + c.page_size - 1) / c.page_size;
    slots = std::max(slots, r.slot + 1);
  }
  Pool pool(c.page_size, pages, c.max_context_len, slots, c.kv_dtype, rng(), c.k_scale);
  AbsorbedBatch b = make_absorbed_batch(pool, c.mode, c.requests, c.heads, c.index_dtype, rng, true,
                                        DType::kFP32, c.out_dtype);
  pool.upload();
  b.upload();

  BackendConfig cpu_config = make_config(pool, c.heads, false, c.out_dtype);
  BackendConfig gpu_config = make_config(pool, c.heads, true, c.out_dtype);
  cpu_config.num_draft_tokens = gpu_config.num_draft_tokens = c.num_draft_tokens;
  gpu_config.deterministic = c.deterministic;
  gpu_config.deterministic_split_keys = c.split_keys;
  Backend cpu(cpu_config), gpu(gpu_config);
  CudaStream stream;

  const ForwardBatch cpu_batch = b.batch(false, c.host_lengths);
  cpu.init_forward_metadata(cpu_batch);
  cpu.forward_decode(cpu_batch, make_layer(pool, false), b.args(false, c.save));

  const ForwardBatch gpu_batch = b.batch(true, c.host_lengths);
  gpu.init_forward_metadata(gpu_batch, stream.get());
  const Plan& plan = gpu.plan();
  EXPECT_EQ(plan.batch_size, int(c.requests.size()));
  EXPECT_EQ(plan.max_blocks, cpu.plan().max_blocks);
  EXPECT_EQ(plan.num_tokens, cpu.plan().num_tokens);
  if (c.deterministic && c.split_keys == 0) {
    ASSERT_EQ(plan.schedule, nullptr) << "a deterministic plan without split keys runs unsplit";
  } else {
    ASSERT_NE(plan.schedule, nullptr) << "a CUDA plan carries a split-KV schedule";
    EXPECT_EQ(plan.schedule->split_keys, c.deterministic ? c.split_keys : 0);
  }
  gpu.forward_decode(gpu_batch, make_layer(pool, true), b.args(true, c.save), stream.get());
  MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

  if (plan.schedule != nullptr) {
    const ScheduleHeaderCopy header = read_schedule_header(*gpu.plan().schedule);
    EXPECT_EQ(header.magic, kScheduleMagic);
    EXPECT_EQ(header.batch_size, int(c.requests.size()));
    EXPECT_EQ(header.num_heads, c.heads);
    if (c.expect_split) EXPECT_GE(header.num_split_units, 1) << "the long request was not split";
  }

  const HostTensor out = b.d_out.download(), lse = b.d_lse.download();
  EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the saves";
  const NaiveAttention ref = b.reference(pool);
  expect_close(out, lse, ref, "CUDA backend vs float64 naive");
  expect_close(b.out, b.lse, ref, "CPU backend vs float64 naive");
  expect_close(out, lse, b.out, b.lse, "CUDA backend vs CPU backend");
}

std::vector<Request> fixed_requests(const std::vector<int>& cached, int q_len) {
  std::vector<Request> r;
  for (size_t b = 0; b < cached.size(); ++b) r.push_back({int(cached.size() - b), cached[b], q_len});
  return r;
}

TEST(GpuBackend, DecodeFamilyMatchesCpuBackend) {
  MLA_REQUIRE_GPU();
  uint64_t seed = 100;
  for (int page_size : {1, 16, 64}) {
    for (int heads : {16, 128}) {
      // Short kv lengths (the 128-head references stay cheap); 0 = only the new tokens.
      const std::vector<int> cached = heads == 128 ? std::vector<int>{0, 3, 40, 70}
                                                   : std::vector<int>{0, 5, 63, 64, 130, 200};
      for (bool host_lengths : {true, false}) {
        DecodeFamilyCase c;
        c.page_size = page_size;
        c.heads = heads;
        c.host_lengths = host_lengths;
        c.index_dtype = host_lengths ? DType::kInt32 : DType::kInt64;
        c.seed = ++seed;

        c.mode = ForwardMode::kDecode;
        c.requests = fixed_requests(cached, 1);
        check_decode_family(c);

        c.mode = ForwardMode::kTargetVerify;
        c.requests = fixed_requests(cached, 3);
        c.seed = ++seed;
        check_decode_family(c);

        c.mode = ForwardMode::kDraftExtend;  // variable lengths, one request with none
        c.num_draft_tokens = 4;
        c.requests.clear();
        const int q_lens[] = {2, 0, 4, 1, 3, 1};
        for (size_t b = 0; b < cached.size(); ++b)
          c.requests.push_back({int(b) + 2, cached[b], q_lens[b]});
        c.seed = ++seed;
        check_decode_family(c);
      }
    }
  }
}

TEST(GpuBackend, DecodeFamilyFp8CacheAndFp32Output) {
  MLA_REQUIRE_GPU();
  DecodeFamilyCase c;
  c.kv_dtype = DType::kFP8E4M3;
  c.k_scale = 0.5f;
  c.out_dtype = DType::kFP32;
  c.requests = fixed_requests({70, 3, 128}, 1);
  c.seed = 7;
  check_decode_family(c);
  c.mode = ForwardMode::kTargetVerify;
  c.requests = fixed_requests({70, 0, 128}, 3);
  check_decode_family(c);
}

// Rows without keys: a DECODE request with seq_len 0 and DRAFT_EXTEND requests with no queries
// or with more queries than keys give out 0 and lse -inf, never NaN. Nothing is saved: every
// request's keys are tokens already cached (kv_len <= cached).
TEST(GpuBackend, EmptyRowsMatchCpuBackend) {
  MLA_REQUIRE_GPU();
  DecodeFamilyCase c;
  c.page_size = 4;
  c.heads = 16;
  c.save = false;
  c.requests = {{0, 5, 1, 5}, {1, 0, 1, 0}, {2, 9, 1, 9}};
  c.seed = 11;
  check_decode_family(c);
  c.mode = ForwardMode::kDraftExtend;
  c.num_draft_tokens = 2;
  c.requests = {{3, 2, 2, 1}, {0, 6, 0}, {1, 0, 2, 0}, {2, 9, 2, 9}};
  for (bool host_lengths : {true, false}) {
    c.host_lengths = host_lengths;
    check_decode_family(c);
  }
}

// DRAFT_EXTEND planned from device lengths alone takes its query count from the queries, so an
// engine may pass more rows than the lengths add up to (a padded batch): those rows come out 0
// with lse -inf, whatever the output held, and the other rows have the unpadded call's bits.
TEST(GpuBackend, DraftExtendPaddedQueriesGiveEmptyRows) {
  MLA_REQUIRE_GPU();
  std::mt19937_64 rng(43);
  const int heads = 16, pad = 5;
  Pool pool(16, 40, 512, 4, DType::kBF16, rng());
  // Nothing is saved: every request's keys are tokens already cached.
  AbsorbedBatch b = make_absorbed_batch(pool, ForwardMode::kDraftExtend,
                                        {{0, 40, 2, 40}, {1, 7, 0, 7}, {2, 100, 3, 100}}, heads,
                                        DType::kInt32, rng);
  pool.upload();
  b.upload();
  BackendConfig config = make_config(pool, heads, true, DType::kBF16);
  config.num_draft_tokens = 3;
  for (bool split : {true, false}) {  // unsplit: the deterministic mode without split keys
    SCOPED_TRACE(split ? "split-KV schedule" : "unsplit");
    config.deterministic = !split;
    Backend gpu(config);
    CudaStream stream;
    const LayerParams layer = make_layer(pool, true);
    const ForwardBatch batch = b.batch(true, false);
    gpu.init_forward_metadata(batch, stream.get());
    b.d_out.upload(b.out);
    b.d_lse.upload(b.lse);
    gpu.forward_decode(batch, layer, b.args(true, false), stream.get());
    MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
    const HostTensor out = b.d_out.download(), lse = b.d_lse.download();

    const int64_t T = b.num_tokens, rows = T + pad;
    HostTensor q(DType::kBF16, {rows, heads, kLatentDim}), out_pad(DType::kBF16, {rows, heads, kKvLoraRank}),
        lse_pad(DType::kFP32, {rows, heads});
    q.fill_nan();
    out_pad.fill_nan();
    lse_pad.fill_nan();
    std::copy(b.q.bytes.begin(), b.q.bytes.end(), q.bytes.begin());
    DeviceCopy d_q(q), d_out(out_pad), d_lse(lse_pad);
    AbsorbedAttentionArgs args = b.args(true, false);
    args.q = d_q.view();
    args.out = d_out.view();
    args.lse = d_lse.view();
    gpu.forward_decode(batch, layer, args, stream.get());
    MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
    const HostTensor got_out = d_out.download(), got_lse = d_lse.download();
    EXPECT_TRUE(std::equal(out.bytes.begin(), out.bytes.end(), got_out.bytes.begin()));
    EXPECT_TRUE(std::equal(lse.bytes.begin(), lse.bytes.end(), got_lse.bytes.begin()));
    int64_t bad = 0;
    for (int64_t i = T * heads * kKvLoraRank; i < got_out.numel(); ++i) bad += got_out.get(i) != 0.0f;
    for (int64_t i = T * heads; i < got_lse.numel(); ++i)
      bad += !(std::isinf(got_lse.get(i)) && got_lse.get(i) < 0);
    EXPECT_EQ(bad, 0) << "padding rows that are not 0 / -inf";
  }
}

// Data-parallel padding grew the batch after it was planned (DESIGN §4): forward_decode re-plans
// on the device instead of reading past the plan (the split-KV schedule grows with it), for a
// long request that splits and in every decode-family mode, with device lengths only for the
// grown batch; the outputs match the float64 naive.
TEST(GpuBackend, LargerBatchThanPlannedIsReplanned) {
  MLA_REQUIRE_GPU();
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    SCOPED_TRACE(forward_mode_name(mode));
    std::mt19937_64 rng(uint64_t(mode) + 44);
    const int heads = 16, k = mode == ForwardMode::kDecode ? 1 : 2;
    Pool pool(16, 400, 4096, 4, DType::kBF16, rng());
    const int q3 = mode == ForwardMode::kDraftExtend ? 1 : k;  // DRAFT_EXTEND: fewer than the bound
    AbsorbedBatch b = make_absorbed_batch(pool, mode, {{0, 40, k}, {1, 3000, k}, {2, 7, q3}}, heads,
                                          DType::kInt32, rng);
    pool.upload();
    b.upload();
    BackendConfig config = make_config(pool, heads, true, DType::kBF16);
    config.num_draft_tokens = k;
    Backend gpu(config);
    CudaStream stream;
    const LayerParams layer = make_layer(pool, true);
    ForwardBatch planned = b.batch(true, false);
    planned.batch_size = 1;  // planned before the padding added two requests
    gpu.init_forward_metadata(planned, stream.get());
    ASSERT_EQ(gpu.plan().batch_size, 1);
    gpu.forward_decode(b.batch(true, false), layer, b.args(true), stream.get());
    MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
    EXPECT_EQ(gpu.plan().batch_size, 3);
    EXPECT_NE(gpu.plan().schedule, nullptr);
    mirror_save(pool, b.k_nope, b.k_pe, b.out_cache_loc);
    EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the saves";
    expect_close(b.d_out.download(), b.d_lse.download(), b.reference(pool), "re-planned forward");
  }
}

// BackendConfig::check_metadata: device lengths that outgrow the block table (its width taken
// from stale seq_lens_cpu) are reported when the batch is planned, as on the CPU; without it
// nothing is (the kernels clamp the lengths to the table). A new token's cache slot past the
// pool and a request index past req_to_token are reported too.
TEST(GpuBackend, CheckMetadataReportsLengthsPastTheBlockTable) {
  MLA_REQUIRE_GPU();
  std::mt19937_64 rng(17);
  Pool pool(64, 12, 512, 3, DType::kBF16, rng());
  AbsorbedBatch b = make_absorbed_batch(pool, ForwardMode::kDecode, {{1, 300, 1}, {2, 9, 1}}, 16,
                                        DType::kInt32, rng);
  pool.upload();
  b.upload();
  BackendConfig config = make_config(pool, 16, true, DType::kBF16);
  ForwardBatch batch = b.batch(true, true);
  const std::vector<int32_t> stale = {10, 10};  // the table gets 2 pages (128 tokens) a request
  batch.seq_lens_cpu = stale;
  CudaStream stream;
  config.check_metadata = true;
  Backend checked(config);
  // Named when the batch is planned, as on the CPU (the device lengths read back in this mode).
  EXPECT_TRUE(throws_error([&] { checked.init_forward_metadata(batch, stream.get()); },
                           {"batch.seq_lens[0] = 301 does not fit the block table of 128 tokens",
                            "batch.seq_lens_cpu (stale?)"}));
  config.check_metadata = false;
  Backend unchecked(config);
  unchecked.init_forward_metadata(batch, stream.get());
  EXPECT_NO_THROW(unchecked.forward_decode(batch, make_layer(pool, true), b.args(true, false), stream.get()));
  MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

  // A new token's cache slot past the pool (12 pages of 64): named by the save, before anything
  // is written (the save runs first).
  config.check_metadata = true;
  Backend saving(config);
  const ForwardBatch good = b.batch(true, true);
  saving.init_forward_metadata(good, stream.get());
  HostTensor bad_loc = index_tensor(DType::kInt32, {int64_t(pool.slot(1, 300)), 12 * 64 + 3});
  DeviceCopy d_bad_loc(bad_loc);
  ForwardBatch bad = good;
  bad.out_cache_loc = d_bad_loc.view();
  EXPECT_TRUE(throws_error([&] { saving.forward_decode(bad, make_layer(pool, true), b.args(true, true), stream.get()); },
                           {"append_latent_kv: loc[1] = 771", "out of range"}));
  EXPECT_NO_THROW(saving.forward_decode(good, make_layer(pool, true), b.args(true, true), stream.get()));
  MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

  // A request index past req_to_token's 3 rows: named when the batch is planned.
  HostTensor bad_rpi = index_tensor(DType::kInt32, {1, 7});
  DeviceCopy d_bad_rpi(bad_rpi);
  ForwardBatch bad_request = good;
  bad_request.req_pool_indices = d_bad_rpi.view();
  EXPECT_TRUE(throws_error([&] { saving.init_forward_metadata(bad_request, stream.get()); },
                           {"build_block_table: req_pool_indices[1] = 7", "out of range [0, 3)"}));

  // A negative device length, named under the engine's argument as on the CPU.
  HostTensor bad_seq = index_tensor(DType::kInt64, {301, -4});
  DeviceCopy d_bad_seq(bad_seq);
  ForwardBatch bad_length = good;
  bad_length.seq_lens = d_bad_seq.view();
  bad_length.seq_lens_cpu = {};
  EXPECT_TRUE(throws_error([&] { saving.init_forward_metadata(bad_length, stream.get()); },
                           {"batch.seq_lens[1] = -4", "is not a length of 0 to 2^31 - 1 tokens"}));
}

// The eager split-KV schedule grows by half again at least (a batch that grows a request a step
// does not reallocate it every step); a deterministic one grows to the batch.
TEST(GpuBackend, EagerScheduleGrowsByHalfAgain) {
  MLA_REQUIRE_GPU();
  for (const bool deterministic : {false, true}) {
    SCOPED_TRACE(deterministic ? "deterministic split" : "balanced");
    std::mt19937_64 rng(deterministic ? 36 : 35);
    Pool pool(64, 48, 512, 24, DType::kBF16, rng());
    BackendConfig config = make_config(pool, 16, true, DType::kBF16);
    config.deterministic = deterministic;
    config.deterministic_split_keys = deterministic ? 256 : 0;
    Backend gpu(config);
    CudaStream stream;
    const std::vector<std::pair<int, int>> steps =
        deterministic ? std::vector<std::pair<int, int>>{{10, 10}, {11, 11}, {16, 16}}
                      : std::vector<std::pair<int, int>>{{10, 10}, {11, 15}, {15, 15}, {16, 22}};
    for (const auto& [bs, capacity] : steps) {
      std::vector<Request> requests;
      for (int b = 0; b < bs; ++b) requests.push_back({b, 100 + b, 1});
      AbsorbedBatch batch = make_absorbed_batch(pool, ForwardMode::kDecode, requests, 16,
                                                DType::kInt32, rng);
      pool.upload();
      batch.upload();
      gpu.init_forward_metadata(batch.batch(true, true), stream.get());
      ASSERT_NE(gpu.plan().schedule, nullptr);
      EXPECT_EQ(gpu.plan().schedule->max_batch, capacity) << "a batch of " << bs;
    }
  }
}

// A 16k-token request next to short ones: the GPU scheduler splits it over several CTAs.
TEST(GpuBackend, LongRequestIsSplitAndMatchesCpuBackend) {
  MLA_REQUIRE_GPU();
  DecodeFamilyCase c;
  c.page_size = 128;
  c.heads = 16;
  c.out_dtype = DType::kFP32;
  c.max_context_len = 16384 + 128;
  c.expect_split = true;
  c.requests = {{0, 16383, 1}, {1, 5, 1}, {2, 700, 1}};
  c.seed = 16;
  check_decode_family(c);
  c.mode = ForwardMode::kTargetVerify;
  c.requests = {{0, 16381, 3}, {1, 0, 3}, {2, 700, 3}};
  c.host_lengths = false;
  check_decode_family(c);
}

// BackendConfig::deterministic: without deterministic_split_keys no schedule is planned; with
// it (1024) a deterministic schedule splits the long requests at the multiples of 1024 keys. In
// both, every mode matches the CPU backend (a request's bits across batches are mla_decode's,
// tested in test_gpu_decode.cpp).
TEST(GpuBackend, DeterministicDecodeFamilyMatchesCpuBackend) {
  MLA_REQUIRE_GPU();
  for (int split_keys : {0, 1024}) {
    DecodeFamilyCase c;
    c.page_size = 64;
    c.heads = 16;
    c.deterministic = true;
    c.split_keys = split_keys;
    c.expect_split = split_keys > 0;
    c.max_context_len = 8192;
    c.requests = {{0, 8000, 1}, {1, 5, 1}, {2, 700, 1}, {3, 0, 1}};
    c.seed = 31;
    check_decode_family(c);
    c.heads = 128;
    c.mode = ForwardMode::kTargetVerify;
    c.requests = {{0, 3000, 3}, {1, 0, 3}, {2, 64, 3}};
    c.host_lengths = false;
    check_decode_family(c);
    c.mode = ForwardMode::kDraftExtend;
    c.requests = {{0, 2200, 2}, {1, 9, 3}, {2, 70, 1}};
    check_decode_family(c);
  }
}

// The backend's rope path (rope_quantize into the workspace, then save and attend), with the
// query as one tensor and as q_nope + q_pe: CUDA equals CPU (the CPU path is checked against a
// float64 naive in tests/cpu/test_backend.cpp). Roped latents may round to neighbouring bf16
// values on the two devices: the caches agree within one bf16 ulp.
TEST(GpuBackend, RopePathAndSplitQueryMatchCpuBackend) {
  MLA_REQUIRE_GPU();
  const int heads = 16, max_position = 1024;
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify}) {
    for (bool split_q : {false, true}) {
      SCOPED_TRACE(std::string(forward_mode_name(mode)) + (split_q ? " q_nope + q_pe" : " q"));
      std::mt19937_64 rng(split_q ? 41 : 42);
      const int q_len = mode == ForwardMode::kDecode ? 1 : 3;
      Pool pool(64, 16, 512, 4, DType::kBF16, rng());
      AbsorbedBatch b = make_absorbed_batch(pool, mode, fixed_requests({0, 37, 300}, q_len), heads,
                                            DType::kInt32, rng, true, DType::kBF16);
      HostTensor positions(DType::kInt64, {b.num_tokens});
      for (int64_t t = 0, row = 0; t < int64_t(b.requests.size()); ++t)
        for (int i = 0; i < b.requests[size_t(t)].q_len; ++i, ++row)
          positions.i64(row) = b.requests[size_t(t)].cached + i;
      HostTensor cos_sin(DType::kFP32, {max_position, kRopeDim});
      for (int pos = 0; pos < max_position; ++pos)
        for (int i = 0; i < kRopeDim / 2; ++i) {
          const double angle = pos * std::pow(10000.0, -2.0 * i / kRopeDim);
          cos_sin.set(int64_t(pos) * kRopeDim + i, float(std::cos(angle)));
          cos_sin.set(int64_t(pos) * kRopeDim + kRopeDim / 2 + i, float(std::sin(angle)));
        }
      // The split form: q_nope [T, H, 512] and q_pe [T, H, 64] as separate tensors.
      HostTensor q_nope(DType::kBF16, {b.num_tokens, heads, kKvLoraRank});
      HostTensor q_pe(DType::kBF16, {b.num_tokens, heads, kRopeDim});
      for (int64_t row = 0; row < b.num_tokens * heads; ++row) {
        for (int d = 0; d < kKvLoraRank; ++d) q_nope.set(row * kKvLoraRank + d, b.q.get(row * kLatentDim + d));
        for (int d = 0; d < kRopeDim; ++d) q_pe.set(row * kRopeDim + d, b.q.get(row * kLatentDim + kKvLoraRank + d));
      }
      pool.upload();
      b.upload();
      DeviceCopy d_positions(positions), d_cos_sin(cos_sin), d_q_nope(q_nope), d_q_pe(q_pe);

      BackendConfig cpu_config = make_config(pool, heads, false, DType::kBF16);
      BackendConfig gpu_config = make_config(pool, heads, true, DType::kBF16);
      cpu_config.num_draft_tokens = gpu_config.num_draft_tokens = 3;
      Backend cpu(cpu_config), gpu(gpu_config);
      CudaStream stream;
      const auto run = [&](Backend& backend, bool gpu_side) {
        ForwardBatch batch = b.batch(gpu_side, true);
        batch.positions = gpu_side ? d_positions.view() : positions.view();
        AbsorbedAttentionArgs args = b.args(gpu_side);
        if (split_q) {
          args.q = TensorView{};
          args.q_nope = gpu_side ? d_q_nope.view() : q_nope.view();
          args.q_pe = gpu_side ? d_q_pe.view() : q_pe.view();
        }
        args.cos_sin_cache = gpu_side ? d_cos_sin.view() : cos_sin.view();
        args.rope_style = RopeStyle::kNeox;
        backend.init_forward_metadata(batch, gpu_side ? stream.get() : nullptr);
        backend.forward_decode(batch, make_layer(pool, gpu_side), args, gpu_side ? stream.get() : nullptr);
      };
      run(cpu, false);
      run(gpu, true);
      MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
      // The inputs are read only: the query tensors are unchanged.
      EXPECT_TRUE(bitwise_equal(b.d_q.download(), b.q));
      EXPECT_TRUE(bitwise_equal(d_q_pe.download(), q_pe));
      const HostTensor gpu_cache = pool.d_cache.download();
      EXPECT_TRUE(all_close(gpu_cache.to_float(), to_double(pool.cache.to_float()), 1e-6, 1.0 / 128))
          << "cache after the roped saves";
      const HostTensor out = b.d_out.download();
      expect_close(out, b.d_lse.download(), b.out, b.lse, "CUDA backend vs CPU backend");
      // Never NaN: the roped queries and keys are finite, so every output is.
      for (float x : out.to_float()) ASSERT_TRUE(std::isfinite(x));
    }
  }
}

// ---------------------------------------------------------------------------------------------
// EXTEND

// The test model's up-projection, per head: k_nope = W_UK c and v = W_UV c (128 each) from the
// 512-wide c_kv, with sparse random W (kTaps terms per output, so 128 heads stay cheap); the
// key's rope part is the cached k_pe. Results are rounded to bf16 (HostTensor::set).
struct UpProjection {
  static constexpr int kTaps = 8;
  int heads;
  std::vector<int> k_index, v_index;   // [H, 128, kTaps] columns of c
  std::vector<float> k_weight, v_weight;

  UpProjection(int h, std::mt19937_64& rng) : heads(h) {
    const size_t n = size_t(h) * 128 * kTaps;
    std::uniform_int_distribution<int> column(0, kKvLoraRank - 1);
    std::uniform_real_distribution<float> weight(-0.35f, 0.35f);
    for (size_t i = 0; i < n; ++i) {
      k_index.push_back(column(rng));
      v_index.push_back(column(rng));
      k_weight.push_back(weight(rng));
      v_weight.push_back(weight(rng));
    }
  }
  // Row `row` of k [N, H, 192] and v [N, H, 128] from one dequantised latent row.
  void project(const float* latent, HostTensor& k, HostTensor& v, int64_t row) const {
    for (int h = 0; h < heads; ++h) {
      for (int i = 0; i < 128; ++i) {
        const size_t at = (size_t(h) * 128 + size_t(i)) * kTaps;
        double sk = 0, sv = 0;
        for (int t = 0; t < kTaps; ++t) {
          sk += double(k_weight[at + t]) * latent[k_index[at + t]];
          sv += double(v_weight[at + t]) * latent[v_index[at + t]];
        }
        k.set((row * heads + h) * 192 + i, float(sk));
        v.set((row * heads + h) * 128 + i, float(sv));
      }
      for (int j = 0; j < kRopeDim; ++j) k.set((row * heads + h) * 192 + 128 + j, latent[kKvLoraRank + j]);
    }
  }
};

struct ExtendBatch {
  int heads = 0;
  std::vector<int> slots;
  std::vector<int32_t> prefix, extend, seq_lens_cpu;
  int64_t num_tokens = 0;
  HostTensor q, k, v;          // MHA, new tokens: [T, H, 192], [T, H, 192], [T, H, 128] bf16
  HostTensor q_abs;            // absorbed: [T, H, 576] bf16
  HostTensor k_nope, k_pe;     // [T, 512], [T, 64] fp32 latents of the new tokens
  HostTensor out, lse;         // [T, H, 128] bf16, [T, H]
  HostTensor out_abs, lse_abs; // [T, H, 512] bf16, [T, H]
  HostTensor req_pool_indices, seq_lens, out_cache_loc;
  DeviceCopy d_q, d_k, d_v, d_q_abs, d_k_nope, d_k_pe, d_out, d_lse, d_out_abs, d_lse_abs, d_rpi,
      d_seq, d_loc;

  void upload() {
    d_q = DeviceCopy(q);
    d_k = DeviceCopy(k);
    d_v = DeviceCopy(v);
    d_q_abs = DeviceCopy(q_abs);
    d_k_nope = DeviceCopy(k_nope);
    d_k_pe = DeviceCopy(k_pe);
    d_out = DeviceCopy(out);
    d_lse = DeviceCopy(lse);
    d_out_abs = DeviceCopy(out_abs);
    d_lse_abs = DeviceCopy(lse_abs);
    d_rpi = DeviceCopy(req_pool_indices);
    d_seq = DeviceCopy(seq_lens);
    d_loc = DeviceCopy(out_cache_loc);
  }
  ForwardBatch batch(bool gpu) {
    ForwardBatch b;
    b.mode = ForwardMode::kExtend;
    b.batch_size = int(slots.size());
    b.req_pool_indices = gpu ? d_rpi.view() : req_pool_indices.view();
    b.seq_lens = gpu ? d_seq.view() : seq_lens.view();
    b.out_cache_loc = gpu ? d_loc.view() : out_cache_loc.view();
    b.seq_lens_cpu = seq_lens_cpu;
    b.extend_seq_lens_cpu = extend;
    b.extend_prefix_lens_cpu = prefix;
    return b;
  }
  MhaAttentionArgs mha_args(bool gpu) {
    MhaAttentionArgs a;
    a.q = gpu ? d_q.view() : q.view();
    a.k = gpu ? d_k.view() : k.view();
    a.v = gpu ? d_v.view() : v.view();
    a.out = gpu ? d_out.view() : out.view();
    a.lse = gpu ? d_lse.view() : lse.view();
    return a;
  }
  AbsorbedAttentionArgs absorbed_args(bool gpu) {
    AbsorbedAttentionArgs a;
    a.q = gpu ? d_q_abs.view() : q_abs.view();
    a.k_nope = gpu ? d_k_nope.view() : k_nope.view();
    a.k_pe = gpu ? d_k_pe.view() : k_pe.view();
    a.out = gpu ? d_out_abs.view() : out_abs.view();
    a.lse = gpu ? d_lse_abs.view() : lse_abs.view();
    return a;
  }
};

ExtendBatch make_extend_batch(Pool& pool, const UpProjection& proj, const std::vector<int>& slots,
                              const std::vector<int32_t>& prefix, const std::vector<int32_t>& extend,
                              std::mt19937_64& rng) {
  const int heads = proj.heads;
  ExtendBatch p;
  p.heads = heads;
  p.slots = slots;
  p.prefix = prefix;
  p.extend = extend;
  for (int32_t e : extend) p.num_tokens += e;
  const int64_t t_count = p.num_tokens;
  p.q = random_tensor(DType::kBF16, {t_count, heads, 192}, rng);
  p.q_abs = random_tensor(DType::kBF16, {t_count, heads, kLatentDim}, rng);
  p.k_nope = random_tensor(DType::kFP32, {t_count, kKvLoraRank}, rng);
  p.k_pe = random_tensor(DType::kFP32, {t_count, kRopeDim}, rng);
  p.k = HostTensor(DType::kBF16, {t_count, heads, 192});
  p.v = HostTensor(DType::kBF16, {t_count, heads, 128});
  std::vector<int64_t> loc, rpi, seq;
  int64_t t = 0;
  for (size_t b = 0; b < slots.size(); ++b) {
    pool.reserve(slots[b], prefix[b] + extend[b]);
    for (int pos = 0; pos < prefix[b]; ++pos) pool.write_random(slots[b], pos, rng);
    for (int i = 0; i < extend[b]; ++i, ++t) {
      loc.push_back(pool.slot(slots[b], prefix[b] + i));
      // The new token's MHA key and value, from its latent as the cache will hold it.
      HostTensor stored(pool.dtype, {kLatentDim});
      for (int d = 0; d < kKvLoraRank; ++d) stored.set(d, p.k_nope.get(t * kKvLoraRank + d));
      for (int d = 0; d < kRopeDim; ++d) stored.set(kKvLoraRank + d, p.k_pe.get(t * kRopeDim + d));
      const std::vector<float> latent = stored.to_float();
      proj.project(latent.data(), p.k, p.v, t);
    }
    rpi.push_back(slots[b]);
    seq.push_back(prefix[b] + extend[b]);
    p.seq_lens_cpu.push_back(prefix[b] + extend[b]);
  }
  p.out = nan_tensor(DType::kBF16, {t_count, heads, 128});
  p.lse = nan_tensor(DType::kFP32, {t_count, heads});
  p.out_abs = nan_tensor(DType::kBF16, {t_count, heads, kKvLoraRank});
  p.lse_abs = nan_tensor(DType::kFP32, {t_count, heads});
  p.req_pool_indices = index_tensor(DType::kInt32, rpi);
  p.seq_lens = index_tensor(DType::kInt32, seq);
  p.out_cache_loc = index_tensor(DType::kInt64, loc);
  return p;
}

// One-shot causal MHA over prefix + new tokens (float64): new token i of request b sees
// positions 0 .. prefix_b + i, keys and values up-projected from the pool's latents.
NaiveAttention naive_extend_mha(Pool& pool, const UpProjection& proj, ExtendBatch& p) {
  int64_t total = 0;
  for (int32_t s : p.seq_lens_cpu) total += s;
  HostTensor k(DType::kBF16, {total, p.heads, 192}), v(DType::kBF16, {total, p.heads, 128});
  int64_t row = 0;
  for (size_t b = 0; b < p.slots.size(); ++b)
    for (int pos = 0; pos < p.seq_lens_cpu[b]; ++pos, ++row) {
      const std::vector<float> latent = pool.latent(p.slots[b], pos);
      proj.project(latent.data(), k, v, row);
    }
  HostTensor cu_q = int32_tensor(prefix_sums(p.extend)), cu_kv = int32_tensor(prefix_sums(p.seq_lens_cpu));
  MhaPrefillArgs a;
  a.q = p.q.view();
  a.k = k.view();
  a.v = v.view();
  a.cu_q_lens = cu_q.view();
  a.cu_kv_lens = cu_kv.view();
  a.causal = true;
  a.softmax_scale = kSoftmaxScale;
  return naive_mha_prefill(a);
}

struct ExtendCase {
  int page_size;
  int heads;
  int64_t capacity;
  std::vector<int32_t> prefix, extend;
};

// The model's up-projection callback. On the GPU it waits for the gather on the backend's stream
// (the one the call was given), reads the latents back, projects on the host and writes k and v
// in that stream's order. Records the gathered latents.
UpProjectFn make_up_project(const UpProjection& proj, Pool& pool, bool gpu, cudaStream_t expected,
                            std::vector<HostTensor>& gathered) {
  return [&proj, &pool, gpu, expected, &gathered](int chunk_idx, const TensorView& latent,
                                                   const TensorView& k, const TensorView& v,
                                                   Stream given) {
    const auto stream = static_cast<cudaStream_t>(given);
    EXPECT_EQ(stream, expected);
    EXPECT_EQ(size_t(chunk_idx), gathered.size());
    EXPECT_TRUE(latent.is_contiguous() && k.is_contiguous() && v.is_contiguous());
    const int64_t n = latent.shape[0];
    HostTensor rows(latent.dtype, {n, kLatentDim});
    HostTensor kh(k.dtype, {n, proj.heads, 192}), vh(v.dtype, {n, proj.heads, 128});
    if (gpu) {
      if (cudaStreamSynchronize(stream) != cudaSuccess ||
          cudaMemcpy(rows.data(), latent.data, rows.bytes.size(), cudaMemcpyDeviceToHost) != cudaSuccess)
        throw std::runtime_error("up_project: reading the gathered latents failed");
    } else {
      std::memcpy(rows.data(), latent.data, rows.bytes.size());
    }
    const float mul = latent.dtype == DType::kFP8E4M3 ? pool.k_scale : 1.0f;
    std::vector<float> row(kLatentDim);
    for (int64_t i = 0; i < n; ++i) {
      for (int d = 0; d < kLatentDim; ++d) row[size_t(d)] = rows.get(i * kLatentDim + d) * mul;
      proj.project(row.data(), kh, vh, i);
    }
    if (gpu) {
      if (cudaMemcpyAsync(k.data, kh.data(), kh.bytes.size(), cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaMemcpyAsync(v.data, vh.data(), vh.bytes.size(), cudaMemcpyHostToDevice, stream) != cudaSuccess ||
          cudaStreamSynchronize(stream) != cudaSuccess)
        throw std::runtime_error("up_project: writing k and v failed");
    } else {
      std::memcpy(k.data, kh.data(), kh.bytes.size());
      std::memcpy(v.data, vh.data(), vh.bytes.size());
    }
    gathered.push_back(std::move(rows));
  };
}

TEST(GpuBackend, ExtendChunkedAndAbsorbedMatchCpuBackend) {
  MLA_REQUIRE_GPU();
  const ExtendCase cases[] = {
      {1, 16, 7, {0, 9, 21, 5}, {4, 1, 6, 0}},  // chunk boundaries inside requests
      {64, 128, 32, {70, 3}, {2, 5}},           // 128 heads, several chunks of one request
      {16, 16, 8, {0, 0}, {5, 2}},              // no prefix: plain causal attention
      {16, 128, 64, {130, 1}, {1, 9}},
      {64, 16, 100, {150, 40, 0, 77}, {3, 17, 8, 1}},
  };
  uint64_t seed = 300;
  for (const ExtendCase& c : cases) {
    SCOPED_TRACE("EXTEND page " + std::to_string(c.page_size) + " heads " + std::to_string(c.heads) +
                 " chunk capacity " + std::to_string(c.capacity));
    std::mt19937_64 rng(++seed);
    UpProjection proj(c.heads, rng);
    int pages = 4;
    std::vector<int> slots;
    for (size_t b = 0; b < c.prefix.size(); ++b) {
      pages += (c.prefix[b] + c.extend[b] + c.page_size - 1) / c.page_size;
      slots.push_back(int(c.prefix.size() - b));
    }
    Pool pool(c.page_size, pages, 512, int(c.prefix.size()) + 1, DType::kBF16, rng());
    ExtendBatch b = make_extend_batch(pool, proj, slots, c.prefix, c.extend, rng);
    pool.upload();
    b.upload();
    CudaStream stream;
    int64_t total_prefix = 0;
    for (int32_t x : c.prefix) total_prefix += x;
    const size_t num_chunks = size_t((total_prefix + c.capacity - 1) / c.capacity);

    // Chunked path: save, new tokens, then per chunk gather -> up-project -> attend -> merge.
    {
      SCOPED_TRACE("chunked");
      BackendConfig cpu_config = make_config(pool, c.heads, false, DType::kBF16);
      BackendConfig gpu_config = make_config(pool, c.heads, true, DType::kBF16);
      for (BackendConfig* config : {&cpu_config, &gpu_config}) {
        config->prefix_chunk_capacity = c.capacity;
        config->extend_prefix_path = ExtendPrefixPath::kChunked;
        config->workspace_bytes = Backend::chunked_extend_workspace_bytes(*config, b.num_tokens);
      }
      Backend cpu(cpu_config), gpu(gpu_config);
      std::vector<HostTensor> cpu_latents, gpu_latents;
      const ForwardBatch cpu_batch = b.batch(false);
      cpu.init_forward_metadata(cpu_batch);
      cpu.save_latent_kv(cpu_batch, make_layer(pool, false), b.k_nope.view(), b.k_pe.view());
      cpu.forward_extend_chunked(cpu_batch, make_layer(pool, false), b.mha_args(false),
                                 make_up_project(proj, pool, false, nullptr, cpu_latents));
      const ForwardBatch gpu_batch = b.batch(true);
      gpu.init_forward_metadata(gpu_batch, stream.get());
      EXPECT_FALSE(gpu.plan().extend.use_absorbed);
      EXPECT_EQ(size_t(gpu.num_prefix_chunks()), num_chunks);
      gpu.save_latent_kv(gpu_batch, make_layer(pool, true), b.d_k_nope.view(), b.d_k_pe.view(),
                         stream.get());
      gpu.forward_extend_chunked(gpu_batch, make_layer(pool, true), b.mha_args(true),
                                 make_up_project(proj, pool, true, raw(stream), gpu_latents),
                                 stream.get());
      MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

      ASSERT_EQ(gpu_latents.size(), num_chunks);
      ASSERT_EQ(cpu_latents.size(), num_chunks);
      for (size_t i = 0; i < num_chunks; ++i)
        EXPECT_TRUE(bitwise_equal(gpu_latents[i], cpu_latents[i])) << "gathered latents of chunk " << i;
      EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the saves";
      const HostTensor out = b.d_out.download(), lse = b.d_lse.download();
      const NaiveAttention ref = naive_extend_mha(pool, proj, b);
      expect_close(out, lse, ref, "CUDA backend vs float64 naive");
      expect_close(b.out, b.lse, ref, "CPU backend vs float64 naive");
      expect_close(out, lse, b.out, b.lse, "CUDA backend vs CPU backend");
    }

    // Absorbed path: save, then 576-wide queries over the paged cache, q lengths = extend lengths.
    {
      SCOPED_TRACE("absorbed");
      BackendConfig cpu_config = make_config(pool, c.heads, false, DType::kBF16);
      BackendConfig gpu_config = make_config(pool, c.heads, true, DType::kBF16);
      cpu_config.extend_prefix_path = gpu_config.extend_prefix_path = ExtendPrefixPath::kAbsorbed;
      Backend cpu(cpu_config);
      const ForwardBatch cpu_batch = b.batch(false);
      cpu.init_forward_metadata(cpu_batch);
      cpu.forward_extend_absorbed(cpu_batch, make_layer(pool, false), b.absorbed_args(false));
      const NaiveAttention ref = naive_absorbed(pool, b.q_abs.view(), slots,
                                                std::vector<int>(b.seq_lens_cpu.begin(), b.seq_lens_cpu.end()),
                                                b.extend);
      expect_close(b.out_abs, b.lse_abs, ref, "CPU backend vs float64 naive");
      // Split-KV on its own schedule; the deterministic mode (with split keys) unsplit.
      for (const bool deterministic : {false, true}) {
        SCOPED_TRACE(deterministic ? "deterministic" : "default");
        gpu_config.deterministic = deterministic;
        gpu_config.deterministic_split_keys = deterministic ? 1024 : 0;
        Backend gpu(gpu_config);
        for (DeviceCopy* d : {&b.d_out_abs, &b.d_lse_abs}) {  // NaN: every row must be written
          HostTensor poison = d->download();
          poison.fill_nan();
          d->upload(poison);
        }
        const ForwardBatch gpu_batch = b.batch(true);
        gpu.init_forward_metadata(gpu_batch, stream.get());
        EXPECT_TRUE(gpu.plan().extend.use_absorbed);
        EXPECT_EQ(gpu.plan().schedule == nullptr, deterministic);
        gpu.forward_extend_absorbed(gpu_batch, make_layer(pool, true), b.absorbed_args(true), stream.get());
        MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

        EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the saves";
        const HostTensor out = b.d_out_abs.download(), lse = b.d_lse_abs.download();
        expect_close(out, lse, ref, "CUDA backend vs float64 naive");
        expect_close(out, lse, b.out_abs, b.lse_abs, "CUDA backend vs CPU backend");
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// IDLE and empty batches

// The requests `which` of `all` (in that order) as a batch of their own: the same slots, query
// rows and new tokens, fresh NaN outputs (host copies; upload() before use).
ExtendBatch sub_batch(const ExtendBatch& all, const std::vector<int>& which) {
  ExtendBatch s;
  s.heads = all.heads;
  std::vector<int64_t> rpi, seq, loc;
  for (int b : which) {
    s.slots.push_back(all.slots[size_t(b)]);
    s.prefix.push_back(all.prefix[size_t(b)]);
    s.extend.push_back(all.extend[size_t(b)]);
    s.seq_lens_cpu.push_back(all.seq_lens_cpu[size_t(b)]);
    s.num_tokens += all.extend[size_t(b)];
    rpi.push_back(all.slots[size_t(b)]);
    seq.push_back(all.seq_lens_cpu[size_t(b)]);
  }
  const std::vector<int32_t> counts = all.extend;
  auto rows = [&](const HostTensor& t) { return test::request_rows(t, counts, which); };
  s.q = rows(all.q);
  s.k = rows(all.k);
  s.v = rows(all.v);
  s.q_abs = rows(all.q_abs);
  s.k_nope = rows(all.k_nope);
  s.k_pe = rows(all.k_pe);
  s.out_cache_loc = rows(all.out_cache_loc);
  s.out = nan_tensor(DType::kBF16, {s.num_tokens, s.heads, 128});
  s.lse = nan_tensor(DType::kFP32, {s.num_tokens, s.heads});
  s.out_abs = nan_tensor(DType::kBF16, {s.num_tokens, s.heads, kKvLoraRank});
  s.lse_abs = nan_tensor(DType::kFP32, {s.num_tokens, s.heads});
  s.req_pool_indices = index_tensor(DType::kInt32, rpi);
  s.seq_lens = index_tensor(DType::kInt32, seq);
  return s;
}

// BackendConfig::deterministic on the GPU: request 1's EXTEND rows (23 cached tokens, pieces of
// 8, 8 and 7) have the same bits alone, behind a 5-token prefix and ahead of others, on the
// chunked path (kAuto) and the absorbed one; the prefill kernel, the merges with empty chunks
// and the unsplit decode must all keep them (the CPU test shows the default chunked path moving
// them).
TEST(GpuBackend, DeterministicExtendRequestBitsDoNotDependOnTheBatch) {
  MLA_REQUIRE_GPU();
  std::mt19937_64 rng(4243);
  const int heads = 16;
  UpProjection proj(heads, rng);
  Pool pool(8, 64, 512, 6, DType::kBF16, rng());
  ExtendBatch all = make_extend_batch(pool, proj, {4, 1, 2, 5}, {5, 23, 13, 0}, {3, 4, 2, 1}, rng);
  pool.upload();
  all.upload();
  CudaStream stream;
  {  // the new tokens' latents into the cache, for the absorbed path
    Backend saver(make_config(pool, heads, true, DType::kBF16));
    const ForwardBatch batch = all.batch(true);
    saver.init_forward_metadata(batch, stream.get());
    saver.save_latent_kv(batch, make_layer(pool, true), all.d_k_nope.view(), all.d_k_pe.view(),
                         stream.get());
    MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
  }
  const std::vector<std::vector<int>> batches = {{1}, {0, 1}, {1, 2, 3}, {0, 1, 2, 3}};
  for (const ExtendPrefixPath path : {ExtendPrefixPath::kAuto, ExtendPrefixPath::kAbsorbed}) {
    const bool absorbed = path == ExtendPrefixPath::kAbsorbed;
    SCOPED_TRACE(absorbed ? "absorbed" : "chunked");
    std::vector<HostTensor> outs, lses;  // request 1's rows in each batch
    for (const std::vector<int>& which : batches) {
      ExtendBatch b = sub_batch(all, which);
      b.upload();
      BackendConfig config = make_config(pool, heads, true, DType::kBF16);
      config.prefix_chunk_capacity = 8;
      config.extend_prefix_path = path;
      config.absorbed_max_extend_len = 1000;  // kAuto alone would take the absorbed path
      config.deterministic = true;
      config.workspace_bytes = std::max(Backend::chunked_extend_workspace_bytes(config, b.num_tokens),
                                        Workspace::kDefaultBytes);
      Backend gpu(config);
      const ForwardBatch batch = b.batch(true);
      gpu.init_forward_metadata(batch, stream.get());
      ASSERT_EQ(gpu.plan().extend.use_absorbed, absorbed);
      EXPECT_EQ(gpu.plan().schedule, nullptr);
      std::vector<HostTensor> latents;
      if (absorbed) {
        AbsorbedAttentionArgs a = b.absorbed_args(true);
        a.save_kv_cache = false;
        gpu.forward_extend_absorbed(batch, make_layer(pool, true), a, stream.get());
      } else {
        gpu.forward_extend_chunked(batch, make_layer(pool, true), b.mha_args(true),
                                   make_up_project(proj, pool, true, raw(stream), latents), stream.get());
      }
      MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
      int64_t t0 = 0;
      for (int r : which) {
        if (r == 1) break;
        t0 += all.extend[size_t(r)];
      }
      const HostTensor out = absorbed ? b.d_out_abs.download() : b.d_out.download();
      const HostTensor lse = absorbed ? b.d_lse_abs.download() : b.d_lse.download();
      const size_t out_row = out.bytes.size() / size_t(b.num_tokens), lse_row = lse.bytes.size() / size_t(b.num_tokens);
      HostTensor o(out.dtype, {4, heads, out.shape[2]}), l(DType::kFP32, {4, heads});
      std::memcpy(o.bytes.data(), out.bytes.data() + size_t(t0) * out_row, 4 * out_row);
      std::memcpy(l.bytes.data(), lse.bytes.data() + size_t(t0) * lse_row, 4 * lse_row);
      outs.push_back(std::move(o));
      lses.push_back(std::move(l));
    }
    for (size_t i = 1; i < outs.size(); ++i) {
      EXPECT_TRUE(bitwise_equal(outs[i], outs[0])) << "out, batch " << i;
      EXPECT_TRUE(bitwise_equal(lses[i], lses[0])) << "lse, batch " << i;
    }
  }
}

TEST(GpuBackend, IdleAndEmptyBatchesDoNothing) {
  MLA_REQUIRE_GPU();
  const int heads = 16;
  Pool pool(16, 8, 64, 2, DType::kBF16, 1);
  Backend backend(make_config(pool, heads, true, DType::kBF16));
  CudaStream stream;
  const LayerParams layer = make_layer(pool, true);
  ForwardBatch idle;
  idle.mode = ForwardMode::kIdle;
  backend.init_forward_metadata(idle, stream.get());
  EXPECT_EQ(backend.plan().mode, ForwardMode::kIdle);
  backend.forward_decode(idle, layer, AbsorbedAttentionArgs{}, stream.get());
  backend.forward_extend_absorbed(idle, layer, AbsorbedAttentionArgs{}, stream.get());
  backend.forward_extend(idle, layer, MhaAttentionArgs{}, stream.get());
  backend.forward_prefix_chunk(idle, 0, layer, MhaAttentionArgs{}, stream.get());
  backend.forward_extend_chunked(idle, layer, MhaAttentionArgs{}, nullptr, stream.get());
  backend.save_latent_kv(idle, layer, TensorView{}, TensorView{}, stream.get());
  EXPECT_EQ(backend.num_prefix_chunks(), 0);

  // Batches of 0 requests, each mode, with empty device tensors.
  DeviceCopy q(HostTensor(DType::kBF16, {0, heads, kLatentDim}));
  DeviceCopy out(HostTensor(DType::kBF16, {0, heads, kKvLoraRank}));
  DeviceCopy none(HostTensor(DType::kInt32, {0}));
  AbsorbedAttentionArgs args;
  args.q = q.view();
  args.out = out.view();
  args.save_kv_cache = false;
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    ForwardBatch empty;
    empty.mode = mode;
    empty.num_draft_tokens = 2;
    empty.req_pool_indices = none.view();
    empty.seq_lens = none.view();
    empty.extend_seq_lens = none.view();
    backend.init_forward_metadata(empty, stream.get());
    backend.forward_decode(empty, layer, args, stream.get());
  }
  ForwardBatch empty_extend;
  empty_extend.mode = ForwardMode::kExtend;
  backend.init_forward_metadata(empty_extend, stream.get());
  backend.forward_extend_absorbed(empty_extend, layer, args, stream.get());

  // IDLE and 0-request batches under CUDA-graph capture.
  backend.init_cuda_graph_state(4, 4);
  backend.init_forward_metadata_capture_cuda_graph(0, 0, none.view(), none.view(), ForwardMode::kIdle,
                                                   stream.get());
  EXPECT_TRUE(run_in_cuda_graph([&](Stream s) { backend.forward_decode(idle, layer, AbsorbedAttentionArgs{}, s); }));
  ForwardBatch empty_decode;
  empty_decode.mode = ForwardMode::kDecode;
  empty_decode.req_pool_indices = none.view();
  empty_decode.seq_lens = none.view();
  backend.init_forward_metadata_capture_cuda_graph(0, 0, none.view(), none.view(), ForwardMode::kDecode,
                                                   stream.get());
  EXPECT_TRUE(run_in_cuda_graph([&](Stream s) { backend.forward_decode(empty_decode, layer, args, s); }));

  MultiStepDraftBackend draft(3, make_config(pool, heads, true, DType::kBF16));
  draft.init_forward_metadata(idle, stream.get());
  draft.step(1).forward_decode(idle, layer, AbsorbedAttentionArgs{}, stream.get());
  MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
  MLA_TEST_CUDA(cudaGetLastError());
}

// ---------------------------------------------------------------------------------------------
// CUDA graphs

// An engine's static buffers for graph runs: max_bs requests (int64 indices, as engines keep
// them), max_tokens query rows.
struct StaticBuffers {
  int max_bs;
  int64_t max_tokens;
  DeviceCopy rpi, seq, accepted, loc, q, k_nope, k_pe, out, lse;

  StaticBuffers(int bs, int64_t tokens, int heads)
      : max_bs(bs), max_tokens(tokens), rpi(HostTensor(DType::kInt64, {bs})),
        seq(HostTensor(DType::kInt64, {bs})), accepted(HostTensor(DType::kInt64, {bs})),
        loc(HostTensor(DType::kInt64, {tokens})),
        q(HostTensor(DType::kBF16, {tokens, heads, kLatentDim})),
        k_nope(HostTensor(DType::kBF16, {tokens, kKvLoraRank})),
        k_pe(HostTensor(DType::kBF16, {tokens, kRopeDim})),
        out(HostTensor(DType::kBF16, {tokens, heads, kKvLoraRank})),
        lse(HostTensor(DType::kFP32, {tokens, heads})) {}

  // The batch's data at the start of the buffers; index entries past it hold values that would
  // be out of range if anything read them.
  // DRAFT_EXTEND's queries per request (a graph's accepted tokens) go to `accepted`.
  void load(AbsorbedBatch& b, int num_slots, int max_context_len) {
    HostTensor r(DType::kInt64, {max_bs}), s(DType::kInt64, {max_bs}), a(DType::kInt64, {max_bs}),
        l(DType::kInt64, {max_tokens});
    for (int i = 0; i < max_bs; ++i) {
      const bool in = i < int(b.requests.size());
      r.i64(i) = in ? b.req_pool_indices.i64(i) : num_slots + 5;
      s.i64(i) = in ? b.seq_lens.i64(i) : max_context_len + 7;
      a.i64(i) = in ? b.requests[size_t(i)].q_len : max_tokens + 3;
    }
    for (int64_t i = 0; i < max_tokens; ++i) l.i64(i) = i < b.num_tokens ? b.out_cache_loc.i64(i) : -1;
    rpi.upload(r);
    seq.upload(s);
    accepted.upload(a);
    loc.upload(l);
    q.upload_prefix(b.q);
    k_nope.upload_prefix(b.k_nope);
    k_pe.upload_prefix(b.k_pe);
  }
  ForwardBatch batch(ForwardMode mode, int bs) const {
    ForwardBatch f;
    f.mode = mode;
    f.batch_size = bs;
    f.req_pool_indices = rpi.view();
    f.seq_lens = seq.view();
    f.out_cache_loc = loc.view();
    return f;
  }
  AbsorbedAttentionArgs args(int64_t tokens) const {
    AbsorbedAttentionArgs a;
    a.q = q.view(tokens);
    a.k_nope = k_nope.view(tokens);
    a.k_pe = k_pe.view(tokens);
    a.out = out.view(tokens);
    a.lse = lse.view(tokens);
    return a;
  }
  void poison(cudaStream_t stream) const {
    out.poison(stream);
    lse.poison(stream);
  }
};

// Captures fn(stream) in global mode (an allocation, a host sync or work on another stream would
// invalidate it) and instantiates it; null (with a failure recorded) when that fails.
template <typename Fn>
cudaGraphExec_t capture_graph(cudaStream_t stream, Fn&& fn) {
  if (cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal) != cudaSuccess) {
    ADD_FAILURE() << "cudaStreamBeginCapture failed";
    return nullptr;
  }
  cudaGraph_t graph = nullptr;
  try {
    fn(static_cast<Stream>(stream));
  } catch (const std::exception& e) {
    cudaStreamEndCapture(stream, &graph);
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    ADD_FAILURE() << "threw during capture: " << e.what();
    return nullptr;
  }
  const cudaError_t status = cudaStreamEndCapture(stream, &graph);
  if (status != cudaSuccess) {
    if (graph) cudaGraphDestroy(graph);
    cudaGetLastError();
    ADD_FAILURE() << "capture invalidated: " << cudaGetErrorString(status);
    return nullptr;
  }
  cudaGraphExec_t exec = nullptr;
  const cudaError_t inst = cudaGraphInstantiate(&exec, graph, 0);
  cudaGraphDestroy(graph);
  if (inst != cudaSuccess) {
    ADD_FAILURE() << "cudaGraphInstantiate failed: " << cudaGetErrorString(inst);
    return nullptr;
  }
  return exec;
}

// Requests for one graph round: bs requests in fresh slots [first_slot, first_slot + bs), short
// cached lengths and one long one, q_len each.
std::vector<Request> random_requests(int bs, int first_slot, int q_len, int long_len, std::mt19937_64& rng) {
  std::vector<Request> requests;
  for (int b = 0; b < bs; ++b) {
    const int cached = b == bs / 2 ? long_len : int(rng() % 160);
    requests.push_back({first_slot + b, cached, q_len});
  }
  return requests;
}

// Capture at batch sizes 1, 8, 32; replays with new lengths and new pages written into the same
// buffers, two ways: metadata replayed eagerly before launching a graph of forward_decode (the
// engine's way), and metadata replay + forward_decode captured in one graph. Both give the same
// bits; they equal an eager run of the same batch bit for bit and the float64 naive, and neither
// allocates. DRAFT_EXTEND graphs run num_draft_tokens rows a request: the first round with that
// many queries each (the eager replay without extend_seq_lens), the next ones with 0..3 accepted
// tokens each packed at the front (extend_seq_lens), whose padding rows must come out 0 / -inf
// from NaN; their accepted rows equal an eager run of the exact batch bit for bit in the
// deterministic mode (64-row tiles whatever max_q_len), within the tolerances otherwise.
TEST(GpuBackendGraph, DecodeAndTargetVerifyReplaysEqualEagerRuns) {
  MLA_REQUIRE_GPU();
  for (ForwardMode mode : {ForwardMode::kDecode, ForwardMode::kTargetVerify, ForwardMode::kDraftExtend}) {
    for (int split_keys : {0, 256}) {  // 256: the deterministic mode on its split schedule
      SCOPED_TRACE(std::string(forward_mode_name(mode)) + (split_keys ? " deterministic split" : ""));
      const int heads = 16, page_size = 16, max_bs = 32, max_len = 1024;
      const int q_len = mode == ForwardMode::kDecode ? 1 : 3;
      const int64_t max_tokens = int64_t(max_bs) * q_len;
      // Slot 0 holds the capture-time dummy request; rounds alternate between two slot ranges.
      const int num_slots = 2 * max_bs + 1;
      std::mt19937_64 rng(uint64_t(mode) + 900);
      Pool pool(page_size, 2 * max_bs * 40 + 8, max_len, num_slots, DType::kBF16, rng());
      pool.reserve(0, 1);
      pool.write_random(0, 0, rng);
      pool.upload();
      BackendConfig config = make_config(pool, heads, true, DType::kBF16);
      config.num_draft_tokens = 3;
      config.deterministic = split_keys > 0;
      config.deterministic_split_keys = split_keys;
      Backend graph(config), eager(config);
      graph.init_cuda_graph_state(max_bs, max_tokens);
      StaticBuffers buffers(max_bs, max_tokens, heads);
      CudaStream stream;
      const LayerParams layer = make_layer(pool, true);
      int round_index = 0;

      for (int bs : {1, 8, 32}) {
        SCOPED_TRACE("bs " + std::to_string(bs));
        const int64_t tokens = int64_t(bs) * q_len;
        // Capture-time contents: every request is the dummy (slot 0, one token), as engines do;
        // its new tokens are not saved (loc -1).
        {
          HostTensor r(DType::kInt64, {max_bs}), s(DType::kInt64, {max_bs}), l(DType::kInt64, {max_tokens});
          for (int i = 0; i < max_bs; ++i) {
            r.i64(i) = 0;
            s.i64(i) = 1;
          }
          for (int64_t i = 0; i < max_tokens; ++i) l.i64(i) = -1;
          buffers.rpi.upload(r);
          buffers.seq.upload(s);
          buffers.loc.upload(l);
        }
        const bool draft = mode == ForwardMode::kDraftExtend;
        if (draft) {
          HostTensor a(DType::kInt64, {max_bs});
          for (int i = 0; i < max_bs; ++i) a.i64(i) = q_len;
          buffers.accepted.upload(a);
        }
        const TensorView accepted = draft ? buffers.accepted.view() : TensorView{};
        graph.init_forward_metadata_capture_cuda_graph(bs, tokens, buffers.rpi.view(), buffers.seq.view(),
                                                       mode, stream.get(), accepted);
        const Plan captured = graph.plan();
        EXPECT_TRUE(captured.fixed_buffers);
        EXPECT_EQ(captured.max_blocks, padded_block_count(max_len, page_size));
        EXPECT_EQ(captured.q_len, draft ? 1 : q_len);
        EXPECT_EQ(captured.max_q_len, q_len);
        EXPECT_EQ(captured.cu_q_lens.empty(), !draft);
        cudaGraphExec_t forward_graph = capture_graph(raw(stream), [&](Stream s) {
          graph.forward_decode(buffers.batch(mode, bs), layer, buffers.args(tokens), s);
        });
        cudaGraphExec_t full_graph = capture_graph(raw(stream), [&](Stream s) {
          graph.init_forward_metadata_replay_cuda_graph(bs, buffers.rpi.view(), buffers.seq.view(), mode, s,
                                                        accepted);
          graph.forward_decode(buffers.batch(mode, bs), layer, buffers.args(tokens), s);
        });
        ASSERT_NE(forward_graph, nullptr);
        ASSERT_NE(full_graph, nullptr);
        // One launch each on the dummy batch: whatever the first launch of a graph sets up is not
        // counted as a replay allocation below.
        MLA_TEST_CUDA(cudaGraphLaunch(forward_graph, raw(stream)));
        MLA_TEST_CUDA(cudaGraphLaunch(full_graph, raw(stream)));
        MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));

        for (int round = 0; round < 3; ++round, ++round_index) {
          SCOPED_TRACE("round " + std::to_string(round));
          // New requests in fresh slots (the previous round's pages go back NaN-poisoned).
          const int first_slot = 1 + (round_index % 2) * max_bs;
          for (int s = first_slot; s < first_slot + max_bs; ++s) pool.release(s);
          const int long_len = round == 2 ? 600 : 200 + 50 * round;
          std::vector<Request> requests = random_requests(bs, first_slot, q_len, long_len, rng);
          const bool packed = draft && round > 0;  // accepted tokens, packed
          if (packed)
            for (Request& r : requests) r.q_len = int(rng() % uint64_t(q_len + 1));
          AbsorbedBatch b = make_absorbed_batch(pool, mode, requests, heads, DType::kInt64, rng, true,
                                                DType::kBF16);
          pool.upload();
          buffers.load(b, num_slots, max_len);
          mirror_save(pool, b.k_nope, b.k_pe, b.out_cache_loc);
          const int64_t used = b.num_tokens;  // the rows of the accepted queries

          const size_t free_before = free_device_memory();
          // (a) metadata replayed eagerly, then the graph of forward_decode.
          buffers.poison(raw(stream));
          graph.init_forward_metadata_replay_cuda_graph(bs, buffers.rpi.view(), buffers.seq.view(), mode,
                                                        stream.get(), packed ? accepted : TensorView{});
          EXPECT_EQ(graph.plan().block_table.data, captured.block_table.data);
          EXPECT_EQ(graph.plan().kv_lens.data, captured.kv_lens.data);
          EXPECT_EQ(graph.plan().schedule, captured.schedule);
          MLA_TEST_CUDA(cudaGraphLaunch(forward_graph, raw(stream)));
          MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
          const HostTensor out_a = buffers.out.download(used), lse_a = buffers.lse.download(used);
          const auto expect_padding_rows_empty = [&](const char* what) {
            const std::vector<float> o = buffers.out.download(tokens).to_float();
            const std::vector<float> l = buffers.lse.download(tokens).to_float();
            int64_t bad = 0;
            for (int64_t i = used * heads * kKvLoraRank; i < tokens * heads * kKvLoraRank; ++i)
              bad += o[size_t(i)] != 0.0f;
            for (int64_t i = used * heads; i < tokens * heads; ++i)
              bad += l[size_t(i)] != -std::numeric_limits<float>::infinity();
            EXPECT_EQ(bad, 0) << what << ": padding rows past the " << used << " accepted ones";
          };
          expect_padding_rows_empty("forward graph");
          // (b) metadata replay and forward in one graph.
          buffers.poison(raw(stream));
          MLA_TEST_CUDA(cudaGraphLaunch(full_graph, raw(stream)));
          MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
          const HostTensor out_b = buffers.out.download(used), lse_b = buffers.lse.download(used);
          expect_padding_rows_empty("full graph");
          EXPECT_EQ(free_device_memory(), free_before) << "device memory was allocated during replay";
          EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the graph saves";

          // (c) the same batch planned eagerly (width from the host lengths).
          buffers.poison(raw(stream));
          ForwardBatch eager_batch = buffers.batch(mode, bs);
          eager_batch.seq_lens_cpu = b.seq_lens_cpu;
          if (draft) eager_batch.extend_seq_lens_cpu = b.q_lens;
          eager.init_forward_metadata(eager_batch, stream.get());
          eager.forward_decode(eager_batch, layer, buffers.args(used), stream.get());
          MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
          const HostTensor out_e = buffers.out.download(used), lse_e = buffers.lse.download(used);

          EXPECT_TRUE(bitwise_equal(out_a, out_b)) << "forward graph vs full graph: out";
          EXPECT_TRUE(bitwise_equal(lse_a, lse_b)) << "forward graph vs full graph: lse";
          if (packed && split_keys == 0) {  // the eager plan's row tiles follow its max_q_len
            expect_close(out_a, lse_a, out_e, lse_e, "graph replay vs eager run");
          } else {
            EXPECT_TRUE(bitwise_equal(out_a, out_e)) << "graph replay vs eager: out";
            EXPECT_TRUE(bitwise_equal(lse_a, lse_e)) << "graph replay vs eager: lse";
          }
          const NaiveAttention ref = b.reference(pool);
          expect_close(out_a, lse_a, ref, "graph replay vs float64 naive");
          expect_close(out_e, lse_e, ref, "eager CUDA backend vs float64 naive");
        }
        MLA_TEST_CUDA(cudaGraphExecDestroy(forward_graph));
        MLA_TEST_CUDA(cudaGraphExecDestroy(full_graph));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Multi-step drafting

// Step i of a MultiStepDraftBackend (eager, and captured in a graph then replayed with a new
// batch) equals an independent CUDA Backend planned for seq_lens + i, bit for bit, and the
// float64 naive.
TEST(GpuBackendMultiStep, StepsEqualIndependentBackends) {
  MLA_REQUIRE_GPU();
  const int heads = 16, page_size = 16, num_steps = 4, bs = 4, max_bs = 8, max_len = 512;
  const int steps = num_steps - 1;
  for (bool graph_mode : {false, true}) {
    for (int split_keys : {0, 256}) {  // 256: the deterministic mode on its split schedule
      SCOPED_TRACE(std::string(graph_mode ? "graph" : "eager") + (split_keys ? ", deterministic split" : ""));
      std::mt19937_64 rng(graph_mode ? 71 : 72);
      Pool pool(page_size, 2 * max_bs * (max_len / page_size), max_len, 2 * bs, DType::kBF16, rng());
      BackendConfig config = make_config(pool, heads, true, DType::kBF16);
      config.deterministic = split_keys > 0;
      config.deterministic_split_keys = split_keys;
      MultiStepDraftBackend draft(num_steps, config);
      ASSERT_EQ(draft.num_step_backends(), steps);
      CudaStream stream;
      const LayerParams layer = make_layer(pool, true);
      std::vector<std::unique_ptr<StaticBuffers>> buffers;
      for (int i = 0; i < steps; ++i) buffers.push_back(std::make_unique<StaticBuffers>(max_bs, max_bs, heads));
      cudaGraphExec_t exec = nullptr;
      if (graph_mode) draft.init_cuda_graph_state(max_bs, max_bs);

      const int rounds = graph_mode ? 2 : 1;
      for (int round = 0; round < rounds; ++round) {
        SCOPED_TRACE("round " + std::to_string(round));
        const int first_slot = (round % 2) * bs;
        for (int s = first_slot; s < first_slot + bs; ++s) pool.release(s);
        const std::vector<int> cached = round == 0 ? std::vector<int>{12, 0, 63, 200}
                                                   : std::vector<int>{301, 7, 16, 90};
        std::vector<AbsorbedBatch> step_batches;
        for (int i = 0; i < steps; ++i) {
          std::vector<Request> requests;
          for (int b = 0; b < bs; ++b) requests.push_back({first_slot + b, cached[size_t(b)] + i, 1});
          // Step 0 fills the cached tokens; step i > 0 sees the draft tokens of steps < i.
          step_batches.push_back(make_absorbed_batch(pool, ForwardMode::kDecode, requests, heads,
                                                     DType::kInt64, rng, i == 0, DType::kBF16));
        }
        pool.upload();
        for (AbsorbedBatch& b : step_batches) b.upload();
        // The engine hands every step the same batch: step 0's request indices and seq_lens.
        AbsorbedBatch& first = step_batches.front();
        const auto step_batch = [&](int i) {
          ForwardBatch f = graph_mode ? buffers[size_t(i)]->batch(ForwardMode::kDecode, bs)
                                      : step_batches[size_t(i)].batch(true, false);
          f.req_pool_indices = graph_mode ? buffers[0]->rpi.view() : first.d_rpi.view();
          f.seq_lens = graph_mode ? buffers[0]->seq.view() : first.d_seq.view();
          return f;
        };

        if (graph_mode) {
          for (int i = 0; i < steps; ++i) buffers[size_t(i)]->load(step_batches[size_t(i)], pool.num_slots, max_len);
          for (int i = 0; i < steps; ++i) buffers[size_t(i)]->poison(raw(stream));
          if (round == 0) {
            draft.init_forward_metadata_capture_cuda_graph(bs, bs, buffers[0]->rpi.view(), buffers[0]->seq.view(),
                                                           stream.get());
            exec = capture_graph(raw(stream), [&](Stream s) {
              for (int i = 0; i < steps; ++i)
                draft.step(i).forward_decode(step_batch(i), layer, buffers[size_t(i)]->args(bs), s);
            });
            ASSERT_NE(exec, nullptr);
          } else {
            draft.init_forward_metadata_replay_cuda_graph(bs, buffers[0]->rpi.view(), buffers[0]->seq.view(),
                                                          stream.get());
          }
          EXPECT_EQ(draft.step(0).plan().block_table.data, draft.step(steps - 1).plan().block_table.data);
          MLA_TEST_CUDA(cudaGraphLaunch(exec, raw(stream)));
        } else {
          ForwardBatch plan_batch = first.batch(true, true);
          draft.init_forward_metadata(plan_batch, stream.get());
          EXPECT_EQ(draft.step(0).workspace(), draft.step(steps - 1).workspace());
          for (int i = 0; i < steps; ++i)
            draft.step(i).forward_decode(step_batch(i), layer, step_batches[size_t(i)].args(true), stream.get());
        }
        MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
        for (AbsorbedBatch& b : step_batches) mirror_save(pool, b.k_nope, b.k_pe, b.out_cache_loc);
        EXPECT_TRUE(bitwise_equal(pool.d_cache.download(), pool.cache)) << "cache after the draft steps";

        for (int i = 0; i < steps; ++i) {
          SCOPED_TRACE("step " + std::to_string(i));
          AbsorbedBatch& b = step_batches[size_t(i)];
          const HostTensor out = graph_mode ? buffers[size_t(i)]->out.download(bs) : b.d_out.download();
          const HostTensor lse = graph_mode ? buffers[size_t(i)]->lse.download(bs) : b.d_lse.download();
          if (!graph_mode) EXPECT_EQ(draft.step(i).plan().kv_lens.shape[0], bs);
          expect_close(out, lse, b.reference(pool), "draft step vs float64 naive");

          // An independent backend planned for this step's own lengths (cached + i + 1).
          Backend independent(config);
          b.d_out = DeviceCopy(nan_tensor(DType::kBF16, {bs, heads, kKvLoraRank}));
          b.d_lse = DeviceCopy(nan_tensor(DType::kFP32, {bs, heads}));
          const ForwardBatch own = b.batch(true, i % 2 == 0);
          independent.init_forward_metadata(own, stream.get());
          independent.forward_decode(own, layer, b.args(true, false), stream.get());
          MLA_TEST_CUDA(cudaStreamSynchronize(raw(stream)));
          EXPECT_TRUE(bitwise_equal(out, b.d_out.download())) << "draft step vs independent backend: out";
          EXPECT_TRUE(bitwise_equal(lse, b.d_lse.download())) << "draft step vs independent backend: lse";
        }
      }
      if (exec) MLA_TEST_CUDA(cudaGraphExecDestroy(exec));
    }
  }
}

}  // namespace
}  // namespace mla::test
