"""Each torch.ops.mla op against the naive references in mla_reference.py, on random data with
NaN-poisoned unused cache slots and out-of-range padding page ids, on CPU and (when present) CUDA.

Tolerances (every element: |got - ref| <= atol + rtol * |ref|), the references in float64 from the
same rounded inputs the op sees:
  bf16 outputs: atol 1e-2, rtol 1e-2 (bf16 has an 8-bit mantissa: half an ulp is 2^-9 relative)
  fp16 outputs: atol 2e-3, rtol 2e-3;  fp32 outputs: atol 2e-4, rtol 2e-4
  LSE (fp32):   atol 2e-3, rtol 1e-4 (scores from bf16/fp16 products, fp32 accumulation)
  fp8 outputs are compared dequantised with rtol 1/8 (e4m3 has a 3-bit mantissa).
The CUDA mla_decode rounds the softmax weights P to its 16-bit compute dtype before P·V (see
src/cuda/decode/decode_kernel.cuh), so on CUDA an fp32 output is only as close as a bf16 one.
"""

import math

import pytest
import torch

from mla_reference import (FP8, LATENT, NOPE, ROPE, assert_close, cdiv, make_cos_sin_cache,
                           make_paged_cache, paged_gather, quantize, ref_mha_prefill,
                           ref_mla_decode, ref_merge, ref_rope, to_f64)
from mla_torch import ops

TOL = {torch.bfloat16: (1e-2, 1e-2), torch.float16: (2e-3, 2e-3), torch.float32: (2e-4, 2e-4)}
LSE_TOL = (2e-3, 1e-4)


# ---- append_latent_kv ---------------------------------------------------------------------------

@pytest.mark.parametrize("cache_dtype,in_dtype,k_scale", [
    (torch.bfloat16, torch.bfloat16, 1.0),
    (torch.bfloat16, torch.float32, 1.0),
    (torch.float16, torch.bfloat16, 1.0),
    (FP8, torch.bfloat16, 1.0),
    (FP8, torch.float32, 0.25),
])
@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_append_latent_kv(device, gen, cache_dtype, in_dtype, k_scale, page_size):
    num_tokens = 37
    num_pages = max(7, cdiv(2 * num_tokens, page_size))
    cache = torch.full((num_pages, page_size, LATENT), float("nan")).to(cache_dtype).to(device)
    slots = torch.randperm(num_pages * page_size, generator=gen)[:num_tokens]
    loc = slots.clone()
    loc[::5] = -1  # skipped tokens
    k_nope = (torch.randn(num_tokens, NOPE, generator=gen) * 3).to(in_dtype)
    k_pe = (torch.randn(num_tokens, ROPE, generator=gen) * 3).to(in_dtype)
    ops.append_latent_kv(k_nope.to(device), k_pe.to(device), loc.to(device), cache, k_scale)

    expected = torch.full((num_pages * page_size, LATENT), float("nan"), dtype=torch.float64)
    keep = loc >= 0
    values = torch.cat([k_nope, k_pe], dim=1)[keep]
    expected[loc[keep]] = to_f64(quantize(values.float(), cache_dtype, k_scale))
    assert_close(cache.view(-1, LATENT), expected, 0.0, 0.0, "kv_cache")


def test_append_latent_kv_int32_loc_strided_inputs(device, gen):
    cache = torch.full((4, 8, LATENT), float("nan"), dtype=torch.bfloat16, device=device)
    both = torch.randn(5, 1000, generator=gen).to(torch.bfloat16).to(device)
    k_nope, k_pe = both[:, :NOPE], both[:, 600:600 + ROPE]  # row stride 1000
    loc = torch.tensor([3, 31, 0, 17, 8], dtype=torch.int32, device=device)
    ops.append_latent_kv(k_nope, k_pe, loc, cache)
    flat = cache.view(-1, LATENT).cpu()
    for t, slot in enumerate(loc.tolist()):
        assert torch.equal(flat[slot, :NOPE], k_nope[t].cpu())
        assert torch.equal(flat[slot, NOPE:], k_pe[t].cpu())
    assert torch.isnan(flat[1].float()).all()


# ---- build_block_table --------------------------------------------------------------------------

@pytest.mark.parametrize("page_size", [1, 4, 64, 128])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_build_block_table(device, gen, page_size, index_dtype):
    num_req_slots, max_context = 9, 300
    # Each request slot owns whole pages (as a paged allocator gives them).
    num_pages = num_req_slots * cdiv(max_context, page_size) + 5
    perm = torch.randperm(num_pages, generator=gen)
    pages_per_slot = cdiv(max_context, page_size)
    req_to_token = torch.empty(num_req_slots, max_context, dtype=torch.int32)
    for r in range(num_req_slots):
        pages = perm[r * pages_per_slot:(r + 1) * pages_per_slot]
        tokens = (pages[:, None] * page_size + torch.arange(page_size)[None, :]).reshape(-1)
        req_to_token[r] = tokens[:max_context].to(torch.int32)
    req_pool_indices = torch.tensor([4, 0, 8, 2, 7], dtype=index_dtype)
    seq_lens = torch.tensor([0, 1, 299, page_size, 300], dtype=index_dtype)
    max_blocks = cdiv(max_context, page_size) + 2
    table = torch.full((5, max_blocks), 12345, dtype=torch.int32, device=device)
    ops.build_block_table(req_to_token.to(device), req_pool_indices.to(device),
          seq_lens.to(device), page_size, table)
    expected = torch.full((5, max_blocks), -1, dtype=torch.int32)
    for b in range(5):
        n = cdiv(int(seq_lens[b]), page_size)
        r = int(req_pool_indices[b])
        expected[b, :n] = req_to_token[r, torch.arange(n) * page_size] // page_size
    assert torch.equal(table.cpu(), expected)


# ---- rope_quantize ------------------------------------------------------------------------------

@pytest.mark.parametrize("is_neox", [True, False])
@pytest.mark.parametrize("in_dtype,q_dtype,k_dtype,q_scale,k_scale", [
    (torch.bfloat16, torch.bfloat16, torch.bfloat16, 1.0, 1.0),
    (torch.float16, torch.float16, torch.float16, 1.0, 1.0),
    (torch.bfloat16, FP8, FP8, 0.5, 2.0),
    (torch.float32, FP8, torch.bfloat16, 1.0, 1.0),
])
def test_rope_quantize(device, gen, is_neox, in_dtype, q_dtype, k_dtype, q_scale, k_scale):
    num_tokens, num_heads, max_pos = 11, 12, 4096
    q_nope = (torch.randn(num_tokens, num_heads, NOPE, generator=gen)).to(in_dtype)
    q_pe = (torch.randn(num_tokens, num_heads, ROPE, generator=gen)).to(in_dtype)
    k_nope = (torch.randn(num_tokens, NOPE, generator=gen)).to(in_dtype)
    k_pe = (torch.randn(num_tokens, ROPE, generator=gen)).to(in_dtype)
    positions = torch.randint(0, max_pos, (num_tokens,), generator=gen)
    cos_sin = make_cos_sin_cache(max_pos)
    q_out, k_nope_out, k_pe_out = ops.rope_quantize(
        q_nope.to(device), q_pe.to(device), cos_sin.to(device),
        positions.to(device), k_nope=k_nope.to(device), k_pe=k_pe.to(device), is_neox=is_neox,
        q_out_dtype=q_dtype, k_out_dtype=k_dtype, q_scale=q_scale, k_scale=k_scale)

    q_ref = torch.cat([to_f64(q_nope), ref_rope(to_f64(q_pe), cos_sin, positions, is_neox)], -1)
    k_pe_ref = ref_rope(to_f64(k_pe), cos_sin, positions, is_neox)

    def check(got, ref, dtype, scale, what):
        if dtype == FP8:
            assert_close(to_f64(got, scale), ref, 2e-2 * scale, 1 / 8, what)
        else:
            atol, rtol = TOL[dtype]
            assert_close(got, ref, atol, rtol, what)

    check(q_out, q_ref, q_dtype, q_scale, "q_out")
    check(k_nope_out, to_f64(k_nope), k_dtype, k_scale, "k_nope_out")
    check(k_pe_out, k_pe_ref, k_dtype, k_scale, "k_pe_out")


def test_rope_quantize_default_output_dtypes(device, gen):
    """fp32 inputs default to bf16 outputs (outputs are 16-bit or fp8); one k output given sets
    the other's dtype (the two share one)."""
    num_tokens, num_heads, max_pos = 3, 2, 64
    q_nope = torch.randn(num_tokens, num_heads, NOPE, generator=gen).to(device)
    q_pe = torch.randn(num_tokens, num_heads, ROPE, generator=gen).to(device)
    k_nope = torch.randn(num_tokens, NOPE, generator=gen).to(device)
    k_pe = torch.randn(num_tokens, ROPE, generator=gen).to(device)
    positions = torch.arange(num_tokens, device=device)
    cos_sin = make_cos_sin_cache(max_pos).to(device)
    q_out, k_nope_out, k_pe_out = ops.rope_quantize(q_nope, q_pe, cos_sin, positions,
                                                    k_nope=k_nope, k_pe=k_pe)
    assert q_out.dtype == k_nope_out.dtype == k_pe_out.dtype == torch.bfloat16
    given = torch.empty(num_tokens, NOPE, dtype=FP8, device=device)
    _, k_nope_out, k_pe_out = ops.rope_quantize(q_nope.bfloat16(), q_pe.bfloat16(), cos_sin,
                                                positions, k_nope=k_nope.bfloat16(),
                                                k_pe=k_pe.bfloat16(), k_nope_out=given)
    assert k_nope_out is given and k_pe_out.dtype == FP8


def test_wrappers_check_what_they_size_outputs_from(device):
    """The wrappers size outputs from their inputs' dims: a wrong rank or page size is a clear
    error, not an output of the wrong shape or an allocation of another size."""
    with pytest.raises(ValueError, match=r"mla_decode: q must have 3 dims, got shape \[4, 576\]"):
        ops.mla_decode(torch.empty(1, 64, LATENT, device=device),
                       torch.zeros(4, 1, dtype=torch.int32, device=device),
                       torch.ones(4, dtype=torch.int32, device=device), 0.1,
                       q=torch.empty(4, LATENT, dtype=torch.bfloat16, device=device))
    with pytest.raises(ValueError, match="mha_prefill: q must have 3 dims"):
        ops.mha_prefill(torch.empty(4, 192, device=device), torch.empty(4, 1, 192, device=device),
                        torch.empty(4, 1, 128, device=device),
                        torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0, 4], dtype=torch.int32),
                        0.1)
    with pytest.raises(ValueError, match="build_block_table: page_size must be a power of two"):
        ops.build_block_table(torch.zeros(2, 8, dtype=torch.int32, device=device),
                              torch.zeros(1, dtype=torch.int32, device=device),
                              torch.ones(1, dtype=torch.int32, device=device), 0)


# ---- mla_decode ---------------------------------------------------------------------------------

DECODE_CASES = [
    # heads, page_size, kv_lens, q_lens (None: q_len 1 per request), dtype
    (1, 1, [1, 5, 17], None, torch.bfloat16),
    (16, 16, [33, 1, 64, 100], None, torch.bfloat16),
    (12, 64, [70, 130], [3, 3], torch.float16),
    (24, 32, [5, 40, 2, 0], [3, 1, 4, 2], torch.bfloat16),     # var q, kv_len < q_len, empty
    (128, 8, [9, 3], [2, 1], torch.bfloat16),
    (16, 16, [50, 7, 31], None, FP8),
    (16, 4, [20, 2, 13], [3, 2, 1], FP8),
    # From a batch of 4, an fp8 cache at 16 rows or fewer takes the Hopper kernel on sm_90.
    (16, 64, [300, 5, 64, 129, 1, 700], None, FP8),
    (8, 32, [65, 0, 200, 33, 1], [2, 1, 2, 0, 1], FP8),
    # More than 16 rows: the Hopper kernel's 64-row tiles, converted by its producer warpgroup.
    (128, 16, [130, 1, 64], None, FP8),
    (32, 64, [90, 0, 200], [2, 1, 3], FP8),
]


@pytest.mark.parametrize("heads,page_size,kv_lens,q_lens,dtype", DECODE_CASES)
@pytest.mark.parametrize("split_query", [False, True])
def test_mla_decode(device, gen, heads, page_size, kv_lens, q_lens, dtype, split_query):
    k_scale = 0.5 if dtype == FP8 else 1.0
    q_scale = 0.25 if dtype == FP8 else 1.0
    paged = make_paged_cache(kv_lens, page_size, dtype, device, gen, k_scale=k_scale)
    fixed = q_lens is None or len(set(q_lens)) == 1  # same length: q_len, no cu_q_lens
    lens = q_lens or [1] * len(kv_lens)
    num_tokens = sum(lens)
    q_f = torch.randn(num_tokens, heads, LATENT, generator=gen)
    q = quantize(q_f, dtype, q_scale).to(device)
    softmax_scale = 1.0 / math.sqrt(192)
    out = torch.full((num_tokens, heads, NOPE), float("nan"), dtype=torch.bfloat16, device=device)
    lse = torch.full((num_tokens, heads), float("nan"), device=device)
    cu = None
    if not fixed:
        cu = torch.tensor([0] + list(torch.tensor(lens).cumsum(0)), dtype=torch.int32, device=device)
    kwargs = dict(cu_q_lens=cu, q_len=lens[0], max_q_len=max(lens), q_scale=q_scale,
                  k_scale=k_scale, out=out, lse=lse)
    if split_query:
        kwargs.update(q_nope=q[..., :NOPE], q_pe=q[..., NOPE:])  # strided views, no copy
    else:
        kwargs.update(q=q)
    ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, softmax_scale, **kwargs)
    out_ref, lse_ref = ref_mla_decode(q, paged, lens, softmax_scale, q_scale, k_scale)
    assert_close(out, out_ref, *TOL[torch.bfloat16], "out")
    assert_close(lse, lse_ref, *LSE_TOL, "lse")
    if device.type == "cuda":  # again with the split-KV schedule (workspace larger than needed)
        ws = ops.DecodeWorkspace(len(kv_lens) + 3, max(lens) + 1, heads, device)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, softmax_scale, **kwargs,
                       **ws.kwargs())
        assert_close(out, out_ref, *TOL[torch.bfloat16], "out (split-KV)")
        assert_close(lse, lse_ref, *LSE_TOL, "lse (split-KV)")


def test_mla_decode_zero_padding_rows(device, gen):
    """zero_padding_rows: a batch padded past cu_q_lens[B] (the last request's three rows here)
    gets those rows 0 with lse -inf, the others as the reference. Without it the CPU refuses the
    padding and CUDA leaves the rows as they were."""
    heads, kv_lens, q_lens = 16, [20, 7, 33], [2, 1, 3]
    paged = make_paged_cache(kv_lens, 16, torch.bfloat16, device, gen)
    q = torch.randn(sum(q_lens), heads, LATENT, generator=gen).to(torch.bfloat16).to(device)
    out_ref, lse_ref = ref_mla_decode(q, paged, q_lens, 0.1)
    cu = torch.tensor([0, 2, 3], dtype=torch.int32, device=device)  # the first two requests
    args = (paged.cache, paged.block_table[:2], paged.kv_lens[:2], 0.1)
    workspaces = [{}]
    if device.type == "cuda":
        workspaces.append(ops.DecodeWorkspace(2, 3, heads, device).kwargs())
    for ws in workspaces:
        out = torch.full((6, heads, NOPE), float("nan"), dtype=torch.bfloat16, device=device)
        lse = torch.full((6, heads), float("nan"), device=device)
        ops.mla_decode(*args, q=q, cu_q_lens=cu, max_q_len=3, out=out, lse=lse,
                       zero_padding_rows=True, **ws)
        assert_close(out[:3], out_ref[:3], *TOL[torch.bfloat16], "out")
        assert_close(lse[:3], lse_ref[:3], *LSE_TOL, "lse")
        assert torch.equal(out[3:], torch.zeros_like(out[3:]))
        assert torch.equal(lse[3:], torch.full_like(lse[3:], float("-inf")))
    out.fill_(float("nan"))
    if device.type == "cpu":
        with pytest.raises(RuntimeError, match=r"cu_q_lens\[2\] must equal the 6 query tokens"):
            ops.mla_decode(*args, q=q, cu_q_lens=cu, max_q_len=3, out=out)
    else:
        ops.mla_decode(*args, q=q, cu_q_lens=cu, max_q_len=3, out=out)
        assert torch.isnan(out[3:].float()).all()


def test_mla_decode_fp32_output_and_strided(device, gen):
    heads, kv_lens = 8, [19, 44]
    paged = make_paged_cache(kv_lens, 16, torch.bfloat16, device, gen)
    q_big = torch.randn(2, heads + 3, LATENT + 64, generator=gen).to(torch.bfloat16).to(device)
    q = q_big[:, 1:heads + 1, 32:32 + LATENT]  # token and head strides not packed
    out_big = torch.full((2, heads, 2 * NOPE), float("nan"), device=device)
    out = out_big[:, :, :NOPE]
    ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, 0.1, q=q, out=out)
    out_ref, _ = ref_mla_decode(q, paged, [1, 1], 0.1)
    # CUDA: weights rounded to bf16 (errors up to ~3e-3 here); the CPU computes in fp32.
    tol = TOL[torch.bfloat16] if device.type == "cuda" else TOL[torch.float32]
    assert_close(out, out_ref, *tol, "out")
    assert torch.isnan(out_big[:, :, NOPE:]).all(), "wrote outside the output view"


def test_mla_decode_deterministic(device, gen):
    """deterministic=True: the reference's values, and one request's rows have the same bits
    alone and in a batch of 40 with other lengths and query counts; no workspace with it."""
    heads, page_size = 16, 16
    gen_lens = torch.Generator().manual_seed(5)
    kv_lens = [int(x) for x in torch.randint(0, 300, (40,), generator=gen_lens)]
    q_lens = [int(x) for x in torch.randint(1, 4, (40,), generator=gen_lens)]
    kv_lens[5], q_lens[5] = 777, 1
    paged = make_paged_cache(kv_lens, page_size, torch.bfloat16, device, gen)
    q = torch.randn(sum(q_lens), heads, LATENT, generator=gen).to(torch.bfloat16).to(device)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    out, lse = ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, 0.1, q=q,
                     cu_q_lens=cu, max_q_len=max(q_lens), return_lse=True, deterministic=True)
    out_ref, lse_ref = ref_mla_decode(q, paged, q_lens, 0.1)
    assert_close(out, out_ref, *TOL[torch.bfloat16], "out")
    assert_close(lse, lse_ref, *LSE_TOL, "lse")
    t0 = sum(q_lens[:5])
    alone_out, alone_lse = ops.mla_decode(
        paged.cache, paged.block_table[5:6], paged.kv_lens[5:6], 0.1, q=q[t0:t0 + 1], q_len=1,
        return_lse=True, deterministic=True)
    assert torch.equal(alone_out, out[t0:t0 + 1]) and torch.equal(alone_lse, lse[t0:t0 + 1])
    workspace = torch.zeros(4096, dtype=torch.uint8, device=device)
    with pytest.raises(RuntimeError, match="deterministic.*no balanced split-KV workspace"):
        ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, 0.1, q=q, cu_q_lens=cu,
                       max_q_len=max(q_lens), deterministic=True, workspace=workspace,
                       workspace_max_batch=40, workspace_max_q_len=3)
    with pytest.raises(RuntimeError, match="deterministic workspace.*deterministic=True"):
        ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, 0.1, q=q, cu_q_lens=cu,
                       max_q_len=max(q_lens), workspace=workspace, workspace_max_batch=40,
                       workspace_max_q_len=3, workspace_max_kv_len=1024, workspace_split_keys=128)


def test_mla_decode_deterministic_split(device, gen):
    """deterministic=True with a deterministic workspace (every request's keys cut every 128
    keys): the reference's values, and one request's rows (in 7 pieces) have the same bits alone
    and in a batch of 40, each on a workspace of its own capacity."""
    if device.type != "cuda":
        pytest.skip("the split-KV workspace exists on CUDA only")
    heads, page_size, split = 16, 16, 128
    gen_lens = torch.Generator().manual_seed(6)
    kv_lens = [int(x) for x in torch.randint(0, 600, (40,), generator=gen_lens)]
    q_lens = [int(x) for x in torch.randint(0, 4, (40,), generator=gen_lens)]
    kv_lens[5], q_lens[5] = 777, 1
    paged = make_paged_cache(kv_lens, page_size, torch.bfloat16, device, gen)
    q = torch.randn(sum(q_lens), heads, LATENT, generator=gen).to(torch.bfloat16).to(device)
    cu = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0)), dtype=torch.int32, device=device)
    table_keys = paged.block_table.shape[1] * page_size
    ws = ops.DecodeWorkspace(40, max(q_lens), heads, device, max_kv_len=table_keys, split_keys=split)
    out, lse = ops.mla_decode(paged.cache, paged.block_table, paged.kv_lens, 0.1, q=q, cu_q_lens=cu,
                              max_q_len=max(q_lens), return_lse=True, deterministic=True,
                              **ws.kwargs())
    out_ref, lse_ref = ref_mla_decode(q, paged, q_lens, 0.1)
    assert_close(out, out_ref, *TOL[torch.bfloat16], "out")
    assert_close(lse, lse_ref, *LSE_TOL, "lse")
    t0 = sum(q_lens[:5])
    alone_ws = ops.DecodeWorkspace(1, 1, heads, device, max_kv_len=table_keys, split_keys=split)
    alone_out, alone_lse = ops.mla_decode(
        paged.cache, paged.block_table[5:6], paged.kv_lens[5:6], 0.1, q=q[t0:t0 + 1], q_len=1,
        return_lse=True, deterministic=True, **alone_ws.kwargs())
    assert torch.equal(alone_out, out[t0:t0 + 1]) and torch.equal(alone_lse, lse[t0:t0 + 1])
    with pytest.raises(RuntimeError, match="split_keys must be a positive multiple of 64"):
        ops.decode_workspace_bytes(4, 1, heads, max_kv_len=1024, split_keys=100)


def test_cumulative_lengths(device):
    lens = torch.tensor([3, 0, 7, 1], dtype=torch.int64, device=device)
    assert ops.cumulative_lengths(lens).tolist() == [0, 3, 3, 10, 11]
    cu = torch.full((5,), -1, dtype=torch.int32, device=device)
    ops.cumulative_lengths(lens.to(torch.int32), cu)
    assert cu.tolist() == [0, 3, 3, 10, 11]
    assert ops.cumulative_lengths(lens[:0]).tolist() == [0]
    with pytest.raises(RuntimeError, match="overlaps"):
        ops.cumulative_lengths(cu[1:], cu)
    # Any stride: every other entry of a longer buffer, as the op documents.
    strided = torch.tensor([3, 9, 0, 9, 7, 9, 1], dtype=torch.int32, device=device)[::2]
    assert ops.cumulative_lengths(strided).tolist() == [0, 3, 3, 10, 11]
    if device.type == "cpu":  # the GPU does not read the values back
        with pytest.raises(RuntimeError, match=r"lens\[1\]"):
            ops.cumulative_lengths(torch.tensor([2, -4], dtype=torch.int32))


# ---- mha_prefill --------------------------------------------------------------------------------

PREFILL_CASES = [
    # heads, q_lens, kv_lens, causal, dtype
    (1, [1, 7, 0, 16], [1, 7, 0, 16], True, torch.bfloat16),
    (16, [5, 33], [5, 33], True, torch.bfloat16),
    (12, [4, 9, 3], [20, 9, 1], True, torch.float16),      # kv longer (prefix) and shorter
    (16, [6, 2], [40, 0], False, torch.bfloat16),           # prefix chunk: non-causal, empty kv
    (128, [3, 2], [3, 5], True, torch.bfloat16),
    (8, [7, 12], [7, 12], True, FP8),
]


@pytest.mark.parametrize("heads,q_lens,kv_lens,causal,dtype", PREFILL_CASES)
def test_mha_prefill(device, gen, heads, q_lens, kv_lens, causal, dtype):
    scales = (0.5, 0.25, 2.0) if dtype == FP8 else (1.0, 1.0, 1.0)
    tq, tk = sum(q_lens), sum(kv_lens)
    q = quantize(torch.randn(tq, heads, 192, generator=gen), dtype, scales[0]).to(device)
    k = quantize(torch.randn(tk, heads, 192, generator=gen), dtype, scales[1]).to(device)
    v = quantize(torch.randn(tk, heads, 128, generator=gen), dtype, scales[2]).to(device)
    cu_q = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    cu_kv = torch.tensor([0] + torch.tensor(kv_lens).cumsum(0).tolist(), dtype=torch.int32, device=device)
    softmax_scale = 1.0 / math.sqrt(192)
    out, lse = ops.mha_prefill(q, k, v, cu_q, cu_kv, softmax_scale, max_q_len=max(q_lens),
                     max_kv_len=max(kv_lens), causal=causal, q_scale=scales[0],
                     k_scale=scales[1], v_scale=scales[2], out_dtype=torch.bfloat16,
                     return_lse=True)
    out_ref, lse_ref = ref_mha_prefill(q, k, v, q_lens, kv_lens, softmax_scale, causal, *scales)
    assert_close(out, out_ref, *TOL[torch.bfloat16], "out")
    assert_close(lse, lse_ref, *LSE_TOL, "lse")


# ---- check_metadata -----------------------------------------------------------------------------

def test_check_metadata(device, gen):
    """The debug mode of each op: a bad index or length raises naming it, before anything is
    written (the CPU always checks; CUDA only with check_metadata, which otherwise never reads or
    writes out of bounds and reports nothing); good input gives the same result with it."""
    cuda = device == "cuda"

    def bits(t):
        return t.contiguous().view(torch.uint8).clone()

    def raises(call, fragment, target):
        """call(flag) writes into target: with the flag it raises and leaves target as it was;
        without it the CPU raises too, CUDA does not (it reports nothing)."""
        before = bits(target)
        with pytest.raises(RuntimeError, match=fragment):
            call(True)
        assert torch.equal(bits(target), before), "written before the error"
        if cuda:
            call(False)
            torch.cuda.synchronize()
        else:
            with pytest.raises(RuntimeError, match=fragment):
                call(False)

    # append_latent_kv: a slot past the pool of 4 pages of 8.
    cache = torch.full((4, 8, LATENT), float("nan"), dtype=torch.bfloat16, device=device)
    k_nope = torch.randn(3, NOPE, generator=gen).to(torch.bfloat16).to(device)
    k_pe = torch.randn(3, ROPE, generator=gen).to(torch.bfloat16).to(device)
    bad_loc = torch.tensor([3, 32, 5], dtype=torch.int64, device=device)
    target = cache.clone()
    raises(lambda flag: ops.append_latent_kv(k_nope, k_pe, bad_loc, target, check_metadata=flag),
           r"loc\[1\] = 32", target)
    checked = cache.clone()
    loc = torch.tensor([3, 31, 5], dtype=torch.int64, device=device)
    ops.append_latent_kv(k_nope, k_pe, loc, checked, check_metadata=True)
    plain = cache.clone()
    ops.append_latent_kv(k_nope, k_pe, loc, plain)
    assert torch.equal(checked.view(-1).view(torch.int16), plain.view(-1).view(torch.int16))

    # build_block_table: a request index past the 3 rows of req_to_token.
    req_to_token = torch.arange(3 * 40, dtype=torch.int32, device=device).view(3, 40)
    seq_lens = torch.tensor([9, 17], dtype=torch.int32, device=device)
    table = torch.full((2, 5), 7, dtype=torch.int32, device=device)
    raises(lambda flag: ops.build_block_table(req_to_token, torch.tensor([0, 3], device=device),
                                              seq_lens, 8, table, check_metadata=flag),
           r"req_pool_indices\[1\] = 3", table)
    good = ops.build_block_table(req_to_token, torch.tensor([2, 1], device=device), seq_lens, 8,
                                 check_metadata=True)
    assert torch.equal(good, ops.build_block_table(req_to_token, torch.tensor([2, 1], device=device),
                                                   seq_lens, 8))

    # rope_quantize: a position past the 16 rows of the cos/sin cache.
    q_nope = torch.randn(2, 4, NOPE, generator=gen).to(torch.bfloat16).to(device)
    q_pe = torch.randn(2, 4, ROPE, generator=gen).to(torch.bfloat16).to(device)
    cos_sin = make_cos_sin_cache(16).to(device)
    q_out = torch.full((2, 4, LATENT), float("nan"), dtype=torch.bfloat16, device=device)
    raises(lambda flag: ops.rope_quantize(q_nope, q_pe, cos_sin, torch.tensor([1, 16], device=device),
                                          q_out=q_out, check_metadata=flag),
           r"positions\[1\] = 16", q_out)
    positions = torch.tensor([1, 15], device=device)
    a = ops.rope_quantize(q_nope, q_pe, cos_sin, positions, check_metadata=True)[0]
    b = ops.rope_quantize(q_nope, q_pe, cos_sin, positions)[0]
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))

    # mla_decode: a length past its block table (2 pages of 8).
    kv_cache = torch.randn(4, 8, LATENT, generator=gen).to(torch.bfloat16).to(device)
    block_table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32, device=device)
    q = torch.randn(2, 4, LATENT, generator=gen).to(torch.bfloat16).to(device)
    out = torch.full((2, 4, NOPE), float("nan"), dtype=torch.bfloat16, device=device)
    raises(lambda flag: ops.mla_decode(kv_cache, block_table,
                                       torch.tensor([5, 17], dtype=torch.int32, device=device),
                                       0.1, q=q, max_q_len=1, out=out, check_metadata=flag),
           r"kv_lens\[1\]", out)
    kv_lens = torch.tensor([5, 16], dtype=torch.int32, device=device)
    a = ops.mla_decode(kv_cache, block_table, kv_lens, 0.1, q=q, max_q_len=1, check_metadata=True)
    b = ops.mla_decode(kv_cache, block_table, kv_lens, 0.1, q=q, max_q_len=1)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))

    # mha_prefill: key offsets that end past the 6 keys given.
    qp = torch.randn(5, 2, 192, generator=gen).to(torch.bfloat16).to(device)
    kp = torch.randn(6, 2, 192, generator=gen).to(torch.bfloat16).to(device)
    vp = torch.randn(6, 2, 128, generator=gen).to(torch.bfloat16).to(device)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32, device=device)
    out_p = torch.full((5, 2, 128), float("nan"), dtype=torch.bfloat16, device=device)
    raises(lambda flag: ops.mha_prefill(qp, kp, vp, cu_q, torch.tensor([0, 3, 7], dtype=torch.int32,
                                                                       device=device),
                                        0.1, max_q_len=3, max_kv_len=4, out=out_p,
                                        check_metadata=flag),
           "cu_kv_lens", out_p)
    cu_kv = torch.tensor([0, 3, 6], dtype=torch.int32, device=device)
    a = ops.mha_prefill(qp, kp, vp, cu_q, cu_kv, 0.1, max_q_len=3, max_kv_len=3, check_metadata=True)
    b = ops.mha_prefill(qp, kp, vp, cu_q, cu_kv, 0.1, max_q_len=3, max_kv_len=3)
    assert torch.equal(a.view(torch.int16), b.view(torch.int16))


# ---- merge_states -------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_place", [False, True])
def test_merge_states(device, gen, dtype, in_place):
    tokens, heads, dim = 9, 16, 128
    out_a = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    out_b = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    lse_a = torch.randn(tokens, heads, generator=gen) * 4
    lse_b = torch.randn(tokens, heads, generator=gen) * 4
    lse_a[0], lse_b[1] = -math.inf, -math.inf    # one side empty
    lse_a[2], lse_b[2] = -math.inf, -math.inf    # both empty
    out_a[0], out_b[1] = 0, 0
    out_a[2], out_b[2] = 0, 0
    out_ref, lse_ref = ref_merge(out_a, lse_a, out_b, lse_b)
    a, la, b, lb = (t.to(device) for t in (out_a, lse_a, out_b, lse_b))
    if in_place:
        out, lse = ops.merge_states(a, la, b, lb, out=a, lse_out=la)
        assert out.data_ptr() == a.data_ptr()
    else:
        out, lse = ops.merge_states(a, la, b, lb)
    assert_close(out, out_ref, *TOL[dtype], "out")
    assert_close(lse, lse_ref, 1e-5, 1e-5, "lse")
    assert not torch.isnan(out.float()).any()


def test_merge_states_head_major_lse(device, gen):
    """LSEs laid out [H, T] and passed transposed (as attention kernels return them): any strides,
    the same result as contiguous ones."""
    tokens, heads, dim = 5, 4, 64
    out_a, out_b = (torch.randn(tokens, heads, dim, generator=gen).to(device) for _ in range(2))
    lse_a, lse_b = (torch.randn(heads, tokens, generator=gen).to(device) * 3 for _ in range(2))
    out, lse = ops.merge_states(out_a, lse_a.t(), out_b, lse_b.t())
    ref_out, ref_lse = ops.merge_states(out_a, lse_a.t().contiguous(), out_b,
                                        lse_b.t().contiguous())
    assert torch.equal(out, ref_out) and torch.equal(lse, ref_lse)
