"""MlaBackend's mode logic and planning (CPU tensors; the same code runs on CUDA): which path each
forward mode takes, the metadata it plans, CUDA-graph buffer updates in place, data-parallel
re-planning, the multi-step draft backend's shared buffers, and the errors for misuse."""

import contextlib
import enum
from types import SimpleNamespace

import pytest
import torch

from conftest import requires_cuda
from mla_reference import cdiv, make_cos_sin_cache
from mla_torch import (AttentionLayer, DecodeMetadata, ForwardBatch, ForwardMode, LatentKvPool,
                       MlaBackend, MlaMultiStepDraftBackend, SpecInfo, mode_kind, ops)

PAGE = 4


def make_backend(device="cpu", **kw):
    gen = torch.Generator().manual_seed(7)
    max_context = 64
    num_pages = 6 * max_context // PAGE
    perm = torch.randperm(num_pages, generator=gen)
    req_to_token = torch.empty(6, max_context, dtype=torch.int32)
    per = max_context // PAGE
    for r in range(6):
        pages = perm[r * per:(r + 1) * per]
        req_to_token[r] = (pages[:, None] * PAGE + torch.arange(PAGE)).reshape(-1).to(torch.int32)
    pool = LatentKvPool(1, num_pages, PAGE, torch.bfloat16, device)
    args = dict(num_q_heads=4, page_size=PAGE, req_to_token=req_to_token.to(device),
                token_to_kv_pool=pool, kv_cache_dtype=torch.bfloat16, num_draft_tokens=3)
    args.update(kw)
    return MlaBackend(**args), req_to_token


def expected_table(req_to_token, reqs, lens, width):
    table = torch.full((len(reqs), width), -1, dtype=torch.int32)
    for b, (r, n) in enumerate(zip(reqs, lens)):
        blocks = cdiv(n, PAGE)
        table[b, :blocks] = req_to_token[r, torch.arange(blocks) * PAGE] // PAGE
    return table


def batch(mode, reqs, seq_lens, extend=None, prefix=None, device="cpu", **kw):
    dev = device
    return ForwardBatch(
        forward_mode=mode, batch_size=len(reqs),
        req_pool_indices=torch.tensor(reqs, device=dev),
        seq_lens=torch.tensor(seq_lens, device=dev), seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens=None if extend is None else torch.tensor(extend, device=dev),
        extend_seq_lens_cpu=extend,
        extend_prefix_lens=None if prefix is None else torch.tensor(prefix, device=dev),
        extend_prefix_lens_cpu=prefix, **kw)


def test_mode_kinds_accept_engine_enums():
    class EngineMode(enum.IntEnum):  # an engine's own enum with more members
        EXTEND = 1
        DECODE = 2
        MIXED = 3
        IDLE = 4
        TARGET_VERIFY = 5
        DRAFT_EXTEND_V2 = 7
        PREBUILT = 9

    assert [mode_kind(m) for m in list(EngineMode)[:6]] == [
        "extend", "decode", "extend", "idle", "verify", "draft_extend"]
    with pytest.raises(ValueError, match="unsupported forward mode .*PREBUILT"):
        mode_kind(EngineMode.PREBUILT)
    assert mode_kind(ForwardMode.DRAFT_EXTEND) == "draft_extend"


def test_decode_plan():
    backend, r2t = make_backend()
    fb = batch(ForwardMode.DECODE, [3, 0, 5], [9, 1, 40])
    backend.init_forward_metadata(fb)
    md = backend.forward_decode_metadata
    assert backend.forward_prefill_metadata is None
    assert md.batch_size == 3 and md.q_len == 1 and md.max_q_len == 1 and md.cu_q_lens is None
    assert md.kv_lens.tolist() == [9, 1, 40] and md.kv_lens.dtype == torch.int32
    assert md.block_table.shape == (3, 10)  # ceil(40 / 4): width from seq_lens_cpu
    assert torch.equal(md.block_table, expected_table(r2t, [3, 0, 5], [9, 1, 40], 10))
    # Without host lengths: full context width, no device read.
    fb.seq_lens_cpu = None
    backend.init_forward_metadata(fb)
    assert backend.forward_decode_metadata.block_table.shape == (3, 16)


def test_target_verify_and_draft_extend_plans():
    backend, r2t = make_backend()
    fb = batch(ForwardMode.TARGET_VERIFY, [1, 2], [10, 5], spec_info=SpecInfo(draft_token_num=3))
    backend.init_forward_metadata(fb)
    md = backend.forward_decode_metadata
    assert md.kv_lens.tolist() == [13, 8] and md.q_len == 3 and md.max_q_len == 3
    assert torch.equal(md.block_table, expected_table(r2t, [1, 2], [13, 8], 4))

    fb = batch(ForwardMode.DRAFT_EXTEND, [1, 2, 4], [12, 7, 3], extend=[2, 0, 3])
    backend.init_forward_metadata(fb)
    md = backend.forward_decode_metadata
    assert md.cu_q_lens.tolist() == [0, 2, 2, 5] and md.cu_q_lens.dtype == torch.int32
    assert md.kv_lens.tolist() == [12, 7, 3] and md.max_q_len == 3


def test_extend_plan_and_prefix_chunks():
    backend, r2t = make_backend(chunked_prefix_capacity=6)
    fb = batch(ForwardMode.EXTEND, [0, 1, 2], [9, 3, 14], extend=[2, 3, 4], prefix=[7, 0, 10])
    backend.init_forward_metadata(fb)
    md = backend.forward_prefill_metadata
    assert md.has_prefix and md.use_chunked_prefix and md.max_q_len == 4
    assert md.cu_q_lens.tolist() == [0, 2, 5, 9]
    # capacity 6 over 3 requests: 2 prefix tokens per request per chunk
    assert fb.num_prefix_chunks == 5
    slots = [[] for _ in range(3)]
    for c in range(fb.num_prefix_chunks):
        cu = fb.prefix_chunk_cu_seq_lens[c].tolist()
        idx = fb.prefix_chunk_kv_indices[c].tolist()
        assert fb.prefix_chunk_max_seq_lens[c] == max(b - a for a, b in zip(cu, cu[1:]))
        for b in range(3):
            slots[b] += idx[cu[b]:cu[b + 1]]
    for b, (r, p) in enumerate(zip([0, 1, 2], [7, 0, 10])):
        assert slots[b] == r2t[r, :p].tolist()
    # Chunking off: the absorbed plan serves the prefix.
    backend2, _ = make_backend(disable_chunked_prefix_cache=True)
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 3], extend=[2, 3], prefix=[7, 0])
    backend2.init_forward_metadata(fb)
    md = backend2.forward_prefill_metadata
    assert md.has_prefix and not md.use_chunked_prefix
    assert md.absorbed.cu_q_lens.tolist() == [0, 2, 5] and md.absorbed.kv_lens.tolist() == [9, 3]
    assert fb.prefix_chunk_cu_seq_lens is None


def test_idle_batch():
    backend, _ = make_backend()
    fb = batch(ForwardMode.IDLE, [], [])
    backend.init_forward_metadata(fb)
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    out = backend.forward_decode(torch.zeros(0, 4 * 512, dtype=torch.bfloat16),
                                 torch.zeros(0, 512, dtype=torch.bfloat16), None, layer, fb,
                                 q_rope=torch.zeros(0, 4 * 64, dtype=torch.bfloat16),
                                 k_rope=torch.zeros(0, 64, dtype=torch.bfloat16))
    assert out.shape == (0, 4 * 512)


def test_replan_when_batch_grew():
    """Data-parallel padding can grow the batch after planning: forward re-plans."""
    backend, _ = make_backend()
    backend.init_forward_metadata(batch(ForwardMode.DECODE, [0, 1], [5, 6]))
    grown = batch(ForwardMode.DECODE, [0, 1, 2], [5, 6, 1])
    grown.out_cache_loc = torch.tensor([-1, -1, -1])
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    q = torch.randn(3, 4 * 576).to(torch.bfloat16)
    out = backend.forward_decode(q, None, None, layer, grown, save_kv_cache=False)
    assert out.shape == (3, 4 * 512) and backend.forward_decode_metadata.batch_size == 3


def test_misuse_errors():
    backend, _ = make_backend(skip_prefill=True)
    with pytest.raises(ValueError, match="skip_prefill"):
        backend.init_forward_metadata(batch(ForwardMode.EXTEND, [0], [3], extend=[3], prefix=[0]))
    backend, _ = make_backend(num_draft_tokens=0)
    with pytest.raises(ValueError, match="draft_token_num"):
        backend.init_forward_metadata(batch(ForwardMode.TARGET_VERIFY, [0], [3]))
    with pytest.raises(ValueError, match="page_size must be a power of two"):
        make_backend(page_size=3)
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        make_backend(kv_cache_dtype=torch.float32)
    backend, _ = make_backend()
    fb = batch(ForwardMode.EXTEND, [0], [3], extend=[3], prefix=[0])
    backend.init_forward_metadata(fb)
    mha = AttentionLayer(0, 4, 192, 128, 0.1)
    x = torch.zeros(3, 4 * 192, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="save_kv_cache=False"):
        backend.forward_extend(x, x, x, mha, fb, save_kv_cache=True)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_capture_cuda_graph(1, 1, torch.zeros(1), torch.ones(1))
    with pytest.raises(NotImplementedError, match="topk 1"):
        MlaMultiStepDraftBackend(3, topk=2)


@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY,
                                  ForwardMode.DRAFT_EXTEND])
def test_graph_buffers_update_in_place(mode):
    """Capture plans over persistent buffers at full width; replay rewrites them in place and
    agrees with an eager plan of the same batch."""
    backend, r2t = make_backend()
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    spec = SpecInfo(draft_token_num=3)
    req_buf = torch.zeros(4, dtype=torch.int64)
    len_buf = torch.ones(4, dtype=torch.int64)
    ext_buf = torch.full((4,), 3, dtype=torch.int64)
    backend.init_forward_metadata_capture_cuda_graph(3, 9, req_buf, len_buf, None, mode, spec,
                                                     extend_seq_lens=ext_buf)
    md = backend.forward_decode_metadata
    ptrs = (md.block_table.data_ptr(), md.kv_lens.data_ptr())
    assert md.block_table.shape == (3, 16)
    for reqs, lens, ext in [([2, 0, 5], [7, 30, 2], [1, 3, 2]), ([1, 4, 3], [64 - 3, 1, 17], [3, 1, 1])]:
        req_buf[:3] = torch.tensor(reqs)
        len_buf[:3] = torch.tensor(lens)
        ext_buf[:3] = torch.tensor(ext)
        backend.init_forward_metadata_replay_cuda_graph(3, req_buf, len_buf, -1, None, mode, spec,
                                                        extend_seq_lens=ext_buf)
        md = backend.forward_decode_metadata
        assert (md.block_table.data_ptr(), md.kv_lens.data_ptr()) == ptrs
        eager = make_backend()[0]
        eager.init_forward_metadata(batch(mode, reqs, lens, extend=ext, spec_info=spec))
        ref = eager.forward_decode_metadata
        assert torch.equal(md.kv_lens, ref.kv_lens)
        width = ref.block_table.shape[1]
        assert torch.equal(md.block_table[:, :width], ref.block_table)
        assert (md.block_table[:, width:] == -1).all()
        if mode == ForwardMode.DRAFT_EXTEND:
            assert torch.equal(md.cu_q_lens, ref.cu_q_lens)
            assert md.max_q_len == 3  # the graph's bound
    # The out-graph entry does the same from a batch object.
    fb = batch(mode, [2, 0, 5], [7, 30, 2], extend=[1, 3, 2], spec_info=spec)
    backend.init_forward_metadata_out_graph(fb, in_capture=False)
    assert backend.forward_decode_metadata.block_table.data_ptr() == ptrs[0]


def test_draft_extend_graph_queries_from_accept_length_or_padded():
    """DRAFT_EXTEND replays without extend_seq_lens: the accepted tokens per request
    (spec_info.accept_length) when the mode is DRAFT_EXTEND, num_draft_tokens each under
    DRAFT_EXTEND_V2 (whose queries are padded); too short a length tensor is an error."""
    class EngineMode(enum.IntEnum):
        DRAFT_EXTEND = 5
        DRAFT_EXTEND_V2 = 7

    backend, _ = make_backend()
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    req_buf = torch.zeros(4, dtype=torch.int64)
    len_buf = torch.ones(4, dtype=torch.int64)
    spec = SimpleNamespace(draft_token_num=3, accept_length=torch.tensor([1, 3, 2, 1], dtype=torch.int32))
    for mode, cu in [(EngineMode.DRAFT_EXTEND, [0, 1, 4, 6]), (EngineMode.DRAFT_EXTEND_V2, [0, 3, 6, 9])]:
        backend.init_forward_metadata_capture_cuda_graph(3, 9, req_buf, len_buf, None, mode, spec)
        assert backend.forward_decode_metadata.cu_q_lens.tolist() == cu
        spec.accept_length[:3] = torch.tensor([2, 2, 3])
        backend.init_forward_metadata_replay_cuda_graph(3, req_buf, len_buf, -1, None, mode, spec)
        expected = [0, 2, 4, 7] if mode == EngineMode.DRAFT_EXTEND else [0, 3, 6, 9]
        assert backend.forward_decode_metadata.cu_q_lens.tolist() == expected
        spec.accept_length[:3] = torch.tensor([1, 3, 2])
    with pytest.raises(ValueError, match="queries of all 3 requests"):
        backend.init_forward_metadata_replay_cuda_graph(
            3, req_buf, len_buf, -1, None, EngineMode.DRAFT_EXTEND, spec,
            extend_seq_lens=torch.tensor([1, 1]))
    assert backend.forward_decode_metadata is None  # a failed replay leaves no plan


def test_a_failed_replay_leaves_no_plan():
    """A replay that fails half way (a request slot out of range) leaves no plan to run with,
    for a single backend and for every step of a multi-step draft backend."""
    backend, _ = make_backend()
    backend.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    req_buf = torch.tensor([0, 1])
    len_buf = torch.tensor([9, 3])
    backend.init_forward_metadata_capture_cuda_graph(2, 2, req_buf, len_buf)
    assert backend.forward_decode_metadata is not None
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        backend.init_forward_metadata_replay_cuda_graph(2, torch.tensor([0, 99]), len_buf)
    assert backend.forward_decode_metadata is None
    base, _ = make_backend()
    kw = dict(num_q_heads=4, page_size=PAGE, req_to_token=base.req_to_token,
              token_to_kv_pool=base.token_to_kv_pool, kv_cache_dtype=torch.bfloat16)
    draft = MlaMultiStepDraftBackend(3, **kw)
    draft.init_cuda_graph_state(2, 2)
    fb = batch(ForwardMode.DECODE, [0, 1], [9, 3])
    draft.init_forward_metadata_capture_cuda_graph(fb)
    fb.req_pool_indices = torch.tensor([0, 99])
    with pytest.raises(RuntimeError, match="req_pool_indices"):
        draft.init_forward_metadata_replay_cuda_graph(fb, 2)
    assert all(b.forward_decode_metadata is None for b in draft.attn_backends)


def test_extend_host_lengths_as_tensors():
    """EXTEND host lengths may come as CPU tensors (e.g. extend_prefix_lens.cpu())."""
    backend, r2t = make_backend(chunked_prefix_capacity=6)
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 5], extend=[1, 1], prefix=[8, 4])
    fb.extend_prefix_lens_cpu = torch.tensor([8, 4])
    fb.extend_seq_lens_cpu = torch.tensor([1, 1])
    backend.init_forward_metadata(fb)
    md = backend.forward_prefill_metadata
    assert md.has_prefix and md.max_q_len == 1 and fb.num_prefix_chunks >= 1


def test_multi_step_draft_backend():
    base, r2t = make_backend()
    kw = dict(num_q_heads=4, page_size=PAGE, req_to_token=base.req_to_token,
              token_to_kv_pool=base.token_to_kv_pool, kv_cache_dtype=torch.bfloat16)
    drafter = MlaMultiStepDraftBackend(speculative_num_steps=4, **kw)
    assert len(drafter.attn_backends) == 3
    fb = batch(ForwardMode.DECODE, [0, 3], [5, 12])
    drafter.init_forward_metadata(fb)
    mds = [b.forward_decode_metadata for b in drafter.attn_backends]
    assert [m.kv_lens.tolist() for m in mds] == [[5, 12], [6, 13], [7, 14]]
    assert len({m.block_table.data_ptr() for m in mds}) == 1
    assert torch.equal(mds[0].block_table, expected_table(r2t, [0, 3], [7, 14], 4))
    # CUDA-graph buffers: one shared block table, separate kv lengths.
    drafter.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    drafter.init_forward_metadata_capture_cuda_graph(fb)
    drafter.init_forward_metadata_replay_cuda_graph(fb, 2)
    mds = [b.forward_decode_metadata for b in drafter.attn_backends]
    assert len({m.block_table.data_ptr() for m in mds}) == 1
    assert len({m.kv_lens.data_ptr() for m in mds}) == 3
    assert [m.kv_lens.tolist() for m in mds] == [[5, 12], [6, 13], [7, 14]]
    assert torch.equal(mds[0].block_table[:, :4], expected_table(r2t, [0, 3], [7, 14], 4))
    # SGLang's convention: seq_lens without the first draft token.
    sg = MlaMultiStepDraftBackend(speculative_num_steps=2, step_base=1, **kw)
    sg.init_forward_metadata(fb)
    assert sg.attn_backends[0].forward_decode_metadata.kv_lens.tolist() == [6, 13]


def test_deterministic_prefix_chunks_depend_only_on_each_request():
    """deterministic=True: a request's prefix is cut at multiples of the capacity of its own
    positions, whatever the other requests (by default the cuts follow capacity // B)."""
    def pieces(backend, reqs, prefix, extend, of):
        seq = [p + e for p, e in zip(prefix, extend)]
        fb = batch(ForwardMode.EXTEND, reqs, seq, extend=extend, prefix=prefix)
        backend.init_forward_metadata(fb)
        b = reqs.index(of)
        out = []
        for c in range(fb.num_prefix_chunks):
            cu = fb.prefix_chunk_cu_seq_lens[c].tolist()
            assert fb.prefix_chunk_num_tokens[c] == cu[-1] <= 6
            if cu[b + 1] > cu[b]:
                out.append(fb.prefix_chunk_kv_indices[c].tolist()[cu[b]:cu[b + 1]])
        return out

    det, r2t = make_backend(chunked_prefix_capacity=6, deterministic=True)
    alone = pieces(det, [2], [14], [2], of=2)
    assert alone == [r2t[2, 0:6].tolist(), r2t[2, 6:12].tolist(), r2t[2, 12:14].tolist()]
    assert pieces(det, [0, 2, 1], [3, 14, 5], [1, 2, 1], of=2) == alone
    assert pieces(det, [2, 4], [14, 1], [2, 2], of=2) == alone
    default, _ = make_backend(chunked_prefix_capacity=6)
    assert pieces(default, [0, 2, 1], [3, 14, 5], [1, 2, 1], of=2) != alone
    assert not det.use_split_kv


def test_deterministic_split_keys():
    """deterministic_split_keys: a multiple of 64, kept only in the deterministic mode; on CUDA
    the backend then decodes with a deterministic split-KV workspace as wide as its context."""
    with pytest.raises(ValueError, match="deterministic_split_keys must be 0 .* multiple of 64"):
        make_backend(deterministic=True, deterministic_split_keys=100)
    b, _ = make_backend(deterministic=True, deterministic_split_keys=1024)
    assert b.split_keys == 1024 and not b.use_split_kv  # on the CPU: no workspace
    b, _ = make_backend(deterministic_split_keys=1024)
    assert b.split_keys == 0, "no split keys outside the deterministic mode"
    if torch.cuda.is_available() and torch.ops.mla.build_info() != "cpu":
        det, _ = make_backend("cuda", deterministic=True, deterministic_split_keys=128)
        assert det.use_split_kv
        ws = det.new_workspace(3, 1)
        assert ws.split_keys == 128 and ws.max_kv_len == det.max_context_len
        assert ws.kwargs()["workspace_split_keys"] == 128


@pytest.fixture
def cpu_workspaces(monkeypatch):
    """DecodeWorkspace on the CPU (256 bytes each), recording the capacity each is sized for."""
    asked = []

    def fake_bytes(max_batch, max_q_len, num_heads, max_kv_len=0, split_keys=0):
        asked.append((max_batch, max_q_len, num_heads, max_kv_len, split_keys))
        return 256

    monkeypatch.setattr(ops, "decode_workspace_bytes", fake_bytes)
    monkeypatch.setattr(torch.cuda, "device", contextlib.nullcontext)
    return asked


def test_deterministic_extend_runs_unsplit(cpu_workspaces):
    """EXTEND's absorbed path takes no workspace in the deterministic mode (a deterministic one
    would hold every piece of every row tile of the longest extend at the full context)."""
    b, _ = make_backend(deterministic=True, deterministic_split_keys=1024)
    md = DecodeMetadata(1, torch.zeros(1, 32, dtype=torch.int32), torch.tensor([2048]),
                        torch.tensor([0, 2048]), 0, 2048, 2048)
    assert b._workspace(md, "extend") == {} and not cpu_workspaces


def test_extend_workspace_drops_replaced_buffers(cpu_workspaces):
    """The EXTEND workspace is eager only (no graph keeps a buffer): growing it frees the old one."""
    b, _ = make_backend()
    for q in (16, 64, 256):
        md = DecodeMetadata(1, torch.zeros(1, 1, dtype=torch.int32), torch.tensor([q]),
                            torch.tensor([0, q]), 0, q, q)
        b._workspace(md, "extend")
    assert b.extend_workspace.max_q_len == 256 and b.extend_workspace._replaced == []


def test_decode_workspace_must_serve_the_backend(cpu_workspaces):
    """A decode_workspace of the wrong kind (balanced for a deterministic split, too narrow a
    max_kv_len, another split or head count) or one the backend would not use is refused."""
    b, r2t = make_backend(deterministic=True, deterministic_split_keys=1024)
    with pytest.raises(ValueError, match="decode_workspace is given but .*deterministic without"):
        make_backend(deterministic=True, decode_workspace=ops.DecodeWorkspace(2, 1, 4, "cpu"))
    b.use_split_kv = True  # as on CUDA
    good = ops.DecodeWorkspace(2, 1, 4, "cpu", max_kv_len=b.max_context_len, split_keys=1024)
    b._check_workspace(good)
    for bad in (ops.DecodeWorkspace(2, 1, 4, "cpu"),
                ops.DecodeWorkspace(2, 1, 4, "cpu", max_kv_len=b.max_context_len - 1, split_keys=1024),
                ops.DecodeWorkspace(2, 1, 4, "cpu", max_kv_len=b.max_context_len, split_keys=512),
                ops.DecodeWorkspace(2, 1, 8, "cpu", max_kv_len=b.max_context_len, split_keys=1024)):
        with pytest.raises(ValueError, match="decode_workspace .* does not serve this backend"):
            b._check_workspace(bad)


def test_init_cuda_graph_state_keeps_state_when_workspace_fails(cpu_workspaces):
    b, _ = make_backend()
    b.init_cuda_graph_state(4, 4)
    before = (b.cuda_graph_block_table, b.cuda_graph_max_bs)

    class CannotGrow:
        def grow(self, *args):
            raise torch.cuda.OutOfMemoryError("out of memory")

    b.use_split_kv, b.decode_workspace = True, CannotGrow()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        b.init_cuda_graph_state(64, 64)
    assert (b.cuda_graph_block_table, b.cuda_graph_max_bs) == before


def test_multi_step_shares_the_given_workspace_sized_for_one_query(cpu_workspaces):
    """The draft steps share the decode_workspace given to them (else a new one), grown for
    DECODE steps of one query, not for num_draft_tokens."""
    kw = dict(deterministic=True, deterministic_split_keys=1024, num_draft_tokens=4)
    _, r2t = make_backend()
    d = MlaMultiStepDraftBackend(speculative_num_steps=3, num_q_heads=4, page_size=PAGE,
                                 req_to_token=r2t, token_to_kv_pool=LatentKvPool(1, 6, PAGE, torch.bfloat16, "cpu"),
                                 kv_cache_dtype=torch.bfloat16, **kw)
    for s in d.attn_backends:  # as on CUDA
        s.use_split_kv = True
    d._share_workspace()
    assert len({id(s.decode_workspace) for s in d.attn_backends}) == 1
    d.init_cuda_graph_state(16, 16)
    assert d.attn_backends[0].decode_workspace.max_q_len == 1
    user = ops.DecodeWorkspace(8, 1, 4, "cpu", max_kv_len=64, split_keys=1024)
    d.attn_backends[0].decode_workspace = user
    d._share_workspace()
    assert all(s.decode_workspace is user for s in d.attn_backends)


def test_from_model_runner():
    backend, _ = make_backend()
    runner = SimpleNamespace(
        model_config=SimpleNamespace(num_attention_heads=128), tp_size=8, page_size=PAGE,
        req_to_token_pool=SimpleNamespace(req_to_token=backend.req_to_token),
        token_to_kv_pool=backend.token_to_kv_pool, kv_cache_dtype=torch.bfloat16,
        dtype=torch.bfloat16,
        server_args=SimpleNamespace(speculative_num_draft_tokens=4, disable_chunked_prefix_cache=True))
    b = MlaBackend.from_model_runner(runner)
    assert b.num_q_heads == 16 and b.num_draft_tokens == 4 and b.disable_chunked_prefix_cache
    assert not b.deterministic
    runner.server_args.enable_deterministic_inference = True
    assert MlaBackend.from_model_runner(runner).deterministic
    del runner.server_args.enable_deterministic_inference
    d = MlaMultiStepDraftBackend.from_model_runner(runner, topk=1, speculative_num_steps=3)
    assert [x.step_offset for x in d.attn_backends] == [1, 2]
    # Data-parallel attention: the heads are split over tp_size / dp_size ranks, not tp_size.
    runner.server_args.enable_dp_attention, runner.server_args.dp_size = True, 8
    assert MlaBackend.from_model_runner(runner).num_q_heads == 128
    runner.server_args.dp_size = 2
    assert MlaBackend.from_model_runner(runner).num_q_heads == 32
    runner.attn_tp_size = 2  # a runner that says it
    assert MlaBackend.from_model_runner(runner).num_q_heads == 64


def rope_decode_inputs(seed=3):
    """Two DECODE requests' new tokens, before RoPE: q_nope / q_pe, c_kv / k_pe (bf16)."""
    gen = torch.Generator().manual_seed(seed)
    bf = torch.bfloat16
    q_nope = torch.randn(2, 4, 512, generator=gen).to(bf)
    q_pe = torch.randn(2, 4, 64, generator=gen).to(bf)
    c_kv = torch.randn(2, 512, generator=gen).to(bf)
    k_pe = torch.randn(2, 64, generator=gen).to(bf)
    return q_nope, q_pe, c_kv, k_pe


def decode_with_slots(r2t, reqs, lens):
    fb = batch(ForwardMode.DECODE, reqs, lens)
    fb.out_cache_loc = torch.stack([r2t[r, n - 1] for r, n in zip(reqs, lens)]).to(torch.int64)
    fb.positions = torch.tensor([n - 1 for n in lens])
    return fb


@pytest.mark.parametrize("rope", [True, False])
def test_merged_query_and_latent_equal_split_ones(rope):
    """A merged query [T, H * 576] and latent [T, 576] give what the split ones (q_nope | q_rope,
    c_kv | k_rope) give, with RoPE in the backend (cos_sin_cache: the cache gets the roped key)
    or without."""
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    kw = dict(cos_sin_cache=make_cos_sin_cache(64), is_neox=True) if rope else {}
    q_nope, q_pe, c_kv, k_pe = rope_decode_inputs()
    results = []
    for merged in (False, True):
        backend, r2t = make_backend()
        fb = decode_with_slots(r2t, [0, 1], [5, 9])
        backend.init_forward_metadata(fb)
        if merged:
            out = backend.forward_decode(torch.cat([q_nope, q_pe], -1).reshape(2, -1),
                                         torch.cat([c_kv, k_pe], -1), None, layer, fb, **kw)
        else:
            out = backend.forward_decode(q_nope.reshape(2, -1), c_kv, None, layer, fb,
                                         q_rope=q_pe.reshape(2, -1), k_rope=k_pe, **kw)
        cache = backend.token_to_kv_pool.get_key_buffer(0)[fb.out_cache_loc, 0].clone()
        results.append((out, cache))
    assert torch.equal(results[0][0], results[1][0])
    assert torch.equal(results[0][1], results[1][1])
    assert torch.equal(results[1][1][:, 512:], k_pe) != rope  # roped in the cache with RoPE


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=requires_cuda)])
def test_check_metadata_debug_mode(device):
    """MlaBackend(check_metadata=True): the same outputs (RoPE, save, decode) and, on CUDA, a new
    token's cache slot past the pool raised by the save instead of skipped, and a position past
    the cos/sin cache raised by the rope instead of NaN rows (the CPU always raises both)."""
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    kw = dict(cos_sin_cache=make_cos_sin_cache(64).to(device), is_neox=True)
    q_nope, q_pe, c_kv, k_pe = (t.to(device) for t in rope_decode_inputs())
    outs = []
    for flag in (False, True):
        backend, r2t = make_backend(device, check_metadata=flag)
        assert backend.check_metadata == flag
        fb = decode_with_slots(r2t, [0, 1], [5, 9])
        for name in ("req_pool_indices", "seq_lens", "out_cache_loc", "positions"):
            setattr(fb, name, getattr(fb, name).to(device))
        backend.init_forward_metadata(fb)
        outs.append(backend.forward_decode(q_nope.reshape(2, -1), c_kv, None, layer, fb,
                                           q_rope=q_pe.reshape(2, -1), k_rope=k_pe, **kw))
        pool_slots = backend.token_to_kv_pool.get_key_buffer(0).shape[0]
        fb.out_cache_loc = torch.tensor([3, pool_slots], dtype=torch.int64, device=device)
        if flag or device == "cpu":
            with pytest.raises(RuntimeError, match=rf"loc\[1\] = {pool_slots}"):
                backend.forward_decode(q_nope.reshape(2, -1), c_kv, None, layer, fb,
                                       q_rope=q_pe.reshape(2, -1), k_rope=k_pe, **kw)
            fb = decode_with_slots(r2t, [0, 1], [5, 9])
            for name in ("req_pool_indices", "seq_lens", "out_cache_loc"):
                setattr(fb, name, getattr(fb, name).to(device))
            fb.positions = torch.tensor([4, 64], device=device)  # the cos/sin cache has 64 rows
            with pytest.raises(RuntimeError, match=r"positions\[1\] = 64"):
                backend.forward_decode(q_nope.reshape(2, -1), c_kv, None, layer, fb,
                                       q_rope=q_pe.reshape(2, -1), k_rope=k_pe, **kw)
    assert torch.equal(outs[0], outs[1])


def test_forward_entry_and_verify_hooks():
    """forward() dispatches by mode as an engine's attention layer calls it; the verify hooks say
    there is nothing to fill."""
    backend, r2t = make_backend()
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    q_nope, q_pe, c_kv, k_pe = rope_decode_inputs()
    q = torch.cat([q_nope, q_pe], -1).reshape(2, -1)
    fb = decode_with_slots(r2t, [0, 1], [5, 9])
    backend.init_forward_metadata(fb)
    direct = backend.forward_decode(q, c_kv, None, layer, fb, k_rope=k_pe)
    assert torch.equal(backend.forward(q, c_kv, None, layer, fb, k_rope=k_pe), direct)
    idle = batch(ForwardMode.IDLE, [], [])
    backend.init_forward_metadata(idle)
    assert backend.forward(q[:0], None, None, layer, idle).shape == (0, 4 * 512)
    assert backend.get_verify_buffers_to_fill_after_draft() == [None, None]
    backend.update_verify_buffers_to_fill_after_draft(None, None)


@pytest.mark.parametrize("split", [True, False])
def test_llama_4_scaling_multiplies_the_query(split):
    """llama_4_scaling (the keyword an engine passes with the rope arguments, often None) scales
    each token's query: the same result as the query scaled by the caller; None changes nothing."""
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    q_nope, q_pe, c_kv, k_pe = rope_decode_inputs()
    scaling = torch.tensor([0.5, 3.0]).view(2, 1, 1)
    bf = torch.bfloat16
    results = []
    for given in (None, scaling, "pre"):
        backend, r2t = make_backend()
        fb = decode_with_slots(r2t, [0, 1], [5, 9])
        backend.init_forward_metadata(fb)
        qn, qp = q_nope, q_pe
        if isinstance(given, str):  # scaled by the caller instead
            qn, qp = (q_nope.float() * scaling).to(bf), (q_pe.float() * scaling).to(bf)
        kw = dict(llama_4_scaling=None if isinstance(given, str) else given)
        if split:
            out = backend.forward_decode(qn.reshape(2, -1), c_kv, None, layer, fb,
                                         q_rope=qp.reshape(2, -1), k_rope=k_pe, **kw)
        else:
            out = backend.forward(torch.cat([qn, qp], -1).reshape(2, -1), c_kv, None, layer,
                                  fb, k_rope=k_pe, **kw)
        results.append(out)
    assert torch.equal(results[1], results[2])
    assert not torch.equal(results[0], results[1])
    backend, r2t = make_backend()
    fb = decode_with_slots(r2t, [0, 1], [5, 9])
    backend.init_forward_metadata(fb)
    q = torch.cat([q_nope, q_pe], -1).reshape(2, -1)
    for bad, what in ((torch.ones(3), r"one a token \(2\), got \[3\]"), (2.0, r"one a token \(2\), got float")):
        with pytest.raises(ValueError, match="llama_4_scaling must be a tensor of one factor or " + what):
            backend.forward_decode(q, c_kv, None, layer, fb, k_rope=k_pe, llama_4_scaling=bad)


def test_rope_without_k_runs_attention():
    """k_rope without k (nothing to save): the query is roped as with k, and attention runs."""
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    q_nope, q_pe, c_kv, k_pe = rope_decode_inputs()
    backend, r2t = make_backend()
    cache = backend.token_to_kv_pool.get_key_buffer(0)
    cache.copy_(torch.randn(cache.shape, generator=torch.Generator().manual_seed(4)).to(cache.dtype))
    fb = decode_with_slots(r2t, [0, 1], [5, 9])
    backend.init_forward_metadata(fb)
    kw = dict(save_kv_cache=False, q_rope=q_pe.reshape(2, -1), k_rope=k_pe, is_neox=True,
              cos_sin_cache=make_cos_sin_cache(64))
    out = backend.forward_decode(q_nope.reshape(2, -1), None, None, layer, fb, **kw)
    with_k = backend.forward_decode(q_nope.reshape(2, -1), c_kv, None, layer, fb, **kw)
    unroped = backend.forward_decode(q_nope.reshape(2, -1), None, None, layer, fb,
                                     save_kv_cache=False, q_rope=q_pe.reshape(2, -1))
    assert torch.equal(out, with_k) and not torch.equal(out, unroped)


def test_in_graph_hook_and_host_lengths_flag():
    """The engine's graph runner calls init_forward_metadata_in_graph inside a capture and reads
    needs_cpu_seq_lens: nothing to plan there, no host lengths needed."""
    backend, r2t = make_backend()
    assert MlaBackend.needs_cpu_seq_lens is False and MlaMultiStepDraftBackend.needs_cpu_seq_lens is False
    fb = batch(ForwardMode.DECODE, [0, 1], [5, 9])
    backend.init_forward_metadata(fb)
    md = backend.forward_decode_metadata
    backend.init_forward_metadata_in_graph(fb)
    assert backend.forward_decode_metadata is md
    drafter = MlaMultiStepDraftBackend(speculative_num_steps=2, num_q_heads=4, page_size=PAGE,
                                       req_to_token=backend.req_to_token,
                                       token_to_kv_pool=backend.token_to_kv_pool,
                                       kv_cache_dtype=torch.bfloat16)
    drafter.init_forward_metadata_in_graph(fb)


def test_extend_prefix_from_host_lengths():
    """EXTEND takes each request's cached prefix from extend_prefix_lens_cpu, or else from
    seq_lens_cpu - extend_seq_lens_cpu; lengths that disagree, or no host prefix at all, are an
    error (a prefix taken as 0 would attend the new tokens alone)."""
    backend, r2t = make_backend(chunked_prefix_capacity=6)
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 3], extend=[2, 3], prefix=None)
    backend.init_forward_metadata(fb)  # prefix 7 and 0 from seq_lens_cpu
    md = backend.forward_prefill_metadata
    assert md.has_prefix and md.use_chunked_prefix
    cu = fb.prefix_chunk_cu_seq_lens
    assert sum(int(c[1] - c[0]) for c in cu) == 7 and all(int(c[2] - c[1]) == 0 for c in cu)
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 3], extend=[2, 3], prefix=[6, 0])
    with pytest.raises(ValueError, match=r"request 0 .* extend_prefix_lens 6 \+ extend_seq_lens 2 "
                                         r"!= seq_lens 9"):
        backend.init_forward_metadata(fb)
    assert backend.forward_prefill_metadata is None
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 3], extend=[2, 3], prefix=None)
    fb.seq_lens_cpu = None
    with pytest.raises(ValueError, match="extend_prefix_lens_cpu, or seq_lens_cpu"):
        backend.init_forward_metadata(fb)
    fb = batch(ForwardMode.EXTEND, [0, 1], [9, 3], extend=[2, 3], prefix=[7])
    with pytest.raises(ValueError, match="extend_prefix_lens_cpu holds 1 lengths for a batch of 2"):
        backend.init_forward_metadata(fb)
    # The decode family takes host lists shorter than a batch padded for data parallelism (the
    # padded requests add no queries): DRAFT_EXTEND plans from the device query counts.
    fb = batch(ForwardMode.DRAFT_EXTEND, [0, 1, 2], [12, 7, 1], extend=[2, 3, 0])
    fb.extend_seq_lens_cpu = [2, 3]
    fb.seq_lens_cpu = [12, 7]
    backend.init_forward_metadata(fb)
    md = backend.forward_decode_metadata
    assert md.cu_q_lens.tolist() == [0, 2, 5, 5] and md.max_q_len == 3
    # A derived prefix below 0 says which lengths disagree.
    fb = batch(ForwardMode.EXTEND, [0], [3], extend=[5], prefix=None)
    with pytest.raises(ValueError, match=r"extend_seq_lens_cpu 5 > seq_lens_cpu 3"):
        backend.init_forward_metadata(fb)
    # seq_lens_cpu as a list
    fb = batch(ForwardMode.DECODE, [0, 1], [9, 3])
    fb.seq_lens_cpu = [9, 3]
    backend.init_forward_metadata(fb)
    assert backend.forward_decode_metadata.block_table.shape == (2, 3)


def test_bad_inputs_name_the_argument():
    backend, r2t = make_backend()
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    fb = decode_with_slots(r2t, [0, 1], [5, 9])
    backend.init_forward_metadata(fb)
    with pytest.raises(ValueError, match=r"q must hold \[2, 2304\]"):
        backend.forward_decode(torch.zeros(2, 4 * 512, dtype=torch.bfloat16), None, None, layer,
                               fb, save_kv_cache=False)
    with pytest.raises(ValueError, match=r"k_rope must hold \[2, 64\]"):
        backend.forward_decode(torch.zeros(2, 4 * 512, dtype=torch.bfloat16),
                               torch.zeros(2, 512, dtype=torch.bfloat16), None, layer, fb,
                               q_rope=torch.zeros(2, 4 * 64, dtype=torch.bfloat16),
                               k_rope=torch.zeros(2, 32, dtype=torch.bfloat16))
    # int64 lengths that int32 cannot hold: an error naming them, not lengths cut to 32 bits.
    big = batch(ForwardMode.DECODE, [0, 1], [5, 2**32 + 6])
    with pytest.raises(ValueError, match=r"seq_lens holds 4294967302"):
        backend.init_forward_metadata(big)
    big.seq_lens_cpu = None
    with pytest.raises(ValueError, match=r"seq_lens holds 4294967302"):
        backend.init_forward_metadata(big)
    # EXTEND is planned from host lengths.
    ext = batch(ForwardMode.EXTEND, [0], [3], extend=None, prefix=[0])
    ext.extend_seq_lens = torch.tensor([3])
    with pytest.raises(ValueError, match="extend_seq_lens_cpu is required"):
        backend.init_forward_metadata(ext)


def test_a_batch_that_fails_to_plan_leaves_no_plan():
    """After a failed init_forward_metadata, forward does not run with the previous batch's plan."""
    backend, r2t = make_backend()
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    backend.init_forward_metadata(decode_with_slots(r2t, [0, 1], [5, 9]))
    with pytest.raises(ValueError, match="seq_lens"):
        backend.init_forward_metadata(batch(ForwardMode.DECODE, [2, 3], [7, 2**32 + 6]))
    q = torch.zeros(2, 4 * 576, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="init_forward_metadata was not called"):
        backend.forward_decode(q, None, None, layer, batch(ForwardMode.DECODE, [2, 3], [7, 8]),
                               save_kv_cache=False)


def test_graph_plan_is_not_replanned_for_a_larger_batch():
    backend, _ = make_backend()
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=4)
    backend.init_forward_metadata_capture_cuda_graph(2, 2, torch.tensor([0, 1]), torch.tensor([5, 6]))
    grown = batch(ForwardMode.DECODE, [0, 1, 2], [5, 6, 1])
    layer = AttentionLayer(0, 4, 576, 512, 0.1)
    q = torch.zeros(3, 4 * 576, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="CUDA-graph plan's 2"):
        backend.forward_decode(q, None, None, layer, grown, save_kv_cache=False)


def test_multi_step_out_graph_entry():
    base, r2t = make_backend()
    kw = dict(num_q_heads=4, page_size=PAGE, req_to_token=base.req_to_token,
              token_to_kv_pool=base.token_to_kv_pool, kv_cache_dtype=torch.bfloat16)
    drafter = MlaMultiStepDraftBackend(speculative_num_steps=3, **kw)
    drafter.init_cuda_graph_state(max_bs=2, max_num_tokens=2)
    fb = batch(ForwardMode.DECODE, [0, 3], [5, 12])
    drafter.init_forward_metadata_out_graph(fb, in_capture=True)
    ptrs = [b.forward_decode_metadata.kv_lens.data_ptr() for b in drafter.attn_backends]
    fb2 = batch(ForwardMode.DECODE, [3, 0], [7, 2])
    drafter.init_forward_metadata_out_graph(fb2)
    mds = [b.forward_decode_metadata for b in drafter.attn_backends]
    assert [m.kv_lens.data_ptr() for m in mds] == ptrs
    assert [m.kv_lens.tolist() for m in mds] == [[7, 2], [8, 3]]


@requires_cuda
def test_decode_family_planning_does_not_sync():
    """The decode family plans without a device-to-host copy (graph-capturable)."""
    backend, _ = make_backend("cuda")
    backend.init_cuda_graph_state(max_bs=4, max_num_tokens=12)
    spec = SpecInfo(draft_token_num=3)
    modes = [(ForwardMode.DECODE, None), (ForwardMode.TARGET_VERIFY, None),
             (ForwardMode.DRAFT_EXTEND, [1, 3, 2])]
    for mode, ext in modes:
        fb = batch(mode, [2, 0, 5], [7, 30, 9], extend=ext, device="cuda", spec_info=spec)
        fb.seq_lens_cpu = None
        backend.init_forward_metadata_capture_cuda_graph(3, 9, fb.req_pool_indices, fb.seq_lens,
                                                         None, mode, spec,
                                                         extend_seq_lens=fb.extend_seq_lens)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            backend.init_forward_metadata(fb)
            backend.init_forward_metadata_replay_cuda_graph(3, fb.req_pool_indices, fb.seq_lens,
                                                            -1, None, mode, spec,
                                                            extend_seq_lens=fb.extend_seq_lens)
        finally:
            torch.cuda.set_sync_debug_mode("default")
