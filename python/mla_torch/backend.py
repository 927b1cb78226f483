"""A drop-in MLA attention backend for Python serving engines.

`MlaBackend` has the life cycle and method names that SGLang-style engines call on an attention
backend: init_cuda_graph_state, init_forward_metadata, init_forward_metadata_capture_cuda_graph /
init_forward_metadata_replay_cuda_graph (and init_forward_metadata_out_graph), forward_decode and
forward_extend; `MlaMultiStepDraftBackend` is the per-step set of backends for EAGLE-style
drafting. The backend is thin: planning is the build_block_table op plus a few torch tensor ops on
the batch's device, attention is torch.ops.mla.*.

Forward modes (one per batch; the engine's own enum works too, matched by member name):
  DECODE         one query per request, absorbed attention over the paged cache
  IDLE           no requests; nothing to compute, must not fail
  EXTEND         prefill: non-absorbed ragged causal attention over the new tokens (mha_prefill);
                 a cached prefix is attended either chunk by chunk (the chunked-prefix path: the
                 engine up-projects each chunk and merges with merge_states) or, when chunking is
                 off or the engine calls with the absorbed layer, by absorbed attention over the
                 paged cache with a variable query length
  TARGET_VERIFY  draft_token_num queries per request, absorbed, causal among the drafts
  DRAFT_EXTEND   a different number of queries per request, absorbed, causal

Conventions (DESIGN.md §2): seq_lens counts the cached tokens of a request including the ones
being computed now — except in TARGET_VERIFY, where, as engines pass it, seq_lens excludes the
draft tokens and the backend adds draft_token_num. The decode family (DECODE, IDLE,
TARGET_VERIFY, DRAFT_EXTEND) plans without reading device values on the host, so it can run
while a CUDA graph is captured; replays update persistent buffers in place and allocate nothing.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field
from typing import Any, List, Optional, Tuple

import torch

from . import ops

Tensor = torch.Tensor


# ---- the engine-facing vocabulary ---------------------------------------------------------------

class ForwardMode(enum.IntEnum):
    EXTEND = 1
    DECODE = 2
    IDLE = 3
    TARGET_VERIFY = 4
    DRAFT_EXTEND = 5

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_decode_or_idle(self) -> bool:
        return self in (ForwardMode.DECODE, ForwardMode.IDLE)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND)


# What the backend does for a mode, by the mode's member name (engines bring their own enums).
_DECODE, _IDLE, _EXTEND, _VERIFY, _DRAFT_EXTEND = "decode", "idle", "extend", "verify", "draft_extend"
_MODE_KINDS = {
    "DECODE": _DECODE,
    "IDLE": _IDLE,
    "EXTEND": _EXTEND,
    "MIXED": _EXTEND,  # chunked prefill mixed with decodes: decodes are extends of length 1
    "TARGET_VERIFY": _VERIFY,
    "DRAFT_EXTEND": _DRAFT_EXTEND,
    "DRAFT_EXTEND_V2": _DRAFT_EXTEND,
}


def _mode_name(forward_mode: Any) -> str:
    return getattr(forward_mode, "name", None) or str(forward_mode).split(".")[-1]


def mode_kind(forward_mode: Any) -> str:
    name = _mode_name(forward_mode)
    try:
        return _MODE_KINDS[name]
    except KeyError:
        raise ValueError(f"MlaBackend: unsupported forward mode {forward_mode!r}; supported: "
                         f"{', '.join(_MODE_KINDS)}") from None


@dataclass
class SpecInfo:
    draft_token_num: int = 0
    topk: int = 1


@dataclass
class ForwardBatch:
    """The attributes the backend reads from an engine's batch (engines pass their own object
    with the same attribute names). Device tensors unless the name ends in _cpu."""

    forward_mode: Any
    batch_size: int
    req_pool_indices: Tensor            # [B] int32/int64
    seq_lens: Tensor                    # [B] int32/int64
    out_cache_loc: Optional[Tensor] = None   # [T] slots of the new tokens
    positions: Optional[Tensor] = None       # [T] positions of the new tokens (for RoPE)
    seq_lens_cpu: Optional[Tensor] = None    # [B] host copy, optional
    extend_seq_lens: Optional[Tensor] = None     # [B] EXTEND / DRAFT_EXTEND
    extend_seq_lens_cpu: Optional[List[int]] = None
    extend_prefix_lens: Optional[Tensor] = None  # [B] EXTEND
    extend_prefix_lens_cpu: Optional[List[int]] = None
    spec_info: Optional[Any] = None              # .draft_token_num for TARGET_VERIFY
    # MHA prefill: return (out, lse) for the new tokens (needed when a prefix is merged in).
    mha_return_lse: bool = False
    # The chunked-prefix path: set attn_attend_prefix_cache and prefix_chunk_idx to attend the
    # new tokens to one prefix chunk. The chunk plan below is filled by init_forward_metadata
    # when the engine did not fill it.
    attn_attend_prefix_cache: bool = False
    prefix_chunk_idx: Optional[int] = None
    num_prefix_chunks: Optional[int] = None
    prefix_chunk_cu_seq_lens: Optional[List[Tensor]] = None  # per chunk [B + 1] int32
    prefix_chunk_max_seq_lens: Optional[List[int]] = None
    prefix_chunk_kv_indices: Optional[List[Tensor]] = None   # per chunk [Tk] token slots
    prefix_chunk_num_tokens: Optional[List[int]] = None


@dataclass
class AttentionLayer:
    """The attributes read from an engine's attention layer (RadixAttention-like). The absorbed
    layer has head_dim 576 and v_head_dim 512; the MHA prefill layer 192 and 128."""

    layer_id: int
    tp_q_head_num: int
    head_dim: int
    v_head_dim: int
    scaling: float
    tp_k_head_num: int = 1
    k_scale_float: Optional[float] = None
    v_scale_float: Optional[float] = None


class LatentKvPool:
    """A minimal per-layer latent cache pool: get_key_buffer(layer_id) -> [P * S, 1, 576]."""

    def __init__(self, num_layers: int, num_pages: int, page_size: int, dtype: torch.dtype,
                 device: torch.device | str, fill: float = 0.0):
        self.page_size = page_size
        self.dtype = dtype
        self.kv_buffer = [
            torch.full((num_pages * page_size, 1, ops.LATENT_DIM), fill, dtype=torch.float32,
                       device=device).to(dtype)
            for _ in range(num_layers)
        ]

    def get_key_buffer(self, layer_id: int) -> Tensor:
        return self.kv_buffer[layer_id]


# ---- metadata -----------------------------------------------------------------------------------

@dataclass
class DecodeMetadata:
    """Plan of one absorbed-attention batch (the decode family, and EXTEND's absorbed path)."""

    batch_size: int
    block_table: Tensor               # [B, max_blocks] int32
    kv_lens: Tensor                   # [B] int32: keys per request, new tokens included
    cu_q_lens: Optional[Tensor]       # [B + 1] int32 for a variable query length, else None
    q_len: int                        # queries per request when cu_q_lens is None
    max_q_len: int                    # upper bound on the queries of one request
    max_kv_len: int                   # upper bound on kv_lens
    graph: bool = False               # a CUDA-graph plan over the persistent buffers


@dataclass
class PrefillMetadata:
    """Plan of one EXTEND batch."""

    batch_size: int
    cu_q_lens: Tensor                 # [B + 1] int32 over the new tokens
    max_q_len: int
    has_prefix: bool
    use_chunked_prefix: bool          # False: prefixes go through the absorbed path
    absorbed: Optional[DecodeMetadata] = None


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _cu_lens(lens: Tensor) -> Tensor:
    """[0, cumsum(lens)] as int32, on lens' device."""
    return ops.cumulative_lengths(lens)


def _check_numel(name: str, t: Tensor, tokens: int, heads: int, width: Any) -> None:
    """t must hold tokens x heads x width elements (width: one value or a tuple of choices)."""
    widths = width if isinstance(width, tuple) else (width,)
    if t.numel() not in [tokens * heads * w for w in widths]:
        shapes = " or ".join(f"[{tokens}, {heads * w}]" for w in widths)
        raise ValueError(f"MlaBackend: {name} must hold {shapes} elements (tokens x "
                         f"{'heads x ' if heads > 1 else ''}width), got {list(t.shape)}")


def _attention_tp_size(model_runner: Any) -> int:
    """The ranks one layer's attention heads are split over: the runner's attn_tp_size when it
    has one; else tp_size, divided by dp_size under data-parallel attention (each DP group
    splits the heads over its tp_size / dp_size ranks)."""
    attn_tp = getattr(model_runner, "attn_tp_size", None)
    if attn_tp:
        return int(attn_tp)
    tp_size = int(getattr(model_runner, "tp_size", 1) or 1)
    server_args = getattr(model_runner, "server_args", None)
    if server_args is not None and getattr(server_args, "enable_dp_attention", False):
        dp_size = int(getattr(server_args, "dp_size", 1) or 1)
        return max(1, tp_size // dp_size)
    return tp_size


_INT32_MAX = 2**31 - 1


def _check_host_lengths(name: str, lens: Any, bs: int, offset: int = 0,
                        allow_short: bool = True) -> Optional[List[int]]:
    """Lengths the host can see (a *_cpu list or tensor, or a CPU tensor) must fit the kernels'
    int32 lengths; device tensors are not read here (that would synchronise). Returns the first
    bs of them as Python ints (_host_list), or None for device tensors and absent lengths."""
    if lens is None:
        return None
    if isinstance(lens, Tensor) and lens.device.type != "cpu":
        return None
    values = _host_list(lens, bs, name, allow_short=allow_short)
    if not values:
        return values
    lo, hi = min(values), max(values)
    if lo < 0 or hi + offset > _INT32_MAX:
        bad = lo if lo < 0 else hi
        raise ValueError(f"MlaBackend: {name} holds {bad}"
                         f"{' (plus the offset ' + str(offset) + ')' if offset else ''}; lengths "
                         f"must be in [0, 2^31 - 1]")
    return values


def _host_lengths(name: str, lens: Any, bs: int, offset: int = 0,
                  allow_short: bool = False) -> Optional[List[int]]:
    """The first bs lengths of a *_cpu attribute as Python ints, checked (_check_host_lengths);
    a device tensor given there is read as it is (None stays None)."""
    values = _check_host_lengths(name, lens, bs, offset, allow_short)
    return values if values is not None or lens is None else _host_list(lens, bs, name, allow_short)


def _host_list(lens: Any, bs: int, name: str, allow_short: bool = False) -> Optional[List[int]]:
    """The first bs host lengths as Python ints (engines pass lists or CPU tensors), or None.
    allow_short: fewer than bs are the engine's (data-parallel padding grows batch_size and the
    device tensors, not the host lists, whose padded requests add no queries or keys)."""
    if lens is None:
        return None
    values = lens[:bs].tolist() if isinstance(lens, Tensor) else list(lens)[:bs]
    if len(values) < bs and not allow_short:
        raise ValueError(f"MlaBackend: {name} holds {len(values)} lengths for a batch of {bs}")
    return [int(x) for x in values]


def _scale_query(q: Tensor, scaling: Any, model_dtype: torch.dtype, fp8: bool = False) -> Tensor:
    """q [T, H, D] times the engine's llama_4_scaling (one factor a token, or one for all), in
    the model dtype, back in q's dtype (saturated for fp8)."""
    if not isinstance(scaling, Tensor) or scaling.numel() not in (1, q.shape[0]):
        raise ValueError(f"MlaBackend: llama_4_scaling must be a tensor of one factor or one a "
                         f"token ({q.shape[0]}), got "
                         f"{list(scaling.shape) if isinstance(scaling, Tensor) else type(scaling).__name__}")
    if scaling.device != q.device:
        raise ValueError(f"MlaBackend: llama_4_scaling must be on {q.device}, got {scaling.device}")
    scaled = q.to(model_dtype) * scaling.reshape(-1, 1, 1)
    return _saturate_fp8(scaled) if fp8 else scaled.to(q.dtype)


def _extend_lens(forward_batch: Any, bs: int) -> Tensor:
    """The first bs of forward_batch.extend_seq_lens (new tokens per request), required."""
    lens = getattr(forward_batch, "extend_seq_lens", None)
    if lens is None:
        raise ValueError("MlaBackend: extend batches need extend_seq_lens (the new tokens per "
                         "request, on the device)")
    _check_host_lengths("extend_seq_lens", lens, bs)
    return lens[:bs]


def _saturate_fp8(x: Tensor, scale: float = 1.0) -> Tensor:
    y = x.float() if scale == 1.0 else x.float() / scale
    return y.clamp(-ops.FP8_E4M3_MAX, ops.FP8_E4M3_MAX).to(torch.float8_e4m3fn)


# ---- the backend --------------------------------------------------------------------------------

class MlaBackend:
    """MLA attention backend over a paged latent cache.

    Args:
      num_q_heads: query heads on this rank (1..128).
      page_size: tokens per page (a power of two, 1..128).
      req_to_token: [max_requests, max_context_len] int32 token slots of each request slot.
      token_to_kv_pool: object with get_key_buffer(layer_id) -> the layer's cache, viewable as
        [num_pages, page_size, 576] (bf16/fp16 or float8_e4m3fn).
      kv_cache_dtype: dtype of the latent cache.
      q_dtype: the model's activation dtype (outputs are returned in it).
      num_draft_tokens: draft tokens per request for TARGET_VERIFY (spec_info may override).
      disable_chunked_prefix_cache: attend cached prefixes with the absorbed path instead.
      chunked_prefix_capacity: tokens per prefix chunk (over the whole batch).
      prefill_fp8: run the MHA prefill in fp8 (default: when the cache is fp8).
      step_offset: a draft step's backend attends to seq_lens + step_offset keys in DECODE.
      use_split_kv: on CUDA, run mla_decode with the split-KV schedule (planned on the device
        before each decode in a workspace the backend owns, or decode_workspace when given).
      deterministic: a request's attention output is bit-identical whatever else is in its
        batch and from run to run: mla_decode runs with deterministic=True, unsplit (use_split_kv
        is then off) unless deterministic_split_keys is given, and prefix chunks cut a request
        only at multiples of chunked_prefix_capacity of its own positions (pieces packed whole,
        in order). From an SGLang ModelRunner: server_args.enable_deterministic_inference.
      deterministic_split_keys: with deterministic on CUDA, > 0 (a multiple of 64) cuts every
        request's keys of the decode family at the multiples of this many keys and spreads the
        pieces over all SMs (a deterministic split-KV workspace with room for every piece of the
        largest batch at the full context: a larger value takes less memory); 0 runs unsplit.
        EXTEND's absorbed path stays unsplit (its row tiles fill the SMs).
    """

    # The decode family is planned on the device from the device lengths; seq_lens_cpu only
    # narrows its eager block table when the engine has it, so it need not copy it. (EXTEND reads
    # its host lengths: extend_seq_lens_cpu, and extend_prefix_lens_cpu or else seq_lens_cpu.)
    needs_cpu_seq_lens: bool = False

    def __init__(self, *, num_q_heads: int, page_size: int, req_to_token: Tensor,
                 token_to_kv_pool: Any, kv_cache_dtype: torch.dtype,
                 q_dtype: torch.dtype = torch.bfloat16, num_draft_tokens: int = 0,
                 disable_chunked_prefix_cache: bool = False,
                 chunked_prefix_capacity: int = 65536, prefill_fp8: Optional[bool] = None,
                 skip_prefill: bool = False, step_offset: int = 0, use_split_kv: bool = True,
                 decode_workspace: Optional[ops.DecodeWorkspace] = None,
                 deterministic: bool = False, deterministic_split_keys: int = 0,
                 check_metadata: bool = False):
        if kv_cache_dtype not in (torch.bfloat16, torch.float16, torch.float8_e4m3fn):
            raise ValueError(f"MlaBackend: kv_cache_dtype must be bfloat16, float16 or "
                             f"float8_e4m3fn, got {kv_cache_dtype}")
        if page_size < 1 or page_size > 128 or page_size & (page_size - 1):
            raise ValueError(f"MlaBackend: page_size must be a power of two in 1..128, got {page_size}")
        self.num_q_heads = num_q_heads
        self.page_size = page_size
        # The ops' debug mode (ops.py): on CUDA each op's indices and lengths are copied to the
        # host and checked before it writes (it waits for the stream: not for CUDA graphs).
        self.check_metadata = bool(check_metadata)
        self.req_to_token = req_to_token
        self.token_to_kv_pool = token_to_kv_pool
        self.data_type = kv_cache_dtype
        self.q_data_type = q_dtype
        self.device = req_to_token.device
        self.max_context_len = req_to_token.shape[1]
        self.num_draft_tokens = num_draft_tokens or 0
        self.disable_chunked_prefix_cache = disable_chunked_prefix_cache
        if chunked_prefix_capacity < 1:
            raise ValueError(f"MlaBackend: chunked_prefix_capacity must be >= 1, got "
                             f"{chunked_prefix_capacity}")
        self.chunked_prefix_capacity = chunked_prefix_capacity
        self.prefill_fp8 = (kv_cache_dtype == torch.float8_e4m3fn) if prefill_fp8 is None else prefill_fp8
        self.skip_prefill = skip_prefill
        self.step_offset = step_offset
        # The split-KV schedule's workspace (CUDA only; shared by the steps of a draft backend,
        # which decode one after another on one stream). None: the decode kernel runs unsplit.
        self.deterministic = bool(deterministic)
        if deterministic_split_keys < 0 or deterministic_split_keys % 64:
            raise ValueError(f"MlaBackend: deterministic_split_keys must be 0 (unsplit) or a "
                             f"positive multiple of 64, got {deterministic_split_keys}")
        # The deterministic mode's split (its workspace's), 0 outside it.
        self.split_keys = int(deterministic_split_keys) if self.deterministic else 0
        self.use_split_kv = use_split_kv and (not self.deterministic or self.split_keys > 0) and \
            self.device.type == "cuda" and torch.ops.mla.build_info() != "cpu"
        if decode_workspace is not None:
            self._check_workspace(decode_workspace)
        self.decode_workspace = decode_workspace
        self.extend_workspace: Optional[ops.DecodeWorkspace] = None  # EXTEND's absorbed path
        self.kv_lora_rank = ops.KV_LORA_RANK
        self.qk_rope_head_dim = ops.ROPE_DIM
        self.kv_cache_dim = ops.LATENT_DIM

        self.forward_decode_metadata: Optional[DecodeMetadata] = None
        self.forward_prefill_metadata: Optional[PrefillMetadata] = None
        # CUDA graph state (init_cuda_graph_state)
        self.decode_cuda_graph_metadata: dict = {}
        self.cuda_graph_block_table: Optional[Tensor] = None
        self.cuda_graph_kv_lens: Optional[Tensor] = None
        self.cuda_graph_cu_q_lens: Optional[Tensor] = None

    @classmethod
    def from_model_runner(cls, model_runner: Any, skip_prefill: bool = False,
                          step_offset: int = 0, **overrides) -> "MlaBackend":
        """Builds the backend from an SGLang-style ModelRunner (model_config, page_size,
        req_to_token_pool, token_to_kv_pool, kv_cache_dtype, dtype, server_args)."""
        config = model_runner.model_config
        server_args = getattr(model_runner, "server_args", None)
        kwargs = dict(
            num_q_heads=config.num_attention_heads // _attention_tp_size(model_runner),
            page_size=model_runner.page_size,
            req_to_token=model_runner.req_to_token_pool.req_to_token,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            kv_cache_dtype=model_runner.kv_cache_dtype,
            q_dtype=model_runner.dtype,
            num_draft_tokens=getattr(server_args, "speculative_num_draft_tokens", 0) or 0,
            disable_chunked_prefix_cache=bool(getattr(server_args, "disable_chunked_prefix_cache", False)),
            deterministic=bool(getattr(server_args, "enable_deterministic_inference", False)),
            skip_prefill=skip_prefill,
            step_offset=step_offset,
        )
        kwargs.update(overrides)
        return cls(**kwargs)

    # ---- helpers --------------------------------------------------------------------------------

    def _draft_token_num(self, spec_info: Any) -> int:
        n = getattr(spec_info, "draft_token_num", None) if spec_info is not None else None
        n = n or self.num_draft_tokens
        if not n:
            raise ValueError("MlaBackend: TARGET_VERIFY needs spec_info.draft_token_num or "
                             "num_draft_tokens")
        return int(n)

    def _kv_cache(self, layer: Any) -> Tensor:
        buf = self.token_to_kv_pool.get_key_buffer(layer.layer_id)
        if buf.dtype != self.data_type:
            raise ValueError(f"MlaBackend: layer {layer.layer_id} cache is {buf.dtype}, the "
                             f"backend was built for {self.data_type}")
        return buf.view(-1, self.page_size, self.kv_cache_dim)

    def _k_scale(self, layer: Any) -> float:
        if self.data_type != torch.float8_e4m3fn:
            return 1.0
        k_scale = getattr(layer, "k_scale_float", None)
        return 1.0 if k_scale is None else float(k_scale)

    def _max_blocks(self, max_kv_len: int) -> int:
        return max(1, _cdiv(min(max_kv_len, self.max_context_len), self.page_size))

    def _workspace_max_kv_len(self) -> int:
        """Keys of the widest block table this backend passes (a deterministic workspace's
        bound; 0 for a balanced one)."""
        return self._max_blocks(self.max_context_len) * self.page_size if self.split_keys else 0

    def _check_workspace(self, ws: Any) -> None:
        """A decode_workspace given to the backend must be the kind it decodes with."""
        what = (f"a deterministic workspace (split_keys {self.split_keys}, max_kv_len >= "
                f"{self._workspace_max_kv_len()})" if self.split_keys else "a balanced workspace")
        if not self.use_split_kv:
            raise ValueError("MlaBackend: decode_workspace is given but this backend decodes "
                             "without a split-KV workspace (" +
                             ("deterministic without deterministic_split_keys"
                              if self.deterministic else "use_split_kv off, or not on CUDA") + ")")
        if ws.split_keys != self.split_keys or ws.max_kv_len < self._workspace_max_kv_len() or \
                ws.num_heads != self.num_q_heads:
            raise ValueError(f"MlaBackend: decode_workspace (split_keys {ws.split_keys}, "
                             f"max_kv_len {ws.max_kv_len}, {ws.num_heads} heads) does not serve "
                             f"this backend: it needs {what} for {self.num_q_heads} heads")

    def new_workspace(self, max_batch: int, max_q_len: int, keep_replaced: bool = True) -> ops.DecodeWorkspace:
        """A split-KV workspace for this backend's decodes: deterministic (for block tables as
        wide as the context) when the backend is."""
        return ops.DecodeWorkspace(max_batch, max_q_len, self.num_q_heads, self.device,
                                   max_kv_len=self._workspace_max_kv_len(),
                                   split_keys=self.split_keys, keep_replaced=keep_replaced)

    def _workspace(self, md: DecodeMetadata, kind: str) -> dict:
        if kind == _EXTEND:
            # EXTEND's long query counts get a workspace of their own (eager only: no graph keeps
            # its old buffers), so that the decode family's (shared by draft steps, sized for the
            # graphs' batches) does not grow to the largest batch times the longest extend. The
            # deterministic mode runs EXTEND unsplit: a deterministic workspace holds every
            # piece of every row tile at the full context, and a long extend fills the SMs with
            # its row tiles anyway.
            if self.deterministic:
                return {}
            if self.extend_workspace is None:
                self.extend_workspace = self.new_workspace(md.batch_size, md.max_q_len,
                                                           keep_replaced=False)
            else:
                self.extend_workspace.grow(md.batch_size, md.max_q_len)
            return self.extend_workspace.kwargs()
        if self.decode_workspace is None:
            self.decode_workspace = self.new_workspace(md.batch_size, md.max_q_len)
        elif not torch.cuda.is_current_stream_capturing():
            self.decode_workspace.grow(md.batch_size, md.max_q_len)
        return self.decode_workspace.kwargs()

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---- planning -------------------------------------------------------------------------------

    def _plan_absorbed(self, forward_batch: Any, kind: str,
                       block_table: Optional[Tensor] = None,
                       step_offset: Optional[int] = None,
                       extend_q: Optional[Tuple[Tensor, int]] = None) -> DecodeMetadata:
        """Eager plan of an absorbed batch. Reads no device value on the host: bounds come from
        the *_cpu attributes when the engine gives them, else from max_context_len. extend_q:
        an EXTEND plan's (cu_q_lens, max_q_len), already made from the same lengths."""
        bs = int(forward_batch.batch_size)
        seq_lens = forward_batch.seq_lens[:bs]
        seq_lens_cpu = getattr(forward_batch, "seq_lens_cpu", None)
        cu_q_lens = None
        q_len = max_q_len = 1
        # Keys a request attends = seq_lens + offset.
        if kind == _VERIFY:  # seq_lens excludes the draft tokens
            offset = q_len = max_q_len = self._draft_token_num(getattr(forward_batch, "spec_info", None))
        elif extend_q is not None:
            offset, q_len = 0, 0
            cu_q_lens, max_q_len = extend_q
        elif kind in (_DRAFT_EXTEND, _EXTEND):
            offset, q_len = 0, 0
            cu_q_lens = _cu_lens(_extend_lens(forward_batch, bs))
            lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
            q_lens_host = _host_lengths("extend_seq_lens_cpu", lens_cpu, bs, allow_short=True)
            if lens_cpu is not None:
                max_q_len = max(q_lens_host, default=0)
            elif kind == _DRAFT_EXTEND and self.num_draft_tokens:
                max_q_len = self.num_draft_tokens
            else:
                raise ValueError("MlaBackend: extend batches need extend_seq_lens_cpu")
        else:  # decode, idle
            offset = self.step_offset if step_offset is None else step_offset
        _check_host_lengths("seq_lens", seq_lens, bs, offset)
        seq_lens_host = (_host_lengths("seq_lens_cpu", seq_lens_cpu, bs, offset, allow_short=True)
                         if bs > 0 else None)
        host_max = max(seq_lens_host, default=1) if seq_lens_host is not None else None
        kv_lens = (seq_lens + offset).to(torch.int32) if offset else seq_lens.to(torch.int32)
        max_kv = host_max + offset if host_max is not None else self.max_context_len
        if block_table is None:
            # build_block_table writes every entry: page ids, then -1; on the GPU also -1 over a
            # row whose device length is past this width (stale *_cpu lengths).
            block_table = torch.empty((bs, self._max_blocks(max_kv)), dtype=torch.int32,
                                      device=self.device)
            if bs > 0:
                ops.build_block_table(self.req_to_token, forward_batch.req_pool_indices[:bs],
                                      kv_lens, self.page_size, block_table,
                                      check_metadata=self.check_metadata)
        return DecodeMetadata(bs, block_table, kv_lens, cu_q_lens, q_len, max_q_len,
                              min(max_kv, self.max_context_len))

    def _plan_extend(self, forward_batch: Any) -> PrefillMetadata:
        bs = int(forward_batch.batch_size)
        lens_cpu = getattr(forward_batch, "extend_seq_lens_cpu", None)
        if lens_cpu is None:
            raise ValueError("MlaBackend: EXTEND is planned from host lengths: "
                             "extend_seq_lens_cpu is required")
        # Host lengths come as lists or CPU tensors (e.g. extend_prefix_lens.cpu()).
        extend_cpu = _host_lengths("extend_seq_lens_cpu", lens_cpu, bs)
        prefix_cpu = self._host_prefix_lens(forward_batch, bs, extend_cpu)
        has_prefix = any(p > 0 for p in prefix_cpu)
        use_chunked = has_prefix and not self.disable_chunked_prefix_cache
        md = PrefillMetadata(bs, _cu_lens(_extend_lens(forward_batch, bs)),
                             max(extend_cpu, default=0), has_prefix, use_chunked)
        # The absorbed path serves prefixes when chunking is off, and any engine that calls
        # forward_extend with the absorbed (576-wide) layer.
        md.absorbed = self._plan_absorbed(forward_batch, _EXTEND,
                                          extend_q=(md.cu_q_lens, md.max_q_len))
        if use_chunked and getattr(forward_batch, "prefix_chunk_cu_seq_lens", None) is None:
            self._plan_prefix_chunks(forward_batch, prefix_cpu)
        return md

    @staticmethod
    def _host_prefix_lens(forward_batch: Any, bs: int, extend_cpu: List[int]) -> List[int]:
        """The cached prefix of each request of an EXTEND batch, from extend_prefix_lens_cpu or
        else seq_lens_cpu - extend_seq_lens_cpu, checked against both where both are given: a
        prefix taken as 0 by mistake would attend the new tokens alone without an error."""
        prefix_given = getattr(forward_batch, "extend_prefix_lens_cpu", None)
        prefix_host = _host_lengths("extend_prefix_lens_cpu", prefix_given, bs)
        seq_cpu = _host_lengths("seq_lens_cpu", getattr(forward_batch, "seq_lens_cpu", None), bs)
        if prefix_given is not None:
            prefix_cpu = prefix_host
        elif seq_cpu is not None:
            prefix_cpu = [n - e for n, e in zip(seq_cpu, extend_cpu)]
        else:
            raise ValueError("MlaBackend: EXTEND needs each request's cached prefix on the host: "
                             "extend_prefix_lens_cpu, or seq_lens_cpu (prefix = seq_lens - "
                             "extend_seq_lens)")
        if prefix_given is None:  # derived: only an extend longer than the sequence can be wrong
            for b, (p, e) in enumerate(zip(prefix_cpu, extend_cpu)):
                if p < 0:
                    raise ValueError(f"MlaBackend: request {b} of the EXTEND batch has "
                                     f"extend_seq_lens_cpu {e} > seq_lens_cpu {p + e}")
        elif seq_cpu is not None:  # both given: they must agree
            for b, (p, e, n) in enumerate(zip(prefix_cpu, extend_cpu, seq_cpu)):
                if p + e != n:
                    raise ValueError(
                        f"MlaBackend: request {b} of the EXTEND batch has extend_prefix_lens "
                        f"{p} + extend_seq_lens {e} != seq_lens {n} (host lengths)")
        return prefix_cpu

    def _chunk_ranges(self, prefix_cpu: List[int]) -> List[Tuple[List[int], List[int]]]:
        """(starts, lens) per request of each prefix chunk. Default: each request gets
        capacity // B tokens a chunk. Deterministic: each request's prefix is cut at multiples of
        the capacity of its own positions, and the pieces are packed whole, in request order,
        into chunks of at most the capacity (every piece but a request's last fills a chunk, so a
        chunk holds at most one piece of a request)."""
        bs = len(prefix_cpu)
        capacity = self.chunked_prefix_capacity
        if not self.deterministic:
            chunk_len = max(1, capacity // max(bs, 1))
            ranges = []
            for c in range(_cdiv(max(prefix_cpu), chunk_len)):
                starts = [min(c * chunk_len, p) for p in prefix_cpu]
                ranges.append((starts, [min(p - s, chunk_len) for p, s in zip(prefix_cpu, starts)]))
            return ranges
        ranges, used = [], capacity + 1  # no open chunk yet
        for b, p in enumerate(prefix_cpu):
            for start in range(0, p, capacity):
                n = min(capacity, p - start)
                if used + n > capacity:
                    ranges.append(([0] * bs, [0] * bs))
                    used = 0
                ranges[-1][0][b], ranges[-1][1][b] = start, n
                used += n
        return ranges

    def _plan_prefix_chunks(self, forward_batch: Any, prefix_cpu: List[int]) -> None:
        """Splits the cached prefixes into chunks of at most chunked_prefix_capacity tokens over
        the batch (_chunk_ranges) and stores, per chunk, the cumulative lengths, the bound on one
        request's chunk and the token slots, on the batch."""
        bs = len(prefix_cpu)
        ranges = self._chunk_ranges(prefix_cpu)
        num_chunks = len(ranges)
        device = self.device
        cu_list, max_list, idx_list, num_list = [], [], [], []
        req_pool_indices = forward_batch.req_pool_indices[:bs].long()
        for starts, lens in ranges:
            rows = torch.repeat_interleave(torch.arange(bs), torch.tensor(lens, dtype=torch.long))
            cols = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lens)]) \
                if sum(lens) else torch.zeros(0, dtype=torch.long)
            rows, cols = rows.to(device), cols.to(device)
            idx_list.append(self.req_to_token[req_pool_indices[rows], cols])
            cu_list.append(torch.tensor([0] + list(_accumulate(lens)), dtype=torch.int32).to(device))
            max_list.append(max(lens))
            num_list.append(sum(lens))
        forward_batch.num_prefix_chunks = num_chunks
        forward_batch.prefix_chunk_cu_seq_lens = cu_list
        forward_batch.prefix_chunk_max_seq_lens = max_list
        forward_batch.prefix_chunk_kv_indices = idx_list
        forward_batch.prefix_chunk_num_tokens = num_list

    def init_forward_metadata(self, forward_batch: Any) -> None:
        """Plans the batch for its forward mode (eager, outside CUDA graphs)."""
        kind = mode_kind(forward_batch.forward_mode)
        # No plan until this one is made: a batch that fails to plan leaves none to run with.
        self.forward_prefill_metadata = None
        self.forward_decode_metadata = None
        if kind == _EXTEND:
            if self.skip_prefill:
                raise ValueError("MlaBackend: this backend was built with skip_prefill")
            self.forward_prefill_metadata = self._plan_extend(forward_batch)
            return
        self.forward_decode_metadata = self._plan_absorbed(forward_batch, kind)

    # ---- CUDA graphs ----------------------------------------------------------------------------

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int,
                              kv_indices_buf: Optional[Tensor] = None,
                              decode_only: bool = False) -> None:
        """Preallocates the decode-family buffers at their maximum: block tables at the full
        context width, kv lengths and cumulative query lengths for max_bs requests.
        decode_only: the graphs will be DECODE only (one query a request: a draft step's)."""
        max_blocks = self._max_blocks(self.max_context_len)
        if self.use_split_kv:  # big enough for every captured batch, so capture never allocates;
            # first, so that a workspace that cannot grow leaves the graph state as it was
            q_bound = 1 if decode_only else max(1, self.num_draft_tokens, max_num_tokens // max(max_bs, 1))
            if self.decode_workspace is None:
                self.decode_workspace = self.new_workspace(max_bs, q_bound)
            else:
                self.decode_workspace.grow(max_bs, q_bound)
        if kv_indices_buf is not None:
            if kv_indices_buf.shape[0] < max_bs or kv_indices_buf.shape[1] < max_blocks \
                    or kv_indices_buf.dtype != torch.int32:
                raise ValueError(f"MlaBackend: kv_indices_buf must be int32 [>= {max_bs}, >= "
                                 f"{max_blocks}], got {kv_indices_buf.dtype} {list(kv_indices_buf.shape)}")
            self.cuda_graph_block_table = kv_indices_buf
        else:
            self.cuda_graph_block_table = torch.full((max_bs, max_blocks), -1, dtype=torch.int32,
                                                     device=self.device)
        self.cuda_graph_kv_lens = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self.cuda_graph_cu_q_lens = torch.zeros(max_bs + 1, dtype=torch.int32, device=self.device)
        self.cuda_graph_q_lens = torch.zeros(max_bs, dtype=torch.int32, device=self.device)
        self.cuda_graph_max_bs = max_bs
        self.cuda_graph_max_num_tokens = max_num_tokens
        self.decode_cuda_graph_metadata = {}

    def _graph_metadata(self, bs: int, kind: str, spec_info: Any) -> DecodeMetadata:
        if self.cuda_graph_block_table is None:
            raise RuntimeError("MlaBackend: call init_cuda_graph_state before capturing graphs")
        if bs > self.cuda_graph_max_bs:
            raise ValueError(f"MlaBackend: batch size {bs} exceeds the graph state's max_bs "
                             f"{self.cuda_graph_max_bs}")
        max_blocks = self._max_blocks(self.max_context_len)
        cu_q_lens = None
        q_len = max_q_len = 1
        if kind == _VERIFY:
            q_len = max_q_len = self._draft_token_num(spec_info)
        elif kind == _DRAFT_EXTEND:
            if not self.num_draft_tokens:
                raise ValueError("MlaBackend: DRAFT_EXTEND graphs need num_draft_tokens (the "
                                 "bound on accepted tokens per request)")
            cu_q_lens = self.cuda_graph_cu_q_lens[:bs + 1]
            q_len, max_q_len = 0, self.num_draft_tokens
        elif kind not in (_DECODE, _IDLE):
            raise ValueError(f"MlaBackend: CUDA graphs serve the decode family, not {kind}")
        return DecodeMetadata(bs, self.cuda_graph_block_table[:bs, :max_blocks],
                              self.cuda_graph_kv_lens[:bs], cu_q_lens, q_len, max_q_len,
                              self.max_context_len, graph=True)

    def _fill_graph_metadata(self, md: DecodeMetadata, kind: str, req_pool_indices: Tensor,
                             seq_lens: Tensor, extend_seq_lens: Optional[Tensor],
                             build_block_table: bool = True, spec_info: Any = None,
                             forward_mode: Any = None) -> None:
        """Updates the persistent buffers in place, on the device, allocating nothing."""
        bs = md.batch_size
        md.kv_lens.copy_(seq_lens[:bs])  # converts to int32 in the copy kernel
        if kind == _VERIFY:
            md.kv_lens.add_(md.q_len)
        elif kind == _DRAFT_EXTEND:
            # Queries per request: extend_seq_lens when given; else DRAFT_EXTEND packs each
            # request's accepted tokens (spec_info.accept_length), and DRAFT_EXTEND_V2 pads every
            # request to num_draft_tokens.
            lens = extend_seq_lens
            v2 = _mode_name(forward_mode) == "DRAFT_EXTEND_V2"
            if lens is None and not v2:
                lens = getattr(spec_info, "accept_length", None) if spec_info is not None else None
            if lens is not None:
                if lens.device != md.cu_q_lens.device:
                    raise ValueError(f"MlaBackend: DRAFT_EXTEND's query counts (extend_seq_lens or "
                                     f"spec_info.accept_length) must be on {md.cu_q_lens.device} "
                                     f"(the graph's buffers), got {lens.device}")
                if lens.dim() != 1 or lens.shape[0] < bs:
                    raise ValueError(f"MlaBackend: DRAFT_EXTEND needs the queries of all {bs} "
                                     f"requests of the graph (extend_seq_lens or "
                                     f"spec_info.accept_length), got shape {list(lens.shape)}")
                q_lens = lens[:bs]
            else:
                q_lens = self.cuda_graph_q_lens[:bs]
                q_lens.fill_(self.num_draft_tokens)
            ops.cumulative_lengths(q_lens, md.cu_q_lens)
        elif kind in (_DECODE, _IDLE) and self.step_offset:
            md.kv_lens.add_(self.step_offset)
        if build_block_table and bs > 0:
            ops.build_block_table(self.req_to_token, req_pool_indices[:bs], md.kv_lens,
                                  self.page_size, md.block_table, check_metadata=self.check_metadata)

    def init_forward_metadata_capture_cuda_graph(self, bs: int, num_tokens: int,
                                                 req_pool_indices: Tensor, seq_lens: Tensor,
                                                 encoder_lens: Optional[Tensor] = None,
                                                 forward_mode: Any = ForwardMode.DECODE,
                                                 spec_info: Any = None,
                                                 extend_seq_lens: Optional[Tensor] = None,
                                                 build_block_table: bool = True) -> None:
        kind = mode_kind(forward_mode)
        self.forward_decode_metadata = None  # none until this one is filled
        md = self._graph_metadata(bs, kind, spec_info)
        self._fill_graph_metadata(md, kind, req_pool_indices, seq_lens, extend_seq_lens,
                                  build_block_table, spec_info, forward_mode)
        self.decode_cuda_graph_metadata[(bs, kind)] = md
        self.forward_decode_metadata = md

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: Tensor,
                                                seq_lens: Tensor, seq_lens_sum: int = -1,
                                                encoder_lens: Optional[Tensor] = None,
                                                forward_mode: Any = ForwardMode.DECODE,
                                                spec_info: Any = None,
                                                seq_lens_cpu: Optional[Tensor] = None,
                                                extend_seq_lens: Optional[Tensor] = None,
                                                build_block_table: bool = True) -> None:
        kind = mode_kind(forward_mode)
        # A replay that fails half way (a bad index) leaves no plan: the buffers may hold part of
        # the new batch and part of the old one.
        self.forward_decode_metadata = None
        md = self.decode_cuda_graph_metadata.get((bs, kind))
        if md is None:
            raise RuntimeError(f"MlaBackend: no graph was captured for batch size {bs} in {kind}")
        self._fill_graph_metadata(md, kind, req_pool_indices, seq_lens, extend_seq_lens,
                                  build_block_table, spec_info, forward_mode)
        self.forward_decode_metadata = md

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """One entry for both: capture (in_capture) or replay of the decode family from a batch
        object; other modes plan eagerly."""
        kind = mode_kind(forward_batch.forward_mode)
        if kind == _EXTEND:
            return self.init_forward_metadata(forward_batch)
        args = (forward_batch.batch_size, forward_batch.req_pool_indices, forward_batch.seq_lens)
        extra = dict(forward_mode=forward_batch.forward_mode,
                     spec_info=getattr(forward_batch, "spec_info", None),
                     extend_seq_lens=getattr(forward_batch, "extend_seq_lens", None))
        if in_capture:
            n = forward_batch.positions.numel() if forward_batch.positions is not None else 0
            self.init_forward_metadata_capture_cuda_graph(args[0], n, args[1], args[2], **extra)
        else:
            self.init_forward_metadata_replay_cuda_graph(*args, **extra)

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Inside a captured region nothing is left to plan: capture and replay fill the graph's
        buffers (init_forward_metadata_out_graph)."""

    # ---- forward --------------------------------------------------------------------------------

    def _decode_metadata(self, forward_batch: Any, kind: str) -> DecodeMetadata:
        if kind == _EXTEND:
            md = self.forward_prefill_metadata
            if md is None or md.absorbed is None:
                raise RuntimeError("MlaBackend: init_forward_metadata was not called for this batch")
            return md.absorbed
        md = self.forward_decode_metadata
        if md is None:
            raise RuntimeError("MlaBackend: init_forward_metadata was not called for this batch")
        if md.batch_size < int(forward_batch.batch_size):
            if md.graph:
                # A CUDA-graph plan: a new plan would live in fresh buffers that a graph being
                # captured would record and its replays never update.
                raise ValueError(
                    f"MlaBackend: batch_size {int(forward_batch.batch_size)} is larger than the "
                    f"CUDA-graph plan's {md.batch_size}; capture and replay with the padded "
                    f"batch size, or plan this batch with init_forward_metadata")
            # The batch grew after planning (data-parallel padding): plan again.
            self.init_forward_metadata(forward_batch)
            md = self.forward_decode_metadata
        return md

    def _absorbed(self, q: Tensor, k: Optional[Tensor], layer: Any, forward_batch: Any,
                  save_kv_cache: bool, q_rope: Optional[Tensor], k_rope: Optional[Tensor],
                  cos_sin_cache: Optional[Tensor], is_neox: bool, kind: str,
                  llama_4_scaling: Optional[Tensor] = None) -> Tensor:
        md = self._decode_metadata(forward_batch, kind)
        num_heads = layer.tp_q_head_num
        num_tokens = q.shape[0]
        if num_tokens == 0:  # IDLE (or an empty batch): nothing to save or attend
            return q.new_empty((0, num_heads * self.kv_lora_rank), dtype=self.q_data_type)
        kv_cache = self._kv_cache(layer)
        k_scale = self._k_scale(layer)
        fp8 = self.data_type == torch.float8_e4m3fn
        query = q_nope = q_pe = None
        lora, rope, latent = self.kv_lora_rank, self.qk_rope_head_dim, self.kv_cache_dim
        _check_numel("q", q, num_tokens, num_heads, latent if q_rope is None else lora)
        if q_rope is not None:
            _check_numel("q_rope", q_rope, num_tokens, num_heads, rope)
        k_nope = k_pe = None
        if k is not None:
            # c_kv [T, 512] with k_rope [T, 64], or the whole latent [T, 576] without k_rope.
            _check_numel("k", k, num_tokens, 1, lora if k_rope is not None else (lora, latent))
            if k_rope is None and k.numel() == num_tokens * latent:
                k_latent = k.reshape(num_tokens, latent)
                k_nope, k_pe = k_latent[:, :lora], k_latent[:, lora:]
            else:
                k_nope = k.reshape(num_tokens, lora)
        if k_rope is not None:
            _check_numel("k_rope", k_rope, num_tokens, 1, rope)
            k_pe = k_rope.reshape(num_tokens, rope)
        if q_rope is None and cos_sin_cache is None:
            # The query comes merged: [T, H * 576].
            query = q.view(num_tokens, num_heads, latent)
            if fp8 and query.dtype != torch.float8_e4m3fn:
                query = _saturate_fp8(query)
            elif not fp8 and query.dtype != self.data_type:
                query = query.to(self.data_type)
        else:
            if q_rope is None:  # merged, roped here: its last 64 dims are q_pe
                merged = q.view(num_tokens, num_heads, latent)
                q_nope, q_pe = merged[..., :lora], merged[..., lora:]
            else:
                q_nope = q.view(num_tokens, num_heads, lora)
                q_pe = q_rope.view(num_tokens, num_heads, rope)
            if cos_sin_cache is not None:
                # RoPE (and for an fp8 cache the query quantisation) in one pass.
                q_dtype = torch.float8_e4m3fn if fp8 else self.data_type
                query, k_rot_nope, k_rot_pe = ops.rope_quantize(
                    q_nope, q_pe, cos_sin_cache, forward_batch.positions,
                    k_nope=k_nope if k_pe is not None else None,
                    k_pe=k_pe if k_nope is not None else None,
                    is_neox=bool(is_neox), q_out_dtype=q_dtype, check_metadata=self.check_metadata)
                if k_rot_nope is not None:
                    k_nope, k_pe = k_rot_nope, k_rot_pe
                q_nope = q_pe = None
            elif fp8:
                query = _saturate_fp8(torch.cat([q_nope, q_pe], dim=-1))
                q_nope = q_pe = None
            elif q_nope.dtype != self.data_type:
                q_nope, q_pe = q_nope.to(self.data_type), q_pe.to(self.data_type)
        if llama_4_scaling is not None:  # Llama-4-style attention scaling of the query
            if query is not None:
                query = _scale_query(query, llama_4_scaling, self.q_data_type, fp8)
            else:
                q_nope = _scale_query(q_nope, llama_4_scaling, self.q_data_type)
                q_pe = _scale_query(q_pe, llama_4_scaling, self.q_data_type)
        if save_kv_cache:
            if k_nope is None or k_pe is None:
                raise ValueError("MlaBackend: save_kv_cache needs k (c_kv [T, 512] with k_rope "
                                 "[T, 64], or the whole latent [T, 576])")
            ops.append_latent_kv(k_nope, k_pe, forward_batch.out_cache_loc, kv_cache, k_scale,
                                 check_metadata=self.check_metadata)
        # DRAFT_EXTEND's graphs run num_draft_tokens query rows a request while the kernel
        # attends the accepted ones (cu_q_lens from accept_length): the rows past them come out
        # 0 (zero_padding_rows), not the graph pool's leftovers.
        out = torch.empty((num_tokens, num_heads, self.kv_lora_rank), dtype=self.q_data_type,
                          device=q.device)
        ws = self._workspace(md, kind) if self.use_split_kv else {}
        ops.mla_decode(kv_cache, md.block_table, md.kv_lens, layer.scaling, q=query, q_nope=q_nope,
                       q_pe=q_pe, cu_q_lens=md.cu_q_lens, q_len=md.q_len or 1,
                       max_q_len=md.max_q_len, k_scale=k_scale, out=out,
                       deterministic=self.deterministic,
                       zero_padding_rows=kind == _DRAFT_EXTEND and md.graph,
                       check_metadata=self.check_metadata, **ws)
        return out.view(num_tokens, num_heads * self.kv_lora_rank)

    def forward_decode(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True,
                       q_rope: Optional[Tensor] = None, k_rope: Optional[Tensor] = None,
                       cos_sin_cache: Optional[Tensor] = None, is_neox: bool = False,
                       llama_4_scaling: Optional[Tensor] = None) -> Tensor:
        """Absorbed attention for DECODE (and IDLE). q: [T, H * 512] absorbed q_nope with q_rope
        [T, H * 64], or [T, H * 576] merged; k: [T, 512] c_kv and k_rope [T, 64] of the new
        tokens (saved at out_cache_loc when save_kv_cache). With cos_sin_cache, RoPE is applied
        to q_rope and k_rope here. llama_4_scaling, when given, multiplies the query (after RoPE)
        per token. Returns [T, H * 512] in the model dtype."""
        kind = mode_kind(forward_batch.forward_mode)
        return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                              cos_sin_cache, is_neox, kind, llama_4_scaling)

    def forward_extend(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer: Any,
                       forward_batch: Any, save_kv_cache: bool = True,
                       q_rope: Optional[Tensor] = None, k_rope: Optional[Tensor] = None,
                       cos_sin_cache: Optional[Tensor] = None, is_neox: bool = False,
                       llama_4_scaling: Optional[Tensor] = None):
        """TARGET_VERIFY, DRAFT_EXTEND and EXTEND with the absorbed layer (head_dim 576): as
        forward_decode. EXTEND with the MHA layer (head_dim 192): q, k [T, H * 192] and v
        [T, H * 128] of the new tokens (the engine saves the latent kv itself; pass
        save_kv_cache=False); returns [T, H, 128], or (out, lse) with mha_return_lse. With
        attn_attend_prefix_cache, q attends (non-causally) to prefix chunk prefix_chunk_idx,
        whose k and v the engine up-projected from gather_prefix_chunk; returns (out, lse)."""
        kind = mode_kind(forward_batch.forward_mode)
        if kind in (_VERIFY, _DRAFT_EXTEND, _DECODE, _IDLE) or layer.head_dim == self.kv_cache_dim:
            return self._absorbed(q, k, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                                  cos_sin_cache, is_neox, kind, llama_4_scaling)
        if save_kv_cache:
            raise ValueError("MlaBackend: the MHA prefill path gets per-head k and v, not the "
                             "latent kv; save the latent kv (save_latent_kv) and pass "
                             "save_kv_cache=False")
        md = self.forward_prefill_metadata
        if md is None:
            raise RuntimeError("MlaBackend: init_forward_metadata was not called for this batch")
        num_heads = layer.tp_q_head_num
        if k_rope is not None:
            k = torch.cat([k.view(-1, num_heads, ops.QK_NOPE_HEAD_DIM),
                           k_rope.view(-1, num_heads, ops.ROPE_DIM)], dim=-1)
        q = q.view(-1, num_heads, ops.QK_HEAD_DIM)
        if llama_4_scaling is not None:
            q = _scale_query(q, llama_4_scaling, self.q_data_type)
        k = k.view(-1, num_heads, ops.QK_HEAD_DIM)
        v = v.view(-1, num_heads, ops.V_HEAD_DIM)
        scales = dict(q_scale=1.0, k_scale=1.0, v_scale=1.0)
        if self.prefill_fp8:
            k_scale = getattr(layer, "k_scale_float", None) or 1.0
            v_scale = getattr(layer, "v_scale_float", None) or 1.0
            q, k, v = _saturate_fp8(q), _saturate_fp8(k, k_scale), _saturate_fp8(v, v_scale)
            scales = dict(q_scale=1.0, k_scale=k_scale, v_scale=v_scale)
        if getattr(forward_batch, "attn_attend_prefix_cache", False):
            c = forward_batch.prefix_chunk_idx
            if c is None:
                raise ValueError("MlaBackend: attn_attend_prefix_cache needs prefix_chunk_idx")
            return ops.mha_prefill(
                q, k, v, md.cu_q_lens, forward_batch.prefix_chunk_cu_seq_lens[c], layer.scaling,
                max_q_len=md.max_q_len, max_kv_len=forward_batch.prefix_chunk_max_seq_lens[c],
                causal=False, out_dtype=self.q_data_type, return_lse=True,
                check_metadata=self.check_metadata, **scales)
        return ops.mha_prefill(
            q, k, v, md.cu_q_lens, md.cu_q_lens, layer.scaling, max_q_len=md.max_q_len,
            max_kv_len=md.max_q_len, causal=True, out_dtype=self.q_data_type,
            return_lse=bool(getattr(forward_batch, "mha_return_lse", False)),
            check_metadata=self.check_metadata, **scales)

    def forward(self, q: Tensor, k: Optional[Tensor], v: Optional[Tensor], layer: Any,
                forward_batch: Any, save_kv_cache: bool = True, **kwargs):
        """The engine's single entry (what an attention layer calls): IDLE gives an empty
        output, DECODE goes to forward_decode, every other mode to forward_extend."""
        kind = mode_kind(forward_batch.forward_mode)
        if kind == _IDLE:
            width = layer.tp_q_head_num * layer.v_head_dim
            return q.new_empty((q.shape[0], width), dtype=self.q_data_type)
        if kind == _DECODE:
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache, **kwargs)

    # ---- speculative decoding hooks -----------------------------------------------------------

    def get_verify_buffers_to_fill_after_draft(self) -> List[Optional[Tensor]]:
        """TARGET_VERIFY here is causal among each request's drafts (chain drafting, topk 1):
        there is no tree mask or other buffer for the engine to fill after drafting."""
        return [None, None]

    def update_verify_buffers_to_fill_after_draft(self, spec_info: Any, cuda_graph_bs: Any) -> None:
        """Nothing to update (see get_verify_buffers_to_fill_after_draft)."""

    # ---- helpers for the engine's model code ------------------------------------------------------

    def save_latent_kv(self, layer: Any, forward_batch: Any, k_nope: Tensor, k_pe: Tensor) -> None:
        """Writes the new tokens' latent kv ([T, 512] and [T, 64], RoPE applied) at
        out_cache_loc, quantising for an fp8 cache."""
        ops.append_latent_kv(k_nope.reshape(-1, self.kv_lora_rank),
                             k_pe.reshape(-1, self.qk_rope_head_dim),
                             forward_batch.out_cache_loc, self._kv_cache(layer), self._k_scale(layer),
                             check_metadata=self.check_metadata)

    def gather_prefix_chunk(self, layer: Any, forward_batch: Any, chunk_idx: int,
                            dtype: Optional[torch.dtype] = None):
        """The latent kv of prefix chunk chunk_idx: (c_kv [Tk, 512], k_pe [Tk, 64]) in dtype
        (default the model dtype), dequantised from an fp8 cache. The engine up-projects c_kv
        to per-head k_nope and v for forward_extend with attn_attend_prefix_cache."""
        slots = forward_batch.prefix_chunk_kv_indices[chunk_idx].long()
        flat = self._kv_cache(layer).view(-1, self.kv_cache_dim)
        if flat.dtype == torch.float8_e4m3fn:  # gather the bytes (index kernels may lack fp8)
            latent = flat.view(torch.uint8).index_select(0, slots).view(torch.float8_e4m3fn)
        else:
            latent = flat.index_select(0, slots)
        dtype = dtype or self.q_data_type
        if latent.dtype == torch.float8_e4m3fn:
            latent = (latent.float() * self._k_scale(layer)).to(dtype)
        else:
            latent = latent.to(dtype)
        return latent[:, :self.kv_lora_rank], latent[:, self.kv_lora_rank:]

    @staticmethod
    def merge_attn_states(out_a: Tensor, lse_a: Tensor, out_b: Tensor, lse_b: Tensor,
                          in_place: bool = True):
        """Merges two partial attentions (the new tokens' and a prefix chunk's) by their LSE;
        in place into out_a/lse_a by default. Returns (out, lse)."""
        if in_place:
            return ops.merge_states(out_a, lse_a, out_b, lse_b, out=out_a, lse_out=lse_a)
        return ops.merge_states(out_a, lse_a, out_b, lse_b)


def _accumulate(values):
    total = 0
    for v in values:
        total += v
        yield total


# ---- multi-step drafting ------------------------------------------------------------------------

class MlaMultiStepDraftBackend:
    """Per-step backends for EAGLE-style multi-step drafting (topk 1): speculative_num_steps - 1
    MlaBackend objects. Step i decodes one token per request and attends to
    seq_lens + step_base + i keys; all steps share one block table (built once, at the longest
    step's lengths), each has its own kv-length buffer.

    step_base: 0 when the batch's seq_lens already counts the first draft token (DESIGN's
    convention), 1 when it counts only the verified tokens (as SGLang's EAGLE worker passes it).
    """

    needs_cpu_seq_lens: bool = False  # as MlaBackend

    def __init__(self, speculative_num_steps: int, topk: int = 1, step_base: int = 0,
                 **backend_kwargs):
        if topk != 1:
            raise NotImplementedError("MlaMultiStepDraftBackend: only topk 1 (chain drafting)")
        if speculative_num_steps < 1:
            raise ValueError("MlaMultiStepDraftBackend: speculative_num_steps must be >= 1")
        self.topk = topk
        self.speculative_num_steps = speculative_num_steps
        self.step_base = step_base
        self.attn_backends: List[MlaBackend] = [
            MlaBackend(skip_prefill=True, step_offset=step_base + i, **backend_kwargs)
            for i in range(speculative_num_steps - 1)
        ]
        self._share_workspace()

    def _share_workspace(self) -> None:
        """The steps decode one after another on one stream: one split-KV workspace serves all
        (the one given as decode_workspace, else a new one)."""
        if self.attn_backends and self.attn_backends[0].use_split_kv:
            b0 = self.attn_backends[0]
            ws = b0.decode_workspace if b0.decode_workspace is not None else b0.new_workspace(1, 1)
            for backend in self.attn_backends:
                backend.decode_workspace = ws

    @classmethod
    def from_model_runner(cls, model_runner: Any, topk: int, speculative_num_steps: int,
                          step_base: int = 1, **overrides) -> "MlaMultiStepDraftBackend":
        self = cls.__new__(cls)
        if topk != 1:
            raise NotImplementedError("MlaMultiStepDraftBackend: only topk 1 (chain drafting)")
        self.topk, self.speculative_num_steps, self.step_base = topk, speculative_num_steps, step_base
        self.attn_backends = [
            MlaBackend.from_model_runner(model_runner, skip_prefill=True,
                                         step_offset=step_base + i, **overrides)
            for i in range(speculative_num_steps - 1)
        ]
        self._share_workspace()
        return self

    def init_forward_metadata(self, forward_batch: Any) -> None:
        if not self.attn_backends:
            return
        for backend in self.attn_backends:  # no step keeps a plan if this batch fails to plan
            backend.forward_prefill_metadata = backend.forward_decode_metadata = None
        last = self.attn_backends[-1]
        last.init_forward_metadata(forward_batch)
        shared = last.forward_decode_metadata.block_table
        kind = mode_kind(forward_batch.forward_mode)
        for backend in self.attn_backends[:-1]:
            backend.forward_prefill_metadata = None
            backend.forward_decode_metadata = backend._plan_absorbed(forward_batch, kind,
                                                                     block_table=shared)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        if not self.attn_backends:
            return
        max_blocks = self.attn_backends[0]._max_blocks(self.attn_backends[0].max_context_len)
        shared = torch.full((max_bs, max_blocks), -1, dtype=torch.int32,
                            device=self.attn_backends[0].device)
        for backend in self.attn_backends:  # (their graphs are DECODE steps: one query each)
            backend.init_cuda_graph_state(max_bs, max_num_tokens, kv_indices_buf=shared,
                                          decode_only=True)

    def _each(self, forward_batch: Any, capture: bool, bs: int) -> None:
        n = len(self.attn_backends)
        # Kv lengths first for every step, then one block table at the longest step's lengths.
        try:
            for i, backend in enumerate(self.attn_backends):
                args = (bs, forward_batch.req_pool_indices, forward_batch.seq_lens)
                kw = dict(forward_mode=ForwardMode.DECODE, build_block_table=(i == n - 1))
                if capture:
                    backend.init_forward_metadata_capture_cuda_graph(bs, bs, *args[1:], **kw)
                else:
                    backend.init_forward_metadata_replay_cuda_graph(*args, **kw)
        except Exception:
            # The steps share the block table the last one builds: none keeps a plan.
            for backend in self.attn_backends:
                backend.forward_decode_metadata = None
            raise

    def init_forward_metadata_capture_cuda_graph(self, forward_batch: Any) -> None:
        self._each(forward_batch, True, int(forward_batch.batch_size))

    def init_forward_metadata_replay_cuda_graph(self, forward_batch: Any, bs: int) -> None:
        self._each(forward_batch, False, bs)

    def init_forward_metadata_out_graph(self, forward_batch: Any, in_capture: bool = False) -> None:
        """Capture (in_capture) or replay of every step's decode plan from the batch object."""
        self._each(forward_batch, in_capture, int(forward_batch.batch_size))

    def init_forward_metadata_in_graph(self, forward_batch: Any) -> None:
        """Nothing to plan inside a captured region (see MlaBackend)."""
