// mla::Backend: planning per batch (eager and CUDA-graph fixed buffers) and the attention calls
// per layer, over the public ops and the memory layer.
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <utility>

#include "backend/backend_impl.hpp"
#include "mla/error.hpp"
#include "mla/ops.hpp"
#if defined(MLA_WITH_CUDA)
#include "cuda/cuda_check.hpp"
#endif

namespace mla {
namespace detail {

int32_t* reserve_int32(Buffer& buffer, int64_t count, Device device, Stream stream) {
  const size_t bytes = size_t(std::max<int64_t>(count, 1)) * sizeof(int32_t);
  if (buffer.size() < bytes || buffer.device() != device) {
    // Grow geometrically so that a slowly growing batch does not reallocate every step.
    const size_t grown = buffer.device() == device ? buffer.size() + buffer.size() / 2 : 0;
    buffer.reset();
    buffer = Buffer(std::max(bytes, grown), device, stream);
  }
  return static_cast<int32_t*>(buffer.data());
}

TensorView int32_view(int32_t* data, std::initializer_list<int64_t> shape, Device device) {
  return TensorView::contiguous(data, DType::kInt32, shape, device);
}

TensorView first_rows(const TensorView& t, int64_t rows) {
  TensorView view = t;
  view.shape[0] = rows;
  return view;
}

TensorView row_range(const TensorView& t, int64_t begin, int64_t rows) {
  TensorView view = first_rows(t, rows);
  view.data = static_cast<char*>(t.data) + begin * t.stride[0] * int64_t(dtype_size(t.dtype));
  return view;
}

void check_index_vector(const char* op, const char* name, const TensorView& t, int64_t min_len,
                        Device device) {
  check::ndim(op, name, t, 1);
  check::dtype_in(op, name, t, {DType::kInt32, DType::kInt64});
  MLA_CHECK(t.shape[0] >= min_len, op, ": ", name, " has ", t.shape[0],
            " entries but the batch needs ", min_len, " (", t.describe(), ")");
  check::same_device(op, name, t, device);
  check::inner_contiguous(op, name, t);
}

void check_host_lengths(const char* op, const char* name, std::span<const int32_t> values,
                        int64_t len) {
  MLA_CHECK(int64_t(values.size()) == len, op, ": ", name, " must have batch_size = ", len,
            " entries, got ", values.size());
}

std::vector<int32_t> lengths_on_host(const char* op, const char* name, const TensorView& lens,
                                     const TensorView& computed, int32_t offset, bool prefix_sums,
                                     Stream stream) {
  const int64_t n = lens.shape[0];
  std::vector<int32_t> out(size_t(n + (prefix_sums ? 1 : 0)));
  if (lens.device.type == DeviceType::kCPU) {
    std::memcpy(out.data(), computed.data, out.size() * sizeof(int32_t));
    return out;
  }
  std::vector<int64_t> raw(static_cast<size_t>(n));  // room for int64 lengths
  copy_to_host(raw.data(), lens.data, size_t(n) * dtype_size(lens.dtype), lens.device, stream);
  const TensorView host_lens = TensorView::contiguous(raw.data(), lens.dtype, {n}, Device::cpu());
  const TensorView host_out =
      TensorView::contiguous(out.data(), DType::kInt32, {int64_t(out.size())}, Device::cpu());
  if (prefix_sums)
    prefix_sum_int32(op, name, host_lens, host_out, nullptr);
  else
    lengths_to_int32(op, name, host_lens, offset, host_out, nullptr);
  return out;
}

void check_query_counts(const char* op, const char* name, const std::vector<int32_t>& cu, int bound,
                        const char* bound_what, const char* bound_source) {
  for (size_t b = 0; b + 1 < cu.size(); ++b)
    MLA_CHECK(cu[b + 1] - cu[b] <= bound, op, ": ", name, "[", b, "] = ", cu[b + 1] - cu[b],
              " is more than ", bound_what, ", ", bound, " (", bound_source, ")");
}

void fill_block_table(const TensorView& req_to_token, const TensorView& req_pool_indices,
                      const TensorView& seq_lens, int page_size, const TensorView& block_table,
                      bool check_metadata, Stream stream) {
  BuildBlockTableArgs args;
  args.check_metadata = check_metadata;
  args.req_to_token = req_to_token;
  args.req_pool_indices = req_pool_indices;
  args.seq_lens = seq_lens;
  args.page_size = page_size;
  args.block_table = block_table;
  build_block_table(args, stream);
}

size_t ScratchArena::total_bytes(std::initializer_list<size_t> sizes) {
  size_t total = 0;
  for (const size_t s : sizes) total = s >= kMaxBytes - total ? kMaxBytes : total + s;
  return total;
}

size_t ScratchArena::aligned_bytes(DType dtype, std::initializer_list<int64_t> shape) {
  constexpr int64_t kLimit = int64_t(kMaxBytes);
  int64_t count = 1;
  for (int64_t s : shape) count = (s > 0 && count > kLimit / s) ? kLimit : count * s;
  const int64_t elem = int64_t(dtype_size(dtype));
  const size_t bytes = size_t(count > kLimit / elem ? kLimit : count * elem);
  return (bytes + Buffer::kAlignment - 1) / Buffer::kAlignment * Buffer::kAlignment;
}

TensorView ScratchArena::take(const char* what, DType dtype, std::initializer_list<int64_t> shape) {
  const size_t bytes = aligned_bytes(dtype, shape);
  MLA_CHECK(used_ + bytes <= workspace_.size_bytes(), op_, ": the workspace (",
            workspace_.size_bytes(), " bytes) is too small: ", what, " needs ", bytes,
            " more bytes with ", used_,
            " in use; give the Backend a larger Workspace (BackendConfig::workspace_bytes; "
            "Backend::absorbed_workspace_bytes and chunked_extend_workspace_bytes give a path's needs)");
  TensorView view = TensorView::contiguous(static_cast<char*>(workspace_.data()) + used_, dtype,
                                           shape, workspace_.device());
  used_ += bytes;
  return view;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Workspace

Workspace::Workspace(size_t size_bytes, Device device, Stream stream)
    : buffer_(std::make_unique<detail::Buffer>(size_bytes, device, stream)) {}
Workspace::~Workspace() = default;
void* Workspace::data() const { return buffer_->data(); }
size_t Workspace::size_bytes() const { return buffer_->size(); }
Device Workspace::device() const { return buffer_->device(); }

// ---------------------------------------------------------------------------------------------
// Backend::Impl: configuration and planning

namespace {

constexpr const char* kPlanOp = "init_forward_metadata";

bool finite_positive(float x) { return std::isfinite(x) && x > 0; }

// [T, H, 576] -> its first 512 (q_nope) or last 64 (q_pe) values per head, as views.
TensorView last_dim_slice(const TensorView& t, int64_t begin, int64_t width) {
  TensorView view = t;
  view.shape[t.ndim - 1] = width;
  view.data = static_cast<char*>(t.data) + begin * int64_t(dtype_size(t.dtype));
  return view;
}

}  // namespace

void Backend::Impl::validate_config() {
  constexpr const char* op = "Backend";
  const BackendConfig& c = config;
  MLA_CHECK(c.num_q_heads >= 1 && c.num_q_heads <= kMaxHeads, op,
            ": config.num_q_heads must be in 1..", kMaxHeads, ", got ", c.num_q_heads);
  MLA_CHECK(c.page_size >= 1 && c.page_size <= kMaxPageSize && (c.page_size & (c.page_size - 1)) == 0,
            op, ": config.page_size must be a power of two in 1..", kMaxPageSize, ", got ",
            c.page_size);
  const auto in = [](DType d, std::initializer_list<DType> allowed) {
    return std::find(allowed.begin(), allowed.end(), d) != allowed.end();
  };
  MLA_CHECK(in(c.kv_cache_dtype, {DType::kBF16, DType::kFP16, DType::kFP8E4M3}), op,
            ": config.kv_cache_dtype must be bf16/fp16/fp8e4m3, got ", dtype_name(c.kv_cache_dtype));
  MLA_CHECK(in(c.q_dtype, {DType::kBF16, DType::kFP16, DType::kFP8E4M3}), op,
            ": config.q_dtype must be bf16/fp16/fp8e4m3, got ", dtype_name(c.q_dtype));
  if (c.kv_cache_dtype == DType::kFP8E4M3) {
    // Any query dtype works with an fp8 cache.
  } else {
    MLA_CHECK(c.q_dtype == c.kv_cache_dtype, op, ": config.q_dtype must equal the ",
              dtype_name(c.kv_cache_dtype), " kv_cache_dtype (only an fp8 cache takes other "
              "queries), got ", dtype_name(c.q_dtype));
  }
  MLA_CHECK(in(c.out_dtype, {DType::kBF16, DType::kFP16, DType::kFP32}), op,
            ": config.out_dtype must be bf16/fp16/fp32, got ", dtype_name(c.out_dtype));
  check::ndim(op, "config.req_to_token", c.req_to_token, 2);
  check::dtype(op, "config.req_to_token", c.req_to_token, DType::kInt32);
  check::inner_contiguous(op, "config.req_to_token", c.req_to_token);
  check::same_device(op, "config.req_to_token", c.req_to_token, c.device);
  max_context_len = c.max_context_len == 0 ? c.req_to_token.shape[1] : c.max_context_len;
  MLA_CHECK(max_context_len >= 1 && max_context_len <= c.req_to_token.shape[1], op,
            ": config.max_context_len must be in 1..req_to_token.shape[1] = ",
            c.req_to_token.shape[1], " (0 = that), got ", c.max_context_len);
  MLA_CHECK(max_context_len <= kMaxKeysPerRequest, op, ": config.max_context_len must be at most ",
            kMaxKeysPerRequest, " (the most keys mla_decode takes a request), got ", max_context_len);
  MLA_CHECK(c.prefix_chunk_capacity >= 1 && c.prefix_chunk_capacity <= INT32_MAX, op,
            ": config.prefix_chunk_capacity must be in [1, 2^31 - 1], got ", c.prefix_chunk_capacity);
  MLA_CHECK(c.num_draft_tokens >= 0, op, ": config.num_draft_tokens must be >= 0, got ",
            c.num_draft_tokens);
  MLA_CHECK(c.absorbed_max_extend_len >= 0, op,
            ": config.absorbed_max_extend_len must be >= 0, got ", c.absorbed_max_extend_len);
  MLA_CHECK(c.deterministic_split_keys >= 0 && c.deterministic_split_keys % 64 == 0, op,
            ": config.deterministic_split_keys must be 0 (unsplit) or a positive multiple of 64, "
            "got ", c.deterministic_split_keys);
}

int Backend::Impl::fixed_q_len(const char* op, ForwardMode mode, int batch_num_draft_tokens) const {
  if (mode == ForwardMode::kDecode) return 1;
  MLA_CHECK(batch_num_draft_tokens >= 0, op, ": batch.num_draft_tokens must be >= 0, got ",
            batch_num_draft_tokens);
  const int k = batch_num_draft_tokens > 0 ? batch_num_draft_tokens : config.num_draft_tokens;
  MLA_CHECK(k >= 1, op, ": ", forward_mode_name(mode),
            " needs num_draft_tokens >= 1 (batch.num_draft_tokens or "
            "BackendConfig::num_draft_tokens), got ", k);
  return k;
}

void Backend::Impl::plan_batch(const ForwardBatch& batch, Stream stream) {
  MLA_CHECK(batch.batch_size >= 0, kPlanOp, ": batch.batch_size must be >= 0, got ",
            batch.batch_size);
  planned = false;
  switch (batch.mode) {
    case ForwardMode::kIdle:
      plan = Plan{};
      plan.mode = ForwardMode::kIdle;
      break;
    case ForwardMode::kExtend:
      plan_extend(batch, stream);
      break;
    case ForwardMode::kDecode:
    case ForwardMode::kTargetVerify:
    case ForwardMode::kDraftExtend:
      plan_decode_family(batch, stream);
      break;
    default:
      MLA_FAIL(kPlanOp, ": batch.mode has an unknown value ", int(batch.mode));
  }
  planned = true;
}

void Backend::Impl::plan_decode_family(const ForwardBatch& batch, Stream stream) {
  const char* op = kPlanOp;
  const int batch_size = batch.batch_size;
  const Device device = config.device;
  const ForwardMode mode = batch.mode;
  Plan p;
  p.mode = mode;
  p.batch_size = batch_size;

  // Query rows per request.
  const bool draft_extend = mode == ForwardMode::kDraftExtend;
  const bool host_q_lens = !batch.extend_seq_lens_cpu.empty();
  const bool device_q_lens = !batch.extend_seq_lens.empty();
  std::vector<int32_t> host_cu_q;
  if (draft_extend) {
    MLA_CHECK(host_q_lens || device_q_lens || batch_size == 0, op,
              ": DRAFT_EXTEND needs the queries per request: batch.extend_seq_lens (device) or "
              "batch.extend_seq_lens_cpu (host)");
    if (device_q_lens)
      detail::check_index_vector(op, "batch.extend_seq_lens", batch.extend_seq_lens, batch_size,
                                 device);
    if (host_q_lens) {
      detail::check_host_lengths(op, "batch.extend_seq_lens_cpu", batch.extend_seq_lens_cpu,
                                 batch_size);
      host_cu_q.assign(size_t(batch_size) + 1, 0);
      int max_q = 0;
      for (int b = 0; b < batch_size; ++b) {
        const int32_t len = batch.extend_seq_lens_cpu[size_t(b)];
        MLA_CHECK(len >= 0, op, ": batch.extend_seq_lens_cpu[", b, "] must be >= 0, got ", len);
        MLA_CHECK(int64_t(host_cu_q[size_t(b)]) + len <= INT32_MAX, op,
                  ": batch.extend_seq_lens_cpu brings the query tokens past 2^31 - 1 at [", b, "] = ",
                  len);
        host_cu_q[size_t(b) + 1] = host_cu_q[size_t(b)] + len;
        max_q = std::max(max_q, int(len));
      }
      p.num_tokens = host_cu_q.back();
      p.max_q_len = std::max(1, max_q);
    } else {
      p.num_tokens = batch_size == 0 ? 0 : -1;  // known from the queries at forward time
      const int bound = batch.num_draft_tokens > 0 ? batch.num_draft_tokens : config.num_draft_tokens;
      MLA_CHECK(bound >= 1 || batch_size == 0, op,
                ": DRAFT_EXTEND without batch.extend_seq_lens_cpu needs a bound on the queries "
                "per request: batch.num_draft_tokens or BackendConfig::num_draft_tokens (> 0)");
      p.max_q_len = std::max(1, bound);
    }
  } else {
    p.q_len = fixed_q_len(op, mode, batch.num_draft_tokens);
    p.max_q_len = p.q_len;
    p.num_tokens = int64_t(batch_size) * p.q_len;
  }
  if (batch_size == 0) {
    plan = std::move(p);
    return;
  }

  detail::check_index_vector(op, "batch.req_pool_indices", batch.req_pool_indices, batch_size,
                             device);
  detail::check_index_vector(op, "batch.seq_lens", batch.seq_lens, batch_size, device);
  // Block-table width: from the host lengths when the engine has them, else the full context
  // (no device-to-host copy either way).
  int64_t max_kv_len = max_context_len;
  if (!batch.seq_lens_cpu.empty()) {
    detail::check_host_lengths(op, "batch.seq_lens_cpu", batch.seq_lens_cpu, batch_size);
    max_kv_len = 0;
    for (int b = 0; b < batch_size; ++b) {
      const int64_t len = int64_t(batch.seq_lens_cpu[size_t(b)]) + seq_len_offset;
      MLA_CHECK(len >= 0 && len <= max_context_len, op, ": batch.seq_lens_cpu[", b, "] = ",
                batch.seq_lens_cpu[size_t(b)],
                seq_len_offset ? " (plus the draft step offset)" : "",
                " must be in [0, max_context_len = ", max_context_len, "]");
      max_kv_len = std::max(max_kv_len, len);
    }
  }
  const int width = padded_block_count(max_kv_len, config.page_size);

  detail::Int32Layout layout;
  const int64_t at_kv_lens = layout.add(batch_size);
  const int64_t at_cu_q = draft_extend ? layout.add(int64_t(batch_size) + 1) : -1;
  const int64_t at_block_table = layout.add(int64_t(batch_size) * width);
  int32_t* base = detail::reserve_int32(plan_buffer, layout.size(), device, stream);

  p.kv_lens = detail::int32_view(base + at_kv_lens, {batch_size}, device);
  detail::lengths_to_int32(op, "batch.seq_lens", detail::first_rows(batch.seq_lens, batch_size),
                           seq_len_offset, p.kv_lens, stream);
  if (draft_extend) {
    p.cu_q_lens = detail::int32_view(base + at_cu_q, {int64_t(batch_size) + 1}, device);
    if (device_q_lens) {
      detail::prefix_sum_int32(op, "batch.extend_seq_lens",
                               detail::first_rows(batch.extend_seq_lens, batch_size), p.cu_q_lens,
                               stream);
    } else {
      host_staging = std::move(host_cu_q);
      detail::copy_to_device(base + at_cu_q, host_staging.data(),
                             host_staging.size() * sizeof(int32_t), device, stream);
    }
  }
  if (device.type == DeviceType::kCPU || config.check_metadata) {
    // The device tensors' values are visible here (on CUDA in the debug mode, by host copies
    // checked as on the CPU): name the engine's argument that disagrees with the bounds planned
    // from the host ones.
    const std::vector<int32_t> kv =
        detail::lengths_on_host(op, "batch.seq_lens", detail::first_rows(batch.seq_lens, batch_size),
                                p.kv_lens, seq_len_offset, false, stream);
    const int64_t table_tokens = int64_t(width) * config.page_size;
    for (int b = 0; b < batch_size; ++b)
      MLA_CHECK(kv[size_t(b)] <= table_tokens, op, ": batch.seq_lens[", b, "] = ", kv[size_t(b)] - seq_len_offset,
                seq_len_offset ? " (plus the draft step offset)" : "", " does not fit the block table of ",
                table_tokens, " tokens a request planned from ",
                batch.seq_lens_cpu.empty() ? "max_context_len" : "batch.seq_lens_cpu (stale?)");
    if (draft_extend && device_q_lens && !host_q_lens) {
      detail::check_query_counts(
          op, "batch.extend_seq_lens",
          detail::lengths_on_host(op, "batch.extend_seq_lens",
                                  detail::first_rows(batch.extend_seq_lens, batch_size), p.cu_q_lens, 0,
                                  true, stream),
          p.max_q_len, "the bound on the queries per request",
          "batch.num_draft_tokens or BackendConfig::num_draft_tokens");
    }
  }
  p.max_blocks = width;
  p.max_kv_len = max_kv_len;
  p.block_table = detail::int32_view(base + at_block_table, {batch_size, width}, device);
  detail::fill_block_table(config.req_to_token,
                           detail::first_rows(batch.req_pool_indices, batch_size), p.kv_lens,
                           config.page_size, p.block_table, config.check_metadata, stream);
  attach_schedule(op, p, eager_schedule, true, stream);
  plan = std::move(p);
}

void Backend::Impl::plan_extend(const ForwardBatch& batch, Stream stream) {
  const char* op = kPlanOp;
  const int batch_size = batch.batch_size;
  const Device device = config.device;
  if (batch_size > 0) {
    MLA_CHECK(!batch.extend_seq_lens_cpu.empty(), op,
              ": EXTEND is planned from host lengths: batch.extend_seq_lens_cpu is required");
    MLA_CHECK(!batch.extend_prefix_lens_cpu.empty(), op,
              ": EXTEND is planned from host lengths: batch.extend_prefix_lens_cpu is required");
  }
  detail::check_host_lengths(op, "batch.extend_seq_lens_cpu", batch.extend_seq_lens_cpu,
                             batch_size);
  detail::check_host_lengths(op, "batch.extend_prefix_lens_cpu", batch.extend_prefix_lens_cpu,
                             batch_size);
  for (int b = 0; b < batch_size; ++b) {
    const int64_t prefix = batch.extend_prefix_lens_cpu[size_t(b)];
    const int64_t extend = batch.extend_seq_lens_cpu[size_t(b)];
    MLA_CHECK(prefix >= 0, op, ": batch.extend_prefix_lens_cpu[", b, "] must be >= 0, got ", prefix);
    MLA_CHECK(extend >= 0, op, ": batch.extend_seq_lens_cpu[", b, "] must be >= 0, got ", extend);
    MLA_CHECK(prefix + extend <= max_context_len, op, ": batch.extend_prefix_lens_cpu[", b,
              "] + batch.extend_seq_lens_cpu[", b, "] = ", prefix + extend,
              " exceeds max_context_len = ", max_context_len);
    if (!batch.seq_lens_cpu.empty()) {
      detail::check_host_lengths(op, "batch.seq_lens_cpu", batch.seq_lens_cpu, batch_size);
      MLA_CHECK(batch.seq_lens_cpu[size_t(b)] == prefix + extend, op, ": batch.seq_lens_cpu[", b,
                "] = ", batch.seq_lens_cpu[size_t(b)], " but extend_prefix_lens_cpu[", b,
                "] + extend_seq_lens_cpu[", b, "] = ", prefix + extend);
    }
  }
  if (!batch.seq_lens.empty())
    detail::check_index_vector(op, "batch.seq_lens", batch.seq_lens, batch_size, device);

  ExtendPlan ext = plan_extend_lengths(batch.extend_prefix_lens_cpu, batch.extend_seq_lens_cpu,
                                       config.prefix_chunk_capacity, config.extend_prefix_path,
                                       config.absorbed_max_extend_len, config.deterministic);
  Plan p;
  p.mode = ForwardMode::kExtend;
  p.batch_size = batch_size;
  p.num_tokens = ext.num_tokens;
  p.max_q_len = std::max(1, ext.max_q_len);
  p.max_kv_len = ext.max_seq_len;
  if (batch_size == 0) {
    p.extend = std::move(ext);
    plan = std::move(p);
    return;
  }
  detail::check_index_vector(op, "batch.req_pool_indices", batch.req_pool_indices, batch_size,
                             device);
  const int width = padded_block_count(ext.max_seq_len, config.page_size);

  // Uploaded from the host: kv_lens | cu_q_lens | prefix_lens | each chunk's cu_kv_lens.
  // Then built on the device: block_table | prefix token slots (request-major).
  detail::Int32Layout layout;
  const int64_t at_kv_lens = layout.add(batch_size);
  const int64_t at_cu_q = layout.add(int64_t(batch_size) + 1);
  const int64_t at_prefix_lens = layout.add(batch_size);
  std::vector<int64_t> at_chunk_cu(ext.chunks.size());
  for (size_t c = 0; c < ext.chunks.size(); ++c) at_chunk_cu[c] = layout.add(int64_t(batch_size) + 1);
  const int64_t upload_count = layout.size();
  const int64_t at_block_table = layout.add(int64_t(batch_size) * width);
  const int64_t at_slots = layout.add(ext.num_prefix_tokens);

  host_staging.assign(size_t(upload_count), 0);
  for (int b = 0; b < batch_size; ++b) {
    host_staging[size_t(at_kv_lens + b)] = ext.prefix_lens[size_t(b)] + ext.extend_lens[size_t(b)];
    host_staging[size_t(at_prefix_lens + b)] = ext.prefix_lens[size_t(b)];
  }
  std::copy(ext.cu_q_lens.begin(), ext.cu_q_lens.end(), host_staging.begin() + at_cu_q);
  for (size_t c = 0; c < ext.chunks.size(); ++c)
    std::copy(ext.chunks[c].cu_kv_lens.begin(), ext.chunks[c].cu_kv_lens.end(),
              host_staging.begin() + at_chunk_cu[c]);
  int32_t* base = detail::reserve_int32(plan_buffer, layout.size(), device, stream);
  detail::copy_to_device(base, host_staging.data(), size_t(upload_count) * sizeof(int32_t), device,
                         stream);

  p.kv_lens = detail::int32_view(base + at_kv_lens, {batch_size}, device);
  p.cu_q_lens = detail::int32_view(base + at_cu_q, {int64_t(batch_size) + 1}, device);
  ext.cu_q_lens_device = p.cu_q_lens;
  p.max_blocks = width;
  p.block_table = detail::int32_view(base + at_block_table, {batch_size, width}, device);
  const TensorView req_pool_indices = detail::first_rows(batch.req_pool_indices, batch_size);
  detail::fill_block_table(config.req_to_token, req_pool_indices, p.kv_lens, config.page_size,
                           p.block_table, config.check_metadata, stream);

  // Prefix token slots, request-major: with page size 1 a block-table row is the request's
  // token slots, so each request's prefix row is written straight into its packed place.
  int64_t slot_offset = 0;
  for (int b = 0; b < batch_size; ++b) {
    const int32_t prefix = ext.prefix_lens[size_t(b)];
    if (prefix == 0) continue;
    detail::fill_block_table(
        config.req_to_token, detail::row_range(req_pool_indices, b, 1),
        detail::int32_view(base + at_prefix_lens + b, {1}, device), 1,
        detail::int32_view(base + at_slots + slot_offset, {1, prefix}, device), config.check_metadata,
        stream);
    slot_offset += prefix;
  }
  for (size_t c = 0; c < ext.chunks.size(); ++c) {
    PrefixChunk& chunk = ext.chunks[c];
    chunk.cu_kv_lens_device =
        detail::int32_view(base + at_chunk_cu[c], {int64_t(batch_size) + 1}, device);
    chunk.slots = detail::int32_view(base + at_slots + chunk.first_token, {chunk.num_tokens}, device);
  }
  // The split-KV schedule only when the absorbed path is the planned one (without it the
  // absorbed kernel still runs, unsplit), on a slot of its own. The deterministic mode runs
  // EXTEND unsplit: a deterministic schedule holds every piece of every row tile at the full
  // context (GiB for long extends), and a long extend fills the SMs with its row tiles anyway.
  if (ext.use_absorbed && !config.deterministic) attach_schedule(op, p, extend_schedule, true, stream);
  p.extend = std::move(ext);
  plan = std::move(p);
}

void Backend::Impl::plan_fixed(const char* op, int bs, int64_t num_tokens,
                               const TensorView& req_pool_indices, const TensorView& seq_lens,
                               ForwardMode mode, const TensorView& extend_seq_lens, Stream stream) {
  MLA_CHECK(graph_max_bs > 0, op, ": no CUDA-graph buffers; call init_cuda_graph_state first");
  MLA_CHECK(mode == ForwardMode::kIdle || is_decode_family(mode), op,
            ": mode must be DECODE, TARGET_VERIFY, DRAFT_EXTEND or IDLE (EXTEND is planned "
            "eagerly), got ", forward_mode_name(mode));
  MLA_CHECK(bs >= 0 && bs <= graph_max_bs, op, ": bs must be in [0, max_bs = ", graph_max_bs,
            "], got ", bs);
  const bool draft_extend = mode == ForwardMode::kDraftExtend;
  MLA_CHECK(extend_seq_lens.empty() || draft_extend, op,
            ": extend_seq_lens is for DRAFT_EXTEND graphs, got it with ", forward_mode_name(mode));
  planned = false;
  Plan p;
  p.mode = mode;
  p.fixed_buffers = true;
  if (mode == ForwardMode::kIdle) {
    plan = std::move(p);
    planned = true;
    return;
  }
  p.batch_size = bs;
  p.q_len = fixed_q_len(op, mode, 0);
  p.max_q_len = p.q_len;
  p.num_tokens = int64_t(bs) * p.q_len;
  if (num_tokens >= 0)
    MLA_CHECK(num_tokens == p.num_tokens, op, ": num_tokens must be bs * q_len = ", bs, " * ",
              p.q_len, " = ", p.num_tokens, " for ", forward_mode_name(mode), ", got ", num_tokens);
  MLA_CHECK(p.num_tokens <= graph_max_num_tokens, op, ": bs ", bs, " x q_len ", p.q_len, " = ",
            p.num_tokens, " tokens exceeds max_num_tokens = ", graph_max_num_tokens);
  p.max_blocks = graph_max_blocks;
  p.max_kv_len = max_context_len;
  p.kv_lens = detail::int32_view(graph_kv_lens, {bs}, config.device);
  p.block_table = detail::int32_view(graph_block_table, {bs, graph_max_blocks}, config.device);
  if (draft_extend) {
    // A DRAFT_EXTEND graph runs bs x num_draft_tokens query rows whatever each replay accepted:
    // the replay's queries per request (extend_seq_lens, each at most num_draft_tokens) are
    // packed at the front, and the rows past their total come out 0 / -inf (run_absorbed).
    // Without extend_seq_lens every request has num_draft_tokens. Both ways the graph reads the
    // same offsets buffer, so one captured either way replays the other.
    p.cu_q_lens = detail::int32_view(graph_cu_q_lens, {int64_t(bs) + 1}, config.device);
    p.q_len = 1;
  }
  if (bs > 0) {
    detail::check_index_vector(op, "req_pool_indices", req_pool_indices, bs, config.device);
    detail::check_index_vector(op, "seq_lens", seq_lens, bs, config.device);
    detail::lengths_to_int32(op, "seq_lens", detail::first_rows(seq_lens, bs), seq_len_offset,
                             p.kv_lens, stream);
    if (config.device.type == DeviceType::kCUDA && config.check_metadata)  // named as on the CPU
      (void)detail::lengths_on_host(op, "seq_lens", detail::first_rows(seq_lens, bs), p.kv_lens,
                                    seq_len_offset, false, stream);
    if (draft_extend && !extend_seq_lens.empty()) {
      detail::check_index_vector(op, "extend_seq_lens", extend_seq_lens, bs, config.device);
      detail::prefix_sum_int32(op, "extend_seq_lens", detail::first_rows(extend_seq_lens, bs),
                               p.cu_q_lens, stream);
      if (config.device.type == DeviceType::kCPU || config.check_metadata) {
        // Readable here (on CUDA in the debug mode, checked as on the CPU): name the count past
        // the bound.
        detail::check_query_counts(
            op, "extend_seq_lens",
            detail::lengths_on_host(op, "extend_seq_lens", detail::first_rows(extend_seq_lens, bs),
                                    p.cu_q_lens, 0, true, stream),
            p.max_q_len, "the graph's queries per request", "BackendConfig::num_draft_tokens");
      }
    } else if (draft_extend) {
      detail::copy_on_device(graph_cu_q_lens, graph_equal_cu_q_lens,
                             (size_t(bs) + 1) * sizeof(int32_t), config.device, stream);
    }
    detail::fill_block_table(config.req_to_token, detail::first_rows(req_pool_indices, bs),
                             p.kv_lens, config.page_size, p.block_table, config.check_metadata, stream);
    attach_schedule(op, p, graph_schedule, false, stream);
  }
  plan = std::move(p);
  planned = true;
}

const Plan* Backend::Impl::begin_forward(const char* op, const ForwardBatch& batch,
                                         bool decode_family, const char* mode_hint,
                                         const LayerParams& layer, Stream stream) {
  if (batch.mode == ForwardMode::kIdle) return nullptr;
  if (decode_family) {
    MLA_CHECK(is_decode_family(batch.mode), op,
              ": batch.mode must be DECODE, TARGET_VERIFY or DRAFT_EXTEND, got ",
              forward_mode_name(batch.mode), mode_hint);
  } else {
    MLA_CHECK(batch.mode == ForwardMode::kExtend, op, ": batch.mode must be EXTEND, got ",
              forward_mode_name(batch.mode), mode_hint);
  }
  check_layer(op, layer);
  return &plan_for(op, batch, stream);
}

const Plan& Backend::Impl::plan_for(const char* op, const ForwardBatch& batch, Stream stream) {
  MLA_CHECK(planned, op,
            ": there is no plan; call init_forward_metadata (or a CUDA-graph capture/replay) first");
  MLA_CHECK(batch.mode == plan.mode, op, ": batch.mode is ", forward_mode_name(batch.mode),
            " but the plan was made for ", forward_mode_name(plan.mode),
            "; call init_forward_metadata for this batch");
  if (batch.batch_size > plan.batch_size) {
    // A CUDA-graph plan is not re-planned: the new plan would live in the eager buffers, which a
    // graph being captured would then point at while later eager plans move or reuse them.
    MLA_CHECK(!plan.fixed_buffers, op, ": batch.batch_size ", batch.batch_size,
              " is larger than the CUDA-graph plan's ", plan.batch_size,
              " requests (init_forward_metadata_capture/replay_cuda_graph); capture and replay "
              "with the padded batch size, or plan this batch with init_forward_metadata");
    // Data-parallel padding grew the batch after it was planned: re-plan rather than read past
    // the end of the plan. The padding grows batch_size and the device tensors; in the decode
    // family a host list it left short is not used then (seq_lens_cpu only narrows the block
    // table; DRAFT_EXTEND's queries come from extend_seq_lens when the device has them). EXTEND
    // is planned from its host lists: a short one is an error naming it.
    ForwardBatch grown = batch;
    if (is_decode_family(batch.mode)) {
      if (int64_t(grown.seq_lens_cpu.size()) < grown.batch_size) grown.seq_lens_cpu = {};
      if (int64_t(grown.extend_seq_lens_cpu.size()) < grown.batch_size && !grown.extend_seq_lens.empty())
        grown.extend_seq_lens_cpu = {};
    }
    if (replan_all_steps)
      replan_all_steps(grown, stream);
    else
      plan_batch(grown, stream);
  }
  MLA_CHECK(batch.batch_size == plan.batch_size, op, ": batch.batch_size is ", batch.batch_size,
            " but the plan has ", plan.batch_size, " requests");
  return plan;
}

void Backend::Impl::check_layer(const char* op, const LayerParams& layer) const {
  check_cache(op, layer);
  MLA_CHECK(finite_positive(layer.softmax_scale), op, ": layer.softmax_scale (layer ",
            layer.layer_id, ") must be finite and > 0 (e.g. 1/sqrt(192)), got ", layer.softmax_scale);
  MLA_CHECK(finite_positive(layer.q_scale), op, ": layer.q_scale (layer ", layer.layer_id,
            ") must be finite and > 0, got ", layer.q_scale);
}

void Backend::Impl::check_cache(const char* op, const LayerParams& layer) const {
  const TensorView& kv = layer.kv_cache;
  check::ndim(op, "layer.kv_cache", kv, 3);
  check::dim(op, "layer.kv_cache", kv, 1, config.page_size, "page size, as BackendConfig::page_size");
  check::dim(op, "layer.kv_cache", kv, 2, kLatentDim, "kv_lora_rank 512 + rope 64");
  check::dtype(op, "layer.kv_cache", kv, config.kv_cache_dtype);
  check::contiguous(op, "layer.kv_cache", kv);
  check::same_device(op, "layer.kv_cache", kv, config.device);
  MLA_CHECK(finite_positive(layer.k_scale), op, ": layer.k_scale (layer ", layer.layer_id,
            ") must be finite and > 0, got ", layer.k_scale);
}

bool Backend::Impl::uses_schedule() const {
  // The deterministic mode runs unsplit unless it has deterministic_split_keys.
  return config.device.type == DeviceType::kCUDA &&
         (!config.deterministic || config.deterministic_split_keys > 0);
}

void Backend::Impl::reserve_schedule(ScheduleSlot& slot, int max_batch, int max_q_len,
                                     Stream stream) {
  if (!uses_schedule()) return;
  max_batch = std::max(max_batch, slot.ready ? slot.schedule.max_batch : 1);
  max_q_len = std::max(max_q_len, slot.ready ? slot.schedule.max_q_len : 1);
  // A deterministic schedule covers every block table the backend builds: up to max_context_len
  // keys, padded to whole rows of pages.
  const int split_keys = config.deterministic ? config.deterministic_split_keys : 0;
  const int max_kv_len = int(std::min<int64_t>(
      INT32_MAX, int64_t(padded_block_count(max_context_len, config.page_size)) * config.page_size));
  const int heads = config.num_q_heads;
#if defined(MLA_WITH_CUDA)
  const cuda::DeviceGuard guard(config.device);  // the schedule's SM count and its workspace
#endif
  const size_t bytes =
      split_keys > 0
          ? decode_workspace_bytes_deterministic(max_batch, max_q_len, heads, max_kv_len, split_keys)
          : decode_workspace_bytes(max_batch, max_q_len, heads);
  slot.ready = false;
  slot.buffer.reset();
  slot.buffer = detail::Buffer(bytes, config.device, stream);
  slot.schedule = split_keys > 0 ? make_deterministic_decode_schedule(slot.buffer.data(), bytes,
                                                                      max_batch, max_q_len, heads,
                                                                      max_kv_len, split_keys)
                                 : make_decode_schedule(slot.buffer.data(), bytes, max_batch,
                                                        max_q_len, heads);
  slot.ready = true;
}

void Backend::Impl::attach_schedule(const char* op, Plan& p, ScheduleSlot& slot, bool may_grow,
                                    Stream stream) {
  p.schedule = nullptr;
  if (!uses_schedule() || p.batch_size == 0) return;
  const int q_rows = p.cu_q_lens.empty() ? p.q_len : p.max_q_len;
  if (!slot.ready || slot.schedule.max_batch < p.batch_size || slot.schedule.max_q_len < q_rows) {
    MLA_CHECK(may_grow, op, ": the CUDA-graph split-KV schedule holds ",
              slot.ready ? slot.schedule.max_batch : 0, " requests of ",
              slot.ready ? slot.schedule.max_q_len : 0, " queries, the batch needs ", p.batch_size,
              " of ", q_rows, " (init_cuda_graph_state sizes it)");
    // A balanced schedule (tens of MB) grows by half again at least, so that a batch growing a
    // request a step does not reallocate (and zero) it every step; a deterministic one, whose
    // partial results scale with the batch at the full context, to the batch.
    const int batch = slot.ready && !config.deterministic && slot.schedule.max_batch < p.batch_size
                          ? std::max<int>(p.batch_size,
                                          std::min<int64_t>(INT32_MAX, int64_t(slot.schedule.max_batch) * 3 / 2))
                          : p.batch_size;
    reserve_schedule(slot, batch, q_rows, stream);
  }
  plan_decode(slot.schedule, p.kv_lens, p.cu_q_lens, p.q_len, p.max_q_len, stream);
  p.schedule = &slot.schedule;
}

// ---------------------------------------------------------------------------------------------
// Backend::Impl: attention

void Backend::Impl::run_absorbed(const char* op, const ForwardBatch& batch, const LayerParams& layer,
                                 const AbsorbedAttentionArgs& args, const Plan& p, Stream stream) {
  const Device device = config.device;
  const int64_t heads = config.num_q_heads;
  const bool fused = !args.q.empty();
  const bool split = !args.q_nope.empty() || !args.q_pe.empty();
  MLA_CHECK(fused != split, op,
            ": give either args.q [T, H, 576] or args.q_nope [T, H, 512] with args.q_pe [T, H, 64]",
            fused ? " (both were given)" : " (none was given)");
  const bool rope = !args.cos_sin_cache.empty();
  const char* q_name = fused ? "args.q" : "args.q_nope";
  const TensorView& q_first = fused ? args.q : args.q_nope;
  check::ndim(op, q_name, q_first, 3);
  const int64_t num_tokens = q_first.shape[0];
  check::dim(op, q_name, q_first, 1, heads, "heads, as BackendConfig::num_q_heads");
  check::dim(op, q_name, q_first, 2, fused ? kLatentDim : kKvLoraRank,
             fused ? "absorbed q_nope 512 + q_pe 64" : "absorbed q_nope");
  if (rope)
    check::dtype_in(op, q_name, q_first, {DType::kBF16, DType::kFP16});
  else
    check::dtype(op, q_name, q_first, config.q_dtype);
  check::same_device(op, q_name, q_first, device);
  if (!fused) {
    check_heads_operand(op, "args.q_pe", args.q_pe, num_tokens, "tokens, as args.q_nope", kRopeDim,
                        "rope dim", q_first.dtype);
  }
  if (p.num_tokens >= 0)
    MLA_CHECK(num_tokens == p.num_tokens, op, ": ", q_name, " has ", num_tokens,
              " tokens but the plan for this ", forward_mode_name(p.mode), " batch has ",
              p.num_tokens);
  // DRAFT_EXTEND planned from device lengths alone: where they are readable here (CPU tensors, or
  // a host copy in the debug mode), their total is checked against the queries under the caller's
  // names (the rows past it are a padded batch's: see zero_padding_rows below).
  if (p.num_tokens < 0 && !p.cu_q_lens.empty() &&
      (p.cu_q_lens.device.type == DeviceType::kCPU || config.check_metadata)) {
    int32_t planned = 0;
    detail::copy_to_host(&planned, static_cast<const int32_t*>(p.cu_q_lens.data) + p.batch_size,
                         sizeof(int32_t), p.cu_q_lens.device, stream);
    MLA_CHECK(planned <= num_tokens, op, ": batch.extend_seq_lens add up to ", planned,
              " query tokens but ", q_name, " has only ", num_tokens);
  }
  check_heads_operand(op, "args.out", args.out, num_tokens, "tokens, as the queries", kKvLoraRank,
                      "kv_lora_rank", config.out_dtype);
  if (!args.lse.empty()) check_lse(op, args.lse, num_tokens, "tokens, as the queries");
  TensorView k_nope = args.k_nope;
  TensorView k_pe = args.k_pe;
  if (args.save_kv_cache) {
    MLA_CHECK(!k_nope.empty() && !k_pe.empty(), op,
              ": args.k_nope and args.k_pe are required with args.save_kv_cache "
              "(or set save_kv_cache = false)");
    check::ndim(op, "args.k_nope", k_nope, 2);
    check::dim(op, "args.k_nope", k_nope, 0, num_tokens, "tokens, as the queries");
    check::same_device(op, "args.k_nope", k_nope, device);
    check::ndim(op, "args.k_pe", k_pe, 2);
    check::dim(op, "args.k_pe", k_pe, 0, num_tokens, "tokens, as the queries");
    check::same_device(op, "args.k_pe", k_pe, device);
    detail::check_index_vector(op, "batch.out_cache_loc", batch.out_cache_loc, num_tokens, device);
  }
  if (p.batch_size == 0 || num_tokens == 0) {
    MLA_CHECK(num_tokens == 0, op, ": ", q_name, " has ", num_tokens,
              " tokens but the batch has no requests");
    return;
  }

  detail::ScratchArena scratch(*workspace, op);
  MlaDecodeArgs decode;
  if (rope) {
    detail::check_index_vector(op, "batch.positions", batch.positions, num_tokens, device);
    RopeQuantizeArgs r;
    r.q_nope = fused ? last_dim_slice(args.q, 0, kKvLoraRank) : args.q_nope;
    r.q_pe = fused ? last_dim_slice(args.q, kKvLoraRank, kRopeDim) : args.q_pe;
    r.cos_sin_cache = args.cos_sin_cache;
    r.positions = detail::first_rows(batch.positions, num_tokens);
    r.style = args.rope_style;
    r.q_out = scratch.take("the roped query", config.q_dtype, {num_tokens, heads, kLatentDim});
    r.q_scale = layer.q_scale;
    r.check_metadata = config.check_metadata;
    if (args.save_kv_cache) {
      r.k_nope = k_nope;
      r.k_pe = k_pe;
      r.k_nope_out = scratch.take("the roped k_nope", k_nope.dtype, {num_tokens, kKvLoraRank});
      r.k_pe_out = scratch.take("the roped k_pe", k_nope.dtype, {num_tokens, kRopeDim});
    }
    rope_quantize(r, stream);
    if (args.save_kv_cache) {
      k_nope = r.k_nope_out;
      k_pe = r.k_pe_out;
    }
    decode.q = r.q_out;
  } else if (fused) {
    decode.q = args.q;
  } else {
    decode.q_nope = args.q_nope;
    decode.q_pe = args.q_pe;
  }
  if (args.save_kv_cache) append_kv(layer, k_nope, k_pe, batch.out_cache_loc, num_tokens, stream);
  decode.kv_cache = layer.kv_cache;
  decode.block_table = p.block_table;
  decode.kv_lens = p.kv_lens;
  decode.cu_q_lens = p.cu_q_lens;
  decode.q_len = p.q_len;
  decode.max_q_len = p.max_q_len;
  decode.softmax_scale = layer.softmax_scale;
  decode.q_scale = config.q_dtype == DType::kFP8E4M3 ? layer.q_scale : 1.0f;
  decode.k_scale = config.kv_cache_dtype == DType::kFP8E4M3 ? layer.k_scale : 1.0f;
  decode.out = args.out;
  decode.lse = args.lse;
  decode.schedule = p.schedule;
  decode.check_metadata = config.check_metadata;
  decode.deterministic = config.deterministic;
  // DRAFT_EXTEND planned from device lengths alone takes its query rows from the queries: rows
  // past the lengths' total (a padded batch) come out as rows that see no key.
  // So do a DRAFT_EXTEND graph's rows past the replay's queries (plan_fixed).
  decode.zero_padding_rows = !p.cu_q_lens.empty() && (p.num_tokens < 0 || p.fixed_buffers);
  mla_decode(decode, stream);
}

void Backend::Impl::check_heads_operand(const char* op, const char* name, const TensorView& t,
                                        int64_t rows, const char* rows_what, int64_t width,
                                        const char* width_what, DType dtype) const {
  check::ndim(op, name, t, 3);
  check::dim(op, name, t, 0, rows, rows_what);
  check::dim(op, name, t, 1, config.num_q_heads, "heads, as BackendConfig::num_q_heads");
  check::dim(op, name, t, 2, width, width_what);
  check::dtype(op, name, t, dtype);
  check::same_device(op, name, t, config.device);
}

void Backend::Impl::check_lse(const char* op, const TensorView& lse, int64_t rows,
                              const char* rows_what) const {
  check::ndim(op, "args.lse", lse, 2);
  check::dim(op, "args.lse", lse, 0, rows, rows_what);
  check::dim(op, "args.lse", lse, 1, config.num_q_heads, "heads, as BackendConfig::num_q_heads");
  check::dtype(op, "args.lse", lse, DType::kFP32);
  check::same_device(op, "args.lse", lse, config.device);
}

void Backend::Impl::check_mha(const char* op, const MhaAttentionArgs& args, int64_t num_q,
                              int64_t num_kv, bool lse_required) const {
  const char* tokens = "tokens, as planned (sum of extend lengths)";
  const char* keys = "keys, as planned";
  const char* qk_dim = "qk_nope 128 + rope 64";
  check_heads_operand(op, "args.q", args.q, num_q, tokens, 192, qk_dim, config.q_dtype);
  check_heads_operand(op, "args.k", args.k, num_kv, keys, 192, qk_dim, config.q_dtype);
  check_heads_operand(op, "args.v", args.v, num_kv, keys, 128, "v head dim", config.q_dtype);
  check_heads_operand(op, "args.out", args.out, num_q, tokens, 128, "v head dim", config.out_dtype);
  // One rule for the operands with or without a prefix, checked before any work and under the
  // caller's names: what mha_prefill asks of them (on the GPU, 16-byte rows), also of an out
  // that, with a prefix, only the last merge writes (which would take any alignment).
  check::inner_contiguous(op, "args.out", args.out);
  check::non_overlapping(op, "args.out", args.out);
  if (config.device.type == DeviceType::kCUDA) {
    for (const auto& [name, t] : {std::pair<const char*, const TensorView*>{"args.q", &args.q},
                                  {"args.k", &args.k}, {"args.v", &args.v}, {"args.out", &args.out}})
      check::rows_aligned16(op, name, *t, "on the GPU (mha_prefill's 16-byte copies)");
  }
  MLA_CHECK(!lse_required || !args.lse.empty(), op, ": args.lse is required");
  if (!args.lse.empty()) {
    check_lse(op, args.lse, num_q, "tokens, as args.q");
    check::non_overlapping(op, "args.lse", args.lse);
  }
}

void Backend::Impl::check_chunk_index(const char* op, int chunk_idx) const {
  MLA_CHECK(planned && plan.mode == ForwardMode::kExtend, op,
            ": the current plan is not an EXTEND plan; call init_forward_metadata first");
  MLA_CHECK(chunk_idx >= 0 && size_t(chunk_idx) < plan.extend.chunks.size(), op,
            ": chunk_idx must be in [0, ", plan.extend.chunks.size(), "), got ", chunk_idx);
}

void Backend::Impl::run_mha_prefill(const LayerParams& layer, const MhaAttentionArgs& args,
                                    const TensorView& cu_kv_lens, int max_kv_len, bool causal,
                                    const TensorView& out, const TensorView& lse, Stream stream) {
  MhaPrefillArgs m;
  m.q = args.q;
  m.k = args.k;
  m.v = args.v;
  m.cu_q_lens = plan.extend.cu_q_lens_device;
  m.cu_kv_lens = cu_kv_lens;
  m.max_q_len = std::max(1, plan.extend.max_q_len);
  m.max_kv_len = std::max(1, max_kv_len);
  m.causal = causal;
  m.check_metadata = config.check_metadata;
  m.softmax_scale = layer.softmax_scale;
  m.q_scale = args.q_scale;
  m.k_scale = args.k_scale;
  m.v_scale = args.v_scale;
  m.out = out;
  m.lse = lse;
  mha_prefill(m, stream);
}

void Backend::Impl::run_new_token_attention(const char*, const LayerParams& layer,
                                            const MhaAttentionArgs& args, const TensorView& out,
                                            const TensorView& lse, Stream stream) {
  // The new tokens attend to themselves, causally.
  run_mha_prefill(layer, args, plan.extend.cu_q_lens_device, plan.extend.max_q_len, true, out,
                  lse, stream);
}

void Backend::Impl::run_prefix_chunk_attention(const char*, int chunk_idx, const LayerParams& layer,
                                               const MhaAttentionArgs& args, const TensorView& out,
                                               const TensorView& lse, Stream stream) {
  const PrefixChunk& chunk = plan.extend.chunks[size_t(chunk_idx)];
  run_mha_prefill(layer, args, chunk.cu_kv_lens_device, chunk.max_kv_len, false, out, lse, stream);
}

void Backend::Impl::append_kv(const LayerParams& layer, const TensorView& k_nope,
                              const TensorView& k_pe, const TensorView& out_cache_loc,
                              int64_t num_tokens, Stream stream) {
  AppendLatentKvArgs append;
  append.k_nope = k_nope;
  append.k_pe = k_pe;
  append.loc = detail::first_rows(out_cache_loc, num_tokens);
  append.kv_cache = layer.kv_cache;
  append.k_scale = layer.k_scale;
  append.check_metadata = config.check_metadata;
  append_latent_kv(append, stream);
}

// ---------------------------------------------------------------------------------------------
// Backend: public entries

Backend::Backend(const BackendConfig& config, std::shared_ptr<Workspace> workspace)
    : impl_(std::make_unique<Impl>()) {
  impl_->config = config;
  impl_->validate_config();
  if (workspace) {
    MLA_CHECK(workspace->device() == config.device, "Backend: the workspace is on ",
              device_name(workspace->device()), " but config.device is ",
              device_name(config.device));
    impl_->workspace = std::move(workspace);
  } else {
    impl_->workspace = std::make_shared<Workspace>(config.workspace_bytes, config.device);
  }
}

Backend::~Backend() = default;
Backend::Backend(Backend&&) noexcept = default;
Backend& Backend::operator=(Backend&&) noexcept = default;

const BackendConfig& Backend::config() const { return impl_->config; }
const std::shared_ptr<Workspace>& Backend::workspace() const { return impl_->workspace; }
const Plan& Backend::plan() const { return impl_->plan; }
bool Backend::has_plan() const { return impl_->planned; }

void Backend::init_forward_metadata(const ForwardBatch& batch, Stream stream) {
  impl_->plan_batch(batch, stream);
}

void Backend::init_cuda_graph_state(int max_bs, int64_t max_num_tokens) {
  constexpr const char* op = "init_cuda_graph_state";
  MLA_CHECK(max_bs >= 1, op, ": max_bs must be >= 1, got ", max_bs);
  MLA_CHECK(max_num_tokens >= max_bs, op,
            ": max_num_tokens must be >= max_bs (DECODE has one token per request), got ",
            max_num_tokens, " with max_bs ", max_bs);
  Impl& s = *impl_;
  const int width = padded_block_count(s.max_context_len, s.config.page_size);
  detail::Int32Layout layout;
  const int64_t at_kv_lens = layout.add(max_bs);
  const int64_t at_block_table = layout.add(int64_t(max_bs) * width);
  const int k = s.config.num_draft_tokens;  // DRAFT_EXTEND graphs need it (fixed_q_len)
  const int64_t at_cu_q = k > 0 ? layout.add(int64_t(max_bs) + 1) : -1;
  const int64_t at_equal_cu_q = k > 0 ? layout.add(int64_t(max_bs) + 1) : -1;
  std::vector<int32_t> equal_cu_q;
  if (k > 0) {
    MLA_CHECK(int64_t(max_bs) * k <= INT32_MAX, op, ": max_bs ", max_bs, " x num_draft_tokens ", k,
              " query tokens do not fit int32 offsets");
    for (int b = 0; b <= max_bs; ++b) equal_cu_q.push_back(b * k);
  }
  // Everything allocated before the graph state changes: an allocation that fails leaves the
  // buffers and their sizes as they were (a failed schedule leaves its slot empty, which a
  // capture then reports).
  s.planned = false;  // the plan may point into the buffers being replaced
  s.reserve_schedule(s.graph_schedule, max_bs, std::max(1, s.config.num_draft_tokens), nullptr);
  s.graph_buffer = detail::Buffer(size_t(layout.size()) * sizeof(int32_t), s.config.device);
  auto* base = static_cast<int32_t*>(s.graph_buffer.data());
  s.graph_kv_lens = base + at_kv_lens;
  s.graph_block_table = base + at_block_table;
  s.graph_cu_q_lens = k > 0 ? base + at_cu_q : nullptr;
  s.graph_equal_cu_q_lens = k > 0 ? base + at_equal_cu_q : nullptr;
  if (k > 0) {
    // On the legacy default stream: waited for, so that a replay on any stream reads them.
    detail::copy_to_device(s.graph_equal_cu_q_lens, equal_cu_q.data(),
                           equal_cu_q.size() * sizeof(int32_t), s.config.device, nullptr);
    detail::wait_for_stream(s.config.device, nullptr);
  }
  s.graph_max_bs = max_bs;
  s.graph_max_num_tokens = max_num_tokens;
  s.graph_max_blocks = width;
}

void Backend::init_forward_metadata_capture_cuda_graph(int bs, int64_t num_tokens,
                                                       const TensorView& req_pool_indices,
                                                       const TensorView& seq_lens, ForwardMode mode,
                                                       Stream stream,
                                                       const TensorView& extend_seq_lens) {
  MLA_CHECK(num_tokens >= 0, "init_forward_metadata_capture_cuda_graph: num_tokens must be >= 0, got ",
            num_tokens);
  impl_->plan_fixed("init_forward_metadata_capture_cuda_graph", bs, num_tokens, req_pool_indices,
                    seq_lens, mode, extend_seq_lens, stream);
}

void Backend::init_forward_metadata_replay_cuda_graph(int bs, const TensorView& req_pool_indices,
                                                      const TensorView& seq_lens, ForwardMode mode,
                                                      Stream stream,
                                                      const TensorView& extend_seq_lens) {
  impl_->plan_fixed("init_forward_metadata_replay_cuda_graph", bs, -1, req_pool_indices, seq_lens,
                    mode, extend_seq_lens, stream);
}

void Backend::save_latent_kv(const ForwardBatch& batch, const LayerParams& layer,
                             const TensorView& k_nope, const TensorView& k_pe, Stream stream) {
  constexpr const char* op = "save_latent_kv";
  if (batch.mode == ForwardMode::kIdle) return;
  impl_->check_cache(op, layer);
  check::ndim(op, "k_nope", k_nope, 2);
  const int64_t num_tokens = k_nope.shape[0];
  check::same_device(op, "k_nope", k_nope, impl_->config.device);
  detail::check_index_vector(op, "batch.out_cache_loc", batch.out_cache_loc, num_tokens,
                             impl_->config.device);
  impl_->append_kv(layer, k_nope, k_pe, batch.out_cache_loc, num_tokens, stream);
}

void Backend::forward_decode(const ForwardBatch& batch, const LayerParams& layer,
                             const AbsorbedAttentionArgs& args, Stream stream) {
  constexpr const char* op = "forward_decode";
  const Plan* p = impl_->begin_forward(op, batch, true, " (EXTEND runs forward_extend_*)", layer,
                                       stream);
  if (p) impl_->run_absorbed(op, batch, layer, args, *p, stream);
}

void Backend::forward_extend_absorbed(const ForwardBatch& batch, const LayerParams& layer,
                                      const AbsorbedAttentionArgs& args, Stream stream) {
  constexpr const char* op = "forward_extend_absorbed";
  const Plan* p = impl_->begin_forward(op, batch, false, " (the decode family runs forward_decode)",
                                       layer, stream);
  if (p) impl_->run_absorbed(op, batch, layer, args, *p, stream);
}

void Backend::forward_extend(const ForwardBatch& batch, const LayerParams& layer,
                             const MhaAttentionArgs& args, Stream stream) {
  constexpr const char* op = "forward_extend";
  const Plan* p = impl_->begin_forward(op, batch, false, "", layer, stream);
  if (!p) return;
  impl_->check_mha(op, args, p->num_tokens, p->num_tokens, false);
  if (p->batch_size == 0 || p->num_tokens == 0) return;
  impl_->run_new_token_attention(op, layer, args, args.out, args.lse, stream);
}

int Backend::num_prefix_chunks() const {
  const Impl& s = *impl_;
  return s.planned && s.plan.mode == ForwardMode::kExtend ? int(s.plan.extend.chunks.size()) : 0;
}

void Backend::gather_prefix_chunk(int chunk_idx, const LayerParams& layer,
                                  const TensorView& latent_out, Stream stream) {
  constexpr const char* op = "gather_prefix_chunk";
  Impl& s = *impl_;
  s.check_chunk_index(op, chunk_idx);
  s.check_cache(op, layer);
  const PrefixChunk& chunk = s.plan.extend.chunks[size_t(chunk_idx)];
  check::ndim(op, "latent_out", latent_out, 2);
  check::dim(op, "latent_out", latent_out, 0, chunk.num_tokens, "prefix tokens in the chunk");
  check::dim(op, "latent_out", latent_out, 1, kLatentDim, "kv_lora_rank 512 + rope 64");
  check::dtype(op, "latent_out", latent_out, s.config.kv_cache_dtype);
  check::inner_contiguous(op, "latent_out", latent_out);
  check::same_device(op, "latent_out", latent_out, s.config.device);
  check::disjoint(op, "latent_out", latent_out, "layer.kv_cache", layer.kv_cache);
  const TensorView& kv = layer.kv_cache;
  const TensorView entries = TensorView::contiguous(
      kv.data, kv.dtype, {kv.shape[0] * kv.shape[1], kLatentDim}, kv.device);
  detail::gather_rows(entries, chunk.slots, latent_out, stream);
}

void Backend::forward_prefix_chunk(const ForwardBatch& batch, int chunk_idx,
                                   const LayerParams& layer, const MhaAttentionArgs& args,
                                   Stream stream) {
  constexpr const char* op = "forward_prefix_chunk";
  const Plan* p = impl_->begin_forward(op, batch, false, "", layer, stream);
  if (!p) return;
  impl_->check_chunk_index(op, chunk_idx);
  const PrefixChunk& chunk = p->extend.chunks[size_t(chunk_idx)];
  impl_->check_mha(op, args, p->num_tokens, chunk.num_tokens, true);
  if (p->num_tokens == 0) return;
  impl_->run_prefix_chunk_attention(op, chunk_idx, layer, args, args.out, args.lse, stream);
}

size_t Backend::chunked_extend_workspace_bytes(const BackendConfig& config, int64_t num_tokens) {
  using detail::ScratchArena;
  MLA_CHECK(num_tokens >= 0, "chunked_extend_workspace_bytes: num_tokens must be >= 0, got ",
            num_tokens);
  const int64_t h = config.num_q_heads;
  const int64_t n = config.prefix_chunk_capacity;
  const size_t out = ScratchArena::aligned_bytes(DType::kFP32, {num_tokens, h, 128});
  const size_t lse = ScratchArena::aligned_bytes(DType::kFP32, {num_tokens, h});
  return ScratchArena::total_bytes({out, out, lse, lse,
                                    ScratchArena::aligned_bytes(config.kv_cache_dtype, {n, kLatentDim}),
                                    ScratchArena::aligned_bytes(config.q_dtype, {n, h, 192}),
                                    ScratchArena::aligned_bytes(config.q_dtype, {n, h, 128})});
}

size_t Backend::absorbed_workspace_bytes(const BackendConfig& config, int64_t num_tokens) {
  using detail::ScratchArena;
  MLA_CHECK(num_tokens >= 0, "absorbed_workspace_bytes: num_tokens must be >= 0, got ", num_tokens);
  // run_absorbed's scratch: the roped query in q_dtype; the roped key in the key's dtype, which
  // rope_quantize takes only as bf16 / fp16 (2 bytes) when it also writes it.
  return ScratchArena::total_bytes(
      {ScratchArena::aligned_bytes(config.q_dtype, {num_tokens, config.num_q_heads, kLatentDim}),
       ScratchArena::aligned_bytes(DType::kBF16, {num_tokens, kKvLoraRank}),
       ScratchArena::aligned_bytes(DType::kBF16, {num_tokens, kRopeDim})});
}

void Backend::forward_extend_chunked(const ForwardBatch& batch, const LayerParams& layer,
                                     const MhaAttentionArgs& new_tokens,
                                     const UpProjectFn& up_project, Stream stream) {
  constexpr const char* op = "forward_extend_chunked";
  Impl& s = *impl_;
  const Plan* begun = s.begin_forward(op, batch, false, "", layer, stream);
  if (!begun) return;
  const Plan& p = *begun;
  s.check_mha(op, new_tokens, p.num_tokens, p.num_tokens, false);
  const std::vector<PrefixChunk>& chunks = p.extend.chunks;
  MLA_CHECK(chunks.empty() || static_cast<bool>(up_project), op,
            ": up_project is required (the batch has a prefix)");
  if (p.batch_size == 0 || p.num_tokens == 0) return;
  if (chunks.empty()) {
    s.run_new_token_attention(op, layer, new_tokens, new_tokens.out, new_tokens.lse, stream);
    return;
  }

  const int64_t tokens = p.num_tokens;
  const int64_t heads = s.config.num_q_heads;
  int64_t max_chunk_tokens = 0;
  for (const PrefixChunk& c : chunks) max_chunk_tokens = std::max(max_chunk_tokens, c.num_tokens);
  detail::ScratchArena scratch(*s.workspace, op);
  const TensorView acc_out = scratch.take("the accumulated output", DType::kFP32, {tokens, heads, 128});
  const TensorView acc_lse = scratch.take("the accumulated lse", DType::kFP32, {tokens, heads});
  const TensorView part_out = scratch.take("a chunk's output", DType::kFP32, {tokens, heads, 128});
  const TensorView part_lse = scratch.take("a chunk's lse", DType::kFP32, {tokens, heads});
  const TensorView latent = scratch.take("the gathered latents", s.config.kv_cache_dtype,
                                         {max_chunk_tokens, kLatentDim});
  const TensorView k = scratch.take("the up-projected keys", s.config.q_dtype,
                                    {max_chunk_tokens, heads, 192});
  const TensorView v = scratch.take("the up-projected values", s.config.q_dtype,
                                    {max_chunk_tokens, heads, 128});

  s.run_new_token_attention(op, layer, new_tokens, acc_out, acc_lse, stream);
  for (size_t c = 0; c < chunks.size(); ++c) {
    const int64_t n = chunks[c].num_tokens;
    const TensorView chunk_latent = detail::first_rows(latent, n);
    gather_prefix_chunk(int(c), layer, chunk_latent, stream);
    MhaAttentionArgs chunk_args = new_tokens;
    chunk_args.k = detail::first_rows(k, n);
    chunk_args.v = detail::first_rows(v, n);
    up_project(int(c), chunk_latent, chunk_args.k, chunk_args.v, stream);
    s.run_prefix_chunk_attention(op, int(c), layer, chunk_args, part_out, part_lse, stream);
    const bool last = c + 1 == chunks.size();
    MergeStatesArgs merge;
    merge.out_a = acc_out;
    merge.lse_a = acc_lse;
    merge.out_b = part_out;
    merge.lse_b = part_lse;
    merge.out = last ? new_tokens.out : acc_out;
    merge.lse_out = last ? new_tokens.lse : acc_lse;
    merge_states(merge, stream);
  }
}

}  // namespace mla
