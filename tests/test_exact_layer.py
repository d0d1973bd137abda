"""One ``exact`` MoE layer (``placement/exact.py``) on 4 gloo ranks against a dense oracle: ranks with different
token counts (the padding path), skewed routes (duplicates made), every rank computing exactly its quota; the
combined outputs and the gradients of tokens, scores and each rank's owned experts equal a per-token loop over
its top-k experts with the whole layer's weights (float32), and the planner leaves no host sync."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from distributed_helpers import run_ranks

E, F, D, K = 8, 12, 8, 2
TOKENS_S = np.array([7, 3, 11, 5])


def _swiglu_ref(x, w1, w2, w3):
    return (torch.nn.functional.silu(x @ w1.T) * (x @ w3.T)) @ w2.T


def _layer(rank, world_size, out_path):
    import torch.distributed as dist

    from titan_foremoe.models.moe import grouped_swiglu
    from titan_foremoe.placement.exact import ExactPlacement

    dist.init_process_group("gloo")
    R = world_size
    gen = torch.Generator().manual_seed(0)
    w1, w2, w3 = (torch.randn(E, F, D, generator=gen, dtype=torch.float32),
                  torch.randn(E, D, F, generator=gen, dtype=torch.float32),
                  torch.randn(E, F, D, generator=gen, dtype=torch.float32))
    xs = [torch.randn(int(t), D, generator=gen, dtype=torch.float32) for t in TOKENS_S]
    hot = torch.tensor([0.02, 0.02, 0.02, 0.02, 0.02, 0.6, 0.25, 0.05])  # rank 2 owns the hot experts
    ids = [torch.stack([torch.multinomial(hot, K, generator=gen) for _ in range(int(t))]) for t in TOKENS_S]
    scores = [torch.rand(int(t), K, generator=gen, dtype=torch.float32) for t in TOKENS_S]
    Kr = E // R
    own = [w[rank * Kr:(rank + 1) * Kr].clone().requires_grad_() for w in (w1, w2, w3)]
    x = xs[rank].clone().requires_grad_()
    s = scores[rank].clone().requires_grad_()
    counts = torch.bincount(ids[rank].reshape(-1), minlength=E)
    rt = SimpleNamespace(tokens_MS=TOKENS_S[None], R=R, rank=rank, replicas_ML=torch.zeros(1, 1, dtype=torch.int64),
                         add_plan_ms=lambda *a: None)
    p = ExactPlacement(None, 0, None, 0, runtime=rt, micro=0)
    rows, per_expert, meta = p.dispatch_tokens(x, s, ids[rank], counts, dist.group.WORLD)
    weights = p.slot_weights(tuple(own), torch.float32)
    out = p.combine_tokens(grouped_swiglu(rows, *weights, per_expert, torch.float32), meta, x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(rank + 1), dtype=torch.float32)
    (out * g).sum().backward()

    # the oracle: this rank's tokens through their top-k experts, whole weights, plain autograd
    rw = [w.clone().requires_grad_() for w in (w1, w2, w3)]
    rx, rs = xs[rank].clone().requires_grad_(), scores[rank].clone().requires_grad_()
    ref = torch.stack([sum(rs[t, j] * _swiglu_ref(rx[t], *(w[ids[rank][t, j]] for w in rw)) for j in range(K))
                       for t in range(len(rx))])
    (ref * g).sum().backward()
    full = [w.grad.clone() for w in rw]  # summed over ranks: what each owner's experts must receive
    for t in full:
        dist.all_reduce(t)
    ok = {
        "out": torch.allclose(out, ref, atol=1e-5),
        "dx": torch.allclose(x.grad, rx.grad, atol=1e-5),
        "ds": torch.allclose(s.grad, rs.grad, atol=1e-5),
        "dw": all(torch.allclose(o.grad, f[rank * Kr:(rank + 1) * Kr], atol=1e-4) for o, f in zip(own, full)),
        "rows": int(rows.shape[0]),
        "replicas": int(rt.replicas_ML[0, 0]),
    }
    got = [None] * R
    dist.all_gather_object(got, ok)
    if rank == 0:
        torch.save(got, out_path)
    dist.destroy_process_group()


def test_exact_layer_matches_a_dense_oracle(tmp_path):
    out_path = tmp_path / "out.pt"
    run_ranks(_layer, 4, str(out_path))
    got = torch.load(out_path)
    pairs = int(TOKENS_S.sum()) * K
    assert [g["rows"] for g in got] == [pairs // 4 + (r < pairs % 4) for r in range(4)]  # exact quotas
    assert sum(g["replicas"] for g in got) > 0  # the hot experts were duplicated
    for r, g in enumerate(got):
        assert g["out"] and g["dx"] and g["ds"] and g["dw"], (r, g)
