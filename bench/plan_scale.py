"""Planning at the paper's scale, in one process: a 405B transformer on 8,960 ranks.

Builds every rank's save-plan structure for a Llama-3-405B layout under Megatron-style 3D
parallelism (paper Table 8: TP=8, DP=70, PP=16) without allocating a tensor, then runs the real
code of the tree's leaders and of the coordinator on it: each leader merges its subtree's plan
messages (`merge_plan_messages`), the coordinator reads them, runs `global_save_plan`, cuts the
reply per rank, builds and serialises the global metadata (`build_metadata`,
`CheckpointMetadata.dumps`), and plans a load for one rank of another layout (parse the metadata,
`box_read_items` on meta tensors). Communication is replaced by what it carries: each message is
its JSON bytes, sent up the tree `Comm` builds (nodes of --gpus-per-node ranks, --fan-in).

Model (documented in docs/monitoring.md): 126 layers, hidden 16384, FFN 53248, 128 query / 8 KV
heads of 128, vocab 128256, untied output layer (~406B parameters). bf16 weights; TP shards
linear_qkv and linear_fc1 by rows and linear_proj and linear_fc2 by columns, the embedding and
output layer by vocab rows; layer norms are replicated. PP=16 stages take 8 layers each (the last
two 7); stage 0 holds the embedding, the last stage the final norm and output layer. Weights
are replicated over DP=70 (the planner dedups them, worst-fit). The optimizer is Megatron's
distributed optimizer: per (TP, PP) rank, the fp32 `fp32_param`, `exp_avg` and `exp_avg_sq` of
the stage's parameters form one flat buffer split evenly over the 70 DP ranks, each slice saved as
n-D boxes (`--zero param` instead splits every parameter over DP, a heavier plan). Each rank also
has per-rank RNG state and one dataloader shard.

    python bench/plan_scale.py                    # the paper's layout
    python bench/plan_scale.py --tp 2 --dp 4 --pp 2 --layers 4 --load-tp 2 --load-pp 2   # a quick run
    python bench/plan_scale.py --check             # also: the same plan as the coordinator planning alone
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import tempfile
import random
import resource
import time

import torch

from bcp_core import codec
from bcp_core.comm import _decode, _decode_all, _encode, build_tree, subtree_messages
from bcp_core.load_planner import box_read_items
from bcp_core.loader import read_metadata
from bcp_core.metadata import CHECKSUM_BLOCK_BYTES, METADATA_FILE, num_blocks
from bcp_core.plan_records import (ObjectShardKey, PerRankEntry, PlanRequest, RankValueKey, SaveId, SaveStructure,
                                   ShardEntry, TensorBoxKey, TensorEntry, WriteReport, WrittenPiece)
from bcp_core.save_planner import (build_metadata, global_save_plan, merge_plan_messages, plan_message, plan_replies,
                                   read_plan_messages)
from bcp_core.shards import Box, range_boxes
from bcp_core.storage import storage_for
from bcp_core.utils import gc_paused

OPT_STATES = ("fp32_param", "exp_avg", "exp_avg_sq")


def model_params(layers: int, hidden: int, ffn: int, heads: int, kv_heads: int, vocab: int, pp: int):
    """Per pipeline stage: [(fqn, global shape, tp_dim)] with tp_dim None for replicated tensors."""
    head_dim = hidden // heads
    per_stage = [layers // pp + (1 if s < layers % pp else 0) for s in range(pp)]
    stages, first = [], 0
    for s, n in enumerate(per_stage):
        params = []
        if s == 0:
            params.append(("embedding.word_embeddings.weight", (vocab, hidden), 0))
        for layer in range(first, first + n):
            p = f"decoder.layers.{layer}."
            params += [(p + "input_layernorm.weight", (hidden,), None),
                       (p + "self_attention.linear_qkv.weight", ((heads + 2 * kv_heads) * head_dim, hidden), 0),
                       (p + "self_attention.linear_proj.weight", (hidden, hidden), 1),
                       (p + "pre_mlp_layernorm.weight", (hidden,), None),
                       (p + "mlp.linear_fc1.weight", (2 * ffn, hidden), 0),
                       (p + "mlp.linear_fc2.weight", (hidden, ffn), 1)]
        if s == pp - 1:
            params += [("decoder.final_layernorm.weight", (hidden,), None),
                       ("output_layer.weight", (vocab, hidden), 0)]
        stages.append(params)
        first += n
    return stages


def tp_shard(shape, tp_dim, tp, t):
    """(offsets, lengths) of TP rank t's shard."""
    if tp_dim is None:
        return (0,) * len(shape), tuple(shape)
    n = shape[tp_dim] // tp
    offs = [0] * len(shape)
    lens = list(shape)
    offs[tp_dim], lens[tp_dim] = t * n, n
    return tuple(offs), tuple(lens)


def flat_slice_boxes(offs, lens, start, stop):
    """The boxes, in global coordinates, of elements [start, stop) of the local shard (offs, lens)."""
    return [[[o + so for o, so in zip(o_, offs)], list(l_)] for o_, l_, _ in range_boxes(lens, start, stop)]


def rank_structure(stage_params, tp, dp, t, d, zero):
    tensors = []
    opt_boxes: dict[str, list] = {}
    shards = [(fqn, shape) + tp_shard(shape, tp_dim, tp, t) for fqn, shape, tp_dim in stage_params]
    for fqn, shape, offs, lens in shards:
        tensors.append(TensorEntry(f"model.{fqn}", "bfloat16", list(shape), [[list(offs), list(lens)]]).text())
    if zero == "bucket":  # one flat buffer of the stage's local shards, split evenly over DP
        total = sum(math.prod(s[3]) for s in shards)
        lo, hi = total * d // dp, total * (d + 1) // dp
        pos = 0
        for fqn, _, offs, lens in shards:
            n = math.prod(lens)
            a, b = max(lo, pos), min(hi, pos + n)
            if a < b:
                opt_boxes[fqn] = flat_slice_boxes(offs, lens, a - pos, b - pos)
            pos += n
    else:  # every parameter's local shard split over DP
        for fqn, _, offs, lens in shards:
            n = math.prod(lens)
            boxes = flat_slice_boxes(offs, lens, n * d // dp, n * (d + 1) // dp)
            if boxes:
                opt_boxes[fqn] = boxes
    by_fqn = {fqn: shape for fqn, shape, _, _ in shards}
    for fqn, boxes in opt_boxes.items():
        for state in OPT_STATES:
            tensors.append(TensorEntry(f"optimizer.state.{fqn}.{state}", "float32", list(by_fqn[fqn]), boxes).text())
    return SaveStructure(tuple(tensors), ("optimizer.param_groups", "iteration", "args", "checkpoint_version"),
                         (PerRankEntry("extra_state.rng", None, None),
                          PerRankEntry("extra_state.cuda_rng", "uint8", (16,))),
                         (ShardEntry("dataloader.rank", (dp,), (d,)),))


def rank_coords(rank, tp, dp):
    """Megatron's default order: TP fastest, then DP, then PP."""
    return rank % tp, rank // tp % dp, rank // (tp * dp)


SAVE = SaveId(1, 1000, "/ckpt/iter_0001000")  # the identity every message of the save carries


def fake_reports(structures, gplan, rng, tp, dp):
    """What each rank reports after writing its assignment: pieces with file, offset, checksums."""
    reports = []
    for r, st in enumerate(structures):
        pieces, pos = [], 0
        file = f"data/r{r}_0.safetensors"
        for ti, bi in gplan.assignments[r].boxes:
            entry = TensorEntry.parse(st.tensors[ti])
            fqn, dt = entry.fqn, entry.dtype
            offs, lens = entry.boxes[bi]
            nbytes = math.prod(lens) * (2 if dt == "bfloat16" else 4)
            sums = tuple(rng.getrandbits(64) for _ in range(num_blocks(nbytes, CHECKSUM_BLOCK_BYTES)))
            pieces.append(WrittenPiece(TensorBoxKey(fqn, tuple(offs), tuple(lens)), file, pos, nbytes, sums))
            pos += nbytes
        for i in gplan.assignments[r].shards:
            shard = st.sharded_objects[i]
            pieces.append(WrittenPiece(ObjectShardKey(shard.fqn, shard.index), file, pos, 300, (rng.getrandbits(64),)))
            pos += 300
        pieces.append(WrittenPiece(RankValueKey("extra_state.cuda_rng"), file, pos, 16, (rng.getrandbits(64),)))
        reports.append(WriteReport(
            SAVE, st.digest(),
            {"optimizer.param_groups": [{"lr": 1e-4, "params": ["..."]}], "iteration": 1000,
             "args": {"tp": 8}, "checkpoint_version": 3.0} if r == 0 else {},
            {"extra_state.rng": {"seed": r % 70}, "extra_state.cuda_rng": ["uint8", [16], f"{r % 7:032x}"]},
            (f"{rank_coords(r, tp, dp)[1]:032x}",), {}, tuple(pieces)))
    return reports


def peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tp", type=int, default=8)
    ap.add_argument("--dp", type=int, default=70)
    ap.add_argument("--pp", type=int, default=16)
    ap.add_argument("--layers", type=int, default=126)
    ap.add_argument("--hidden", type=int, default=16384)
    ap.add_argument("--ffn", type=int, default=53248)
    ap.add_argument("--heads", type=int, default=128)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=128256)
    ap.add_argument("--zero", choices=["bucket", "param"], default="bucket")
    ap.add_argument("--fan-in", type=int, default=32)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--load-tp", type=int, default=4, help="layout of the loading job (TP)")
    ap.add_argument("--load-pp", type=int, default=8, help="layout of the loading job (PP)")
    ap.add_argument("--check", action="store_true", help="also plan from the whole structures on the coordinator "
                    "alone (the ranks' entries grouped there) and check the plan is the same")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    world = a.tp * a.dp * a.pp
    out: dict = {"world_size": world, "tp": a.tp, "dp": a.dp, "pp": a.pp, "zero": a.zero}
    stages = model_params(a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.pp)
    out["parameters"] = sum(math.prod(s) for st in stages for _, s, _ in st)
    rng = random.Random(0)

    # 1. Every rank's planning message, as the bytes it sends (built here one rank after another;
    #    in a job each rank builds its own, in parallel).
    def structures():  # every rank's, one after another (not held while the coordinator plans)
        for r in range(world):
            t, d, p = rank_coords(r, a.tp, a.dp)
            yield rank_structure(stages[p], a.tp, a.dp, t, d, a.zero)

    t0 = time.perf_counter()
    messages = [_encode(plan_message(PlanRequest(SAVE, st.digest(), None, st), r)) for r, st in enumerate(structures())]
    out["build_messages_s"] = time.perf_counter() - t0
    out["gathered_mib"] = sum(map(len, messages)) / 2**20
    st0 = next(structures())
    out["boxes"] = sum(len(TensorEntry.parse(t).boxes) for t in st0.tensors)

    # The cached-plan path: a rank whose structure is unchanged hashes it, finds the plan, and
    # sends nothing (the cost of one rank: its structure's encoding and digest, then a lookup).
    cache = {st0.digest(): "plan"}
    t0 = time.perf_counter()
    reps = 20
    for _ in range(reps):
        assert st0.digest() in cache
    out["cached_plan_ms"] = (time.perf_counter() - t0) / reps * 1e3

    # 2. Up the tree (Comm.gather with merge): each leader decodes its children's messages, merges
    #    them with its own (save_planner.merge_plan_messages: an entry's replicas grouped) and sends
    #    the result up. The leaders of one tree level work at the same time, so what the leaders add
    #    to planning is the sum over levels of the slowest leader's merge (its CPU time).
    tree = build_tree([r // a.gpus_per_node for r in range(world)], a.fan_in)
    depth, height = {0: 0}, [0] * world
    for r in range(1, world):  # parents have lower ranks
        depth[r] = depth[tree.parent[r]] + 1
    out["tree_depth"] = tree.depth
    out["tree_max_children_per_level"] = max(len(lv) for levels in tree.children for lv in levels)
    out["flat_coordinator_messages"] = world - 1
    out["tree_coordinator_messages"] = sum(len(lv) for lv in tree.children[0])
    slowest: dict[int, float] = {}  # a leader's height in the tree -> its slowest merge
    sent = {}
    for r in reversed(range(1, world)):  # children have higher ranks than their leader
        kids = [c for level in tree.children[r] for c in level]
        if not kids:
            sent[r] = messages[r]
            continue
        height[r] = 1 + max(height[c] for c in kids)
        own = _decode(messages[r])  # a leader holds its own message as an object
        t0 = time.process_time()  # CPU time: in a job each leader is a process of its own
        sent[r] = _encode(merge_plan_messages([own] + _decode_all([sent.pop(c) for c in kids])))
        slowest[height[r]] = max(slowest.get(height[r], 0.0), time.process_time() - t0)
    out["leaders_s"] = sum(slowest.values())
    out["leader_levels_s"] = [round(slowest[h], 4) for h in sorted(slowest)]
    own = _decode(messages[0])
    received = [sent.pop(c) for level in tree.children[0] for c in level]
    out["coordinator_receives_mib"] = sum(map(len, received)) / 2**20
    del messages, sent
    gc.collect()

    # The coordinator: decode and merge its children's messages, read the requests, plan, reply.
    t_plan, c_plan = time.perf_counter(), time.process_time()
    gathered = read_plan_messages(merge_plan_messages([own] + _decode_all(received)), world, SAVE)
    t1 = time.perf_counter()
    gplan = global_save_plan([q.structure for q in gathered.requests], None, gathered.entries)
    t2 = time.perf_counter()
    # the coordinator's part of the scatter: one message per child, holding its subtree's replies
    replies = plan_replies(gplan, SAVE, "0" * 8, "p" * 16)
    to_children = subtree_messages(tree, 0, replies)
    t3 = time.perf_counter()
    out["decode_s"], out["global_plan_s"], out["scatter_encode_s"] = t1 - t_plan, t2 - t1, t3 - t2
    out["planning_s"] = t3 - t_plan
    out["planning_cpu_s"] = time.process_time() - c_plan
    out["peak_mib_after_plan"] = peak_mib()
    if a.check:  # the plan of every rank's whole structure, grouped on the coordinator alone: the same
        flat = global_save_plan(list(structures()))
        out["same_plan_as_flat"] = all(getattr(flat, f.name) == getattr(gplan, f.name)
                                       for f in dataclasses.fields(flat))
        if not out["same_plan_as_flat"]:
            raise SystemExit("the plan gathered over the tree differs from the flat one")
    # a rank's reply travels once per tree level above it
    sizes = [len(json.dumps(x, separators=(",", ":"))) for x in replies]
    out["reply_bytes_max"] = max(sizes)
    out["reply_bytes_total"] = sum(n * depth[r] for r, n in enumerate(sizes))
    out["coordinator_sends_mib"] = sum(map(len, to_children.values())) / 2**20
    # the old flat broadcast sent every rank all assignments
    out["broadcast_bytes_total_flat"] = len(json.dumps([codec.to_wire(x) for x in gplan.assignments],
                                                       separators=(",", ":"))) * world
    loads = gplan.bytes_per_rank
    out["write_bytes_max_gib"] = max(loads) / 2**30
    out["write_bytes_mean_gib"] = sum(loads) / len(loads) / 2**30
    del replies, to_children, received, gathered

    # 3. Commit: every rank's report (pieces with checksums) -> global metadata, serialised.
    reports = fake_reports(structures(), gplan, rng, a.tp, a.dp)
    rank_keys = [st.digest() for st in structures()]
    gc.collect()
    t0 = time.perf_counter()
    md = build_metadata(gplan, rank_keys, reports, "megatron", {})
    t1 = time.perf_counter()
    raw = gc_paused(md.dumps)()  # as the commit does
    out["metadata_build_s"], out["metadata_dumps_s"] = t1 - t0, time.perf_counter() - t1
    out["metadata_mib"] = len(raw) / 2**20
    out["pieces"] = sum(len(tm.pieces) for tm in md.tensors.values())
    out["checkpoint_tib"] = sum(tm.nbytes for tm in md.tensors.values()) / 2**40
    out["peak_mib_after_metadata"] = peak_mib()
    del reports, md, gplan
    gc.collect()

    # 4. Load planning for rank 0 of another layout (load_tp x load_pp, same DP product): parse the
    #    metadata, then intersect each target box with the saved pieces (meta tensors: no memory).
    with tempfile.TemporaryDirectory() as tmp:
        st = storage_for(tmp)
        st.write_atomic(METADATA_FILE, raw)
        t0 = time.perf_counter()
        md = read_metadata(st)  # what load does: read and validate
        t1 = time.perf_counter()
    lstages = model_params(a.layers, a.hidden, a.ffn, a.heads, a.kv_heads, a.vocab, a.load_pp)
    load_dp = world // (a.load_tp * a.load_pp)
    target = rank_structure(lstages[0], a.load_tp, load_dp, 0, 0, a.zero)
    items = 0
    for entry in map(TensorEntry.parse, target.tensors):
        fqn = entry.fqn
        tm = md.tensors[fqn]
        for offs, lens in entry.boxes:
            view = torch.empty(lens, dtype=tm.dtype, device="meta")
            items += len(box_read_items(fqn, tm, Box(tuple(offs), tuple(lens), view)))
    t2 = time.perf_counter()
    out["load_layout"] = f"TP={a.load_tp} PP={a.load_pp} DP={load_dp}"
    out["load_metadata_parse_s"], out["load_plan_s"], out["load_read_items"] = t1 - t0, t2 - t1, items
    out["peak_mib"] = peak_mib()
    return out


def _print(out: dict) -> None:
    print(f"{out['world_size']} ranks (TP={out['tp']} DP={out['dp']} PP={out['pp']}), "
          f"{out['parameters'] / 1e9:.1f}B parameters, optimizer layout '{out['zero']}'")
    print(f"  gathered plan messages  {out['gathered_mib']:.1f} MiB ({out['boxes']} boxes on rank 0)")
    print(f"  tree                    depth {out['tree_depth']}, <= {out['tree_max_children_per_level']} children "
          f"per level; coordinator reads {out['tree_coordinator_messages']} messages (flat: "
          f"{out['flat_coordinator_messages']})")
    print(f"  coordinator receives    {out['coordinator_receives_mib']:.1f} MiB, merged by the tree's leaders "
          f"(slowest leader per level {out['leader_levels_s']} s: {out['leaders_s']:.2f} s in all)")
    print(f"  coordinator planning    {out['planning_s']:.2f} s, {out['planning_cpu_s']:.2f} s CPU  (decode and "
          f"read {out['decode_s']:.2f}, global plan {out['global_plan_s']:.2f}, per-rank replies "
          f"{out['scatter_encode_s']:.2f})" + ("; the same plan as flat" if out.get("same_plan_as_flat") else ""))
    print(f"  plan replies (scatter)  {out['reply_bytes_total'] / 2**20:.1f} MiB over all tree edges, largest "
          f"{out['reply_bytes_max'] / 1024:.1f} KiB, coordinator sends {out['coordinator_sends_mib']:.1f} MiB "
          f"(a broadcast of all assignments: {out['broadcast_bytes_total_flat'] / 2**30:.1f} GiB)")
    print(f"  write balance           max {out['write_bytes_max_gib']:.2f} GiB / mean "
          f"{out['write_bytes_mean_gib']:.2f} GiB per rank")
    print(f"  metadata                build {out['metadata_build_s']:.2f} s, serialise "
          f"{out['metadata_dumps_s']:.2f} s, {out['metadata_mib']:.1f} MiB "
          f"JSON, {out['pieces']} pieces, checkpoint {out['checkpoint_tib']:.2f} TiB")
    print(f"  cached plan (per save)  {out['cached_plan_ms']:.2f} ms on each rank, no messages")
    print(f"  load plan ({out['load_layout']}, rank 0)  parse metadata {out['load_metadata_parse_s']:.2f} s, "
          f"plan {out['load_plan_s']:.3f} s, {out['load_read_items']} read items")
    print(f"  peak memory             {out['peak_mib']:.0f} MiB (after planning {out['peak_mib_after_plan']:.0f}, "
          f"after metadata {out['peak_mib_after_metadata']:.0f})")


if __name__ == "__main__":
    import sys
    result = main()
    if "--json" in sys.argv:
        print(json.dumps(result, indent=1))
    else:
        _print(result)
