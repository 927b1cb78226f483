"""End to end: one DeepSeek-V3-shaped MLA attention layer per tensor-parallel rank (16 or 128 local
heads; random weights for the q/kv down and up projections and the output projection; RoPE),
driven through MlaBackend the way an engine does, over a sequence of batches:

  1. EXTEND: prefill of several requests of different lengths (MHA path)
  2. EXTEND with cached prefixes, one of them shared with another request's pages (the
     chunked-prefix path: MHA over the new tokens + each prefix chunk, merged by LSE; or the
     absorbed path when chunking is off)
  3. IDLE, then DECODE steps (RoPE by the engine, then by the backend)
  4. TARGET_VERIFY with 3 draft tokens, then acceptance of a different number per request
  5. DRAFT_EXTEND with varying accepted lengths
  6. multi-step drafting with MlaMultiStepDraftBackend, then DECODE

Every batch's layer output is compared with a naive, non-absorbed float64 implementation of the
same layer that recomputes keys and values from each request's token history (it never reads
the paged cache). Tolerance on the layer output (unit scale): bf16 cache atol = rtol = 3e-2
(bf16 inputs to attention and bf16 attention outputs, each rounded at 2^-9 relative; errors of
the ~10 roundings on the path add up); fp8 cache atol = rtol = 0.2 (e4m3 rounds at 2^-4 relative).
"""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import cuda_ready
from mla_reference import FP8, assert_close, make_cos_sin_cache
from mla_torch import (AttentionLayer, ForwardBatch, ForwardMode, LatentKvPool, MlaBackend,
                       MlaMultiStepDraftBackend, SpecInfo)

NOPE_HEAD, ROPE, V_HEAD, LORA = 128, 64, 128, 512


def rms_norm(x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)


class Weights:
    """Random per-rank weights: W_DQ [hidden, q_lora], W_UQ [q_lora, H*192], W_DKV
    [hidden, 576], W_UK [H, 128, 512], W_UV [H, 128, 512], W_O [H*128, hidden]."""

    def __init__(self, heads, hidden, q_lora, gen):
        def rand(*shape, fan_in):
            return torch.randn(*shape, generator=gen, dtype=torch.float64) / math.sqrt(fan_in)
        self.heads = heads
        self.w_dq = rand(hidden, q_lora, fan_in=hidden)
        self.w_uq = rand(q_lora, heads * 192, fan_in=q_lora)
        self.w_dkv = rand(hidden, LORA + ROPE, fan_in=hidden)
        self.w_uk = rand(heads, NOPE_HEAD, LORA, fan_in=LORA)
        self.w_uv = rand(heads, V_HEAD, LORA, fan_in=LORA)
        self.w_o = rand(heads * V_HEAD, hidden, fan_in=heads * V_HEAD)

    def project(self, x, dtype=torch.float64):
        """x [T, hidden] -> q_nope [T,H,128], q_pe [T,H,64], c_kv [T,512], k_pe [T,64]."""
        w = lambda t: t.to(dtype=dtype, device=x.device)
        q = (rms_norm(x @ w(self.w_dq)) @ w(self.w_uq)).view(-1, self.heads, 192)
        kv = x @ w(self.w_dkv)
        return q[..., :NOPE_HEAD], q[..., NOPE_HEAD:], rms_norm(kv[:, :LORA]), kv[:, LORA:]


def rope_neox(x, cos_sin, positions):
    """NeoX RoPE in float64 on x's device; x [T, (H,) 64], cos_sin [max_pos, 64] (cos | sin)."""
    cs = cos_sin.to(device=x.device, dtype=torch.float64)[positions.to(x.device)]
    cos, sin = cs[:, :ROPE // 2], cs[:, ROPE // 2:]
    if x.dim() == 3:
        cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x[..., :ROPE // 2], x[..., ROPE // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def naive_layer(w, history, positions, num_new, cos_sin, scale, device="cpu"):
    """Non-absorbed attention of the last num_new tokens of one request over its whole history
    (float64, on `device`). Returns [num_new, hidden] on the CPU."""
    history = history.to(device)
    q_nope, q_pe, c_kv, k_pe = w.project(history)
    q_pe = rope_neox(q_pe, cos_sin, positions)
    k_pe = rope_neox(k_pe, cos_sin, positions)
    k_nope = torch.einsum("tc,hdc->thd", c_kv, w.w_uk.to(device))
    v = torch.einsum("tc,hdc->thd", c_kv, w.w_uv.to(device))
    n = history.shape[0]
    q = torch.cat([q_nope, q_pe], -1)[n - num_new:]
    k = torch.cat([k_nope, k_pe[:, None, :].expand(n, w.heads, ROPE)], -1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    visible = torch.arange(n)[None, :] <= (n - num_new + torch.arange(num_new))[:, None]
    probs = torch.softmax(scores.masked_fill(~visible[None].to(device), -math.inf), dim=-1)
    out = torch.einsum("hqk,khd->qhd", probs, v)
    return (out.reshape(num_new, -1) @ w.w_o.to(device)).cpu()


class Harness:
    """The engine side: weights, a paged pool with NaN-poisoned slots, req_to_token, token
    histories, and the model code around the backend's calls."""

    def __init__(self, heads, page_size, kv_dtype, device, gen, *, prefix_path="chunked",
                 chunk_capacity=8, hidden=64, q_lora=96, max_context=512, max_requests=8,
                 k_scale=1.0):
        self.heads, self.page_size, self.kv_dtype, self.device, self.gen = heads, page_size, kv_dtype, device, gen
        self.w = Weights(heads, hidden, q_lora, gen)
        self.hidden = hidden
        num_pages = max_requests * (max_context // page_size) + 4
        self.pool = LatentKvPool(1, num_pages, page_size, kv_dtype, device, fill=float("nan"))
        self.free_pages = torch.randperm(num_pages, generator=gen).tolist()
        # Slots past what a request uses hold garbage (never read).
        self.req_to_token = torch.randint(0, 2**30, (max_requests, max_context), generator=gen,
                                          dtype=torch.int32).to(device)
        self.page_of = {}
        self.history = {}
        self.cos_sin = make_cos_sin_cache(max_context + 16)
        self.cos_sin_dev = self.cos_sin.to(device)
        self.scale = 1.0 / math.sqrt(192)
        self.prefix_path = prefix_path
        kscale = k_scale if kv_dtype == FP8 else None
        self.mqa = AttentionLayer(0, heads, 576, 512, self.scale, k_scale_float=kscale)
        self.mha = AttentionLayer(0, heads, 192, 128, self.scale, tp_k_head_num=heads,
                                  k_scale_float=kscale)
        self.backend_kwargs = dict(num_q_heads=heads, page_size=page_size,
                                   req_to_token=self.req_to_token, token_to_kv_pool=self.pool,
                                   kv_cache_dtype=kv_dtype, q_dtype=torch.bfloat16,
                                   num_draft_tokens=3)
        self.backend = MlaBackend(disable_chunked_prefix_cache=(prefix_path == "absorbed"),
                                  chunked_prefix_capacity=chunk_capacity, **self.backend_kwargs)
        self.max_err = 0.0

    # ---- slots ------------------------------------------------------------------------------
    def alloc(self, r, start, n):
        slots = []
        for pos in range(start, start + n):
            key = (r, pos // self.page_size)
            if key not in self.page_of:
                self.page_of[key] = self.free_pages.pop()
            slots.append(self.page_of[key] * self.page_size + pos % self.page_size)
        slots = torch.tensor(slots, dtype=torch.int32)
        self.req_to_token[r, start:start + n] = slots.to(self.device)
        return slots

    def share_prefix(self, r_new, r_src, n):
        assert n % self.page_size == 0, "shared prefixes are whole pages"
        for blk in range(n // self.page_size):
            self.page_of[(r_new, blk)] = self.page_of[(r_src, blk)]
        self.req_to_token[r_new, :n] = self.req_to_token[r_src, :n]
        self.history[r_new] = self.history[r_src][:n].clone()

    def length(self, r):
        return self.history.get(r, torch.zeros(0, self.hidden, dtype=torch.float64)).shape[0]

    # ---- one batch --------------------------------------------------------------------------
    def batch(self, mode, reqs, num_new, *, spec=None, draft_offsets=None):
        """Appends num_new[b] random tokens to each request, builds the ForwardBatch and the
        naive expectation. Returns (fb, x [T, hidden] float32 on device, expected [T, hidden])."""
        xs, locs, positions, expected = [], [], [], []
        seq_lens, prefix = [], []
        for r, n in zip(reqs, num_new):
            start = self.length(r)
            x = torch.randn(n, self.hidden, generator=self.gen, dtype=torch.float64)
            hist = torch.cat([self.history.get(r, x[:0]), x])
            pos = torch.arange(hist.shape[0])
            expected.append(naive_layer(self.w, hist, pos, n, self.cos_sin, self.scale,
                                        self.device))
            self.history[r] = hist
            xs.append(x)
            locs.append(self.alloc(r, start, n))
            positions.append(torch.arange(start, start + n))
            prefix.append(start)
            seq_lens.append(start + n)
        dev = self.device
        if mode == ForwardMode.TARGET_VERIFY:
            seq_lens = [s - n for s, n in zip(seq_lens, num_new)]  # engines pass it without drafts
        fb = ForwardBatch(
            forward_mode=mode, batch_size=len(reqs),
            req_pool_indices=torch.tensor(reqs, dtype=torch.int64, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=dev),
            seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
            out_cache_loc=torch.cat(locs).to(dev) if locs else torch.zeros(0, dtype=torch.int32, device=dev),
            positions=torch.cat(positions).to(dev) if positions else torch.zeros(0, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.tensor(num_new, dtype=torch.int32, device=dev),
            extend_seq_lens_cpu=list(num_new),
            extend_prefix_lens=torch.tensor(prefix, dtype=torch.int32, device=dev),
            extend_prefix_lens_cpu=prefix,
            spec_info=spec)
        x = torch.cat(xs).float().to(dev) if xs else torch.zeros(0, self.hidden, device=dev)
        exp = torch.cat(expected) if expected else torch.zeros(0, self.hidden, dtype=torch.float64)
        return fb, x, exp

    def check(self, got, expected, what):
        tol = 0.2 if self.kv_dtype == FP8 else 3e-2
        assert_close(got, expected, tol, tol, what)
        if got.numel():
            self.max_err = max(self.max_err, (got.double().cpu() - expected).abs().max().item())

    # ---- the model code around the backend (what an engine's DeepSeek layer does) ------------
    def rope(self, t, positions):
        return rope_neox(t.double(), self.cos_sin, positions).float()

    def absorbed(self, backend, fb, x, backend_rope):
        w = self.w
        q_nope, q_pe, c_kv, k_pe = w.project(x, torch.float32)
        if not backend_rope:
            q_pe, k_pe = self.rope(q_pe, fb.positions), self.rope(k_pe, fb.positions)
        q_abs = torch.einsum("thd,hdc->thc", q_nope, w.w_uk.float().to(x.device))
        bf = torch.bfloat16
        call = backend.forward_decode if fb.forward_mode in (ForwardMode.DECODE, ForwardMode.IDLE) \
            else backend.forward_extend
        n, H = len(x), self.heads
        out = call(q_abs.to(bf).reshape(n, H * LORA), c_kv.to(bf), None, self.mqa, fb,
                   save_kv_cache=True, q_rope=q_pe.to(bf).reshape(n, H * ROPE), k_rope=k_pe.to(bf),
                   cos_sin_cache=self.cos_sin_dev if backend_rope else None, is_neox=True)
        assert out.shape == (len(x), self.heads * LORA) and out.dtype == bf
        o = torch.einsum("thc,hdc->thd", out.view(len(x), self.heads, LORA).float(),
                         w.w_uv.float().to(x.device))
        return o.reshape(n, H * V_HEAD) @ w.w_o.float().to(x.device)

    def up_project(self, c_kv, k_pe):
        w = self.w
        k_nope = torch.einsum("tc,hdc->thd", c_kv.float(), w.w_uk.float().to(c_kv.device))
        v = torch.einsum("tc,hdc->thd", c_kv.float(), w.w_uv.float().to(c_kv.device))
        k = torch.cat([k_nope, k_pe.float()[:, None, :].expand(-1, self.heads, ROPE)], -1)
        return k, v

    def extend_mha(self, fb, x):
        w, bf, n = self.w, torch.bfloat16, len(x)
        q_nope, q_pe, c_kv, k_pe = w.project(x, torch.float32)
        q_pe, k_pe = self.rope(q_pe, fb.positions), self.rope(k_pe, fb.positions)
        self.backend.save_latent_kv(self.mha, fb, c_kv.to(bf), k_pe.to(bf))
        md = self.backend.forward_prefill_metadata
        q = torch.cat([q_nope, q_pe], -1).to(bf)
        k, v = self.up_project(c_kv.to(bf), k_pe.to(bf))
        fb.mha_return_lse = md.has_prefix
        res = self.backend.forward_extend(q.reshape(n, -1), k.to(bf).reshape(n, -1),
                                          v.to(bf).reshape(n, -1), self.mha, fb, save_kv_cache=False)
        if md.has_prefix:
            out, lse = res
            assert fb.num_prefix_chunks >= 1
            for c in range(fb.num_prefix_chunks):
                fb.attn_attend_prefix_cache, fb.prefix_chunk_idx = True, c
                ck, kp = self.backend.gather_prefix_chunk(self.mha, fb, c)
                kc, vc = self.up_project(ck, kp)
                out_c, lse_c = self.backend.forward_extend(
                    q.reshape(n, -1), kc.to(bf).reshape(len(kc), -1),
                    vc.to(bf).reshape(len(kc), -1), self.mha, fb, save_kv_cache=False)
                out, lse = MlaBackend.merge_attn_states(out, lse, out_c, lse_c)
            fb.attn_attend_prefix_cache = False
        else:
            out = res
        assert out.shape == (n, self.heads, V_HEAD)
        return out.float().reshape(n, -1) @ w.w_o.float().to(x.device)

    def extend(self, fb, x):
        self.backend.init_forward_metadata(fb)
        md = self.backend.forward_prefill_metadata
        if md.has_prefix and not md.use_chunked_prefix:
            return self.absorbed(self.backend, fb, x, backend_rope=True)
        return self.extend_mha(fb, x)


def run_sequence(h: Harness, scale_lens: int = 1):
    s = scale_lens
    S = h.page_size
    bf_mode = ForwardMode

    # 1. prefill of three requests of different lengths (no prefix)
    fb, x, exp = h.batch(bf_mode.EXTEND, [0, 1, 2], [5 * s, 17 * s + 3, 1])
    h.check(h.extend(fb, x), exp, "prefill")

    # 2. prefill with cached prefixes: requests 0 and 1 continue; request 3 starts with request
    #    1's first whole pages as a shared (cached) prefix
    shared = ((17 * s + 3) // S) * S
    h.share_prefix(3, 1, shared)
    fb, x, exp = h.batch(bf_mode.EXTEND, [0, 1, 3], [4, 3 * s, 5])
    h.check(h.extend(fb, x), exp, "prefill with prefix")

    # 3. an idle batch, then decode steps
    fb, x, exp = h.batch(bf_mode.IDLE, [], [])
    h.backend.init_forward_metadata(fb)
    assert h.absorbed(h.backend, fb, x, backend_rope=False).shape == (0, h.hidden)
    for backend_rope in (False, True):
        fb, x, exp = h.batch(bf_mode.DECODE, [0, 1, 2, 3], [1, 1, 1, 1])
        fb.seq_lens_cpu = None if backend_rope else fb.seq_lens_cpu  # plan without host lengths
        h.backend.init_forward_metadata(fb)
        h.check(h.absorbed(h.backend, fb, x, backend_rope), exp, "decode")

    # 4. target verify with 3 draft tokens, then acceptance
    reqs = [0, 1, 2, 3]
    fb, x, exp = h.batch(bf_mode.TARGET_VERIFY, reqs, [3] * 4, spec=SpecInfo(draft_token_num=3))
    h.backend.init_forward_metadata(fb)
    h.check(h.absorbed(h.backend, fb, x, backend_rope=True), exp, "target verify")
    for r, accepted in zip(reqs, [1, 3, 0, 2]):
        h.history[r] = h.history[r][:h.length(r) - 3 + accepted]

    # 5. draft extend with a different number of tokens per request
    fb, x, exp = h.batch(bf_mode.DRAFT_EXTEND, reqs, [2, 4, 1, 3])
    h.backend.init_forward_metadata(fb)
    h.check(h.absorbed(h.backend, fb, x, backend_rope=False), exp, "draft extend")

    # 6. multi-step drafting (3 steps: 2 attention backends), then a decode
    drafter = MlaMultiStepDraftBackend(speculative_num_steps=3, **h.backend_kwargs)
    base = [h.length(r) + 1 for r in reqs]  # seq_lens counting the first draft token
    for r in reqs:  # the engine allocates the slots of every draft step up front
        h.alloc(r, h.length(r), len(drafter.attn_backends))
    step_fb = None
    for i, backend in enumerate(drafter.attn_backends):
        fb, x, exp = h.batch(bf_mode.DECODE, reqs, [1] * 4)
        fb.seq_lens = torch.tensor(base, device=h.device)  # the same batch lengths every step
        fb.seq_lens_cpu = torch.tensor(base)
        if step_fb is None:
            drafter.init_forward_metadata(fb)
            step_fb = fb
        h.check(h.absorbed(backend, fb, x, backend_rope=True), exp, f"draft step {i}")
    tables = {b.forward_decode_metadata.block_table.data_ptr() for b in drafter.attn_backends}
    assert len(tables) == 1, "draft steps share one block table"
    fb, x, exp = h.batch(bf_mode.DECODE, reqs, [1] * 4)
    h.backend.init_forward_metadata(fb)
    h.check(h.absorbed(h.backend, fb, x, backend_rope=False), exp, "decode after drafting")


CPU_CASES = [
    # heads, page_size, kv dtype, prefix path
    (16, 4, torch.bfloat16, "chunked"),
    (16, 1, torch.bfloat16, "absorbed"),
    (128, 16, torch.bfloat16, "chunked"),
    (16, 8, FP8, "chunked"),
]


@pytest.mark.parametrize("heads,page_size,kv_dtype,prefix_path", CPU_CASES)
def test_layer_cpu(gen, heads, page_size, kv_dtype, prefix_path):
    h = Harness(heads, page_size, kv_dtype, torch.device("cpu"), gen, prefix_path=prefix_path,
                k_scale=0.5)
    run_sequence(h)
    print(f"layer heads={heads} page={page_size} {kv_dtype} {prefix_path}: max abs err {h.max_err:.4f}")


GPU_CASES = [
    (16, 64, torch.bfloat16, "chunked"),
    (128, 64, torch.bfloat16, "chunked"),
    (16, 32, torch.bfloat16, "absorbed"),
    (128, 1, torch.bfloat16, "absorbed"),
    (16, 64, FP8, "chunked"),
    (128, 16, FP8, "absorbed"),
]


@pytest.mark.skipif(not cuda_ready(), reason="needs CUDA and the extension's CUDA kernels")
@pytest.mark.parametrize("heads,page_size,kv_dtype,prefix_path", GPU_CASES)
def test_layer_cuda(gen, heads, page_size, kv_dtype, prefix_path):
    h = Harness(heads, page_size, kv_dtype, torch.device("cuda"), gen, prefix_path=prefix_path,
                chunk_capacity=64, max_context=2048, k_scale=0.5)
    run_sequence(h, scale_lens=20)
    print(f"layer heads={heads} page={page_size} {kv_dtype} {prefix_path}: max abs err {h.max_err:.4f}")
