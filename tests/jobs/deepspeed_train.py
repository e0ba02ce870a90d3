"""DeepSpeed ZeRO through bcp's plain API, as a user's torchrun job runs it (DS_ACCELERATOR=cpu, gloo).

    torchrun --nproc_per_node 2 tests/jobs/deepspeed_train.py --phase matrix --root DIR
    torchrun --nproc_per_node 2 tests/jobs/deepspeed_train.py --phase reshard --root DIR
    torchrun --nproc_per_node 1 tests/jobs/deepspeed_train.py --phase continue --root DIR

A tiny LlamaForCausalLM (built from a config, no dropout) trains on fixed tokens, 2 sequences per rank
per step (the whole batch of 4 on one rank).

matrix (2 ranks): for ZeRO stage 1, 2 and 3, an engine trains 2 steps and is saved with
`bcp.save(DIR/zero<s>, engine_state(engine) + RNG)` (stage 3 asynchronously, with one more training
step before `wait()`: the checkpoint must hold the state of the call) and with DeepSpeed's own
`save_checkpoint(DIR/ds<s>)` (stages 2 and 3); rank 0 writes DIR/ref_zero<s>.pt, DeepSpeed's full
fp32 values and Adam moments (`safe_get_full_fp32_param` / `safe_get_full_optimizer_state`), the step
and `global_steps` at the save. Then every checkpoint is loaded into a fresh engine of every stage,
bf16 with the optimizer offloaded (ZeRO-Offload) into bf16 engines of stage 0 (no ZeRO), 2 and 3 and
back, into FSDP2 (`fully_shard`), FSDP1 (flat parameters) and DDP and, a step further, from each of
them into ZeRO, and DIR/plain (a 1-process checkpoint the test wrote) into ZeRO-3; each
loaded state is compared, bit for bit, with its reference. A checkpoint of another shape must fail
on every rank with one error naming the tensor and both shapes, leaving the engine as it was.
Writes DIR/matrix_ok_rank<r> when all of it holds.

reshard (2 ranks), the default tier's share of matrix: ZeRO-3 trains 2 steps and is saved asynchronously
while a third step runs (DIR/zero3, DIR/ref_zero3.pt, DIR/after_zero3.pt as in matrix), then loaded into
a fresh ZeRO-2 engine and compared bit for bit; a checkpoint of another shape is refused on every rank,
leaving the engine as it was; so are a save of one optimizer over two modules whose parameters have
the same names, and the module ZeRO-2 trains passed without its engine. Writes DIR/reshard_ok_rank<r>.

megatron (2 ranks): DIR/megatron/iter_0000003 (Megatron-core's checkpoint of recipes/megatron_to_hf.py)
into a Hugging Face Llama under ZeRO-3 with `mapping="auto"`, compared with DIR/ref_megatron.pt.

continue (1 rank): ZeRO-2 loads DIR/zero3 (saved by 2 ranks), takes the step the 2-rank run took
after its save on the same 4 sequences, and writes DIR/continued.pt (its fp32 values after it).
"""

from __future__ import annotations

import argparse
import os
import sys

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import deepspeed  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402

import bcp_core as bcp  # noqa: E402
from bcp_integrations.deepspeed import engine_state  # noqa: E402

MODEL = dict(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
             num_key_value_heads=2, max_position_embeddings=32)
PER_RANK, SEQ = 2, 8


def build_model(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**MODEL, **overrides}, attn_implementation="eager"))


def tokens(step: int, rank: int, world: int) -> torch.Tensor:
    """The step's sequences of this rank: the global batch of 2 * 2 sequences split by rank."""
    g = torch.Generator().manual_seed(100 + step)
    batch = torch.randint(0, MODEL["vocab_size"], (2 * PER_RANK, SEQ), generator=g)
    n = len(batch) // world
    return batch[rank * n:(rank + 1) * n]


def ds_config(stage: int, world: int, bf16: bool = False, offload: bool = False) -> dict:
    zero = {"stage": stage, "stage3_param_persistence_threshold": 0}
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {"train_micro_batch_size_per_gpu": 2 * PER_RANK // world, "gradient_accumulation_steps": 1,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01, "torch_adam": True}},
            "zero_optimization": zero, "bf16": {"enabled": bf16}, "steps_per_print": 1000}


def engine_for(stage: int, seed: int = 1, bf16: bool = False, offload: bool = False, **overrides):
    model = build_model(seed, **overrides)
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(stage, dist.get_world_size(), bf16, offload))
    return engine


def low_precision_follows(engine, what: str) -> None:
    """The engine's bf16 working copies equal its fp32 master values, rounded (after a load)."""
    values = full_values(engine)
    params = list(engine.module.parameters())
    with deepspeed.zero.GatheredParameters(params):
        for name, p in engine.module.named_parameters():
            assert p.dtype == torch.bfloat16, (what, name, p.dtype)
            assert torch.equal(p.data, values[f"model.{name}"].to(torch.bfloat16)), f"{what}: {name}"


def train_step(engine, step: int) -> float:
    ids = tokens(step, dist.get_rank(), dist.get_world_size())
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    return loss.item()


def full_values(engine) -> dict:
    """DeepSpeed's own full fp32 values and Adam moments of every parameter (collective); without ZeRO
    (bf16 on CPU: FP16_UnfusedOptimizer, one fp32 master copy per parameter) its master copies."""
    out: dict = {"global_steps": engine.global_steps}
    opt = engine.optimizer
    masters = dict(zip((id(p) for g in getattr(opt, "fp16_groups", ()) for p in g),
                       (p for g in getattr(opt, "fp32_groups", ()) for p in g)))
    for name, p in engine.module.named_parameters():
        if id(p) in masters:
            hp = masters[id(p)]
            out[f"model.{name}"] = hp.detach().clone()
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{name}.{k}"] = opt.optimizer.state[hp][k].clone()
            continue
        out[f"model.{name}"] = safe_get_full_fp32_param(p).detach().clone()
        for k in ("exp_avg", "exp_avg_sq"):
            out[f"optimizer.state.{name}.{k}"] = safe_get_full_optimizer_state(p, k).detach().clone()
    inner = engine.optimizer.optimizer
    steps = {float(s["step"]) for s in inner.state.values() if "step" in s}
    out["step"] = steps.pop() if len(steps) == 1 else steps
    return out


def _relink(engine) -> None:
    # DeepSpeed's own load leaves the per-parameter state views unlinked until the next step
    getattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state", lambda: None)()


def torch_layout(layout: str):
    """A tiny Llama under FSDP2, FSDP1 (flat parameters) or DDP on the job's ranks, with torch's AdamW."""
    from torch.distributed.fsdp import FullyShardedDataParallel, fully_shard
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    model = build_model(seed=7)
    if layout == "fsdp2":
        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
    elif layout == "fsdp1":
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        model = FullyShardedDataParallel(model, device_id=torch.device("cpu"),
                                         auto_wrap_policy=ModuleWrapPolicy({LlamaDecoderLayer}))
    else:
        model = torch.nn.parallel.DistributedDataParallel(model)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)


def torch_values(model, opt, layout: str) -> dict:
    """The full values and Adam moments of a torch layout, keyed as `full_values` keys them (collective)."""
    from torch.distributed.fsdp import FullyShardedDataParallel
    out: dict = {}
    if layout == "fsdp1":
        osd = FullyShardedDataParallel.optim_state_dict(model, opt)
        with FullyShardedDataParallel.summon_full_params(model, writeback=False):
            for name, p in model.named_parameters():
                name = name.replace("_fsdp_wrapped_module.", "")
                out[f"model.{name}"] = p.detach().clone()
        for name, st in osd["state"].items():
            for k in ("exp_avg", "exp_avg_sq"):
                out[f"optimizer.state.{name}.{k}"] = st[k].clone()
        out["step"] = {float(st["step"]) for st in osd["state"].values()}.pop()
        return out
    for name, p in model.named_parameters():
        name = name.removeprefix("module.")
        full = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        out[f"model.{name}"] = full.clone()
        for k in ("exp_avg", "exp_avg_sq"):
            v = opt.state[p][k]
            out[f"optimizer.state.{name}.{k}"] = (v.full_tensor() if hasattr(v, "full_tensor") else v).clone()
    out["step"] = {float(st["step"]) for st in opt.state.values()}.pop()
    return out


def check_equal(got: dict, ref: dict, what: str) -> None:
    assert got.keys() == ref.keys(), f"{what}: keys differ: {sorted(got.keys() ^ ref.keys())[:6]}"
    for k in ref:
        a, b = got[k], ref[k]
        same = torch.equal(a, b) if isinstance(b, torch.Tensor) else a == b
        assert same, f"{what}: {k} differs"


def matrix(root: str) -> None:
    rank = dist.get_rank()
    refs = {}
    for stage in (1, 2, 3):
        engine = engine_for(stage)
        for step in (0, 1):
            train_step(engine, step)
        state = {**engine_state(engine), "extra_state": {"rng": bcp.rng.rng_state()}}
        path = os.path.join(root, f"zero{stage}")
        if stage == 3:
            handle = bcp.save(path, state, async_save=True)
            refs[stage] = full_values(engine)
            after = train_step(engine, 2)  # the next step runs while the save writes
            handle.wait()
            post = full_values(engine)
            if rank == 0:
                torch.save({"loss": after, "values": post}, os.path.join(root, "after_zero3.pt"))
        else:
            bcp.save(path, state)
            refs[stage] = full_values(engine)
            engine.save_checkpoint(os.path.join(root, f"ds{stage}"))
        if rank == 0:
            torch.save(refs[stage], os.path.join(root, f"ref_zero{stage}.pt"))

    for src in (1, 2, 3):
        for dst in (1, 2, 3):
            engine = engine_for(dst, seed=7)
            bcp.load(os.path.join(root, f"zero{src}"), engine_state(engine))
            check_equal(full_values(engine), refs[src], f"bcp ZeRO-{src} -> ZeRO-{dst}")
    for src in (2,):
        for dst in (2, 3):
            engine = engine_for(dst, seed=7)
            bcp.load(os.path.join(root, f"ds{src}"), engine_state(engine))  # DeepSpeed's own files
            check_equal(full_values(engine), refs[src], f"DeepSpeed ZeRO-{src} checkpoint -> ZeRO-{dst} by bcp")
        native = engine_for(src, seed=7)
        native.load_checkpoint(os.path.join(root, f"ds{src}"))
        _relink(native)
        check_equal(full_values(native), refs[src], f"DeepSpeed ZeRO-{src} loaded by DeepSpeed")

    # mixed precision (bf16) with the optimizer offloaded to the CPU (ZeRO-Offload): saved from the fp32
    # master values, loaded into bf16 engines of stage 2 and 3, whose bf16 copies follow
    engine = engine_for(3, bf16=True, offload=True)
    for step in (0, 1):
        train_step(engine, step)
    bcp.save(os.path.join(root, "zero3_bf16"), engine_state(engine))
    ref = full_values(engine)
    for dst in (0, 2, 3):  # 0: DeepSpeed's bf16 optimizer without ZeRO (master copies per parameter)
        engine = engine_for(dst, seed=7, bf16=True)
        bcp.load(os.path.join(root, "zero3_bf16"), engine_state(engine))
        check_equal(full_values(engine), ref, f"bf16 ZeRO-3 offloaded -> bf16 ZeRO-{dst}")
        low_precision_follows(engine, f"bf16 ZeRO-{dst}")
    train_step(engine, 2)
    bcp.save(os.path.join(root, "zero0_bf16"), engine_state(engine))  # and back: stage 0 -> ZeRO-3
    ref = full_values(engine)
    engine = engine_for(3, seed=7, bf16=True)
    bcp.load(os.path.join(root, "zero0_bf16"), engine_state(engine))
    check_equal(full_values(engine), ref, "bf16 without ZeRO -> bf16 ZeRO-3")

    # ZeRO -> FSDP2, FSDP1 and DDP on the same ranks (every full tensor equal), then each of those,
    # one step further, -> ZeRO
    for layout, src, dst in (("fsdp2", 3, 2), ("fsdp1", 2, 3), ("ddp", 1, 3)):
        model, opt = torch_layout(layout)
        bcp.load(os.path.join(root, f"zero{src}"), {"model": model, "optimizer": opt})
        check_equal(torch_values(model, opt, layout), {k: v for k, v in refs[src].items() if k != "global_steps"},
                    f"ZeRO-{src} -> {layout}")
        ids = tokens(2, rank, dist.get_world_size())
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        bcp.save(os.path.join(root, layout), {"model": model, "optimizer": opt})
        ref = torch_values(model, opt, layout)
        engine = engine_for(dst, seed=7)
        bcp.load(os.path.join(root, layout), {"model": engine, "optimizer": engine.optimizer})
        got = full_values(engine)
        got.pop("global_steps")
        check_equal(got, ref, f"{layout} -> ZeRO-{dst}")

    # a 1-process plain checkpoint (written by the test) -> ZeRO-3 on 2 ranks
    engine = engine_for(3, seed=7)
    bcp.load(os.path.join(root, "plain"), {"model": engine, "optimizer": engine.optimizer})
    plain_ref = torch.load(os.path.join(root, "ref_plain.pt"))
    got = full_values(engine)
    got.pop("global_steps")
    check_equal(got, plain_ref, "plain -> ZeRO-3")

    shape_mismatch_is_refused(os.path.join(root, "zero2"))

    open(os.path.join(root, f"matrix_ok_rank{rank}"), "w").close()


def reshard(root: str) -> None:
    rank = dist.get_rank()
    engine = engine_for(3)
    for step in (0, 1):
        train_step(engine, step)
    path = os.path.join(root, "zero3")
    handle = bcp.save(path, {**engine_state(engine), "extra_state": {"rng": bcp.rng.rng_state()}}, async_save=True)
    ref = full_values(engine)
    after = train_step(engine, 2)  # the next step runs while the save writes
    handle.wait()
    if rank == 0:
        torch.save(ref, os.path.join(root, "ref_zero3.pt"))
        torch.save({"loss": after, "values": full_values(engine)}, os.path.join(root, "after_zero3.pt"))
    else:
        full_values(engine)  # collective
    same_names_are_refused(root, engine)
    engine = engine_for(2, seed=7)
    bcp.load(path, engine_state(engine))
    check_equal(full_values(engine), ref, "bcp ZeRO-3 -> ZeRO-2")
    module_without_engine_is_refused(path, engine)
    shape_mismatch_is_refused(path)
    open(os.path.join(root, f"reshard_ok_rank{rank}"), "w").close()


def same_names_are_refused(root: str, engine) -> None:
    """One optimizer over two modules of the state whose parameters have the same names (two decoder
    layers, each under its own key): refused on every rank, as one's state would be saved over the other's."""
    layers = engine.module.model.layers
    try:
        bcp.save(os.path.join(root, "same_names"), {"a": layers[0], "b": layers[1], "optimizer": engine.optimizer})
    except bcp.BCPError as e:
        assert "both named 'self_attn.q_proj.weight'" in str(e), str(e)
    else:
        raise AssertionError("one optimizer over two modules with the same parameter names was saved")


def module_without_engine_is_refused(path: str, engine) -> None:
    """The module a ZeRO-2 engine trains, without the engine (alone, or with the ZeRO optimizer): its
    parameters are the working copies, not the fp32 values the optimizer trains, so a load into them
    would be lost at the next step. Refused on every rank, naming the fix; the engine unchanged."""
    before = full_values(engine)
    for state in ({"model": engine.module}, {"model": engine.module, "optimizer": engine.optimizer}):
        for op in (lambda state: bcp.save(path + "_module", state), lambda state: bcp.load(path, state)):
            try:
                op(state)
            except bcp.BCPError as e:
                assert "pass the DeepSpeed engine" in str(e), str(e)
            else:
                raise AssertionError(f"a ZeRO-2 model without its engine was saved or loaded: {sorted(state)}")
    check_equal(full_values(engine), before, "after the refused loads")


def shape_mismatch_is_refused(path: str) -> None:
    """A checkpoint of another shape: one error on every rank, nothing changed."""
    engine = engine_for(3, seed=7, vocab_size=80)
    train_step(engine, 0)  # the optimizer state exists: the failed load must leave it too
    before = full_values(engine)
    try:
        bcp.load(path, engine_state(engine))
    except bcp.ShapeMismatchError as e:
        assert "embed_tokens.weight" in str(e) and "(64, 16)" in str(e) and "(80, 16)" in str(e), str(e)
    else:
        raise AssertionError("loading a checkpoint of another vocabulary size did not fail")
    check_equal(full_values(engine), before, "after the failed load")


def continue_on_one(root: str) -> None:
    engine = engine_for(2, seed=7)
    bcp.load(os.path.join(root, "zero3"), engine_state(engine))
    ref = torch.load(os.path.join(root, "ref_zero3.pt"))
    check_equal(full_values(engine), ref, "ZeRO-3 on 2 ranks -> ZeRO-2 on 1")
    loss = train_step(engine, 2)
    torch.save({"loss": loss, "values": full_values(engine)}, os.path.join(root, "continued.pt"))


def megatron_llama():
    """The Llama of recipes/megatron_to_hf.py's Hugging Face side (its Megatron GPTModel's shape)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes"))
    import megatron_to_hf as r
    return LlamaForCausalLM(LlamaConfig(hidden_size=r.HIDDEN, num_attention_heads=r.HEADS,
                                        num_key_value_heads=r.GROUPS, num_hidden_layers=r.LAYERS,
                                        intermediate_size=r.FFN, vocab_size=r.VOCAB, rms_norm_eps=1e-5,
                                        rope_theta=10000.0, max_position_embeddings=32, tie_word_embeddings=False))


def from_megatron(root: str) -> None:
    """A Megatron-core checkpoint (TP=2, DistributedOptimizer) into a Hugging Face Llama under ZeRO-3,
    through `mapping="auto"`: what a plain model in one process loads (DIR/ref_megatron.pt)."""
    model = megatron_llama()
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                      config=ds_config(3, dist.get_world_size()))
    bcp.load(os.path.join(root, "megatron", "iter_0000003"), {"model": engine, "optimizer": engine.optimizer},
             mapping="auto")
    got = full_values(engine)
    got.pop("global_steps")
    check_equal(got, torch.load(os.path.join(root, "ref_megatron.pt")), "Megatron -> ZeRO-3 (mapping='auto')")
    open(os.path.join(root, f"megatron_ok_rank{dist.get_rank()}"), "w").close()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--phase", choices=("matrix", "reshard", "continue", "megatron"), required=True)
    parser.add_argument("--root", required=True)
    args = parser.parse_args()
    deepspeed.init_distributed(dist_backend="gloo")
    phases = {"matrix": matrix, "reshard": reshard, "continue": continue_on_one, "megatron": from_megatron}
    phases[args.phase](args.root)


if __name__ == "__main__":
    main()
    # how this job ends is not under test: past the torch 2.13 + gloo abort at interpreter teardown
    # (docs/integrations.md, "Shared notes"); exit handlers still run
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "recipes"))
    from _launch import exit_without_teardown
    exit_without_teardown()
