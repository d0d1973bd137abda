"""The engine fleet's layout and request deal: brute-force oracles on small fleets."""

import itertools

import numpy as np
import pytest

from titan_foremoe.rollouts.engines.sync_cost import group_ranks
from titan_foremoe.rollouts.fleet.dealing import deal, engine_tokens, request_tokens
from titan_foremoe.rollouts.fleet.layout import LayoutError, engine_layout


def test_colocated_one_engine_per_node_fed_from_its_own_node():
    L = engine_layout(trainer_gpus=64, gpus_per_node=8, engines=0, gpus_per_engine=8, colocated=True)
    assert L.count == 8 and L.engine_gpus == 0
    for e in L.engines:
        assert e.node == e.source_rank // 8 == e.index
        assert set(e.members) == set(range(8 * e.index, 8 * e.index + 8))
        assert L.launcher_rank(e.index) == e.source_rank
    assert sorted(r for e in L.engines for r in e.members) == list(range(64))  # every GPU in exactly one engine


def test_colocated_two_engines_per_node():
    L = engine_layout(trainer_gpus=16, gpus_per_node=8, engines=0, gpus_per_engine=4, colocated=True)
    assert [e.node for e in L.engines] == [0, 0, 1, 1] and L.sources() == [0, 4, 8, 12]


@pytest.mark.parametrize("kw, words", [
    (dict(gpus_per_engine=3, colocated=True), "inside one node"),
    (dict(gpus_per_engine=16, colocated=True), "inside one node"),
    (dict(gpus_per_engine=8, colocated=True, engines=9), "engines = 9"),
    (dict(gpus_per_engine=8, colocated=True, urls=["http://a:1"]), "urls with colocated"),
    (dict(gpus_per_engine=0, colocated=False), "gpus_per_engine = 0"),
])
def test_bad_fleets_are_one_line(kw, words):
    args = dict(trainer_gpus=64, gpus_per_node=8, engines=0)
    args.update(kw)
    with pytest.raises(LayoutError, match=words) as e:
        engine_layout(**args)
    assert "\n" not in str(e.value)


def test_disaggregated_sources_on_different_nodes_first():
    L = engine_layout(trainer_gpus=16, gpus_per_node=8, engines=6, gpus_per_engine=8, colocated=False)
    assert L.engine_gpus == 48 and not L.colocated
    nodes = [s // 8 for s in L.sources()]
    assert nodes[:2] == [0, 1] and len(set(L.sources())) == 6  # alternate nodes, never one source twice
    for e in L.engines:
        assert list(e.members) == group_ranks(e.index, 16, 8) and e.members[0] == e.source_rank
        assert L.launcher_rank(e.index) == 0


def test_user_urls_are_the_fleet():
    L = engine_layout(trainer_gpus=2, gpus_per_node=2, engines=5, gpus_per_engine=1, colocated=False,
                      urls=["http://a:1", "http://b:2"])
    assert L.count == 2 and [e.url for e in L.engines] == ["http://a:1", "http://b:2"]
    assert not any(e.launched for e in L.engines)


def _best_max(tokens, K):
    return min(max(np.bincount(a, weights=tokens, minlength=K)) for a in itertools.product(range(K), repeat=len(tokens)))


@pytest.mark.parametrize("seed", range(20))
def test_deal_is_lpt_within_its_bound_of_the_brute_force_optimum(seed):
    rng = np.random.default_rng(seed)
    G, K = int(rng.integers(3, 8)), int(rng.integers(2, 4))
    tokens = request_tokens(rng.integers(10, 200, G), rng.integers(1, 5, G), float(rng.integers(50, 500)))
    got = deal(tokens, np.ones(K, bool))
    assert np.array_equal(got, deal(tokens, np.ones(K, bool)))  # pure: every rank deals the same
    per_K = engine_tokens(tokens, got, K)
    assert per_K.sum() == tokens.sum()
    opt = _best_max(tokens, K)
    assert per_K.max() <= (4 / 3 - 1 / (3 * K)) * opt + 1e-9  # Graham's LPT bound
    assert per_K.max() >= opt


def test_deal_balances_tokens_not_request_counts():
    tokens = np.array([1000, 10, 10, 10, 10, 10])
    got = deal(tokens, np.ones(2, bool))
    assert np.bincount(got).tolist() == [1, 5]  # a count deal would give 3 and 3


def test_dead_engine_gets_nothing_and_the_survivors_take_its_requests_on_top_of_their_load():
    rng = np.random.default_rng(0)
    tokens = rng.integers(100, 1000, 40)
    first = deal(tokens, np.ones(3, bool))
    lost = first == 1
    load = engine_tokens(tokens[~lost], first[~lost], 3)
    again = deal(tokens[lost], np.array([True, False, True]), load_K=load)
    assert set(again.tolist()) <= {0, 2}
    final = engine_tokens(tokens[~lost], first[~lost], 3) + engine_tokens(tokens[lost], again, 3)
    assert final[1] == 0 and final.sum() == tokens.sum()
    assert abs(int(final[0]) - int(final[2])) <= tokens.max()
    with pytest.raises(ValueError, match="no engine is alive"):
        deal(tokens, np.zeros(3, bool))
