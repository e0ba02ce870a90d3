"""A collective load after the job made process groups only some ranks belong to.

torch names a group made with `use_local_synchronization=True` after the number of groups the
calling rank knows; once ranks know different numbers (Megatron's pipeline and embedding groups,
a group of rank 0 alone here), the members of such a group wait under different store keys
forever. bcp's node group for the metadata broadcast is made outside torch's registry, under a
name every member computes alike, so the load below finishes.
"""

from __future__ import annotations

import torch

from dist import run_ranks


def _load_after_uneven_groups(rank, world_size, path):
    import torch.distributed as dist

    import bcp_core as bcp
    from bcp_core.comm import _NODE_GROUPS
    dist.new_group([0], backend="gloo")  # rank 1 is no member: the ranks now know different numbers of groups
    state = {"w": torch.arange(12.0).reshape(3, 4) + rank * 0}
    bcp.save(path, state).wait()
    got = []
    for _ in range(2):  # the second load reuses the node group
        target = {"w": torch.zeros(3, 4)}
        bcp.load(path, target, share_reads=True)
        got.append(torch.equal(target["w"], state["w"]))
    return got, len(_NODE_GROUPS)


def test_collective_load_after_groups_of_some_ranks(tmp_path):
    results = run_ranks(2, _load_after_uneven_groups, str(tmp_path / "ckpt"), timeout=90)
    assert results == [([True, True], 1), ([True, True], 1)]
