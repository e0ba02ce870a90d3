"""A Megatron checkpoint loaded into a Hugging Face MoE model on one process, and under DDP or FSDP2 on 2
ranks compared with that (tests/test_mapping_moe.py, tests/test_megatron_deepseek.py)."""

from __future__ import annotations

from collections.abc import Callable

import torch

import bcp_core as bcp


def hf_logits(model: torch.nn.Module, tokens: Callable[[int], torch.Tensor]) -> torch.Tensor:
    """The model's logits on the tokens of seed 99."""
    with torch.no_grad():
        return model(input_ids=tokens(99)).logits.clone()


def load_into_hf_alone(hf: torch.nn.Module, path: str, tokens: Callable[[int], torch.Tensor],
                       check: Callable) -> tuple[dict, dict]:
    """Load `path` into `hf` and a fresh AdamW on this process alone (`mapping=megatron_to_hf`), then
    one more AdamW step. Returns what the test asserts (logits, Adam steps before and after, counts,
    and `check(path, hf, opt)`'s (differences, elements checked)) and the reference the wrapped loads
    are compared with (`load_into_wrapped_hf`): the logits, moments by name, parameters after the step."""
    opt = torch.optim.AdamW(hf.parameters(), lr=1e-2, weight_decay=0.01)
    bcp.load(path, {"model": hf, "optimizer": opt}, mapping=bcp.mapping.megatron_to_hf(hf.config))
    r = {"logits": hf_logits(hf, tokens), "steps": sorted({float(s["step"]) for s in opt.state.values()}),
         "states": len(opt.state), "params": len(list(hf.parameters()))}
    r["bad"], r["checked"] = check(path, hf, opt)
    ref = {"logits": r["logits"], "moments": {n: {k: opt.state[p][k].clone() for k in ("exp_avg", "exp_avg_sq")}
                                              for n, p in hf.named_parameters()}}
    hf(input_ids=tokens(7), labels=tokens(7)).loss.backward()  # one more AdamW step
    opt.step()
    r["after"] = sorted({float(s["step"]) for s in opt.state.values()})
    ref["after_step"] = {n: p.detach().clone() for n, p in hf.named_parameters()}
    return r, ref


def load_into_wrapped_hf(hf: torch.nn.Module, wrap: str, path: str, ref: dict, tokens: Callable[[int], torch.Tensor],
                         experts: str | None = None) -> dict:
    """Load `path` into `hf` wrapped by DDP (`mapping="auto"`) or FSDP2 (the declared mapping) on every
    rank (a collective load: shared reads, the metadata read once per node), then one more AdamW step
    on the same batch on every rank: what differs from the one-process load `ref` (its logits, moments
    by name, parameters after that step), and whether FSDP2 sharded the stacked experts `experts` (or,
    without experts, every parameter)."""
    from torch.distributed.tensor import DTensor

    if wrap == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(hf)
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        mesh = init_device_mesh("cpu", (2,))
        for layer in hf.model.layers:
            fully_shard(layer, mesh=mesh)
        model = fully_shard(hf, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    mapping = "auto" if wrap == "ddp" else bcp.mapping.megatron_to_hf(hf.config)
    bcp.load(path, {"model": model, "optimizer": opt}, mapping=mapping, share_reads=True)

    def full(t):
        return t.full_tensor() if isinstance(t, DTensor) else t

    params = dict(hf.named_parameters())
    bad = [n for n, p in params.items() for k in ("exp_avg", "exp_avg_sq")
           if not torch.equal(full(opt.state[p][k]), ref["moments"][n][k])]
    with torch.no_grad():
        out = model(input_ids=tokens(99)).logits
    steps = sorted({float(s["step"]) for s in opt.state.values()})
    model(input_ids=tokens(7), labels=tokens(7)).loss.backward()
    opt.step()
    after = max(float((full(p.detach()) - ref["after_step"][n]).abs().max()) for n, p in params.items())
    if experts is None:
        sharded = all(isinstance(p, DTensor) for p in params.values())
    else:
        sharded = isinstance(params[experts], DTensor) and params[experts].to_local().shape[0] == 2
    return {"logits_diff": float((full(out) - ref["logits"]).abs().max()), "bad": bad, "steps": steps,
            "states": len(opt.state), "params": len(params), "after_step_diff": after,
            "sharded": wrap == "ddp" or sharded}
