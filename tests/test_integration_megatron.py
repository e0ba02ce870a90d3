"""bcp as a Megatron-core dist_checkpointing backend, on real GPTModels over gloo.

One 2-rank run walks a checkpoint through the layouts (TP2 -> TP1xPP2 -> TP1 -> TP2, plus PP2 ->
PP1, an async save and a torch_dist save of the same state) and reports, per case, every
ShardedTensor it checked; the tests below assert on those reports. A second 2-rank run reshards
hand-built distributed-optimizer state across DP and TP. Every ShardedTensor is filled from its
global coordinates (`expected`), so each rank knows what its boxes must hold after a load, and a
misplaced element cannot go unseen. Targets are filled with a sentinel before every load.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

import bcp_core as bcp
import megatron_releases
from dist import run_ranks

megatron_releases.skip_without_megatron_core()

SENTINEL = -3.0


# ----------------------------------------------------------------------------- rank-side helpers

def expected(key: str, shape, dtype=torch.float32) -> torch.Tensor:
    """The global tensor `key` of the test state: distinct, exactly representable values."""
    n = 1
    for s in shape:
        n *= s
    base = zlib.crc32(key.encode()) % 997
    return ((torch.arange(n, dtype=torch.int64) * 3 + base) % 65521).to(dtype).div_(8).reshape(shape)


def _box(sh):
    lengths = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset, lengths))


def _sharded_tensors(sd):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bcp_integrations.megatron.adapter import iter_leaves
    return [v for _, v in iter_leaves(sd) if isinstance(v, ShardedTensor)]


def _fill(sd, value=None) -> None:
    """Every ShardedTensor's data := its part of `expected` (or `value` everywhere)."""
    with torch.no_grad():
        for sh in _sharded_tensors(sd):
            if value is None:
                sh.data.copy_(expected(sh.key, sh.global_shape, sh.dtype)[_box(sh)].reshape(sh.local_shape))
            else:
                sh.data.fill_(value)


def _check(sd, case: str, rank: int, tensors=None) -> dict:
    """Compare every ShardedTensor of `sd` (or `tensors`, aligned with them) bit for bit."""
    bad, n = [], 0
    shs = _sharded_tensors(sd)
    for i, sh in enumerate(shs):
        got = sh.data if tensors is None else tensors[i]
        want = expected(sh.key, sh.global_shape, sh.dtype)[_box(sh)].reshape(sh.local_shape)
        n += 1
        if not torch.equal(got, want):
            bad.append(f"{case}: rank {rank} {sh.key} at {tuple(sh.global_offset)}")
    return {"checked": n, "bad": bad}


def _gpt(tp: int, pp: int):
    """A tiny GPTModel at TP=tp, PP=pp over the 2 gloo ranks (DP fills the rest)."""
    from megatron.core import parallel_state as ps
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                 create_gloo_process_groups=True)
    torch.manual_seed(1234)
    cfg = TransformerConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64,
                            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                            use_cpu_initialization=True, params_dtype=torch.float32,
                            pipeline_dtype=torch.float32)
    # Untied embeddings: tying them across stages needs an all-reduce Megatron issues only on CUDA.
    return GPTModel(cfg, get_gpt_layer_local_spec(), vocab_size=128, max_sequence_length=32,
                    pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False)


def _dir(root: str, name: str) -> str:
    path = os.path.join(root, name)
    os.makedirs(path, exist_ok=True)
    torch.distributed.barrier()
    return path


# ----------------------------------------------------------------------------- GPT layouts

def _gpt_layouts(rank, world_size, root, release):
    megatron_releases.activate(release)
    from megatron.core import dist_checkpointing as dcp

    import bcp_integrations.megatron  # noqa: F401 - routes dist_checkpointing's entry points
    megatron_releases.check_active(release)

    out: dict = {}

    def load_and_check(model, path, case):
        sd = model.sharded_state_dict()
        _fill(sd, SENTINEL)
        loaded = dcp.load(sd, path)
        model.load_state_dict(loaded)
        out[case] = _check(model.sharded_state_dict(), case, rank)

    # TP=2: the source. bcp sync, bcp async (state changed after staging), torch_dist.
    model = _gpt(2, 1)
    sd = model.sharded_state_dict()
    _fill(sd)
    dcp.save(sd, _dir(root, "tp2"), sharded_strategy=("bcp", 1))
    # Async through Megatron's own queue, as Megatron-LM schedules it. The queue puts its
    # completion all-reduce on torch.cuda.current_device(), so that call alone is redirected.
    from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue
    saved_cuda = torch.cuda.synchronize, torch.cuda.current_device
    queue = AsyncCallsQueue()
    queue.schedule_async_request(dcp.save(model.sharded_state_dict(), _dir(root, "tp2_async"),
                                          sharded_strategy=("bcp", 1), async_sharded_save=True))
    _fill(model.sharded_state_dict(), 99.0)  # after staging: must not reach the checkpoint
    out["async_metadata_before_finalize"] = os.path.exists(os.path.join(root, "tp2_async", "metadata.json"))
    torch.cuda.current_device = lambda: "cpu"
    out["async_finalized"] = queue.maybe_finalize_async_calls(blocking=True)
    torch.cuda.current_device = saved_cuda[1]
    _fill(model.sharded_state_dict())
    with megatron_releases.torch_dist_on_cpu():
        dcp.save(model.sharded_state_dict(), _dir(root, "torch_dist"), sharded_strategy=("torch_dist", 1))

    # TP2xPP1 -> TP1xPP2, then save at PP=2
    model = _gpt(1, 2)
    load_and_check(model, os.path.join(root, "tp2"), "tp2pp1_to_tp1pp2")
    dcp.save(model.sharded_state_dict(), _dir(root, "pp2"), sharded_strategy=("bcp", 1))

    # TP 2 -> 1 and PP 2 -> 1 (DP=2), then save at TP=1 the way Megatron-LM does by default:
    # wrapped in FullyParallelSaveStrategyWrapper, which moves main replicas around the DP group
    from megatron.core import parallel_state as ps
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    from bcp_integrations.megatron import BcpSaveShardedStrategy
    model = _gpt(1, 1)
    load_and_check(model, os.path.join(root, "tp2"), "tp2_to_tp1")
    load_and_check(model, os.path.join(root, "pp2"), "pp2_to_pp1")
    wrapped = FullyParallelSaveStrategyWrapper(BcpSaveShardedStrategy(), ps.get_data_parallel_group())
    dcp.save(model.sharded_state_dict(), _dir(root, "tp1"), sharded_strategy=wrapped)

    # TP 1 -> 2; the async checkpoint; bcp and torch_dist of the same state side by side
    model = _gpt(2, 1)
    load_and_check(model, os.path.join(root, "tp1"), "tp1_to_tp2")
    load_and_check(model, os.path.join(root, "tp2_async"), "async_tp2_to_tp2")
    _fill(model.sharded_state_dict(), SENTINEL)
    from_bcp = [t.clone() for t in (sh.data for sh in _sharded_tensors(
        _loaded_into(dcp, model, os.path.join(root, "tp2"))))]
    with megatron_releases.torch_dist_on_cpu():
        from_td = [sh.data.clone() for sh in _sharded_tensors(_loaded_into(dcp, model,
                                                                          os.path.join(root, "torch_dist")))]
    keys = [sh.key for sh in _sharded_tensors(model.sharded_state_dict())]
    out["bcp_vs_torch_dist"] = {"differ": [k for k, a, b in zip(keys, from_bcp, from_td) if not torch.equal(a, b)],
                                "n": min(len(from_bcp), len(from_td)),
        **_check(model.sharded_state_dict(), "torch_dist", rank, from_td)}

    # Metadata queries answer like torch_dist's
    bcp_meta = dcp.load_tensors_metadata(os.path.join(root, "tp2"))
    td_meta = dcp.load_tensors_metadata(os.path.join(root, "torch_dist"))
    out["tensors_metadata"] = {k: (tuple(v.global_shape), str(v.dtype)) for k, v in bcp_meta.items()}
    out["tensors_metadata_td"] = {k: (tuple(v.global_shape), str(v.dtype)) for k, v in td_meta.items()}
    out["sharded_metadata"] = sorted(dcp.serialization.load_sharded_metadata(os.path.join(root, "tp2")))
    return out


def _loaded_into(dcp, model, path):
    """Load `path` into `model` (sentinel first) and return its sharded state dict."""
    sd = model.sharded_state_dict()
    _fill(sd, SENTINEL)
    model.load_state_dict(dcp.load(sd, path))  # torch_dist returns new tensors, bcp fills in place
    return model.sharded_state_dict()


@pytest.fixture(scope="module", params=megatron_releases.params())
def gpt_run(request, tmp_path_factory):
    root = str(tmp_path_factory.mktemp("megatron_gpt"))
    results = run_ranks(2, _gpt_layouts, root, request.param, timeout=240)
    return root, results


def _assert_case(results, case):
    checked = sum(r[case]["checked"] for r in results)
    assert checked >= 20, f"{case}: only {checked} ShardedTensors checked"
    bad = [b for r in results for b in r[case]["bad"]]
    assert not bad, "\n".join(bad)


def test_tp2_to_tp1(gpt_run):
    _assert_case(gpt_run[1], "tp2_to_tp1")


def test_tp1_to_tp2(gpt_run):
    _assert_case(gpt_run[1], "tp1_to_tp2")


def test_pp2_to_pp1(gpt_run):
    _assert_case(gpt_run[1], "pp2_to_pp1")


def test_tp2pp1_to_tp1pp2(gpt_run):
    _assert_case(gpt_run[1], "tp2pp1_to_tp1pp2")


def test_async_save_writes_the_state_at_staging_time(gpt_run):
    results = gpt_run[1]
    # Megatron's metadata.json comes after bcp's commit, in the request's finalize step
    assert not any(r["async_metadata_before_finalize"] for r in results)
    assert all(r["async_finalized"] == [0] for r in results)
    _assert_case(results, "async_tp2_to_tp2")


def test_bcp_and_torch_dist_load_identical_values(gpt_run):
    results = gpt_run[1]
    for r in results:
        assert r["bcp_vs_torch_dist"]["n"] >= 20 and not r["bcp_vs_torch_dist"]["differ"], r["bcp_vs_torch_dist"]
    _assert_case([{"c": r["bcp_vs_torch_dist"]} for r in results], "c")


def test_checkpoint_is_a_megatron_and_a_bcp_checkpoint(gpt_run):
    root, results = gpt_run
    path = os.path.join(root, "tp2")
    assert {"metadata.json", "bcp_metadata.json", "data"} <= set(os.listdir(path))
    import json
    with open(os.path.join(path, "metadata.json")) as f:
        assert json.load(f)["sharded_backend"] == "bcp"
    md = bcp.inspect(path)
    assert md.framework == "megatron"
    # Megatron's non-sharded values: bcp's object, inside its commit, on every release (no common.pt)
    assert "common_state/shard_0_1" in md.sharded_objects and not os.path.exists(os.path.join(path, "common.pt"))
    assert not os.path.exists(os.path.join(path, ".metadata"))  # nothing of torch_dist
    # replicated boxes written once, by both ranks (balanced), never all by the coordinator
    ranks = {p.rank for tm in md.tensors.values() for p in tm.pieces}
    assert ranks == {0, 1}
    ln = md.tensors["decoder.layers.self_attention.linear_qkv.layer_norm_weight"]
    assert len(ln.pieces) == 2 and ln.shape == (2, 32)  # 2 layers x (replicated over TP) -> one box each
    assert md.sharded_objects["decoder.layers.mlp.linear_fc1._extra_state/shard_1_2"].grid == (2,)


def test_metadata_queries_match_torch_dist(gpt_run):
    for r in gpt_run[1]:
        assert r["tensors_metadata"] == r["tensors_metadata_td"]
        assert len(r["tensors_metadata"]) == 17
        assert "decoder.layers.mlp.linear_fc2._extra_state/shard_1_2" in r["sharded_metadata"]


def test_non_megatron_consumer_loads_by_fqn(gpt_run):
    """No Megatron on the reading side: plain tensors by key, at full size."""
    root, _ = gpt_run
    md = bcp.inspect(os.path.join(root, "tp1"))
    state = {k: torch.full(tm.shape, SENTINEL, dtype=tm.dtype) for k, tm in md.tensors.items()}
    bcp.load(os.path.join(root, "tp1"), state, strict=True)
    assert len(state) == 17
    for k, t in state.items():
        assert torch.equal(t, expected(k, t.shape)), k


# ----------------------------------------------------------------------------- distributed optimizer

# Two parameters of a tiny model, as Megatron's ShardedTensors describe them at TP=tp, TP rank r:
#   w (4 layers stacked, 6, 10): column-parallel on its last local axis (prepend_axis_num=1)
#   b (12,): row-parallel on axis 0
# A distributed optimizer puts the TP-local parameters one after the other in a bucket and gives
# each DP rank a contiguous slice of it; the state of one DP rank is flat pieces of parameters.
W_SHAPE, B_SHAPE = (4, 6, 10), (12,)


def _params(tp, tp_rank):
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    w_local = (6, 10 // tp)
    w = [ShardedTensor.from_rank_offsets("w", torch.empty(w_local), (0, i, 4), (2, tp_rank, tp),
                                         prepend_axis_num=1) for i in range(4)]
    b = ShardedTensor.from_rank_offsets("b", torch.empty(12 // tp), (0, tp_rank, tp))
    return w + [b]


def _optimizer_sd(tp, tp_rank, dp, dp_rank, split):
    """This rank's distributed-optimizer state: flat slices of `exp_avg` for the TP-local params.

    `split(bucket_numel, dp)` gives the DP ranks' [start, stop) in the bucket (uneven is fine).
    Also Megatron's own dp_reshardable form: the bucket as one 1-D tensor, keyed per TP rank
    because its layout depends on TP (Megatron keys it by DP group), so it reshards across DP only.
    """
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bcp_integrations.megatron import flat_range_sharded_tensors
    params = _params(tp, tp_rank)
    sizes = [p.data.numel() for p in params]
    lo, hi = split(sum(sizes), dp)[dp_rank]
    state, at = [], 0
    for p, n in zip(params, sizes):
        s, e = max(lo, at), min(hi, at + n)
        if s < e:
            flat = torch.empty(e - s)
            for st in flat_range_sharded_tensors(f"optimizer.state.exp_avg.{p.key}", flat, p, s - at):
                st.data.copy_(expected(st.key, st.global_shape)[_box(st)].reshape(st.local_shape))
                state.append(st)
        at += n
    bucket = torch.arange(lo, hi, dtype=torch.float32)
    plain = ShardedTensor(f"optimizer.tp{tp}_{tp_rank}.bucket.exp_avg", bucket, bucket.dtype, (hi - lo,),
                          (sum(sizes),), (lo,), axis_fragmentations=None)
    return {"optimizer": {"param_state": state, "bucket": plain, "step": 7}}


def _drop_bucket(sd):
    """Without the TP-dependent bucket tensor (for loads at another TP degree)."""
    sd["optimizer"].pop("bucket")
    return sd


def _even(n, dp):
    edges = [n * i // dp for i in range(dp + 1)]
    return list(zip(edges[:-1], edges[1:]))


def _skewed(n, dp):
    cut = [0, 5, n] if dp == 2 else [0, n]
    return list(zip(cut[:-1], cut[1:]))


def _optimizer_layouts(rank, world_size, root, release):
    megatron_releases.activate(release)
    from megatron.core import dist_checkpointing as dcp
    from megatron.core.dist_checkpointing.validation import StrictHandling

    import bcp_integrations.megatron  # noqa: F401

    out = {}
    # (saved layout, loaded layout): (tp, dp, split) with tp * dp == 2; rank = dp_rank * tp + tp_rank
    cases = {"tp1dp2_to_tp2dp1": ((1, 2, _even), (2, 1, _even)),
             "tp2dp1_to_tp1dp2": ((2, 1, _even), (1, 2, _skewed)),
             "tp1dp2_to_tp1dp2_skewed": ((1, 2, _even), (1, 2, _skewed))}
    for case, (src, dst) in cases.items():
        path = _dir(root, case)
        tp, dp, split = src
        same_tp = src[0] == dst[0]
        sd = _optimizer_sd(tp, rank % tp, dp, rank // tp, split)
        dcp.save(sd if same_tp else _drop_bucket(sd), path, sharded_strategy=("bcp", 1))
        tp, dp, split = dst
        sd = _optimizer_sd(tp, rank % tp, dp, rank // tp, split)
        if not same_tp:
            _drop_bucket(sd)
        targets = sd["optimizer"]["param_state"]
        for st in targets:
            st.data.fill_(SENTINEL)
        if same_tp:
            sd["optimizer"]["bucket"].data.fill_(SENTINEL)
        loaded = dcp.load(sd, path, strict=StrictHandling.RAISE_ALL)
        got = loaded["optimizer"]["param_state"]
        bad = [f"{case}: rank {rank} {st.key} at {tuple(st.global_offset)}" for st, t in zip(targets, got)
               if not torch.equal(t, expected(st.key, st.global_shape)[_box(st)].reshape(st.local_shape))]
        b = sd["optimizer"].get("bucket")
        if b is not None and not torch.equal(loaded["optimizer"]["bucket"], torch.arange(b.global_offset[0],
                                                                       b.global_offset[0] + b.local_shape[0],
                                                                       dtype=torch.float32)):
            bad.append(f"{case}: rank {rank} bucket")
        if loaded["optimizer"]["step"] != 7:
            bad.append(f"{case}: rank {rank} step")
        out[case] = {"checked": len(targets) + 1, "bad": bad,
                     "pieces": len(bcp.inspect(path).tensors["optimizer.state.exp_avg.w"].pieces)}
    out["factory"] = _factories(rank, root)
    out["gpt_optimizer"] = _gpt_optimizer(rank, root)
    return out


def _factory_sd(tp, tp_rank, replica=0):
    """A (4, 6) weight, column-split over TP, that a factory stores as two tensors (gate, up rows)."""
    from megatron.core.dist_checkpointing.mapping import (LocalNonpersistentObject, ShardedTensor,
                                                          ShardedTensorFactory)
    cols = 6 // tp

    def build(key, t, replica_id, flattened_range):
        return {part: ShardedTensor.from_rank_offsets(f"{key}.{part}", t[rows], (1, tp_rank, tp),
                                                      replica_id=replica_id)
                for part, rows in (("gate", slice(0, 2)), ("up", slice(2, 4)))}

    def merge(sub):
        return torch.cat([sub["gate"], sub["up"]])

    data = torch.full((4, cols), SENTINEL)
    return {"w": ShardedTensorFactory("glu.w", data, build, merge, replica_id=replica),
            "note": LocalNonpersistentObject("local")}


def _factories(rank, root):
    """TP2 -> TP1 through a factory, via dist_checkpointing and via the direct bcp entry points."""
    from megatron.core import dist_checkpointing as dcp

    import bcp_integrations.megatron as bm
    full = torch.cat([expected("glu.w.gate", (2, 6)), expected("glu.w.up", (2, 6))])
    src = _factory_sd(2, rank)
    src["w"].data.copy_(full[:, rank * 3:(rank + 1) * 3])
    via_dcp = _dir(root, "factory_dcp")
    dcp.save(src, via_dcp, sharded_strategy=("bcp", 1))
    direct = os.path.join(root, "factory_direct")
    bm.save(_factory_sd(2, rank) | {"w": src["w"]}, direct).wait()
    bad = []
    for name, loaded in (("dcp", dcp.load(_factory_sd(1, 0, rank), via_dcp)),
                         ("direct", bm.load(_factory_sd(1, 0, rank), direct))):
        if not torch.equal(loaded["w"], full) or loaded["note"] != "local":
            bad.append(f"factory via {name}: rank {rank}")
    shapes = {k: tm.shape for k, tm in bcp.inspect(via_dcp).tensors.items()}
    return {"checked": 2, "bad": bad, "shapes": shapes}


class _DistOptLayout:
    """What `fully_reshardable_param_state` reads of Megatron's DistributedOptimizer (which needs
    CUDA to build), laid out as Megatron lays it: the parameters back to back in one bucket, padded
    to a multiple of DP, each DP rank owning one contiguous range (`gbuf_ranges[..]["param_map"]`
    with each parameter's `"param"` Range inside itself), and fp32 main weights + Adam moments for
    that range (`_get_main_param_and_optimizer_states`)."""

    def __init__(self, params, dp, dp_rank):
        from megatron.core.optimizer.distrib_optimizer import Range
        total = sum(p.numel() for p in params)
        per_rank = -(-total // dp)
        lo, hi = dp_rank * per_rank, min(total, (dp_rank + 1) * per_rank)
        param_map, self.states, at = {}, {}, 0
        for p in params:
            s, e = max(lo, at), min(hi, at + p.numel())
            if s < e:
                param_map[p] = {"param": Range(s - at, e - at)}
                self.states[id(p)] = {"param": torch.empty(e - s), "exp_avg": torch.empty(e - s),
                                      "exp_avg_sq": torch.empty(e - s), "step": torch.tensor(3.0)}
            at += p.numel()
        self.gbuf_ranges = [{torch.float32: [{"param_map": param_map}]}]

    def _get_main_param_and_optimizer_states(self, model_param):
        return self.states[id(model_param)]


def _gpt_optimizer(rank, root):
    """GPT params at TP=1 x DP=2 -> gather-free fully_reshardable save -> Megatron-style load at TP=2."""
    from dataclasses import replace

    from megatron.core import dist_checkpointing as dcp

    from bcp_integrations.megatron import fully_reshardable_param_state
    model = _gpt(1, 1)
    model_sd = model.sharded_state_dict()
    params = [p for p in model.parameters()]
    layout = _DistOptLayout(params, dp=2, dp_rank=rank)
    param_state = fully_reshardable_param_state(layout, model_sd)
    _fill(param_state)  # writes through the views into the optimizer's own state tensors
    filled = sum(float(t.sum()) for st in layout.states.values() for k, t in st.items() if k != "step")
    path = _dir(root, "gpt_optimizer")
    dcp.save({"optimizer": {"param_state": param_state, "param_state_sharding_type": "fully_reshardable"}},
             path, sharded_strategy=("bcp", 1))

    model = _gpt(2, 1)
    # What Megatron's fully_reshardable load requests: each state tensor shaped like its TP-local param
    request = {f"{name}.{i}": replace(sh, key=f"optimizer.state.{name}.{sh.key}",
                                      data=torch.full(sh.local_shape, SENTINEL))
               for i, sh in enumerate(_sharded_tensors(model.sharded_state_dict()))
               for name in ("param", "exp_avg", "exp_avg_sq")}
    dcp.load(request, path)
    result = _check(request, "gpt_optimizer_dp2_to_tp2", rank)
    result["filled"] = filled != 0.0
    return result


@pytest.fixture(scope="module", params=megatron_releases.params())
def optimizer_run(request, tmp_path_factory):
    return run_ranks(2, _optimizer_layouts, str(tmp_path_factory.mktemp("megatron_optim")), request.param,
                     timeout=180)


@pytest.mark.parametrize("case", ["tp1dp2_to_tp2dp1", "tp2dp1_to_tp1dp2", "tp1dp2_to_tp1dp2_skewed"])
def test_flat_optimizer_state_reshards_across_dp_and_tp(optimizer_run, case):
    assert sum(r[case]["checked"] for r in optimizer_run) >= 6
    for r in optimizer_run:
        assert not r[case]["bad"], r[case]["bad"]
        # the flat slices were saved as several boxes each, never gathered into whole rows
        assert r[case]["pieces"] > 4


# ----------------------------------------------------------------------------- single process

def test_flat_range_boxes_cover_the_range_in_order():
    from bcp_core.shards import range_boxes as row_major_boxes
    shape = (3, 4, 5)
    for start in range(0, 60, 7):
        for stop in range(start, 61, 11):
            flat = torch.arange(60).reshape(shape)
            got = []
            for offs, lens, first in row_major_boxes(shape, start, stop):
                box = flat[tuple(slice(o, o + n) for o, n in zip(offs, lens))]
                assert box.reshape(-1).tolist() == list(range(first, first + box.numel()))
                got += box.reshape(-1).tolist()
            assert got == list(range(start, stop))


def test_bad_sharded_tensor_is_reported_with_key_and_shape():
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    from bcp_integrations.megatron import save_state
    st = ShardedTensor.from_rank_offsets("layer.w", torch.zeros(4, 3), (0, 0, 2))
    st.data = torch.zeros(5, 3)
    with pytest.raises(bcp.ShapeMismatchError, match=r"'layer.w'.*\(5, 3\).*\(4, 3\)"):
        save_state({"w": st})


def test_gpt_distributed_optimizer_state_saved_gather_free_loads_at_other_tp(optimizer_run):
    _assert_case([{"c": r["gpt_optimizer"]} for r in optimizer_run], "c")
    assert all(r["gpt_optimizer"]["filled"] for r in optimizer_run)


def test_factories_build_on_save_and_merge_on_load(optimizer_run):
    for r in optimizer_run:
        assert not r["factory"]["bad"], r["factory"]["bad"]
        assert r["factory"]["shapes"] == {"glu.w.gate": (2, 6), "glu.w.up": (2, 6)}


# ----------------------------------------------------------------------------- Megatron-LM

def test_ckpt_format_bcp_parses_as_the_dist_checkpointing_path():
    """--ckpt-format as Megatron-LM declares it (choices from a Literal, default torch_dist)."""
    import argparse

    from bcp_integrations.megatron import megatron_lm

    def parser():
        p = argparse.ArgumentParser()
        p.add_argument("--ckpt-format", default="torch_dist", choices=["torch", "torch_dist", "torch_dcp",
                                                                       "fsdp_dtensor"])
        return megatron_lm.add_ckpt_format_choice(p)

    megatron_lm._state["selected"] = False
    assert parser().parse_args([]).ckpt_format == "torch_dist" and not megatron_lm.bcp_selected()
    assert parser().parse_args(["--ckpt-format", "torch"]).ckpt_format == "torch"
    assert not megatron_lm.bcp_selected()
    with pytest.raises(SystemExit):
        parser().parse_args(["--ckpt-format", "zarr"])
    # every Megatron-LM branch keyed on "torch_dist" is taken; the save strategy lookup gives bcp
    assert parser().parse_args(["--ckpt-format", "bcp"]).ckpt_format == "torch_dist"
    assert megatron_lm.bcp_selected()
    megatron_lm._state["selected"] = False


_MEGATRON_LM_ARGS = r"""
import sys
from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper
from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy
from megatron.training import arguments
from bcp_integrations.megatron import BcpSaveShardedStrategy, bcp_selected, enable_megatron_lm, routing
enable_megatron_lm()
sys.argv = ["pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
            *sys.argv[1:]]
args = arguments.parse_args(ignore_unknown_args=True)  # what the early parses (in-process restart) call
torch_dist = TorchDistSaveShardedStrategy(backend="torch_dist", version=1)
routed = [routing.save_strategy_for(s) for s in (None, torch_dist, FullyParallelSaveStrategyWrapper(torch_dist))]
print(args.ckpt_format, bcp_selected(), [type(s).__name__ for s in routed])
"""


@pytest.mark.parametrize("release", megatron_releases.params(need_tree=True, slow=megatron_releases.ALL_BUT_NEWEST))
def test_enable_megatron_lm_makes_every_save_of_the_run_bcp(release):
    """Megatron-LM's own argument parser (each release) takes --ckpt-format bcp, and every save
    strategy Megatron-LM builds (looked up, constructed, wrapped) is routed to bcp; without the flag,
    none is."""
    import subprocess
    import sys
    env = {**os.environ, **megatron_releases.env(release, need_tree=True)}
    out = {}
    for flag in ("bcp", "torch_dist"):
        proc = subprocess.run([sys.executable, "-c", _MEGATRON_LM_ARGS, "--ckpt-format", flag], env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-4000:]
        out[flag] = proc.stdout.strip().splitlines()[-1]
    assert out["bcp"] == "torch_dist True ['BcpSaveShardedStrategy', 'BcpSaveShardedStrategy', " \
                         "'BcpSaveShardedStrategy']", out
    assert out["torch_dist"] == "torch_dist False ['NoneType', 'TorchDistSaveShardedStrategy', " \
                                "'FullyParallelSaveStrategyWrapper']", out


def test_export_tool_writes_megatron_checkpoint_as_safetensors(gpt_run, tmp_path):
    from safetensors import safe_open

    from bcp_core.tools import export_checkpoint
    root, _ = gpt_run
    export_checkpoint(os.path.join(root, "tp2"), str(tmp_path / "hf"), to="hf")
    seen = 0
    for name in os.listdir(tmp_path / "hf"):
        if name.endswith(".safetensors"):
            with safe_open(str(tmp_path / "hf" / name), framework="pt") as f:
                for k in f.keys():
                    t = f.get_tensor(k)
                    assert torch.equal(t, expected(k, t.shape)), k
                    seen += 1
    assert seen == 17


def test_direct_entry_points_keep_objects_values_and_padded_shapes(tmp_path):
    """One process, no dist_checkpointing: BytesIO extra state, plain values, a padded vocabulary."""
    import io

    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import bcp_integrations.megatron as bm
    emb = expected("emb", (10, 4))
    src = {"emb": ShardedTensor.from_rank_offsets("emb", emb.clone(), allow_shape_mismatch=True),
           "extra": ShardedObject("layer._extra_state", io.BytesIO(b"\x00fp8"), (1,), (0,)),
           "iteration": 42}
    bm.save(src, str(tmp_path)).wait()
    # the resumed model pads its vocabulary to 12 rows: the 2 new rows come back zero
    dst = {"emb": ShardedTensor.from_rank_offsets("emb", torch.full((12, 4), SENTINEL), allow_shape_mismatch=True),
           "extra": ShardedObject("layer._extra_state", None, (1,), (0,)), "iteration": None}
    out = bm.load(dst, str(tmp_path))
    assert torch.equal(out["emb"][:10], emb) and torch.equal(out["emb"][10:], torch.zeros(2, 4))
    assert isinstance(out["extra"], io.BytesIO) and out["extra"].getvalue() == b"\x00fp8"
    assert out["iteration"] == 42


def test_failed_load_leaves_a_padded_tensor_as_it_was(tmp_path):
    """allow_shape_mismatch zeroes what lies past the saved shape only once the load has succeeded: a
    load that fails (here on a key the checkpoint lacks) leaves the target's values untouched."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import bcp_integrations.megatron as bm
    bm.save({"emb": ShardedTensor.from_rank_offsets("emb", expected("emb", (10, 4)), allow_shape_mismatch=True)},
            str(tmp_path)).wait()
    target = torch.full((12, 4), SENTINEL)
    with pytest.raises(bcp.KeyMismatchError, match="missing_key"):
        bm.load({"emb": ShardedTensor.from_rank_offsets("emb", target, allow_shape_mismatch=True),
                 "other": ShardedTensor.from_rank_offsets("missing_key", torch.zeros(3))}, str(tmp_path))
    assert torch.equal(target, torch.full((12, 4), SENTINEL))
    # and a load that succeeds pads with zeros, also through a dtype cast (the checkpoint holds float32)
    for dtype in (torch.float32, torch.float64):
        target = torch.full((12, 4), SENTINEL, dtype=dtype)
        bm.load({"emb": ShardedTensor.from_rank_offsets("emb", target, allow_shape_mismatch=True)}, str(tmp_path))
        assert torch.equal(target[:10], expected("emb", (10, 4)).to(dtype)), dtype
        assert torch.equal(target[10:], torch.zeros(2, 4, dtype=dtype)), dtype


def test_a_box_or_object_requested_twice_on_a_rank_is_loaded_into_both(tmp_path):
    """Two leaves asking for the same box of one key (or the same object shard) in other memory: the
    box is read once and both get it; neither is left as it was (or None)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import bcp_integrations.megatron as bm
    bm.save({"w": ShardedTensor.from_rank_offsets("w", expected("w", (4, 2))),
             "o": ShardedObject("o", {"x": 1}, (1,), (0,))}, str(tmp_path)).wait()
    first, second = torch.full((4, 2), SENTINEL), torch.full((4, 2), SENTINEL, dtype=torch.float64)
    tied = torch.full((4, 2), SENTINEL)
    out = bm.load({"a": ShardedTensor.from_rank_offsets("w", first),
                   "b": ShardedTensor.from_rank_offsets("w", second, replica_id=1),
                   "tied": ShardedTensor.from_rank_offsets("w", tied[:, :], replica_id=1),
                   "tied_again": ShardedTensor.from_rank_offsets("w", tied, replica_id=2),
                   "o": ShardedObject("o", None, (1,), (0,)),
                   "o_again": ShardedObject("o", None, (1,), (0,), replica_id=1)}, str(tmp_path))
    assert torch.equal(first, expected("w", (4, 2))) and torch.equal(tied, expected("w", (4, 2)))
    assert torch.equal(second, expected("w", (4, 2)).double())
    assert out["o"] == out["o_again"] == {"x": 1}


def test_a_checkpoint_of_another_key_layout_and_dtype_is_cast_into_place(tmp_path):
    """A bf16 stacked request of an fp32 checkpoint saved per layer: read in the saved dtype, cast into
    place, as a load in the same layout is."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor

    import bcp_integrations.megatron as bm
    name = "decoder.layers.{}mlp.linear_fc2.weight"
    whole = expected(name.format(""), (2, 3, 4))
    bm.save({i: ShardedTensor.from_rank_offsets(name.format(f"{i}."), whole[i].clone()) for i in range(2)},
            str(tmp_path)).wait()
    target = torch.full((2, 3, 4), SENTINEL, dtype=torch.bfloat16)
    bm.load({i: ShardedTensor.from_rank_offsets(name.format(""), target[i], (0, i, 2), prepend_axis_num=1)
             for i in range(2)}, str(tmp_path))
    assert torch.equal(target, whole.to(torch.bfloat16))


def test_a_load_through_a_mapping_leaves_sharded_objects_their_own_values(tmp_path):
    """docs/megatron.md: through a mapping only tensors are read; plain values and ShardedObjects (extra
    state) keep the target's own (they came back None)."""
    transformers = pytest.importorskip("transformers")
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor

    import bcp_integrations.megatron as bm
    cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=2, tie_word_embeddings=False)
    hf = transformers.LlamaForCausalLM(cfg)
    bcp.save(str(tmp_path), {"model": hf}).wait()
    embedding = torch.full((16, 8), SENTINEL)
    out = bm.load({"embedding": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight", embedding),
                   "extra": ShardedObject("decoder.layers.0.self_attention._extra_state", {"own": 1}, (1,), (0,)),
                   "value": 5}, str(tmp_path), mapping=bcp.mapping.hf_to_megatron(cfg))
    assert torch.equal(embedding, hf.model.embed_tokens.weight.detach())
    assert out["extra"] == {"own": 1} and out["value"] == 5
