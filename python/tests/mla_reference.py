"""Naive PyTorch references for the mla ops (float64, written for clarity, not speed) and test
data builders: paged caches with NaN-poisoned unused slots, out-of-range padding page ids."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional

import torch

LATENT = 576
NOPE = 512
ROPE = 64
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_f64(x: torch.Tensor, scale: float = 1.0) -> torch.Tensor:
    return x.float().double() * scale


def quantize(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """x (float) -> dtype; fp8 stores saturate(x / scale)."""
    if dtype == FP8:
        return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return x.to(dtype)


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float,
                 what: str = "") -> None:
    """Every element within atol + rtol * |expected|; NaN and inf positions equal."""
    a = actual.detach().float().double().cpu()
    e = expected.detach().double().cpu()
    assert a.shape == e.shape, f"{what}: shape {tuple(a.shape)} != {tuple(e.shape)}"
    nan_a, nan_e = torch.isnan(a), torch.isnan(e)
    assert torch.equal(nan_a, nan_e), f"{what}: NaN positions differ ({int(nan_a.sum())} vs {int(nan_e.sum())})"
    inf_e = torch.isinf(e)
    assert torch.equal(torch.isinf(a), inf_e) and torch.equal(a[inf_e], e[inf_e]), f"{what}: inf positions differ"
    ok = nan_e | inf_e
    err = (a - e).abs()
    bound = atol + rtol * e.abs()
    bad = (~ok) & ~(err <= bound)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {int(bad.sum())} of {a.numel()} elements out of tolerance "
                             f"(atol {atol}, rtol {rtol}); first at {idx}: got {a[idx].item():.6g}, "
                             f"expected {e[idx].item():.6g}; max err {err[~ok].max().item():.3g}")


# ---- paged cache --------------------------------------------------------------------------------

@dataclass
class PagedCache:
    cache: torch.Tensor         # [P, S, 576] in the cache dtype, NaN in every unused slot
    block_table: torch.Tensor   # [B, max_blocks] int32, padding: -1 or ids >= P
    kv_lens: torch.Tensor       # [B] int32
    page_size: int


def make_paged_cache(kv_lens: List[int], page_size: int, dtype: torch.dtype, device,
                     gen: torch.Generator, k_scale: float = 1.0, extra_pages: int = 3,
                     extra_blocks: int = 2, value_scale: float = 1.0) -> PagedCache:
    pages_needed = [cdiv(n, page_size) for n in kv_lens]
    num_pages = sum(pages_needed) + extra_pages
    perm = torch.randperm(num_pages, generator=gen)
    max_blocks = max(pages_needed + [0]) + extra_blocks
    # Padding entries: a mix of -1 and ids past the pool.
    pad = torch.randint(0, 2, (len(kv_lens), max_blocks), generator=gen)
    table = torch.where(pad == 0, torch.full_like(pad, -1), num_pages + 7 + pad).to(torch.int32)
    cache = torch.full((num_pages, page_size, LATENT), float("nan"))
    used = 0
    for b, n in enumerate(kv_lens):
        pages = perm[used:used + pages_needed[b]]
        used += pages_needed[b]
        table[b, :len(pages)] = pages.to(torch.int32)
        values = torch.randn(n, LATENT, generator=gen) * value_scale
        flat = cache[pages].reshape(-1, LATENT)
        flat[:n] = values
        cache[pages] = flat.reshape(len(pages), page_size, LATENT)
    return PagedCache(quantize(cache, dtype, k_scale).to(device), table.to(device),
                      torch.tensor(kv_lens, dtype=torch.int32, device=device), page_size)


def paged_gather(cache: torch.Tensor, table_row: torch.Tensor, kv_len: int) -> torch.Tensor:
    """The first kv_len entries of one request, [kv_len, 576], in the cache dtype."""
    page_size = cache.shape[1]
    pages = table_row[:cdiv(kv_len, page_size)].long().cpu()
    return cache.cpu()[pages].reshape(-1, cache.shape[2])[:kv_len]


# ---- op references ------------------------------------------------------------------------------

def ref_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                  causal: bool):
    """q [Q, H, D], k [K, H or 1, D], v [K, H or 1, Dv] float64; bottom-right causal.
    Returns out [Q, H, Dv] and lse [Q, H] (-inf and 0 for rows that see no key)."""
    nq, nh = q.shape[0], q.shape[1]
    nk = k.shape[0]
    out = torch.zeros(nq, nh, v.shape[2], dtype=torch.float64)
    lse = torch.full((nq, nh), -math.inf, dtype=torch.float64)
    if nq == 0 or nk == 0:
        return out, lse
    scores = torch.einsum("qhd,khd->hqk", q, k.expand(nk, nh, k.shape[2])) * scale
    if causal:
        visible = torch.arange(nk)[None, :] <= (nk - nq + torch.arange(nq))[:, None]
    else:
        visible = torch.ones(nq, nk, dtype=torch.bool)
    scores = scores.masked_fill(~visible[None], -math.inf)
    any_key = visible.any(dim=1)
    lse_h = torch.logsumexp(scores, dim=2)  # [H, Q]
    probs = torch.exp(scores - lse_h[..., None]).nan_to_num(0.0)
    out_h = torch.einsum("hqk,khd->qhd", probs, v.expand(nk, nh, v.shape[2]))
    out[any_key] = out_h[any_key]
    lse[any_key] = lse_h.t()[any_key]
    return out, lse


def ref_mla_decode(q: torch.Tensor, paged: PagedCache, q_lens: List[int], softmax_scale: float,
                   q_scale: float = 1.0, k_scale: float = 1.0):
    """Absorbed attention by paged gather. q [T, H, 576] (any dtype). Returns float64 out
    [T, H, 512], lse [T, H]."""
    qf = to_f64(q.cpu(), q_scale)
    kv_lens = paged.kv_lens.cpu().tolist()
    out = torch.zeros(q.shape[0], q.shape[1], NOPE, dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=torch.float64)
    start = 0
    for b, ql in enumerate(q_lens):
        keys = to_f64(paged_gather(paged.cache, paged.block_table[b], kv_lens[b]), k_scale)
        o, l = ref_attention(qf[start:start + ql], keys[:, None, :], keys[:, None, :NOPE],
                             softmax_scale, causal=True)
        out[start:start + ql], lse[start:start + ql] = o, l
        start += ql
    return out, lse


def ref_mha_prefill(q, k, v, q_lens, kv_lens, softmax_scale, causal, q_scale=1.0, k_scale=1.0,
                    v_scale=1.0):
    qf, kf, vf = to_f64(q.cpu(), q_scale), to_f64(k.cpu(), k_scale), to_f64(v.cpu(), v_scale)
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=torch.float64)
    lse = torch.full((q.shape[0], q.shape[1]), -math.inf, dtype=torch.float64)
    qs = ks = 0
    for ql, kl in zip(q_lens, kv_lens):
        o, l = ref_attention(qf[qs:qs + ql], kf[ks:ks + kl], vf[ks:ks + kl], softmax_scale, causal)
        out[qs:qs + ql], lse[qs:qs + ql] = o, l
        qs += ql
        ks += kl
    return out, lse


def ref_merge(out_a, lse_a, out_b, lse_b):
    oa, ob = to_f64(out_a.cpu()), to_f64(out_b.cpu())
    la, lb = lse_a.cpu().double(), lse_b.cpu().double()
    lse = torch.logaddexp(la, lb)
    wa = torch.where(torch.isinf(la) & (la < 0), torch.zeros_like(la), torch.exp(la - lse))
    wb = torch.where(torch.isinf(lb) & (lb < 0), torch.zeros_like(lb), torch.exp(lb - lse))
    both_empty = torch.isinf(lse) & (lse < 0)
    wa = wa.masked_fill(both_empty, 0.0)
    wb = wb.masked_fill(both_empty, 0.0)
    return oa * wa[..., None] + ob * wb[..., None], lse


def make_cos_sin_cache(max_position: int, base: float = 10000.0) -> torch.Tensor:
    """[max_position, 64] fp32: 32 cos then 32 sin."""
    inv_freq = 1.0 / (base ** (torch.arange(0, ROPE, 2, dtype=torch.float64) / ROPE))
    angles = torch.arange(max_position, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=1).float()


def ref_rope(x: torch.Tensor, cos_sin_cache: torch.Tensor, positions: torch.Tensor,
             is_neox: bool) -> torch.Tensor:
    """x [..., T, (H,) 64] float64 with T on dim 0; rotary embedding, pairs (i, i+32) for NeoX and
    (2i, 2i+1) interleaved."""
    cs = cos_sin_cache.cpu().double()[positions.cpu().long()]
    cos, sin = cs[:, :ROPE // 2], cs[:, ROPE // 2:]
    while cos.dim() < x.dim():
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    if is_neox:
        x1, x2 = x[..., :ROPE // 2], x[..., ROPE // 2:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = x1 * cos - x2 * sin
    out[..., 1::2] = x2 * cos + x1 * sin
    return out
