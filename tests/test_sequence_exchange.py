"""Sequences move to their scheduled ranks intact: the exchange against the rows as they were.

Three gloo ranks each hold rows of their own (different lengths, a multi-turn loss mask on one rank only, route
holes on another, a rank that receives nothing); every row goes to a random rank. Gathered back by global id, every
field of every row equals the original (the oracle is the rows before the exchange), and each rank holds its rows
in ascending id order.
"""

from __future__ import annotations

import numpy as np
import torch

from distributed_helpers import run_ranks

X, K, E = 3, 2, 8


def _rows(rank: int, n: int):
    from titan_foremoe.rollouts.generate import Rollout
    from titan_foremoe.routing_log import RoutingLog

    g = torch.Generator().manual_seed(rank)
    lengths = torch.randint(2, 12, (n,), generator=g)
    W = int(lengths.max()) + 3  # wider than the longest: the exchange trims to each row's own length
    routes = [torch.randint(0, E, (int(t) - 1, X, K), generator=g) for t in lengths]
    if rank == 1:  # holes: no route at some positions and layers
        routes[0][0, 1] = -1
    log = RoutingLog.from_sequences(routes, lengths.tolist(), E)
    log.experts_BTXK = torch.nn.functional.pad(log.experts_BTXK, (0, 0, 0, 0, 0, W - log.experts_BTXK.shape[1]))
    tokens = torch.randint(1, 50, (n, W), generator=g)
    rollout = Rollout(tokens, torch.randint(1, 3, (n,), generator=g), lengths, torch.randn(n, W, generator=g),
                      torch.rand(n, generator=g) > 0.5, log,
                      loss_mask_BT=torch.rand(n, W, generator=g) > 0.3 if rank == 2 else None)
    return rollout, torch.randn(n, generator=g, dtype=torch.float64), torch.rand(n, generator=g) > 0.2


def _row(rollout, adv, trained, b: int) -> dict:
    n = int(rollout.lengths_B[b])
    live = rollout.routes.live_BTX
    return {
        "tokens": rollout.tokens_BT[b, :n].tolist(), "logp": rollout.logprobs_BT[b, :n].tolist(),
        "prompt": int(rollout.prompt_lens_B[b]), "finished": bool(rollout.finished_B[b]),
        "experts": rollout.routes.experts_BTXK[b, : n - 1].tolist(),
        "live": None if live is None else live[b, : n - 1].tolist(),
        "loss_mask": None if rollout.loss_mask_BT is None else rollout.loss_mask_BT[b, :n].tolist(),
        "adv": float(adv[b]), "trained": bool(trained[b]),
    }


def _check(rank, world_size, out_path):
    import torch.distributed as dist

    from titan_foremoe.distributed import collectives
    from titan_foremoe.schedule.exchange import exchange_rows

    dist.init_process_group("gloo")
    n = 5
    rollout, adv, trained = _rows(rank, n)
    ids = np.arange(rank * n, (rank + 1) * n)
    dest = np.random.default_rng(rank).integers(0, 2, n)  # rank 2 receives nothing
    before = {int(i): _row(rollout, adv, trained, b) for b, i in enumerate(ids)}
    got = exchange_rows(rollout, adv, trained, ids, dest)
    after = {int(i): _row(got.rollout, got.advantages_B, got.trained_B, b) for b, i in enumerate(got.ids_B)}
    every_before = collectives.all_gather_objects(before)
    every_after = collectives.all_gather_objects((after, got.ids_B.tolist(), dest.tolist()))
    if rank == 0:
        torch.save({"before": every_before, "after": every_after}, out_path)
    dist.destroy_process_group()


def test_rows_arrive_intact_on_their_ranks(tmp_path):
    out = tmp_path / "out.pt"
    run_ranks(_check, 3, str(out))
    res = torch.load(out, weights_only=False)
    before = {i: row for part in res["before"] for i, row in part.items()}
    dest = {r * 5 + b: d for r, (_, _, ds) in enumerate(res["after"]) for b, d in enumerate(ds)}
    seen = []
    for rank, (after, ids, _) in enumerate(res["after"]):
        assert ids == sorted(ids)  # ascending global order
        for i, row in after.items():
            assert dest[i] == rank  # landed where it was sent
            want = dict(before[i])
            for r in (want, row):  # a row without a hole is the same with or without a (False) hole mask
                if r["live"] is not None and not any(any(x) for x in r["live"]):
                    r["live"] = None
            if want["loss_mask"] is None and row["loss_mask"] is not None:  # another source's mask: all tokens
                assert all(row["loss_mask"])
                row["loss_mask"] = None
            assert row == want, f"sequence {i} changed in the exchange"
            seen.append(i)
    assert sorted(seen) == sorted(before)
    assert res["after"][2][1] == []  # a rank that receives nothing holds no rows
