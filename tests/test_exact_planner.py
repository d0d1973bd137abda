"""The exact planner (``planner/exact.py``) against its contract, checked by brute force on random layers:
every rank receives exactly its node's rows split as evenly as integers allow, every expert's rows are all
placed, duplicates stay inside the owner's node, and the torch ops raise no host sync (a device planner)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from titan_foremoe.planner.exact import host_quota_R, plan_exact, plan_exact_stage, rank_rows, replicas_R


def _layers(rng, n, E):
    for i in range(n):
        skew = [0.0, 0.5, 1.0, 2.0][i % 4]
        w = rng.zipf(1.0 + 1.0 / (skew + 0.3), E).astype(float) if skew else np.ones(E)
        p = rng.permutation(w) / w.sum()
        yield rng.multinomial(int(rng.integers(0, 5000)), p)


@pytest.mark.parametrize("E,R,G", [(8, 4, 4), (16, 8, 4), (32, 8, 8), (64, 16, 8), (12, 4, 2)])
def test_exact_quotas_conservation_and_node_domain(E, R, G):
    rng = np.random.default_rng(E * 100 + R)
    K = E // R
    for load_E in _layers(rng, 40, E):
        a = plan_exact(torch.as_tensor(load_E), R, G).numpy()
        assert (a >= 0).all()
        assert np.array_equal(a.sum(1), load_E)  # every row placed
        node_load = load_E.reshape(R // G, -1).sum(1)
        want = np.concatenate([n // G + (np.arange(G) < n % G) for n in node_load])
        assert np.array_equal(a.sum(0), want)  # exact quotas, brute force
        if R == G:
            assert np.array_equal(want, host_quota_R(int(load_E.sum()), R))
        e, r = np.nonzero(a)
        assert ((e // K) // G == r // G).all()  # duplicates only inside the owner's node
        assert np.array_equal(replicas_R(torch.as_tensor(a)).numpy(), np.bincount(r[e // K != r], minlength=R))


def test_rank_rows_partition_the_expert_sorted_pairs():
    rng = np.random.default_rng(3)
    E, R = 16, 4
    for load_E in _layers(rng, 12, E):
        load = torch.as_tensor(load_E)
        a = plan_exact(load, R, R)
        q = host_quota_R(int(load_E.sum()), R)
        pos = torch.cat([rank_rows(a, r, int(q[r]), load) for r in range(R)]).numpy()
        assert np.array_equal(np.sort(pos), np.arange(load_E.sum()))  # each pair exactly once
        expert_of = np.repeat(np.arange(E), load_E)
        start = 0
        for r in range(R):  # a rank's rows in expert order, matching its assignment
            e = expert_of[pos[start:start + q[r]]]
            assert (np.diff(e) >= 0).all() and np.array_equal(np.bincount(e, minlength=E), a[:, r].numpy())
            start += q[r]


def test_stage_slots_list_owned_then_duplicates():
    rng = np.random.default_rng(5)
    load = np.stack(list(_layers(rng, 6, 16))).reshape(2, 3, 16)
    assign, slots = plan_exact_stage(load, 8, 4)
    for m in range(2):
        for l in range(3):
            for r in range(8):
                used = set(np.nonzero(assign[m, l, :, r])[0])
                s = slots[m, l, r]
                assert list(s[:2]) == [2 * r, 2 * r + 1]
                assert used <= set(s[s >= 0])
                assert set(s[2:][s[2:] >= 0]) == used - {2 * r, 2 * r + 1}


def test_planner_runs_without_host_syncs():
    from torch.utils._python_dispatch import TorchDispatchMode

    from titan_foremoe.distributed.checked import sync_kind

    seen = []

    class Watch(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            k = sync_kind(func, args, kwargs or {})
            if k:
                seen.append(k)
            return func(*args, **(kwargs or {}))

    load = torch.as_tensor(np.random.default_rng(0).integers(0, 300, 64))
    rows = int(host_quota_R(int(load.sum()), 8)[3])  # host-known in the runtime (the sources' pair counts)
    with Watch():
        a = plan_exact(load, 8, 8)
        rank_rows(a, 3, rows, load)
        replicas_R(a)
    assert seen == []
