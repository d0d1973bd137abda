"""The same process-group creation order on every rank, asserted once at start-up (``distributed/group_order.py``)."""

from __future__ import annotations

import pytest

from titan_foremoe.distributed.group_order import first_difference
from distributed_helpers import end_rank, rank_results, run_ranks


def _ranks(rank: int, world: int, out: str, swap_on: int) -> None:
    import torch.distributed as dist

    from titan_foremoe.distributed import group_order, groups

    group_order.record()
    dist.init_process_group("gloo")
    for p in ([[0, 1], [2]], [[0, 2], [1]]):
        groups.subgroups(p)
    from torch.distributed.device_mesh import init_device_mesh

    init_device_mesh("cpu", (world,), mesh_dim_names=("dp",))
    if rank == swap_on:  # as if this rank had made its first two groups in the other order: on gloo that would
        group_order._calls[:2] = group_order._calls[2:4]  # hang in the creation itself (its store rendezvous);
        # NCCL's lazily made communicators would pair with the wrong peers at the first collective instead
    try:
        group_order.check_same_order()
        result = {"error": None}
    except RuntimeError as e:
        result = {"error": str(e)}
    end_rank(out, rank, result | {"calls": group_order.calls()})


@pytest.mark.parametrize("swap_on", [None, 2])
def test_every_rank_stops_with_the_first_difference(tmp_path, swap_on):
    run_ranks(_ranks, 3, str(tmp_path), swap_on)
    res = rank_results(tmp_path, 3)
    assert res[0]["calls"][:2] == [["new_group", [0, 1]], ["new_group", [2]]]
    if swap_on is None:
        assert [r["error"] for r in res] == [None] * 3
        return
    line = ("process groups created in another order on rank 2 than on rank 0: creation #0 is "
            "new_group(ranks=[0, 2]) here, new_group(ranks=[0, 1]) on rank 0")
    assert [r["error"] for r in res] == [line] * 3  # every rank stops, not only the one that differs


def test_first_difference_names_a_missing_creation():
    a = [["new_group", [0, 1]], ["split_group", [[0], [1]]]]
    assert first_difference(a, a, 1) is None
    why = first_difference(a[:1], a, 1)
    assert why == ("process groups: rank 1 created 1, rank 0 2; the first extra is #1 "
                   "split_group(ranks=[[0], [1]]) on rank 0")
