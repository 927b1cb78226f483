// mla::MultiStepDraftBackend: num_steps - 1 decode backends for EAGLE-style drafting. Step i
// attends over seq_lens + i tokens. The steps share the workspace (they run one after another)
// and one block table built for the longest step (a page id does not depend on the step; a
// shorter step just reads fewer of them); kv_lens are per step.
#include <algorithm>
#include <utility>

#include "backend/backend_impl.hpp"
#include "cpu/load_index.hpp"
#include "mla/error.hpp"
#include "mla/ops.hpp"

namespace mla {

struct MultiStepDraftBackend::Impl {
  int num_steps = 0;
  BackendConfig config;
  std::shared_ptr<Workspace> workspace;
  std::vector<Backend> steps;
  detail::Buffer plan_buffer;  // eager: kv_lens per step | shared block table

  int graph_max_bs = 0;
  int64_t graph_max_num_tokens = 0;
  int graph_max_blocks = 0;
  detail::Buffer graph_buffer;  // kv_lens [steps, max_bs] | block table [max_bs, max_blocks]
  int32_t* graph_base = nullptr;
  int64_t graph_block_table_at = 0;

  int64_t max_context_len() const { return steps.front().impl_->max_context_len; }
  void plan(const ForwardBatch& batch, Stream stream);
  void plan_fixed(const char* op, int bs, int64_t num_tokens, const TensorView& req_pool_indices,
                  const TensorView& seq_lens, Stream stream);
  // Fills kv_lens of every step (kv_lens[i] = seq_lens + i, each a [bs] view) and the shared
  // block table from the last step's lengths, then installs the plans.
  void build_and_install(const char* op, const char* seq_lens_name, int bs,
                         const TensorView& req_pool_indices, const TensorView& seq_lens,
                         const std::vector<TensorView>& kv_lens, const TensorView& block_table,
                         int64_t max_kv_len, bool fixed_buffers, Stream stream);
};

void MultiStepDraftBackend::Impl::build_and_install(const char* op, const char* seq_lens_name, int bs,
                                                    const TensorView& req_pool_indices,
                                                    const TensorView& seq_lens,
                                                    const std::vector<TensorView>& kv_lens,
                                                    const TensorView& block_table,
                                                    int64_t max_kv_len, bool fixed_buffers,
                                                    Stream stream) {
  const int num_step_backends = int(steps.size());
  // The steps share one block table, built for the last step (seq_lens + num_steps - 2 keys).
  // Where the lengths are readable here (CPU tensors), one past the context is reported under
  // the caller's name; on a GPU the table's row of such a request is -1 (build_block_table), so
  // its keys read as zeros in every step.
  if (seq_lens.device.type == DeviceType::kCPU) {
    const int64_t last_offset = num_step_backends - 1;
    const int64_t table_tokens = block_table.shape[1] * int64_t(config.page_size);
    for (int b = 0; b < bs; ++b) {
      const int64_t len = cpu::load_index(seq_lens, b);
      MLA_CHECK(len >= 0 && len + last_offset <= max_context_len(), op, ": ", seq_lens_name, "[", b,
                "] = ", len, " plus ", last_offset, " draft steps must be in [0, max_context_len = ",
                max_context_len(), "]");
      // (the table is narrower than the context only when planned from batch.seq_lens_cpu)
      MLA_CHECK(len + last_offset <= table_tokens, op, ": ", seq_lens_name, "[", b, "] = ", len,
                " plus ", last_offset, " draft steps does not fit the block table of ", table_tokens,
                " tokens a request planned from batch.seq_lens_cpu (stale?)");
    }
  }
  for (int i = 0; i < num_step_backends; ++i)
    detail::lengths_to_int32(op, seq_lens_name, detail::first_rows(seq_lens, bs), i,
                             kv_lens[size_t(i)], stream);
  detail::fill_block_table(config.req_to_token, detail::first_rows(req_pool_indices, bs),
                           kv_lens.back(), config.page_size, block_table, config.check_metadata, stream);
  for (int i = 0; i < num_step_backends; ++i) {
    Plan p;
    p.mode = ForwardMode::kDecode;
    p.batch_size = bs;
    p.num_tokens = bs;
    p.fixed_buffers = fixed_buffers;
    p.block_table = block_table;
    p.max_blocks = int(block_table.shape[1]);
    p.kv_lens = kv_lens[size_t(i)];
    p.q_len = 1;
    p.max_q_len = 1;
    p.max_kv_len = std::min(max_context_len(), max_kv_len + (fixed_buffers ? 0 : i));
    Backend::Impl& step = *steps[size_t(i)].impl_;
    step.attach_schedule(fixed_buffers ? "MultiStepDraftBackend (CUDA graph)"
                                       : "MultiStepDraftBackend::init_forward_metadata",
                         p, fixed_buffers ? step.graph_schedule : step.eager_schedule,
                         !fixed_buffers, stream);
    step.plan = std::move(p);
    step.planned = true;
  }
}

void MultiStepDraftBackend::Impl::plan(const ForwardBatch& batch, Stream stream) {
  constexpr const char* op = "MultiStepDraftBackend::init_forward_metadata";
  MLA_CHECK(batch.mode == ForwardMode::kDecode || batch.mode == ForwardMode::kIdle, op,
            ": batch.mode must be DECODE or IDLE (draft steps decode), got ",
            forward_mode_name(batch.mode));
  MLA_CHECK(batch.batch_size >= 0, op, ": batch.batch_size must be >= 0, got ", batch.batch_size);
  if (steps.empty()) return;
  for (Backend& step : steps) step.impl_->planned = false;
  const int bs = batch.mode == ForwardMode::kIdle ? 0 : batch.batch_size;
  if (bs == 0) {
    for (Backend& step : steps) {
      step.impl_->plan = Plan{};
      step.impl_->plan.mode = batch.mode;
      step.impl_->planned = true;
    }
    return;
  }
  const Device device = config.device;
  detail::check_index_vector(op, "batch.req_pool_indices", batch.req_pool_indices, bs, device);
  detail::check_index_vector(op, "batch.seq_lens", batch.seq_lens, bs, device);
  const int last_offset = int(steps.size()) - 1;
  int64_t max_kv_len = max_context_len();  // of step 0
  int64_t width_len = max_context_len();   // of the last step
  if (!batch.seq_lens_cpu.empty()) {
    detail::check_host_lengths(op, "batch.seq_lens_cpu", batch.seq_lens_cpu, bs);
    max_kv_len = 0;
    for (int b = 0; b < bs; ++b) {
      const int64_t len = batch.seq_lens_cpu[size_t(b)];
      MLA_CHECK(len >= 0 && len + last_offset <= max_context_len(), op, ": batch.seq_lens_cpu[", b,
                "] = ", len, " plus ", last_offset, " draft steps must be in [0, max_context_len = ",
                max_context_len(), "]");
      max_kv_len = std::max(max_kv_len, len);
    }
    width_len = max_kv_len + last_offset;
  }
  const int width = padded_block_count(width_len, config.page_size);
  detail::Int32Layout layout;
  std::vector<int64_t> at_kv_lens;
  for (size_t i = 0; i < steps.size(); ++i) at_kv_lens.push_back(layout.add(bs));
  const int64_t at_block_table = layout.add(int64_t(bs) * width);
  int32_t* base = detail::reserve_int32(plan_buffer, layout.size(), device, stream);
  std::vector<TensorView> kv_lens;
  for (int64_t at : at_kv_lens) kv_lens.push_back(detail::int32_view(base + at, {bs}, device));
  build_and_install(op, "batch.seq_lens", bs, batch.req_pool_indices, batch.seq_lens, kv_lens,
                    detail::int32_view(base + at_block_table, {bs, width}, device), max_kv_len,
                    false, stream);
}

void MultiStepDraftBackend::Impl::plan_fixed(const char* op, int bs, int64_t num_tokens,
                                             const TensorView& req_pool_indices,
                                             const TensorView& seq_lens, Stream stream) {
  MLA_CHECK(graph_max_bs > 0, op, ": no CUDA-graph buffers; call init_cuda_graph_state first");
  MLA_CHECK(bs >= 0 && bs <= graph_max_bs, op, ": bs must be in [0, max_bs = ", graph_max_bs,
            "], got ", bs);
  if (num_tokens >= 0)
    MLA_CHECK(num_tokens == bs, op, ": num_tokens must equal bs = ", bs,
              " (one draft token per request), got ", num_tokens);
  MLA_CHECK(bs <= graph_max_num_tokens, op, ": bs ", bs, " exceeds max_num_tokens = ",
            graph_max_num_tokens);
  if (steps.empty()) return;
  for (Backend& step : steps) step.impl_->planned = false;
  const Device device = config.device;
  if (bs > 0) {
    detail::check_index_vector(op, "req_pool_indices", req_pool_indices, bs, device);
    detail::check_index_vector(op, "seq_lens", seq_lens, bs, device);
  }
  std::vector<TensorView> kv_lens;
  for (size_t i = 0; i < steps.size(); ++i)
    kv_lens.push_back(detail::int32_view(graph_base + int64_t(i) * graph_max_bs, {bs}, device));
  const TensorView block_table =
      detail::int32_view(graph_base + graph_block_table_at, {bs, graph_max_blocks}, device);
  if (bs > 0) {
    build_and_install(op, "seq_lens", bs, req_pool_indices, seq_lens, kv_lens, block_table, max_context_len(),
                      true, stream);
    return;
  }
  for (size_t i = 0; i < steps.size(); ++i) {
    Plan p;
    p.mode = ForwardMode::kDecode;
    p.fixed_buffers = true;
    p.block_table = block_table;
    p.max_blocks = graph_max_blocks;
    p.kv_lens = kv_lens[i];
    steps[i].impl_->plan = std::move(p);
    steps[i].impl_->planned = true;
  }
}

MultiStepDraftBackend::MultiStepDraftBackend(int num_steps, const BackendConfig& config,
                                             std::shared_ptr<Workspace> workspace)
    : impl_(std::make_unique<Impl>()) {
  MLA_CHECK(num_steps >= 1, "MultiStepDraftBackend: num_steps must be >= 1, got ", num_steps);
  Impl& s = *impl_;
  s.num_steps = num_steps;
  s.config = config;
  // Validate the config before allocating anything for it (also when no step backend is made:
  // num_steps 1).
  { Backend probe(config, std::make_shared<Workspace>(0, config.device)); }
  if (!workspace) workspace = std::make_shared<Workspace>(config.workspace_bytes, config.device);
  s.workspace = workspace;
  Impl* owner = impl_.get();
  for (int i = 0; i + 1 < num_steps; ++i) {
    s.steps.emplace_back(config, workspace);
    Backend::Impl& step = *s.steps.back().impl_;
    step.seq_len_offset = i;
    step.replan_all_steps = [owner](const ForwardBatch& batch, Stream stream) {
      owner->plan(batch, stream);
    };
  }
}

MultiStepDraftBackend::~MultiStepDraftBackend() = default;
MultiStepDraftBackend::MultiStepDraftBackend(MultiStepDraftBackend&&) noexcept = default;
MultiStepDraftBackend& MultiStepDraftBackend::operator=(MultiStepDraftBackend&&) noexcept = default;

int MultiStepDraftBackend::num_steps() const { return impl_->num_steps; }
int MultiStepDraftBackend::num_step_backends() const { return int(impl_->steps.size()); }

Backend& MultiStepDraftBackend::step(int i) {
  MLA_CHECK(i >= 0 && i < num_step_backends(), "MultiStepDraftBackend::step: i must be in [0, ",
            num_step_backends(), "), got ", i);
  return impl_->steps[size_t(i)];
}

void MultiStepDraftBackend::init_forward_metadata(const ForwardBatch& batch, Stream stream) {
  impl_->plan(batch, stream);
}

void MultiStepDraftBackend::init_cuda_graph_state(int max_bs, int64_t max_num_tokens) {
  constexpr const char* op = "MultiStepDraftBackend::init_cuda_graph_state";
  MLA_CHECK(max_bs >= 1, op, ": max_bs must be >= 1, got ", max_bs);
  MLA_CHECK(max_num_tokens >= max_bs, op, ": max_num_tokens must be >= max_bs, got ",
            max_num_tokens, " with max_bs ", max_bs);
  Impl& s = *impl_;
  if (s.steps.empty()) {
    s.graph_max_bs = max_bs;
    s.graph_max_num_tokens = max_num_tokens;
    return;
  }
  const int width = padded_block_count(s.max_context_len(), s.config.page_size);
  const int64_t kv_count = int64_t(s.steps.size()) * max_bs;
  const int64_t block_table_at = (kv_count + 63) / 64 * 64;
  // Everything allocated before the graph state changes: an allocation that fails leaves the
  // buffer and the sizes its views are cut by as they were (a failed schedule leaves its slot
  // empty, which a capture then reports).
  for (Backend& step : s.steps) step.impl_->planned = false;
  for (Backend& step : s.steps)
    step.impl_->reserve_schedule(step.impl_->graph_schedule, max_bs, 1, nullptr);
  s.graph_buffer = detail::Buffer(size_t(block_table_at + int64_t(max_bs) * width) * sizeof(int32_t),
                                  s.config.device);
  s.graph_base = static_cast<int32_t*>(s.graph_buffer.data());
  s.graph_block_table_at = block_table_at;
  s.graph_max_bs = max_bs;
  s.graph_max_num_tokens = max_num_tokens;
  s.graph_max_blocks = width;
}

void MultiStepDraftBackend::init_forward_metadata_capture_cuda_graph(
    int bs, int64_t num_tokens, const TensorView& req_pool_indices, const TensorView& seq_lens,
    Stream stream) {
  MLA_CHECK(num_tokens >= 0,
            "MultiStepDraftBackend::init_forward_metadata_capture_cuda_graph: num_tokens must be "
            ">= 0, got ", num_tokens);
  impl_->plan_fixed("MultiStepDraftBackend::init_forward_metadata_capture_cuda_graph", bs,
                    num_tokens, req_pool_indices, seq_lens, stream);
}

void MultiStepDraftBackend::init_forward_metadata_replay_cuda_graph(
    int bs, const TensorView& req_pool_indices, const TensorView& seq_lens, Stream stream) {
  impl_->plan_fixed("MultiStepDraftBackend::init_forward_metadata_replay_cuda_graph", bs, -1,
                    req_pool_indices, seq_lens, stream);
}

}  // namespace mla
