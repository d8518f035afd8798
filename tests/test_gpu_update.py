"""AdamW on the GPU (slidedp/gpu_update.py) on CUDA: the state's copies to the GPU must not race
kernels still queued on the compute stream, and SlideDP with the embedding's state streamed there,
or the embedding's and the first blocks' resident there, must train as `single` does on a model
of real width and depth. GPU only (run on the GPU machine)."""

from dataclasses import replace

import pytest
import torch

from protocols.model_spec import get_flavor
from recipes.config import run_config
from recipes.parallelize import build_backend
from slidedp.engine import SlideDPBackend
from slidedp.gpu_update import GPU_CHUNK
from tests.slidedp_worker import make_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a GPU (run on the GPU machine)")


def test_prefetch_waits_for_kernels_queued_on_the_memory_it_reuses():
    """A tensor freed by the host while a kernel queued on the compute stream still writes it:
    the caching allocator hands that memory to the prefetch's first copy at once. The copy must
    land after the kernel, or the kernel overwrites the prefetched master."""
    device = torch.device("cuda", 0)
    cfg = make_config({"embedding_update": "gpu"}, accum=1, max_norm=0.0)
    backend = SlideDPBackend(run_config(cfg), get_flavor("qwen3-debug"), device=device, dp_rank=0,
                             dp_world=1)
    try:
        upd = backend.gpu_updates[0]
        first = min(upd.hi - upd.lo, GPU_CHUNK)
        torch.cuda.synchronize()
        stale = torch.empty(first, dtype=torch.float32, device=device)
        address = stale.data_ptr()
        torch.cuda._sleep(200_000_000)  # keeps the fill below queued for ~0.1 s
        stale.fill_(float("nan"))
        del stale
        upd.prefetch()
        torch.cuda.synchronize()
        a, b, param, exp_avg, exp_avg_sq = upd._pieces[0]
        assert param.data_ptr() == address  # the reuse this test is about happened
        master = backend.state.unit_view("master", upd.unit.index, a, b)
        assert torch.equal(param.cpu(), master)
        upd.drop()
    finally:
        backend.close()


def _lockstep(flavor: str, layers: int, *, max_norm: float, where: str, steps: int = 5,
              batch: int = 2, seq: int = 1024) -> list[tuple[float, float, float, float]]:
    """(single's loss, SlideDP's, single's gradient norm, SlideDP's) per step, both from the same
    init on the same batches; SlideDP with its embedding updated where `where` says
    (slidedp.embedding_update), and with a "+blocks" suffix the first half of the blocks' state
    resident on the GPU too (slidedp.gpu_state_blocks), with "+all" every block's (then the
    head's too, and the norm is taken on the GPU)."""
    device = torch.device("cuda", 0)
    args = replace(get_flavor(flavor), n_layers=layers)
    where, _, plus = where.partition("+")
    resident = {"": 0, "blocks": layers // 2, "all": layers}[plus]
    cfg = make_config({"embedding_update": where, "nonfinite": "skip" if max_norm else "off",
                       "gpu_state_blocks": resident, "update_order": "next_use"},
                      accum=1, max_norm=max_norm, kernels="liger", batch=batch, seq=seq)
    cfg.training.loss_chunk_tokens = 1024
    cfg.parallelism.mode = "single"
    single = build_backend(cfg, args, device=device, dp_rank=0, dp_world=1)
    slide = SlideDPBackend(run_config(cfg), args, device=device, dp_rank=0, dp_world=1)
    g = torch.Generator().manual_seed(3)
    rows = []
    try:
        for _ in range(steps):
            x = torch.randint(0, args.vocab_size, (batch, seq + 1), generator=g)
            micro = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]
            n = batch * seq
            a = single.train_step(micro, lr=1e-4, global_target_tokens=n)
            b = slide.train_step(micro, lr=1e-4, global_target_tokens=n)
            rows.append((a.loss_sum / n, b.loss_sum / n, a.grad_norm, b.grad_norm))
    finally:
        slide.close()
        del single
        torch.cuda.empty_cache()
    return rows


# Real width, more blocks than the prefetch point, an embedding of several GPU chunks: Qwen3
# tied (1.7B, all 28 blocks) and Qwen2.5 untied with QKV bias (7B's width, 6 blocks). At
# 8 x 4096 micro-batches the kernels are large enough to keep the compute stream far behind its
# host thread, which is when the prefetch's reuse of freed memory raced them
# (issue 25: NaN gradients from the first step).
@pytest.mark.parametrize("flavor,layers,batch,seq", [
    ("qwen3-1.7B", 28, 2, 1024), ("qwen3-4B", 8, 8, 4096), ("qwen2.5-7B", 6, 8, 4096)],
    ids=["qwen3-1.7B-28x2x1024", "qwen3-4B-8x8x4096", "qwen2.5-7B-6x8x4096"])
@pytest.mark.parametrize("max_norm", [0.0, 1.0])
@pytest.mark.parametrize("where",
                         ["gpu", "host", "resident+blocks", "gpu+blocks", "resident+all"])
def test_embedding_update_trains_as_single_at_real_size(flavor, layers, batch, seq, max_norm,
                                                        where):
    rows = _lockstep(flavor, layers, max_norm=max_norm, where=where, batch=batch, seq=seq)
    for ref_loss, loss, ref_norm, norm in rows:
        assert torch.isfinite(torch.tensor([loss, norm])).all(), rows
        assert loss == pytest.approx(ref_loss, rel=1e-2), rows
        assert norm == pytest.approx(ref_norm, rel=5e-2), rows
