"""The table compiler against brute force, on random plans of every balancer.

Per rank, the compiled dispatch tables equal the old all-ranks layout (``tests/reference_layout.py``:
the full ``tokens_SER`` split); simulating the all-to-all of every rank's pairs through the compiled
segments delivers each token-expert pair exactly once, to a slot holding its expert, in the counts each
receiver expects; the weight and gradient lists of all ranks pair up (what one sends to another is what
that one expects from it), and every replica slot is filled exactly once.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from reference_layout import layer_layout
from titan_foremoe.models.dispatch import route_pairs
from titan_foremoe.placement.tables import compile_stage
from titan_foremoe.planner import CostModel, PlannerConfig, Topology, plan_stage
from titan_foremoe.planner.owners import owned_slots_LRK

R, P, E, L, M, MPS = 8, 4, 16, 2, 4, 2


def _loads(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    pop = rng.lognormal(0, 1.2, size=(L, E))
    p = pop / pop.sum(1, keepdims=True)
    return np.stack([[rng.multinomial(rng.integers(20, 80), p[l], size=R) for l in range(L)] for _ in range(M)])


CASES = [("foremoe", 0), ("foremoe", 1), ("eplb_oracle", 0), ("static", 0), ("foremoe_balanced", 0),
         ("foremoe_balanced", 1), ("foremoe_slot_cost", 0)]


@pytest.fixture(scope="module", params=CASES, ids=[f"{b}-{s}" for b, s in CASES])
def compiled(request):
    balancer, seed = request.param
    loads = _loads(seed)
    # foremoe_slot_cost: a slot's fixed cost, so whole experts are handed to spare slots (planner/handoff.py)
    cost = CostModel(slot_overhead_tokens=20) if balancer == "foremoe_slot_cost" else None
    # balanced owners with no hysteresis: owners move at every step (the layout is not the DTensor default)
    plan = plan_stage(balancer.replace("_slot_cost", ""), loads, Topology.from_ranks(R, P),
                      PlannerConfig(spare_slots=2, owner_hysteresis=0.0), cost, micro_steps_per_step=MPS)
    if cost is not None:  # some expert runs whole on another rank's spare slot, its owner's slot idle
        own = plan.owner_MLE
        assign = plan.assign_MLER
        whole = (assign.sum(axis=3) > 0) & (np.take_along_axis(assign, own[..., None], axis=3)[..., 0] == 0)
        assert whole.any()
    if balancer == "foremoe_balanced":
        assert (plan.layout_owner_MLE != np.arange(E) // (E // R)).any()
    host = balancer == "foremoe_balanced" and seed == 1  # CPU-assisted lanes for every move
    return plan, loads, [compile_stage(plan, loads, r, host_intra=host, host_inter=host) for r in range(R)]


def _owner(plan, m, layer, e):
    return plan.layout_owner_MLE[m, layer, e]


def _nonown(plan, m, layer, r):
    """This rank's replica slots (ascending) in micro-step m."""
    slots = plan.slots_MLRC[m, layer, r]
    return np.nonzero((slots >= 0) & (plan.layout_owner_MLE[m, layer, np.maximum(slots, 0)] != r))[0]


def _bank_slots(tables_R, plan, m, layer, r):
    """The slot each bank row of rank r serves in micro-step m (from its ``slot_source_C``): every replica slot
    has exactly one bank row, rows 0..n-1."""
    K = E // R
    source = tables_R[r][m].layers[layer].slot_source_C
    c = np.nonzero(source >= K)[0]
    rows = source[c] - K
    assert sorted(rows.tolist()) == list(range(len(c))), (m, layer, r)
    assert c.tolist() == _nonown(plan, m, layer, r).tolist(), (m, layer, r)  # exactly the replica slots
    assert np.array_equal(tables_R[r][m].bank_row_LC[layer][c], rows)
    out = np.empty(len(c), dtype=np.int64)
    out[rows] = c
    return out


def test_dispatch_tables_equal_brute_force(compiled):
    plan, loads, tables_R = compiled
    node_R = np.arange(R) // P
    for m in range(M):
        for layer in range(L):
            for r in range(R):
                ref = layer_layout(r, plan.slots_MLRC[m, layer], plan.assign_MLER[m, layer], loads[m, layer], node_R)
                d = tables_R[r][m].layers[layer].dispatch
                send_ER = np.zeros_like(ref.send_ER)
                seg_e = plan.slots_MLRC[m, layer, d.seg_rank_Q, d.seg_slot_Q]
                np.add.at(send_ER, (seg_e, d.seg_rank_Q), np.diff(d.seg_end_Q, prepend=0))
                assert np.array_equal(send_ER, ref.send_ER), (m, layer, r)
                assert np.array_equal(ref.dest_slot_ER[seg_e, d.seg_rank_Q], d.seg_slot_Q)
                assert np.array_equal(d.recv_SC, ref.recv_SC), (m, layer, r)
                assert np.array_equal(d.tokens_E, loads[m, layer, r])


def test_simulated_all_to_all_delivers_every_pair_once(compiled):
    plan, loads, tables_R = compiled
    rng = np.random.default_rng(7)
    for m in range(M):
        for layer in range(L):
            got = [[[] for _ in range(R)] for _ in range(R)]  # got[dst][src]: (slot, expert, pair id)
            sent_ids = []
            for s in range(R):
                d = tables_R[s][m].layers[layer].dispatch
                e_N = rng.permutation(np.repeat(np.arange(E), loads[m, layer, s]))  # this source's routes
                order, rank_N, slot_N = route_pairs(torch.as_tensor(e_N), *(torch.as_tensor(a) for a in (
                    d.seg_end_Q, d.seg_rank_Q, d.seg_slot_Q)), d.num_slots)
                order = order.numpy()
                splits = d.input_splits()
                assert sum(splits) == len(e_N)
                start = 0
                for dst, n in enumerate(splits):  # the send buffer, cut by the input splits
                    for i in order[start : start + n]:
                        got[dst][s].append((int(slot_N[i]), int(e_N[i]), (s, int(i))))
                    start += n
                sent_ids += [(s, i) for i in range(len(e_N))]
            delivered = []
            for dst in range(R):
                d = tables_R[dst][m].layers[layer].dispatch
                rows = 0
                for s in range(R):
                    chunk = got[dst][s]
                    assert len(chunk) == d.recv_SC[s].sum()  # the receiver's output split
                    # slots arrive in order, with the counts the receiver expects
                    assert [c for c, _, _ in chunk] == sorted(c for c, _, _ in chunk)
                    assert np.bincount([c for c, _, _ in chunk], minlength=d.num_slots).tolist() == d.recv_SC[s].tolist()
                    for c, e, pid in chunk:
                        assert d.slot_expert_C[c] == e  # every pair lands on a slot holding its expert
                        delivered.append(pid)
                    rows += len(chunk)
                assert rows == plan.assign_MLER[m, layer, :, dst].sum() == tables_R[dst][m].planned_rows_L[layer]
            assert sorted(delivered) == sorted(sent_ids)  # each pair exactly once


def _expert_of_row(tables_R, plan, m, layer, r, row, K):
    """Expert of a direct-lane send row of rank r: a row of its EP shard (owned, ascending) or a previous
    bank row."""
    if row < K:
        return int(owned_slots_LRK(plan.layout_owner_MLE[m], R)[layer, r, row])
    prev = plan.slots_MLRC[m - 1, layer, r]  # same owners: never read across a step boundary
    return int(prev[_bank_slots(tables_R, plan, m - 1, layer, r)[row - K]])


def test_transfer_lists_pair_up_and_fill_every_replica(compiled):
    plan, loads, tables_R = compiled
    K = E // R
    host_moves = sum(len(t.layers[layer].transfers.host.recv_row_T) for tr in tables_R for t in tr for layer in range(L))
    direct_moves = sum(len(t.layers[layer].transfers.direct.recv_row_T) for tr in tables_R for t in tr for layer in range(L))
    assert (host_moves + direct_moves > 0) == (plan.balancer != "static")
    for m in range(M):
        shard = owned_slots_LRK(plan.layout_owner_MLE[m], R)  # logical expert at each row of each rank's shard
        for layer in range(L):
            lts = [tables_R[r][m].layers[layer].transfers for r in range(R)]
            # every rank joins the host lane's collective exactly when some rank receives on it
            assert {lt.host_any for lt in lts} == {any(len(lt.host.recv_row_T) for lt in lts)}
            # and the gradient return's exactly when some rank holds a replica (static: never)
            held = (plan.slots_MLRC[m, layer] >= 0) & (plan.owner_MLE[m, layer][plan.slots_MLRC[m, layer].clip(0)]
                                                       != np.arange(R)[:, None])
            assert {lt.grad_any for lt in lts} == {bool(held.any())} == {any(len(lt.grad.send_row_T) for lt in lts)}
            for src in range(R):
                for dst in range(R):
                    ex_s, ex_d = lts[src].direct, lts[dst].direct
                    sent = [_expert_of_row(tables_R, plan, m, layer, src, row, K)
                            for peer, row in zip(ex_s.send_peer_T, ex_s.send_row_T) if peer == dst]
                    slots = plan.slots_MLRC[m, layer, dst]
                    slot_of_row = _bank_slots(tables_R, plan, m, layer, dst)
                    recv = [int(slots[slot_of_row[row]]) for peer, row in zip(ex_d.recv_peer_T, ex_d.recv_row_T) if peer == src]
                    assert sent == recv, (m, layer, src, dst)
                    # host lane: the owner stages rows of its shard; the receiver's bank rows want those experts
                    h_s, h_d = lts[src].host, lts[dst].host
                    sent = [shard[layer, src, row] for peer, row in zip(h_s.send_peer_T, h_s.send_row_T) if peer == dst]
                    recv = [int(slots[slot_of_row[row]]) for peer, row in zip(h_d.recv_peer_T, h_d.recv_row_T) if peer == src]
                    assert sent == recv, (m, layer, src, dst)
                    # gradient return: a replica's bank row on src lands on the owner's row of that expert
                    g_s, g_d = lts[src].grad, lts[dst].grad
                    src_slots = plan.slots_MLRC[m, layer, src]
                    sent = [int(src_slots[_bank_slots(tables_R, plan, m, layer, src)[row]])
                            for peer, row in zip(g_s.send_peer_T, g_s.send_row_T) if peer == dst]
                    recv = [shard[layer, dst, row] for peer, row in zip(g_d.recv_peer_T, g_d.recv_row_T) if peer == src]
                    assert sent == recv, (m, layer, src, dst)
            for r in range(R):
                slots = plan.slots_MLRC[m, layer, r]
                n_rep = len(_nonown(plan, m, layer, r))
                # owned slots read the right row of the shard, replicas their bank row
                source = tables_R[r][m].layers[layer].slot_source_C
                for c in np.nonzero(slots >= 0)[0]:
                    if source[c] < K:
                        assert shard[layer, r, source[c]] == slots[c], (m, layer, r, c)
                    else:
                        assert slots[_bank_slots(tables_R, plan, m, layer, r)[source[c] - K]] == slots[c]
                filled = np.concatenate([lts[r].direct.recv_row_T, lts[r].host.recv_row_T, lts[r].keep_row_U])
                # every replica slot exactly once, in arrival order: direct receives (source, slot), host-lane
                # receives, kept replicas; each lane's run is where its all-to-all lands (no second copy)
                assert filled.tolist() == list(range(n_rep)), (m, layer, r)
                for ex in (lts[r].direct, lts[r].host):
                    assert np.all(np.diff(ex.recv_peer_T) >= 0)
                if len(lts[r].keep_row_U):  # a kept replica is copied from the previous bank row of its expert
                    prev = plan.slots_MLRC[m - 1, layer, r][_bank_slots(tables_R, plan, m - 1, layer, r)]
                    now = slots[_bank_slots(tables_R, plan, m, layer, r)]
                    assert prev[lts[r].keep_prev_row_U].tolist() == now[lts[r].keep_row_U].tolist()
                assert lts[r].stale == (m % MPS == 0)
                if lts[r].stale:
                    assert len(lts[r].keep_row_U) == 0  # stale copies are never kept
                    assert all(row < K for row in lts[r].direct.send_row_T)  # only owners send
            # gradient return: every replica's gradient reaches its owner
            owners = np.concatenate([lt.grad.send_peer_T for lt in lts])
            n_recv = sum(len(lt.grad.recv_row_T) for lt in lts)
            assert len(owners) == n_recv


def test_tables_are_small_and_hold_no_global_split(compiled):
    plan, loads, tables_R = compiled
    for t in tables_R[0]:
        for lt in t.layers:
            assert lt.dispatch.recv_SC.shape == (R, plan.slots_MLRC.shape[3])
            assert lt.dispatch.seg_end_Q.size <= E + R * 2 * 2  # (expert, host) pairs with tokens


def test_slot_split_reads_owned_slots_in_place_unless_one_holds_another_row(compiled):
    """The slot GEMM's split (``tables.slot_split``): in place exactly when every owned slot c holds owned row c
    (or nothing); then its rows are the owned slots' received rows. EPLB-style plans fall back to the gather."""
    plan, loads, tables_R = compiled
    K = E // R
    in_place = 0
    for t in (t for ts in tables_R for t in ts):
        for lt in t.layers:
            own = lt.slot_source_C[:K]
            reads_own = bool(np.all((own == np.arange(K)) | (own < 0)))
            assert (lt.split is not None) == reads_own
            if lt.split is not None:
                in_place += 1
                recv = lt.dispatch.recv_SC
                assert (lt.split.owned_rows, lt.split.spare_rows) == (recv[:, :K].sum(), recv[:, K:].sum())
                src = lt.slot_source_C[K:]
                U = len(lt.split.spare_owned_U)
                assert np.array_equal(lt.split.spare_source_J[src >= K], src[src >= K] - K + U)  # bank rows
    total = sum(len(t.layers) for ts in tables_R for t in ts)
    assert in_place == (0 if plan.balancer == "eplb_oracle" else total), (in_place, total)


def test_refuses_a_replica_neither_moved_nor_resident():
    from titan_foremoe.placement.tables import compile_micro_step
    from titan_foremoe.planner.types import TRANSFER_DTYPE

    slots = np.array([[[0, 1, 2], [2, 3, -1]]])  # rank 0 holds a replica of expert 2 in its spare slot
    assign = np.array([[[2, 0], [2, 0], [1, 1], [0, 2]]])
    loads = np.array([[[1, 1, 1, 1], [1, 1, 1, 1]]])
    none = np.zeros(0, dtype=TRANSFER_DTYPE)
    kw = dict(prev_slots_LRC=np.array([[[0, 1, -1], [2, 3, -1]]]), moves_T=none)
    with pytest.raises(ValueError, match="prev_rows_LC .* is required"):  # bank rows depend on history
        compile_micro_step(slots, assign, loads, 0, 2, stale=False, **kw)
    kw["prev_rows_LC"] = np.array([[-1, -1, -1]])  # rank 0 held no replica
    with pytest.raises(RuntimeError, match="expert 2 in slot 2 of rank 0 .layer 0. is neither moved nor resident"):
        compile_micro_step(slots, assign, loads, 0, 2, stale=False, **kw)
    t = compile_micro_step(slots, assign, loads, 0, 2, stale=True, **kw)  # stale: fetched from the owner
    assert t.layers[0].transfers.direct.recv_peer_T.tolist() == [1]
