"""Tree communication: 12 gloo ranks arranged as 4 simulated nodes of 3, fan-in 2.

The tree must respect the fan-in bound (no rank ever waits on more than `fan_in` messages at
once), give exactly the results of a flat exchange (a gather whose leaders merge their subtrees
included), carry a whole save (plan scatter + commit gather), and name a missing rank deep in the
tree.
"""

from __future__ import annotations

import json
import os
from datetime import timedelta

import pytest
import torch

from bcp_core.comm import Comm, build_tree
from bcp_core.plan_records import PlanRequest, SaveId, SaveStructure, TensorEntry
from bcp_core.save_planner import group_entries, merge_plan_messages, plan_message, read_plan_messages
from dist import mark, run_ranks, wait_for_file

WORLD, NODE, FAN_IN = 12, 3, 2


def _check_tree(nodes, fan_in):
    tree = build_tree(nodes, fan_in)
    n = len(nodes)
    assert tree.parent[0] is None and all(tree.parent[r] is not None for r in range(1, n))
    for r in range(n):
        for level in tree.children[r]:
            assert 1 <= len(level) <= fan_in
        # a subtree is the contiguous range r .. r+span-1, the concatenation of its children's
        kids = sorted(c for level in tree.children[r] for c in level)
        covered = [r]
        for c in kids:
            assert covered[-1] + 1 == c
            covered.extend(range(c, c + tree.span[c]))
            covered = [covered[0], covered[-1]]
        assert covered[-1] == r + tree.span[r] - 1
    # local ranks -> node leader: on a node no larger than the fan-in allows, every rank's parent
    # is the node's lowest rank
    for r in range(n):
        first = nodes.index(nodes[r])
        if r != first and nodes.count(nodes[r]) <= fan_in + 1:
            assert tree.parent[r] == first
    assert tree.span[0] == n
    return tree


def test_tree_shape():
    tree = _check_tree([r // NODE for r in range(WORLD)], FAN_IN)
    assert tree.children[0] == ((1, 2), (3, 6), (9,))
    assert tree.children[9] == ((10, 11),)
    assert tree.parent[10] == 9 and tree.parent[9] == 0 and tree.depth == 2
    # the paper's scale: 8,960 ranks on 1,120 nodes of 8
    big = _check_tree([r // 8 for r in range(8960)], 32)
    assert big.depth == 3 and max(len(lv) for levels in big.children for lv in levels) == 32
    # nodes larger than the fan-in are cut into blocks; uneven nodes; one rank
    _check_tree([r // 10 for r in range(37)], 4)
    _check_tree([0, 0, 0, 1, 2, 2, 3, 3, 3, 3, 3], 2)
    assert build_tree([0], 4).span == (1,)


SAVE = SaveId(1, None, "/ckpt")


def _request(rank: int) -> PlanRequest:
    """Rank `rank`'s plan request: a weight sharded over 3 "TP" ranks, replicated over the others,
    and an optimizer slice of its own."""
    weight = TensorEntry("w", "float32", [6, 4], [[[rank % 3 * 2, 0], [2, 4]]]).text()
    opt = TensorEntry("opt.w", "float32", [WORLD], [[[rank], [1]]]).text()
    return PlanRequest(SAVE, f"k{rank}", None, SaveStructure((weight, opt), ("cfg",), (), ()))


def _tree_vs_flat(rank, world_size, root):
    import bcp_core as bcp
    out = {}
    tree = Comm(tag="tree", fan_in=FAN_IN, local_world_size=NODE)
    flat = Comm(tag="flat", fan_in=world_size, local_world_size=world_size)
    assert flat.tree.depth == 1 and tree.tree.depth == 2
    msg = {"rank": rank, "boxes": [[rank, rank + 1]] * (rank % 3), "name": f"r{rank}"}
    for c in (tree, flat):
        got = {
            "gather": c.gather(msg, "plan"),
            # each leader merges its subtree's plan requests (replicas of an entry grouped)
            "merged": c.gather(plan_message(_request(rank), rank), "merged", merge=merge_plan_messages),
            "broadcast": c.broadcast({"plan": list(range(5))} if rank == 0 else None, "bcast"),
            "scatter": c.scatter([{"for": r, "w": [r] * r} for r in range(world_size)] if rank == 0 else None,
                                 "scatter"),
            "all_gather": c.all_gather([rank, str(rank)], "allgather"),
        }
        c.barrier("barrier")
        out[c is tree] = got
    assert out[True] == out[False]
    assert out[True]["scatter"] == {"for": rank, "w": [rank] * rank}
    assert out[True]["all_gather"] == [[r, str(r)] for r in range(world_size)]
    if rank == 0:
        assert out[True]["gather"] == [{"rank": r, "boxes": [[r, r + 1]] * (r % 3), "name": f"r{r}"}
                                       for r in range(world_size)]
        requests = [_request(r) for r in range(world_size)]
        gathered = read_plan_messages(out[True]["merged"], world_size, SAVE)
        assert gathered.entries == group_entries([q.structure for q in requests])
        assert len(gathered.entries) == 3 + world_size  # 3 distinct weight shards, one optimizer slice per rank
        assert [(q.key, q.structure.tensors) for q in gathered.requests] == [(q.key, ()) for q in requests]
    # the fan-in bound is respected on every rank; the flat exchange has the coordinator wait on all
    out["tree_wait"] = tree.max_wait_keys
    out["flat_wait"] = flat.max_wait_keys

    # A whole save through the tree (plan scatter, commit gather) equals the flat save.
    state = {"w": torch.arange(24.0).reshape(6, 4), "extra_state": {"rank": rank % 2}}
    os.environ.update(BCP_LOCAL_WORLD_SIZE=str(NODE), BCP_FAN_IN=str(FAN_IN))
    bcp.save(os.path.join(root, "tree"), state, role="tree-save").wait()
    del os.environ["BCP_LOCAL_WORLD_SIZE"], os.environ["BCP_FAN_IN"]
    bcp.save(os.path.join(root, "flat"), state, role="flat-save").wait()
    target = {"w": torch.zeros(6, 4), "extra_state": {"rank": -1}}
    bcp.load(os.path.join(root, "tree"), target)
    assert torch.equal(target["w"], state["w"]) and target["extra_state"]["rank"] == rank % 2

    # A rank deep in the tree (10, under node leader 9) never comes: every rank names it. Each rank
    # calls the save once every rank below it in the tree is in it (an event), so that only rank 10 is
    # missing when a rank above it gives up after the 3 s it tests; the others wait up to 60 s for
    # the answer naming it.
    os.environ.update(BCP_LOCAL_WORLD_SIZE=str(NODE), BCP_FAN_IN=str(FAN_IN))
    if rank == 10:
        return out
    for below in range(rank + 1, rank + tree.tree.span[rank]):
        if below != 10:
            wait_for_file(os.path.join(root, f"missing_called_{below}"))
    timeout = timedelta(seconds=3 if rank in tree.tree.ancestors(10) else 60)
    with pytest.raises(bcp.SaveError, match=r"rank\(s\) \[10\] that never arrived"):
        if rank == 0:
            bcp.save(os.path.join(root, "missing"), state, role="tree-missing", timeout=timeout)
        else:
            handle = bcp.save(os.path.join(root, "missing"), state, role="tree-missing", async_save=True,
                              timeout=timeout)
            mark(os.path.join(root, f"missing_called_{rank}"))
            handle.wait()
    return out


def _normalised(path):
    with open(os.path.join(path, "bcp_metadata.json")) as f:
        md = json.load(f)
    return {k: v for k, v in md.items() if k != "files"}


def test_tree_matches_flat_and_respects_fan_in(tmp_path):
    results = run_ranks(WORLD, _tree_vs_flat, str(tmp_path), timeout=240)
    assert all(r["tree_wait"] <= FAN_IN for r in results)
    assert results[0]["flat_wait"] == WORLD - 1
    # leaders really gathered for their nodes: rank 9 waited on its two node-mates
    assert results[9]["tree_wait"] == FAN_IN
    assert _normalised(tmp_path / "tree") == _normalised(tmp_path / "flat")
    assert not (tmp_path / "missing" / "bcp_metadata.json").exists()
