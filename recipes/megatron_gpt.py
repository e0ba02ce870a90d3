"""bcp with Megatron-core: save a GPTModel at TP=2, load it at TP=1 and at PP=2.

    torchrun --nproc_per_node 2 recipes/megatron_gpt.py [--out DIR]

Runs on CPU with gloo (Megatron-core's model construction and `sharded_state_dict()` need no
GPU). bcp is Megatron's dist_checkpointing backend `("bcp", 1)`: `dist_checkpointing.save` with
`sharded_strategy=("bcp", 1)` writes, and a plain `dist_checkpointing.load` finds bcp from the
checkpoint's metadata.json.

1. Builds a tiny GPTModel with tensor parallelism 2 and saves it.
2. Rebuilds it with TP=1 (the two ranks are data-parallel replicas), loads, and checks that
   every parameter is bit-identical to the TP=2 original.
3. Rebuilds it with pipeline parallelism 2 (one layer per rank), loads, checks the same.
4. Reads the checkpoint without Megatron, as plain full tensors by name.
"""

from __future__ import annotations

import argparse
import os
import tempfile

from _launch import exit_without_teardown  # recipes/_launch.py

import torch
import torch.distributed as dist
from megatron.core import dist_checkpointing, parallel_state
from megatron.core.dist_checkpointing.mapping import ShardedTensor
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

import bcp_core as bcp
import bcp_integrations.megatron  # noqa: F401 - registers the ("bcp", 1) backend
from bcp_integrations.megatron.adapter import iter_leaves


def build(tp: int, pp: int) -> GPTModel:
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                                             create_gloo_process_groups=True)
    config = TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=256,
                               tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                               use_cpu_initialization=True, params_dtype=torch.float32,
                               pipeline_dtype=torch.float32)
    # Untied embeddings: tying them across pipeline stages needs an all-reduce Megatron only does on CUDA.
    return GPTModel(config, get_gpt_layer_local_spec(), vocab_size=256, max_sequence_length=64,
                    pre_process=parallel_state.is_pipeline_first_stage(),
                    post_process=parallel_state.is_pipeline_last_stage(),
                    share_embeddings_and_output_weights=False)


def shards(model: GPTModel) -> list[ShardedTensor]:
    return [v for _, v in iter_leaves(model.sharded_state_dict()) if isinstance(v, ShardedTensor)]


def box(sh: ShardedTensor) -> tuple[slice, ...]:
    lengths = (1,) * sh.prepend_axis_num + tuple(sh.local_shape)
    return tuple(slice(o, o + n) for o, n in zip(sh.global_offset, lengths))


def global_tensors(model: GPTModel) -> dict[str, torch.Tensor]:
    """Every rank's shards assembled into full tensors (tiny model: fine to gather)."""
    mine = [(sh.key, tuple(sh.global_shape), box(sh), sh.data.detach().clone()) for sh in shards(model)]
    every: list = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    full: dict[str, torch.Tensor] = {}
    for rank_shards in every:
        for key, shape, where, data in rank_shards:
            target = full.setdefault(key, torch.full(shape, float("nan")))[where]
            target.copy_(data.reshape(target.shape))
    return full


def check(model: GPTModel, reference: dict[str, torch.Tensor], what: str) -> int:
    n = 0
    for sh in shards(model):
        want = reference[sh.key][box(sh)].reshape(sh.local_shape)
        if not torch.equal(sh.data, want):
            raise SystemExit(f"{what}: rank {dist.get_rank()} {sh.key} at {tuple(sh.global_offset)} differs")
        n += 1
    return n


def reload(model: GPTModel, path: str) -> None:
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # nothing may survive from the fresh model
    model.load_state_dict(dist_checkpointing.load(model.sharded_state_dict(), path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one)")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc_per_node 2")
    out = args.out or (tempfile.mkdtemp(prefix="bcp_megatron_") if rank == 0 else None)
    holder = [out]
    dist.broadcast_object_list(holder)
    path = os.path.join(holder[0], "iter_0000010")
    os.makedirs(path, exist_ok=True)
    torch.manual_seed(0)

    model = build(tp=2, pp=1)
    reference = global_tensors(model)
    dist_checkpointing.save(model.sharded_state_dict(), path, sharded_strategy=("bcp", 1))
    if rank == 0:
        md = bcp.inspect(path)
        print(f"saved TP=2 -> {path}: {len(md.tensors)} tensors, {len(md.files)} data files, "
              f"Megatron files {sorted(f for f in os.listdir(path) if f != 'data')}")

    model = build(tp=1, pp=1)
    reload(model, path)
    n = check(model, reference, "TP=1")
    print(f"rank {rank}: TP=1 loaded, {n} sharded tensors bit-identical")

    model = build(tp=1, pp=2)
    reload(model, path)
    n = check(model, reference, "PP=2")
    print(f"rank {rank}: PP=2 stage {parallel_state.get_pipeline_model_parallel_rank()} loaded, "
          f"{n} sharded tensors bit-identical")

    if rank == 0:  # no Megatron needed on the reading side
        md = bcp.inspect(path)
        plain = {k: torch.empty(tm.shape, dtype=tm.dtype) for k, tm in md.tensors.items()}
        bcp.load(path, plain)
        assert all(torch.equal(plain[k], reference[k]) for k in plain)
        print(f"plain bcp.load by name: {len(plain)} full tensors identical")
    dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


if __name__ == "__main__":  # required: Megatron and bcp start helper processes that re-import __main__
    main()
    exit_without_teardown()
