"""The binding layer: argument checks with messages naming the op and the tensor (shape, dtype,
device, strides), mla::Error from the library surfacing as RuntimeError with its message, the
schemas (mutation annotations) and the Meta kernels that fake tensors and torch.compile use."""

import math
import re

import pytest
import torch

from mla_reference import LATENT, NOPE, ROPE, make_paged_cache
from mla_torch import ops

mla = torch.ops.mla


def decode_args(gen, heads=4, kv_lens=(5, 9), page_size=4, dtype=torch.bfloat16):
    paged = make_paged_cache(list(kv_lens), page_size, dtype, "cpu", gen)
    num_tokens = len(kv_lens)
    return dict(
        q=torch.randn(num_tokens, heads, LATENT, generator=gen).to(dtype), q_nope=None, q_pe=None,
        kv_cache=paged.cache, block_table=paged.block_table, kv_lens=paged.kv_lens,
        cu_q_lens=None, q_len=1, max_q_len=1, softmax_scale=0.1, q_scale=1.0, k_scale=1.0,
        out=torch.empty(num_tokens, heads, NOPE, dtype=torch.bfloat16),
        lse=torch.empty(num_tokens, heads))


def call_decode(**args):
    mla.mla_decode(args["q"], args["q_nope"], args["q_pe"], args["kv_cache"], args["block_table"],
                   args["kv_lens"], args["cu_q_lens"], args["q_len"], args["max_q_len"],
                   args["softmax_scale"], args["q_scale"], args["k_scale"], args["out"],
                   args["lse"])


def expect_error(fn, *patterns):
    with pytest.raises(RuntimeError) as info:
        fn()
    message = str(info.value)
    for pattern in patterns:
        assert re.search(pattern, message), f"{pattern!r} not in message: {message}"
    return message


def test_decode_arguments_valid(gen):
    call_decode(**decode_args(gen))


@pytest.mark.parametrize("change,patterns", [
    (dict(q=lambda a: a["q"].double()),
     [r"^mla\.mla_decode: q must be bfloat16, float16 or float8_e4m3fn, got shape \[2, 4, 576\], "
      r"strides \[2304, 576, 1\], float64 on cpu"]),
    (dict(q=lambda a: a["q"][:, :, :512]),
     [r"mla\.mla_decode: q\.shape\[2\] must be 576 \[T, H, 576\], got shape \[2, 4, 512\]"]),
    (dict(q=lambda a: a["q"][0]),
     [r"mla\.mla_decode: q must have 3 dims \[T, H, 576\], got shape \[4, 576\]"]),
    (dict(q=lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     [r"q must have a contiguous last dim \(stride 1\), got shape \[2, 4, 576\], strides \[2304, 1, 4\]"]),
    (dict(kv_cache=lambda a: a["kv_cache"].transpose(0, 1)),
     [r"kv_cache must be contiguous, got shape \[4, \d+, 576\], strides"]),
    (dict(block_table=lambda a: a["block_table"].long()),
     [r"block_table must be int32, got .* int64 on cpu"]),
    (dict(kv_lens=lambda a: a["kv_lens"].long()), [r"kv_lens must be int32"]),
    (dict(out=lambda a: torch.empty(1, 4, NOPE).expand(2, 4, NOPE)),
     [r"out is written by the op but overlaps itself \(stride 0 at dim 0\)"]),
    (dict(out=lambda a: a["out"].to(torch.float8_e4m3fn)),
     [r"out must be bfloat16, float16 or float32, got .*float8_e4m3fn"]),
    (dict(lse=lambda a: a["lse"].half()), [r"lse must be float32"]),
    (dict(q=lambda a: None), [r"give either q \[T, H, 576\] or both q_nope .* not neither"]),
    (dict(q_nope=lambda a: a["q"][..., :NOPE]), [r"not both forms"]),
    (dict(q_nope=lambda a: a["q"][..., :NOPE], q=lambda a: None),  # q last: the others read it
     [r"^mla\.mla_decode: q_nope \[T, H, 512\] and q_pe \[T, H, 64\] go together, but q_pe was "
      r"not given"]),
    (dict(q_pe=lambda a: a["q"][..., NOPE:], q=lambda a: None),
     [r"go together, but q_nope was not given"]),
    (dict(block_table=lambda a: a["block_table"].to("meta")),
     [r"block_table is on meta but q is on cpu; all tensors must be on one device"]),
])
def test_decode_argument_errors(gen, change, patterns):
    args = decode_args(gen)
    for key, fn in change.items():
        args[key] = fn(args)
    expect_error(lambda: call_decode(**args), *patterns)


def test_decode_workspace_checked_then_ignored_on_cpu(gen):
    """The split-KV workspace (a uint8 byte buffer) goes through the binding like on CUDA: it is
    checked, then the CPU ignores it (same result as without)."""
    args = decode_args(gen)
    call_decode(**args)
    expected = args["out"].clone(), args["lse"].clone()

    def call(workspace, max_batch=4, max_q_len=1):
        mla.mla_decode(args["q"], None, None, args["kv_cache"], args["block_table"],
                       args["kv_lens"], None, 1, 1, 0.1, 1.0, 1.0, args["out"], args["lse"],
                       workspace, max_batch, max_q_len)

    args["out"].fill_(float("nan"))
    args["lse"].fill_(float("nan"))
    call(torch.zeros(4096, dtype=torch.uint8))
    assert torch.equal(args["out"], expected[0]) and torch.equal(args["lse"], expected[1])
    ops.mla_decode(args["kv_cache"], args["block_table"], args["kv_lens"], 0.1, q=args["q"],
                   out=args["out"], workspace=torch.zeros(64, dtype=torch.uint8),
                   workspace_max_batch=2, workspace_max_q_len=1)
    expect_error(lambda: call(torch.zeros(4096, dtype=torch.int8)),
                 r"^mla\.mla_decode: workspace must be uint8, got shape \[4096\], strides \[1\], "
                 r"int8 on cpu")
    expect_error(lambda: call(torch.zeros(4096, dtype=torch.uint8)[::2]),
                 r"^mla\.mla_decode: workspace must be contiguous")
    expect_error(lambda: call(torch.zeros(64, 64, dtype=torch.uint8)),
                 r"^mla\.mla_decode: workspace must have 1 dims \[bytes\]")
    expect_error(lambda: call(torch.zeros(4096, dtype=torch.uint8, device="meta")),
                 r"workspace is on meta but q is on cpu")


def test_library_errors_surface_intact(gen):
    """Checks only the library can make (relations between tensors, values) come through with
    the library's message and its source location."""
    args = decode_args(gen)
    args["out"] = torch.empty(3, 4, NOPE, dtype=torch.bfloat16)
    expect_error(lambda: call_decode(**args), r"^mla_decode: out", r"\[.*src/.*\.cpp:\d+\]$")
    args = decode_args(gen)
    args["softmax_scale"] = 0.0
    expect_error(lambda: call_decode(**args), r"^mla_decode: softmax_scale")
    # A page id past the pool, found while reading the table on the CPU.
    args = decode_args(gen)
    args["block_table"] = args["block_table"].clone()
    args["block_table"][0, 0] = 10_000
    expect_error(lambda: call_decode(**args), r"^mla_decode: .*block_table", r"10000")


def test_other_ops_name_their_tensors():
    k = torch.randn(3, NOPE)
    cache = torch.zeros(2, 4, LATENT, dtype=torch.bfloat16)
    expect_error(lambda: mla.append_latent_kv(k, torch.randn(3, 32), torch.zeros(3, dtype=torch.long),
                                              cache, 1.0),
                 r"^mla\.append_latent_kv: k_pe\.shape\[1\] must be 64 \[T, 64\], got shape \[3, 32\]")
    expect_error(lambda: mla.append_latent_kv(k, torch.randn(3, ROPE), torch.zeros(3).float(),
                                              cache, 1.0),
                 r"loc must be int32 or int64, got shape \[3\], strides \[1\], float32 on cpu")
    expect_error(lambda: mla.append_latent_kv(k, torch.randn(3, ROPE), torch.zeros(3, dtype=torch.long),
                                              cache.float(), 1.0),
                 r"kv_cache must be bfloat16, float16 or float8_e4m3fn")
    expect_error(lambda: mla.build_block_table(torch.zeros(2, 8, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int32),
                                               torch.ones(1, dtype=torch.int32), 2**40,
                                               torch.zeros(1, 4, dtype=torch.int32)),
                 r"page_size = 1099511627776 does not fit in int32")
    expect_error(lambda: mla.build_block_table(torch.zeros(2, 8, dtype=torch.int32),
                                               torch.zeros(1, dtype=torch.int32),
                                               torch.ones(1, dtype=torch.int32), 3,
                                               torch.zeros(1, 4, dtype=torch.int32)),
                 r"^build_block_table: page_size must be a power of two")
    q = torch.randn(4, 2, 192, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    expect_error(lambda: mla.mha_prefill(q, q, torch.randn(4, 2, 128), cu, cu, 0, 0, True, 0.1,
                                         1.0, 1.0, 1.0, torch.empty(4, 2, 128), None),
                 r"^mla\.mha_prefill: v must be bfloat16, float16 or float8_e4m3fn, got shape "
                 r"\[4, 2, 128\], strides \[256, 128, 1\], float32 on cpu")
    # Mixed query/key/value dtypes: a relation between tensors, checked by the library.
    expect_error(lambda: mla.mha_prefill(q, q, q[..., :128].half(), cu, cu, 0, 0, True, 0.1, 1.0,
                                         1.0, 1.0, torch.empty(4, 2, 128), None),
                 r"^mha_prefill: v", r"\[.*src/.*\.cpp:\d+\]$")
    o = torch.randn(3, 2, 16)
    expect_error(lambda: mla.merge_states(o, torch.randn(3, 2), o, torch.randn(3, 2, dtype=torch.float64),
                                          o, None),
                 r"^mla\.merge_states: lse_b must be float32, got shape \[3, 2\]")
    expect_error(lambda: mla.rope_quantize(torch.randn(2, 1, NOPE), torch.randn(2, 1, ROPE), None,
                                           None, torch.randn(8, ROPE).double(),
                                           torch.zeros(2, dtype=torch.long), True,
                                           torch.empty(2, 1, LATENT), None, None, 1.0, 1.0),
                 r"^mla\.rope_quantize: cos_sin_cache must be float32")


# ---- schemas, Meta kernels, torch.compile --------------------------------------------------------

def _opcheck_cases(gen):
    paged = make_paged_cache([5, 9], 4, torch.bfloat16, "cpu", gen)
    q = torch.randn(2, 4, LATENT, generator=gen).to(torch.bfloat16)
    out = torch.empty(2, 4, NOPE, dtype=torch.bfloat16)
    lse = torch.empty(2, 4)
    qp = torch.randn(6, 2, 192, generator=gen).to(torch.bfloat16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    o = torch.randn(3, 2, 16)
    l = torch.randn(3, 2)
    req_to_token = torch.arange(64, dtype=torch.int32).reshape(2, 32)
    return {
        "mla_decode": (q, None, None, paged.cache, paged.block_table, paged.kv_lens, None, 1, 1,
                       0.1, 1.0, 1.0, out, lse),
        "mha_prefill": (qp, qp, qp[..., :128].contiguous(), cu, cu, 4, 4, True, 0.1, 1.0, 1.0, 1.0,
                        torch.empty(6, 2, 128, dtype=torch.bfloat16), torch.empty(6, 2)),
        "merge_states": (o, l, o.clone(), l.clone(), torch.empty_like(o), torch.empty_like(l)),
        "append_latent_kv": (torch.randn(3, NOPE), torch.randn(3, ROPE),
                             torch.tensor([0, 5, 7]), torch.zeros(2, 4, LATENT, dtype=torch.bfloat16),
                             1.0),
        "build_block_table": (req_to_token, torch.tensor([1, 0], dtype=torch.int32),
                              torch.tensor([9, 32], dtype=torch.int32), 4,
                              torch.empty(2, 8, dtype=torch.int32)),
        "rope_quantize": (torch.randn(2, 3, NOPE), torch.randn(2, 3, ROPE), torch.randn(2, NOPE),
                          torch.randn(2, ROPE), torch.randn(16, ROPE), torch.tensor([1, 7]), True,
                          torch.empty(2, 3, LATENT, dtype=torch.bfloat16),
                          torch.empty(2, NOPE, dtype=torch.bfloat16),
                          torch.empty(2, ROPE, dtype=torch.bfloat16), 1.0, 1.0),
    }


@pytest.mark.parametrize("name", ["mla_decode", "mha_prefill", "merge_states", "append_latent_kv",
                                  "build_block_table", "rope_quantize"])
def test_opcheck(gen, name):
    """Schema (mutations declared), fake-tensor (Meta) kernel and AOT dispatch agree."""
    args = _opcheck_cases(gen)[name]
    torch.library.opcheck(getattr(mla, name).default, args,
                          test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_meta_kernels_check_arguments():
    q = torch.empty(2, 4, 500, device="meta", dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match=r"q\.shape\[2\] must be 576"):
        mla.mla_decode(q, None, None, torch.empty(3, 4, LATENT, device="meta", dtype=torch.bfloat16),
                       torch.empty(2, 3, device="meta", dtype=torch.int32),
                       torch.empty(2, device="meta", dtype=torch.int32), None, 1, 1, 0.1, 1.0, 1.0,
                       torch.empty(2, 4, NOPE, device="meta", dtype=torch.bfloat16), None)


def test_torch_compile_fullgraph(gen):
    """The ops trace into one graph (no breaks) and give the eager results."""
    paged = make_paged_cache([5, 9, 1], 4, torch.bfloat16, "cpu", gen)
    q = torch.randn(3, 4, LATENT, generator=gen).to(torch.bfloat16)

    def attend_and_merge(q, cache, table, lens):
        out_a, lse_a = ops.mla_decode(cache, table, lens, 0.1, q=q, return_lse=True)
        out_b, lse_b = ops.mla_decode(cache, table, lens, 0.2, q=q, return_lse=True)
        out, lse = ops.merge_states(out_a, lse_a, out_b, lse_b)
        return out * 2, lse

    eager = attend_and_merge(q, paged.cache, paged.block_table, paged.kv_lens)
    compiled = torch.compile(attend_and_merge, backend="aot_eager", fullgraph=True)
    got = compiled(q, paged.cache, paged.block_table, paged.kv_lens)
    assert torch.equal(got[0], eager[0]) and torch.equal(got[1], eager[1])


def test_deterministic_workspace_arguments_checked_on_every_device(gen):
    """What a deterministic workspace must cover is checked on the CPU too (which ignores the
    workspace): a block table wider than workspace_max_kv_len, a split that is not a multiple of
    64, a negative split."""
    a = decode_args(gen, kv_lens=(5, 9), page_size=4)  # block table: 3 pages of 4 = 12 keys
    ws = torch.zeros(256, dtype=torch.uint8)

    def run(max_kv_len, split, deterministic=True):
        mla.mla_decode(a["q"], None, None, a["kv_cache"], a["block_table"], a["kv_lens"], None, 1, 1,
                       0.1, 1.0, 1.0, a["out"], a["lse"], ws, 2, 1, deterministic, max_kv_len, split)

    table_keys = a["block_table"].shape[1] * 4
    expect_error(lambda: run(table_keys - 1, 64), "block_table holds up to %d keys" % table_keys,
                 "workspace_max_kv_len = %d" % (table_keys - 1))
    expect_error(lambda: run(0, 64), "workspace_max_kv_len = 0")
    expect_error(lambda: run(1024, 100), "workspace_split_keys must be 0 .* multiple of 64, got 100")
    expect_error(lambda: run(1024, -64, False), "workspace_split_keys must be 0 .* got -64")
    run(table_keys, 64)  # fits: the CPU computes without the workspace
