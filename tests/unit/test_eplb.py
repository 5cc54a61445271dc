"""Expert-parallel load balancing's policy (replicate the hottest experts,
pack the slots onto the ranks), slot routing among replicas, balancedness,
and what /metrics shows of it (the weight moves run in
tests/integration/test_moe_parallel.py)."""

import torch

from appliance.engine.outputs import StepStats
from appliance.models.eplb import LayerPlacement, balancedness, initial_placement, pack, rebalance, replicate
from appliance.server.metrics import Metrics
from tests.integration.server_helpers import metric


def test_replicas_go_to_the_most_load_per_replica():
    slots, count = replicate(torch.tensor([100, 10, 60, 5]), 7)
    assert slots[:4] == [0, 1, 2, 3] and sorted(slots[4:]) == [0, 0, 2]  # 100 -> 50 -> 33 vs 60 -> 30
    assert count == [3, 1, 2, 1]
    assert replicate(torch.tensor([3, 3]), 3)[0] == [0, 1, 0]  # a tie to the lowest id


def test_packing_puts_the_heaviest_slot_on_the_lightest_rank_with_room():
    packs = pack([9.0, 1.0, 8.0, 2.0, 5.0, 5.0], 3)
    assert [sorted(p) for p in packs] == [[0, 1], [2, 3], [4, 5]]
    assert all(len(p) == 2 for p in packs)


def test_rebalance_evens_two_hot_experts_on_one_rank():
    load = torch.tensor([500, 500, 0, 0, 0, 250, 250, 0])  # experts 0 and 1 both on rank 0 of 4
    start = torch.tensor([float(load[e]) for e in initial_placement(8, 8)])
    assert balancedness(start, 4) == 0.375  # rank 0 takes 1000 of 1500
    placed = rebalance(load, 12, 4)  # four redundant slots
    assert placed == [0, 4, 5, 1, 6, 7, 0, 0, 2, 1, 1, 3]  # rank r: slots 3r .. 3r + 2, by expert id
    lp = LayerPlacement(placed, 8)
    assert lp.replicas.tolist() == [3, 3, 1, 1, 1, 1, 1, 1]  # the extra slots to the most load per replica
    per_slot = torch.tensor([float(load[e]) / int(lp.replicas[e]) for e in placed])
    assert balancedness(per_slot, 4) > 0.89


def test_pairs_take_an_experts_replicas_in_turn():
    lp = LayerPlacement([0, 1, 2, 0, 1, 3], 4)  # experts 0 and 1 in two slots each
    assert lp.replica_slots.tolist() == [[0, 3], [1, 4], [2, -1], [5, -1]]
    ids = torch.tensor([[0, 1], [0, 2], [0, 3], [1, 0]])
    assert lp.to_slots(ids).tolist() == [[0, 1], [3, 2], [0, 5], [4, 3]]  # row t: replica t mod 2


def test_metrics_show_balancedness_expert_load_and_slot_ratios():
    m = Metrics("m", "cpu", "h", "d")
    new = StepStats(eplb_balancedness=0.6, eplb_rebalances=1, expert_load=[7, 0, 3],
                    eplb_slot_load_ratios=[2.0, 0.5, 0.5])
    m.on_core_stats(StepStats(), new)
    text = m.render().decode()
    assert metric(text, "appliance:eplb_balancedness", engine="0") == 0.6
    assert metric(text, "appliance:eplb_rebalances_total", engine="0") == 1
    assert metric(text, "appliance:expert_load", engine="0", expert="2") == 3
    assert metric(text, "appliance:eplb_slot_load_ratio_count", engine="0") == 3
