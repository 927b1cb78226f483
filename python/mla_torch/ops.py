"""Python wrappers of torch.ops.mla.* with keyword arguments and optional output allocation.

The registered ops are out= style (outputs are passed in and written in place, nothing is
returned), which is what CUDA graphs and torch.compile want. These wrappers allocate the outputs
that are not given and return them, which is what tests and simple callers want. Semantics of
every op: include/mla/ops.hpp. LSE is ln(sum exp(scaled score)); a row with no key has output 0
and LSE -inf.
"""

from __future__ import annotations

from typing import Optional

import torch

from ._library import load_library

load_library()

Tensor = torch.Tensor

KV_LORA_RANK = 512
ROPE_DIM = 64
LATENT_DIM = KV_LORA_RANK + ROPE_DIM  # 576
QK_NOPE_HEAD_DIM = 128
QK_HEAD_DIM = QK_NOPE_HEAD_DIM + ROPE_DIM  # 192
V_HEAD_DIM = 128
FP8_E4M3_MAX = 448.0

# The ops' check_metadata keyword is a debug mode (CUDA only: the CPU always checks): the op copies
# its index and length tensors to the host and raises, naming the first bad value, before it
# writes anything. It waits for the stream, so it raises inside a CUDA-graph capture. Without it
# a bad value on CUDA is never read or written out of bounds, but it is not reported either.


def append_latent_kv(k_nope: Tensor, k_pe: Tensor, loc: Tensor, kv_cache: Tensor,
                     k_scale: float = 1.0, *, check_metadata: bool = False) -> None:
    """kv_cache[loc[t] // S, loc[t] % S] = k_nope[t] | k_pe[t] (quantised for an fp8 cache:
    stored = saturate(x / k_scale)). loc -1 skips the token; any other slot outside the pool
    raises on the CPU, and on CUDA is skipped (with check_metadata, the debug mode above, raises)."""
    torch.ops.mla.append_latent_kv(k_nope, k_pe, loc, kv_cache, float(k_scale), bool(check_metadata))


def _require_dims(op: str, name: str, t: Tensor, dims: int) -> None:
    """A tensor the wrapper sizes an output from: its rank first (the op's own check would come
    only after that output was allocated from the wrong dims)."""
    if t.dim() != dims:
        raise ValueError(f"{op}: {name} must have {dims} dims, got shape {list(t.shape)}")


def _output_dtype(input_dtype: torch.dtype) -> torch.dtype:
    """The default output of an op whose outputs are 16-bit or fp8: the input's dtype, bf16 for
    fp32 inputs."""
    return torch.bfloat16 if input_dtype == torch.float32 else input_dtype


def build_block_table(req_to_token: Tensor, req_pool_indices: Tensor, seq_lens: Tensor,
                      page_size: int, block_table: Optional[Tensor] = None,
                      max_blocks: Optional[int] = None, *, check_metadata: bool = False) -> Tensor:
    """block_table[b, j] = req_to_token[req_pool_indices[b], j * S] // S for the pages in use,
    -1 after. Allocates [B, max_blocks] (default: the full width of req_to_token) if not given."""
    if block_table is None:
        if max_blocks is None:
            if page_size < 1:  # the op names it; the default width needs it first
                raise ValueError(f"build_block_table: page_size must be a power of two in 1..128, "
                                 f"got {page_size}")
            max_blocks = -(-req_to_token.shape[1] // page_size)
        block_table = torch.empty((req_pool_indices.shape[0], max_blocks), dtype=torch.int32,
                                  device=req_to_token.device)
    torch.ops.mla.build_block_table(req_to_token, req_pool_indices, seq_lens, int(page_size),
                                    block_table, bool(check_metadata))
    return block_table


def rope_quantize(q_nope: Tensor, q_pe: Tensor, cos_sin_cache: Tensor, positions: Tensor, *,
                  k_nope: Optional[Tensor] = None, k_pe: Optional[Tensor] = None,
                  is_neox: bool = True, q_out: Optional[Tensor] = None,
                  q_out_dtype: Optional[torch.dtype] = None,
                  k_nope_out: Optional[Tensor] = None, k_pe_out: Optional[Tensor] = None,
                  k_out_dtype: Optional[torch.dtype] = None, q_scale: float = 1.0,
                  k_scale: float = 1.0, check_metadata: bool = False):
    """Rotary embedding of q_pe (and k_pe), q_out = q_nope | rope(q_pe) (576 wide), optional fp8
    outputs (stored = saturate(x / scale)). Returns (q_out, k_nope_out, k_pe_out); the k outputs
    are None without k_nope."""
    _require_dims("rope_quantize", "q_nope", q_nope, 3)
    num_tokens, num_heads = q_nope.shape[0], q_nope.shape[1]
    if q_out is None:
        q_out = torch.empty((num_tokens, num_heads, LATENT_DIM),
                            dtype=q_out_dtype or _output_dtype(q_nope.dtype), device=q_nope.device)
    if k_nope is not None:
        given = k_nope_out if k_nope_out is not None else k_pe_out  # both k outputs share a dtype
        k_dtype = k_out_dtype or (given.dtype if given is not None else _output_dtype(k_nope.dtype))
        if k_nope_out is None:
            k_nope_out = torch.empty((num_tokens, KV_LORA_RANK), dtype=k_dtype, device=k_nope.device)
        if k_pe_out is None:
            k_pe_out = torch.empty((num_tokens, ROPE_DIM), dtype=k_dtype, device=k_nope.device)
    torch.ops.mla.rope_quantize(q_nope, q_pe, k_nope, k_pe, cos_sin_cache, positions,
                                bool(is_neox), q_out, k_nope_out, k_pe_out, float(q_scale),
                                float(k_scale), bool(check_metadata))
    return q_out, k_nope_out, k_pe_out


def mla_decode(kv_cache: Tensor, block_table: Tensor, kv_lens: Tensor, softmax_scale: float, *,
               q: Optional[Tensor] = None, q_nope: Optional[Tensor] = None,
               q_pe: Optional[Tensor] = None, cu_q_lens: Optional[Tensor] = None,
               q_len: int = 1, max_q_len: int = 0, q_scale: float = 1.0, k_scale: float = 1.0,
               out: Optional[Tensor] = None, out_dtype: Optional[torch.dtype] = None,
               lse: Optional[Tensor] = None, return_lse: bool = False,
               workspace: Optional[Tensor] = None, workspace_max_batch: int = 0,
               workspace_max_q_len: int = 0, deterministic: bool = False,
               workspace_max_kv_len: int = 0, workspace_split_keys: int = 0,
               zero_padding_rows: bool = False, check_metadata: bool = False):
    """Absorbed attention over the paged latent cache (causal for q_len > 1). Queries as q
    [T, H, 576] or q_nope [T, H, 512] + q_pe [T, H, 64]. Returns out [T, H, 512], or (out, lse)
    when return_lse or lse is given.

    On CUDA, a workspace (uint8, decode_workspace_bytes(max_batch, max_q_len, H) bytes, made for
    that capacity) turns on the split-KV schedule: it is planned on the device for this batch
    right before the kernel (no host sync, graph-capturable). Without it the kernel runs unsplit.
    The CPU ignores the workspace.

    deterministic: a request's rows are bit-identical whatever else is in the batch and from run
    to run (64-row tiles, 16 on sm_86 / sm_89; the kernel chosen without the batch size): unsplit
    without a workspace,
    or with a deterministic workspace (workspace_split_keys > 0, DecodeWorkspace(...,
    split_keys=N)) every request's keys cut at the multiples of N and spread over all SMs.

    zero_padding_rows (with cu_q_lens): the rows past cu_q_lens[B] of a padded batch (a CUDA
    graph captured at its largest query count) come out 0 with lse -inf, on CUDA written on the
    device after the attention. Without it CUDA leaves them as they were and the CPU refuses
    cu_q_lens[B] below T.

    check_metadata: the debug mode described at the top of this module."""
    ref = q if q is not None else q_nope
    if ref is None:
        raise ValueError("mla_decode: give q or q_nope and q_pe")
    _require_dims("mla_decode", "q" if q is not None else "q_nope", ref, 3)
    num_tokens, num_heads = ref.shape[0], ref.shape[1]
    if out is None:
        dtype = out_dtype or (torch.bfloat16 if ref.dtype == torch.float8_e4m3fn else ref.dtype)
        out = torch.empty((num_tokens, num_heads, KV_LORA_RANK), dtype=dtype, device=ref.device)
    if lse is None and return_lse:
        lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=ref.device)
    torch.ops.mla.mla_decode(q, q_nope, q_pe, kv_cache, block_table, kv_lens, cu_q_lens,
                             int(q_len), int(max_q_len), float(softmax_scale), float(q_scale),
                             float(k_scale), out, lse, workspace, int(workspace_max_batch),
                             int(workspace_max_q_len), bool(deterministic),
                             int(workspace_max_kv_len), int(workspace_split_keys),
                             bool(zero_padding_rows), bool(check_metadata))
    return (out, lse) if lse is not None else out


def cumulative_lengths(lens: Tensor, cu: Optional[Tensor] = None) -> Tensor:
    """cu[0] = 0, cu[b + 1] = cu[b] + lens[b] (int32), on the tensors' device: on CUDA one small
    kernel with no host copy and no allocation (for CUDA-graph buffers updated before a replay).
    lens [B] int32/int64 (any stride); cu [B + 1] int32 must not overlap lens. Returns cu."""
    if cu is None:
        cu = torch.empty(lens.shape[0] + 1, dtype=torch.int32, device=lens.device)
    torch.ops.mla.cumulative_lengths(lens, cu)
    return cu


def decode_workspace_bytes(max_batch: int, max_q_len: int, num_heads: int,
                           max_kv_len: int = 0, split_keys: int = 0) -> int:
    """Bytes of the split-KV workspace of mla_decode for the given capacity (CUDA builds, on the
    current CUDA device). split_keys > 0: a deterministic workspace (every request's keys cut at
    the multiples of split_keys, a positive multiple of 64) for requests of up to max_kv_len
    keys, with room for every piece's partial result."""
    return int(torch.ops.mla.decode_workspace_bytes(int(max_batch), int(max_q_len), int(num_heads),
                                                    int(max_kv_len), int(split_keys)))


class DecodeWorkspace:
    """A zero-initialised split-KV workspace for mla_decode on one CUDA device, with its
    capacity. grow() allocates a larger buffer for a larger batch (never while a CUDA graph is
    captured). The buffers it replaces stay allocated as long as the workspace lives: a CUDA
    graph captured earlier keeps planning into and reading from the buffer it was captured
    with (keep_replaced=False drops them: a workspace that no graph captures). split_keys > 0
    makes it a deterministic workspace (for deterministic=True) for block tables of up to
    max_kv_len keys."""

    def __init__(self, max_batch: int, max_q_len: int, num_heads: int, device,
                 max_kv_len: int = 0, split_keys: int = 0, keep_replaced: bool = True):
        self.num_heads = num_heads
        self.max_kv_len, self.split_keys = int(max_kv_len), int(split_keys)
        self.device = torch.device(device)
        self.max_batch = self.max_q_len = 0
        self.buffer: Optional[Tensor] = None
        self.keep_replaced = keep_replaced
        self._replaced: list = []
        self.grow(max_batch, max_q_len)

    def grow(self, max_batch: int, max_q_len: int) -> None:
        if self.buffer is not None and max_batch <= self.max_batch and max_q_len <= self.max_q_len:
            return
        new_batch = max(max_batch, self.max_batch, 1)
        new_q_len = max(max_q_len, self.max_q_len, 1)
        # Sized and allocated before anything changes: a capacity that is too large (or out of
        # memory) raises and leaves the workspace as it was.
        with torch.cuda.device(self.device):
            nbytes = decode_workspace_bytes(new_batch, new_q_len, self.num_heads,
                                            self.max_kv_len, self.split_keys)
        buffer = torch.zeros(nbytes, dtype=torch.uint8, device=self.device)
        if self.buffer is not None and self.keep_replaced:
            self._replaced.append(self.buffer)
        self.buffer, self.max_batch, self.max_q_len = buffer, new_batch, new_q_len

    def kwargs(self) -> dict:
        return dict(workspace=self.buffer, workspace_max_batch=self.max_batch,
                    workspace_max_q_len=self.max_q_len, workspace_max_kv_len=self.max_kv_len,
                    workspace_split_keys=self.split_keys)


def mha_prefill(q: Tensor, k: Tensor, v: Tensor, cu_q_lens: Tensor, cu_kv_lens: Tensor,
                softmax_scale: float, *, max_q_len: int = 0, max_kv_len: int = 0,
                causal: bool = True, q_scale: float = 1.0, k_scale: float = 1.0,
                v_scale: float = 1.0, out: Optional[Tensor] = None,
                out_dtype: Optional[torch.dtype] = None, lse: Optional[Tensor] = None,
                return_lse: bool = False, check_metadata: bool = False):
    """Ragged non-absorbed attention (192-wide q/k, 128-wide v), causal bottom-right aligned.
    Returns out [Tq, H, 128], or (out, lse) when return_lse or lse is given."""
    _require_dims("mha_prefill", "q", q, 3)
    if out is None:
        dtype = out_dtype or (torch.bfloat16 if q.dtype == torch.float8_e4m3fn else q.dtype)
        out = torch.empty((q.shape[0], q.shape[1], V_HEAD_DIM), dtype=dtype, device=q.device)
    if lse is None and return_lse:
        lse = torch.empty((q.shape[0], q.shape[1]), dtype=torch.float32, device=q.device)
    torch.ops.mla.mha_prefill(q, k, v, cu_q_lens, cu_kv_lens, int(max_q_len), int(max_kv_len),
                              bool(causal), float(softmax_scale), float(q_scale), float(k_scale),
                              float(v_scale), out, lse, bool(check_metadata))
    return (out, lse) if lse is not None else out


def merge_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor, *,
                 out: Optional[Tensor] = None, lse_out: Optional[Tensor] = None):
    """Combines two partial attentions over disjoint key sets by their LSE. out may be out_a or
    out_b (in place). Returns (out, lse_out)."""
    if out is None:
        out = torch.empty_like(out_a)
    if lse_out is None:
        lse_out = torch.empty_like(lse_a)
    torch.ops.mla.merge_states(out_a, lse_a, out_b, lse_b, out, lse_out)
    return out, lse_out
