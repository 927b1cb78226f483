"""CUDA graphs (GPU only): decode and target-verify captured at batch sizes 1, 8, 32 and 128 over
the backend's persistent buffers (block tables at full context width); replays with new
lengths, new requests and new pages give what an eager run of the same batch gives, and a
replay (metadata update + graph launch) allocates no memory."""

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import cuda_ready
from mla_reference import FP8, assert_close
from mla_torch import AttentionLayer, ForwardBatch, ForwardMode, LatentKvPool, MlaBackend, SpecInfo

pytestmark = pytest.mark.skipif(not cuda_ready(), reason="needs CUDA and the extension's CUDA kernels")

HEADS, PAGE, MAX_CONTEXT, MAX_BS, DRAFT = 16, 64, 2048, 128, 3


class Engine:
    def __init__(self, kv_dtype, gen):
        self.gen = gen
        self.num_pages = MAX_BS * MAX_CONTEXT // PAGE + 8
        self.pool = LatentKvPool(1, self.num_pages, PAGE, kv_dtype, "cuda")
        cuda_gen = torch.Generator(device="cuda").manual_seed(5)
        latent = torch.randn(self.num_pages * PAGE, 1, 576, generator=cuda_gen, device="cuda")
        self.pool.kv_buffer[0].copy_(latent.clamp(-4, 4).to(kv_dtype))  # random everywhere
        del latent
        self.req_to_token = torch.zeros(MAX_BS * 2, MAX_CONTEXT, dtype=torch.int32, device="cuda")
        self.kv_dtype = kv_dtype
        self.backend = self.new_backend()
        self.layer = AttentionLayer(0, HEADS, 576, 512, 1 / math.sqrt(192),
                                    k_scale_float=0.5 if kv_dtype == FP8 else None)

    def new_backend(self):
        """A backend over this engine's pool (the graphs' one, or a fresh one for eager runs)."""
        return MlaBackend(num_q_heads=HEADS, page_size=PAGE, req_to_token=self.req_to_token,
                          token_to_kv_pool=self.pool, kv_cache_dtype=self.kv_dtype,
                          num_draft_tokens=DRAFT)

    def new_batch(self, bs, q_len, max_len):
        """Random requests: fresh req slots, random lengths, random (shared-nothing) pages."""
        g = self.gen
        reqs = torch.randperm(MAX_BS * 2, generator=g)[:bs]
        lens = torch.randint(1, max_len - q_len, (bs,), generator=g)
        pages = torch.randperm(self.num_pages, generator=g)
        used = 0
        locs = []
        for b in range(bs):
            n_tok = int(lens[b]) + q_len
            n_pages = -(-n_tok // PAGE)
            slots = (pages[used:used + n_pages, None] * PAGE + torch.arange(PAGE)).reshape(-1)[:n_tok]
            used += n_pages
            self.req_to_token[int(reqs[b]), :n_tok] = slots.to(torch.int32).cuda()
            locs.append(slots[int(lens[b]):])
        return reqs, lens, torch.cat(locs)

    def inputs(self, tokens):
        g = self.gen
        bf = torch.bfloat16
        return (torch.randn(tokens, HEADS * 512, generator=g).to(bf).cuda(),
                torch.randn(tokens, 512, generator=g).to(bf).cuda(),
                torch.randn(tokens, HEADS * 64, generator=g).to(bf).cuda(),
                torch.randn(tokens, 64, generator=g).to(bf).cuda())


def forward(backend, layer, mode, fb, q, k, q_rope, k_rope):
    call = backend.forward_decode if mode == ForwardMode.DECODE else backend.forward_extend
    return call(q, k, None, layer, fb, save_kv_cache=True, q_rope=q_rope, k_rope=k_rope)


def capture(backend, layer, mode, fb, args):
    """A warm-up run on a side stream, then the capture; returns (graph, its output)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside the graph
        forward(backend, layer, mode, fb, *args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forward(backend, layer, mode, fb, *args)
    return graph, out


def run_replay(backend, graph, graph_out, bs, req_buf, len_buf, mode, spec):
    """The engine's replay (metadata update, then the graph) after the inputs were written;
    asserts that it allocates nothing and returns a copy of the graph's output."""
    torch.cuda.synchronize()
    before = torch.cuda.memory_stats()
    backend.init_forward_metadata_replay_cuda_graph(bs, req_buf, len_buf, -1, None, mode, spec)
    graph.replay()
    torch.cuda.synchronize()
    after = torch.cuda.memory_stats()
    assert after["allocation.all.allocated"] == before["allocation.all.allocated"], \
        f"bs {bs}: the replay allocated memory"
    assert after["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    return graph_out.clone()


@pytest.mark.parametrize("kv_dtype", [torch.bfloat16, FP8])
@pytest.mark.parametrize("mode", [ForwardMode.DECODE, ForwardMode.TARGET_VERIFY])
def test_capture_and_replay(kv_dtype, mode):
    gen = torch.Generator().manual_seed(11)
    eng = Engine(kv_dtype, gen)
    backend = eng.backend
    q_len = DRAFT if mode == ForwardMode.TARGET_VERIFY else 1
    spec = SpecInfo(draft_token_num=DRAFT) if q_len > 1 else None
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * q_len)
    # The graph runner's static inputs, at their maximum.
    max_tokens = MAX_BS * q_len
    req_buf = torch.zeros(MAX_BS, dtype=torch.int64, device="cuda")
    len_buf = torch.ones(MAX_BS, dtype=torch.int64, device="cuda")
    loc_buf = torch.full((max_tokens,), -1, dtype=torch.int64, device="cuda")
    q_buf, k_buf, qr_buf, kr_buf = (torch.zeros_like(t) for t in eng.inputs(max_tokens))

    for bs in (1, 8, 32, 128):
        tokens = bs * q_len
        fb = ForwardBatch(forward_mode=mode, batch_size=bs, req_pool_indices=req_buf[:bs],
                          seq_lens=len_buf[:bs], out_cache_loc=loc_buf[:tokens], spec_info=spec)
        args = (q_buf[:tokens], k_buf[:tokens], qr_buf[:tokens], kr_buf[:tokens])
        backend.init_forward_metadata_capture_cuda_graph(bs, tokens, req_buf[:bs], len_buf[:bs],
                                                         None, mode, spec)
        graph, graph_out = capture(backend, eng.layer, mode, fb, args)

        for replay in range(2):
            reqs, lens, locs = eng.new_batch(bs, q_len, MAX_CONTEXT if replay else 700)
            new_inputs = eng.inputs(tokens)
            req_buf[:bs].copy_(reqs)
            len_buf[:bs].copy_(lens if q_len > 1 else lens + 1)  # decode: count the new token
            loc_buf[:tokens].copy_(locs)
            for buf, new in zip((q_buf, k_buf, qr_buf, kr_buf), new_inputs):
                buf[:tokens].copy_(new)
            got = run_replay(backend, graph, graph_out, bs, req_buf, len_buf, mode, spec)

            # The same batch eagerly, with a fresh plan (and host lengths).
            eager_fb = ForwardBatch(forward_mode=mode, batch_size=bs,
                                    req_pool_indices=reqs.cuda(),
                                    seq_lens=len_buf[:bs].clone(), seq_lens_cpu=len_buf[:bs].cpu(),
                                    out_cache_loc=locs.cuda(), spec_info=spec)
            eager = eng.new_backend()
            eager.init_forward_metadata(eager_fb)
            want = forward(eager, eng.layer, mode, eager_fb, *new_inputs)
            assert not torch.isnan(got.float()).any()
            # Split schedules differ (graph: full-width bound), so allow bf16 rounding.
            assert_close(got, want.double(), 2e-2, 2e-2, f"{mode.name} bs {bs} replay {replay}")


def test_draft_extend_graph_packs_accepted_queries():
    """DRAFT_EXTEND captured at num_draft_tokens query rows a request and replayed with each
    request's accepted tokens (spec_info.accept_length, packed at the front): those rows equal an
    eager run of the same batch, the rows past them are 0 (their NaN inputs are never read, and
    the kernel writes them over the output's NaN), and the replay allocates nothing."""
    gen = torch.Generator().manual_seed(13)
    eng = Engine(torch.bfloat16, gen)
    backend = eng.backend
    mode = ForwardMode.DRAFT_EXTEND
    bs = 8
    tokens = bs * DRAFT
    backend.init_cuda_graph_state(MAX_BS, MAX_BS * DRAFT)
    req_buf = torch.zeros(bs, dtype=torch.int64, device="cuda")
    len_buf = torch.full((bs,), DRAFT, dtype=torch.int64, device="cuda")
    loc_buf = torch.full((tokens,), -1, dtype=torch.int64, device="cuda")
    accept_buf = torch.full((bs,), DRAFT, dtype=torch.int32, device="cuda")
    spec = SimpleNamespace(draft_token_num=DRAFT, accept_length=accept_buf)
    bufs = [torch.zeros_like(t) for t in eng.inputs(tokens)]
    fb = ForwardBatch(forward_mode=mode, batch_size=bs, req_pool_indices=req_buf,
                      seq_lens=len_buf, out_cache_loc=loc_buf, spec_info=spec)
    backend.init_forward_metadata_capture_cuda_graph(bs, tokens, req_buf, len_buf, None, mode, spec)
    graph, graph_out = capture(backend, eng.layer, mode, fb, bufs)

    for replay in range(2):
        reqs, lens, locs = eng.new_batch(bs, DRAFT, 700)
        accept = torch.randint(1, DRAFT + 1, (bs,), generator=gen)
        accept[1] = 1  # at least one padded row
        total = int(accept.sum())
        kept = torch.cat([locs[b * DRAFT:b * DRAFT + int(accept[b])] for b in range(bs)])
        new_inputs = eng.inputs(total)
        req_buf.copy_(reqs)
        len_buf.copy_(lens + accept)
        accept_buf.copy_(accept)
        loc_buf.fill_(-1)
        loc_buf[:total].copy_(kept)
        for buf, new in zip(bufs, new_inputs):
            buf[:total].copy_(new)
            buf[total:].fill_(float("nan"))
        graph_out.fill_(float("nan"))  # what the rows held before: none may survive the replay
        got = run_replay(backend, graph, graph_out, bs, req_buf, len_buf, mode, spec)
        assert torch.equal(got[total:], torch.zeros_like(got[total:])), f"replay {replay}"

        seq = lens + accept
        eager_fb = ForwardBatch(forward_mode=mode, batch_size=bs, req_pool_indices=reqs.cuda(),
                                seq_lens=seq.cuda(), seq_lens_cpu=seq,
                                extend_seq_lens=accept.to(torch.int32).cuda(),
                                extend_seq_lens_cpu=accept.tolist(), out_cache_loc=kept.cuda(),
                                spec_info=spec)
        eager = eng.new_backend()
        eager.init_forward_metadata(eager_fb)
        want = forward(eager, eng.layer, mode, eager_fb, *new_inputs)
        assert not torch.isnan(got.float()).any()
        assert_close(got[:total], want.double(), 2e-2, 2e-2, f"DRAFT_EXTEND replay {replay}")


def test_padded_batch_replay():
    """A DECODE graph captured at batch 8 and replayed with 5 real requests padded to 8 as an
    engine pads them (request slot 0, seq_lens the fill value, out_cache_loc -1): the real rows
    equal an eager run of the 5, the padding rows are finite, and the replay allocates nothing."""
    gen = torch.Generator().manual_seed(17)
    eng = Engine(torch.bfloat16, gen)
    backend = eng.backend
    mode = ForwardMode.DECODE
    bs, real = 8, 5
    backend.init_cuda_graph_state(MAX_BS, MAX_BS)
    req_buf = torch.zeros(bs, dtype=torch.int64, device="cuda")
    len_buf = torch.ones(bs, dtype=torch.int64, device="cuda")
    loc_buf = torch.full((bs,), -1, dtype=torch.int64, device="cuda")
    bufs = [torch.zeros_like(t) for t in eng.inputs(bs)]
    fb = ForwardBatch(forward_mode=mode, batch_size=bs, req_pool_indices=req_buf,
                      seq_lens=len_buf, out_cache_loc=loc_buf)
    backend.init_forward_metadata_capture_cuda_graph(bs, bs, req_buf, len_buf, None, mode, None)
    graph, graph_out = capture(backend, eng.layer, mode, fb, bufs)

    reqs, lens, locs = eng.new_batch(real, 1, 900)
    new_inputs = eng.inputs(real)
    req_buf.zero_()
    req_buf[:real].copy_(reqs)
    len_buf.fill_(backend.get_cuda_graph_seq_len_fill_value())
    len_buf[:real].copy_(lens + 1)
    loc_buf.fill_(-1)
    loc_buf[:real].copy_(locs)
    for buf, new in zip(bufs, new_inputs):
        buf.zero_()
        buf[:real].copy_(new)
    got = run_replay(backend, graph, graph_out, bs, req_buf, len_buf, mode, None)
    assert torch.isfinite(got.float()).all()

    eager_fb = ForwardBatch(forward_mode=mode, batch_size=real, req_pool_indices=reqs.cuda(),
                            seq_lens=(lens + 1).cuda(), seq_lens_cpu=lens + 1,
                            out_cache_loc=locs.cuda())
    eager = eng.new_backend()
    eager.init_forward_metadata(eager_fb)
    want = forward(eager, eng.layer, mode, eager_fb, *new_inputs)
    assert_close(got[:real], want.double(), 2e-2, 2e-2, "padded DECODE replay")
