"""The distributed optimizer's `fully_reshardable` state, saved by bcp, holds the optimizer's state.

Megatron's own save of that layout gathers each buffer's DP slices without the padding between its
buckets, then cuts every parameter out at its offset in the padded buffer: every parameter in a
bucket after a padded boundary gets another parameter's values (the first and last pipeline stages
of a model with tied embeddings keep the embedding in a bucket of its own, so a PP > 1 resume of
Megatron-LM's `--dist-ckpt-optim-fully-reshardable` loads a shifted embedding, with torch_dist and
with a plain bcp save alike). bcp's gather-free `fully_reshardable_param_state`, which `--ckpt-format
bcp` uses in Megatron-LM, cuts each rank's slices at their own ranges.

One 2-rank launch per megatron-core release: a GPTModel at PP=2 with tied embeddings (and q/k/v
biases, which leave stage 0's first bucket 64 elements short of the 128 it is padded to), Megatron's
DistributedOptimizer (torch Adam, CPU stand-ins of recipes/_megatron_cpu.py), 2 steps trained;
then the state saved both ways through ("bcp", 1), each loaded by Megatron's own
fully_reshardable loader into a fresh optimizer of the same layout and compared with the trained
optimizer's state, tensor by tensor.
"""

from __future__ import annotations

import os

import pytest
import torch

import megatron_releases
from dist import run_ranks

megatron_releases.skip_without_megatron_core()

FULLY_RESHARDABLE = {"distrib_optim_sharding_type": "fully_reshardable"}


def _states(distopt, model) -> dict[str, dict[str, torch.Tensor]]:
    """{parameter name: {state: this rank's slice}} of a DistributedOptimizer (main param, moments)."""
    out = {}
    for name, p in model.named_parameters():
        if p in distopt.model_param_group_index_map:
            out[name] = {k: v.detach().clone() for k, v in distopt._get_main_param_and_optimizer_states(p).items()
                         if isinstance(v, torch.Tensor) and v.dim() == 1}
    return out


def _mismatches(got: dict, want: dict) -> list[str]:
    return [f"{name}.{k}: max diff {float((got[name][k] - t).abs().max())}"
            for name, states in want.items() for k, t in states.items() if not torch.equal(got[name][k], t)]


def _buckets_and_state(rank, world_size, root, release):
    megatron_releases.activate(release)
    import warnings
    warnings.filterwarnings("ignore")
    from megatron.core import dist_checkpointing as dc

    from test_mapping_megatron import _distributed, _gpt, _train, tokens  # puts recipes/ on the path

    from _megatron_cpu import cuda_on_cpu
    from bcp_integrations.megatron import fully_reshardable_param_state, megatron_lm
    megatron_releases.check_active(release)

    out = {}
    with cuda_on_cpu():
        cfg, model = _gpt(1, 2, tied=True, qkv_bias=True)
        ddp, opt = _distributed(cfg, model)
        _train(ddp, opt, [tokens(10), tokens(11)])
        distopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
        trained = _states(distopt, model)
        # the padding at the end of each bucket but the last (q/k/v biases make stage 0's first one 64 short)
        out["padding"] = [end - start - bucket.numel_unpadded for buffer in distopt.buffers
                          for (start, end), bucket in zip(buffer.bucket_indices[:-1], buffer.buckets)]

        def save(name, param_state=None):
            path = os.path.join(root, name)
            os.makedirs(path, exist_ok=True)
            torch.distributed.barrier()
            model_sd = model.sharded_state_dict()
            opt_sd = opt.sharded_state_dict(model_sd, metadata=FULLY_RESHARDABLE)
            if param_state is not None:
                opt_sd["param_state"] = param_state(distopt, model.sharded_state_dict())
            dc.save({"model": model_sd, "optimizer": opt_sd}, path, sharded_strategy=("bcp", 1))
            return path

        paths = {"megatron": save("megatron"), "gather_free": save("gather_free", fully_reshardable_param_state)}
        # what a Megatron-LM run with --ckpt-format bcp builds: the gather-free state, from Megatron's own call
        megatron_lm._state["selected"] = True
        try:
            megatron_lm._save_fully_reshardable_gather_free()
            paths["ckpt_format_bcp"] = save("ckpt_format_bcp")
        finally:
            megatron_lm._state["selected"] = False

        for name, path in paths.items():
            cfg2, model2 = _gpt(1, 2, tied=True, qkv_bias=True)
            ddp2, opt2 = _distributed(cfg2, model2)
            _train(ddp2, opt2, [tokens(3)])  # torch's Adam has no state to describe before a step
            model_sd = model2.sharded_state_dict()
            request = {"model": model_sd,
                       "optimizer": opt2.sharded_state_dict(model_sd, is_loading=True, metadata=FULLY_RESHARDABLE)}
            loaded = dc.load(request, path)
            model2.load_state_dict(loaded["model"])
            opt2.load_state_dict(loaded["optimizer"])
            distopt2 = opt2.chained_optimizers[0] if hasattr(opt2, "chained_optimizers") else opt2
            out[name] = _mismatches(_states(distopt2, model2), trained)
    return out


@pytest.fixture(scope="module", params=megatron_releases.params())
def runs(request, tmp_path_factory):
    return run_ranks(2, _buckets_and_state, str(tmp_path_factory.mktemp("megatron_optim_state")), request.param,
                     timeout=300)


def test_the_layout_has_a_padded_bucket_boundary(runs):
    assert runs[0]["padding"] == [64]  # stage 0: the tied embedding in a bucket of its own, after 64 padding


def test_bcp_gather_free_state_loads_back_exactly(runs):
    for rank, r in enumerate(runs):
        assert r["gather_free"] == [], (rank, r["gather_free"])


def test_ckpt_format_bcp_saves_the_gather_free_state(runs):
    for rank, r in enumerate(runs):
        assert r["ckpt_format_bcp"] == [], (rank, r["ckpt_format_bcp"])


def test_megatrons_own_fully_reshardable_save_misplaces_the_state_after_a_bucket_boundary(runs):
    """Megatron's bug, kept as evidence for docs/megatron.md: the embedding's state (stage 0, the
    bucket after the boundary) comes back as another stretch of the buffer; stage 1 has one bucket
    before its embedding copy and is unaffected."""
    assert any("embedding.word_embeddings.weight" in m for m in runs[0]["megatron"]), runs[0]["megatron"]
