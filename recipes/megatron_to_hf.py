"""Megatron-core (TP=2) -> Hugging Face under FSDP2 on 2 processes: weights, Adam state and step, no conversion.

    torchrun --nproc_per_node 2 recipes/megatron_to_hf.py [--out DIR]

Runs on CPU with gloo (Megatron's DDP and DistributedOptimizer through recipes/_megatron_cpu.py).

1. `--phase megatron`: a tiny Llama-like GPTModel (RMSNorm, SwiGLU, grouped-query attention,
   RoPE) at tensor parallelism 2 trains 3 steps with Megatron's DDP and DistributedOptimizer and
   is saved through `dist_checkpointing.save(..., sharded_strategy=("bcp", 1))`, the optimizer
   state in the `fully_reshardable` layout written without a gather.
2. `--phase hf`: a LlamaForCausalLM of the same shape, sharded with FSDP2 (`fully_shard`) on the
   same 2 processes, with a fresh AdamW, loads that checkpoint with `mapping="auto"` (bcp sees
   the checkpoint was saved by Megatron and the target is a Llama: `megatron_to_hf`); its first
   loss equals Megatron's next loss on the same batch, and training goes on from step 3.

`--phase run` (the default) does both in one launch; `--report FILE` writes the losses as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile

from _launch import exit_without_teardown  # recipes/_launch.py

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import bcp_core as bcp  # noqa: E402

VOCAB, HIDDEN, HEADS, GROUPS, FFN, LAYERS, SEQ, BATCH = 100, 32, 4, 2, 48, 2, 8, 4
MEGATRON_STEPS, HF_STEPS = 3, 3


def batch(step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)


def on_cpu():
    """Megatron's CUDA calls redirected to the CPU, only when there is no GPU."""
    if torch.cuda.is_available():
        return contextlib.nullcontext()
    from _megatron_cpu import cuda_on_cpu  # recipes/_megatron_cpu.py
    return cuda_on_cpu()


# ----------------------------------------------------------------------------- phase 1: Megatron

def megatron_phase(path: str) -> list[float]:
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                           finalize_model_grads)
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.transformer import TransformerConfig

    from bcp_integrations.megatron import fully_reshardable_param_state  # registers ("bcp", 1)

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=True)
    torch.manual_seed(0)
    cfg = TransformerConfig(num_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                            num_query_groups=GROUPS, ffn_hidden_size=FFN, tensor_model_parallel_size=2,
                            use_cpu_initialization=True, params_dtype=torch.float32, normalization="RMSNorm",
                            gated_linear_unit=True, activation_func=F.silu, add_bias_linear=False,
                            bias_activation_fusion=False, layernorm_epsilon=1e-5, hidden_dropout=0.0,
                            attention_dropout=0.0)
    cfg.finalize_model_grads_func = finalize_model_grads
    losses = []
    with on_cpu():
        model = GPTModel(cfg, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=256,
                         max_sequence_length=32, position_embedding_type="rope", rotary_base=10000,
                         share_embeddings_and_output_weights=False)
        ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                         grad_reduce_in_fp32=True), model)
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01,
                                                     use_distributed_optimizer=True), [ddp])
        pos = torch.arange(SEQ)[None].expand(BATCH, SEQ)

        def loss_of(tokens: torch.Tensor, forward_only: bool) -> float:
            def step(_, m):
                # next-token loss over the real vocabulary, as the Hugging Face model computes it
                logits = m(tokens, pos, None)
                from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
                full = gather_from_tensor_model_parallel_region(logits)[..., :VOCAB]  # [batch, seq, vocab]
                loss = F.cross_entropy(full[:, :-1].reshape(-1, VOCAB).float(), tokens[:, 1:].reshape(-1))
                return loss, lambda out: (out, {"loss": out.detach()})
            out = get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[ddp],
                                              num_microbatches=1, seq_length=SEQ, micro_batch_size=BATCH,
                                              forward_only=forward_only)
            return float(out[0]["loss"])

        for step in range(MEGATRON_STEPS):
            ddp.zero_grad_buffer()
            opt.zero_grad()
            losses.append(loss_of(batch(step), forward_only=False))
            opt.step()
        losses.append(loss_of(batch(MEGATRON_STEPS), forward_only=True))  # what the next step would see
        model_sd = model.sharded_state_dict()
        opt_sd = opt.sharded_state_dict(model.sharded_state_dict(),
                                        metadata={"distrib_optim_sharding_type": "fully_reshardable"})
        distopt = opt.chained_optimizers[0] if hasattr(opt, "chained_optimizers") else opt
        opt_sd["param_state"] = fully_reshardable_param_state(distopt, model_sd)  # no gather over DP
        os.makedirs(path, exist_ok=True)
        dist_checkpointing.save({"model": model_sd, "optimizer": opt_sd}, path, sharded_strategy=("bcp", 1))
    parallel_state.destroy_model_parallel()
    return losses


# ----------------------------------------------------------------------------- phase 2: Hugging Face, FSDP2

def hf_phase(path: str) -> tuple[list[float], float]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(hidden_size=HIDDEN, num_attention_heads=HEADS, num_key_value_heads=GROUPS,
                         num_hidden_layers=LAYERS, intermediate_size=FFN, vocab_size=VOCAB, rms_norm_eps=1e-5,
                         rope_theta=10000.0, max_position_embeddings=32, tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)  # state: created by the load
    bcp.load(path, {"model": model, "optimizer": opt}, mapping="auto")
    step = int(next(iter(opt.state.values()))["step"])
    losses = []
    for i in range(HF_STEPS):
        tokens = batch(MEGATRON_STEPS + i)
        loss = model(input_ids=tokens, labels=tokens).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, step


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--phase", choices=["run", "megatron", "hf"], default="run")
    p.add_argument("--out", default=None, help="checkpoint directory (default: a temporary one)")
    p.add_argument("--report", default=None, help="write the losses as JSON here (rank 0)")
    args = p.parse_args()
    dist.init_process_group("gloo")
    if dist.get_world_size() != 2:
        raise SystemExit("run with torchrun --nproc_per_node 2")
    holder = [args.out or (tempfile.mkdtemp(prefix="bcp_m2hf_") if dist.get_rank() == 0 else None)]
    dist.broadcast_object_list(holder)
    path = os.path.join(holder[0], "iter_0000003")
    report: dict = {}
    if args.phase in ("run", "megatron"):
        report["megatron_losses"] = megatron_phase(path)
        if dist.get_rank() == 0:
            print(f"Megatron TP=2: losses {[round(x, 4) for x in report['megatron_losses'][:-1]]}, saved to {path} "
                  f"({bcp.inspect(path).framework}); next-batch loss {report['megatron_losses'][-1]:.6f}")
    if args.phase in ("run", "hf"):
        report["hf_losses"], report["hf_start_step"] = hf_phase(path)
        if dist.get_rank() == 0:
            print(f"Hugging Face FSDP2 on 2 ranks: resumed at step {report['hf_start_step']}, losses "
                  f"{[round(x, 6) for x in report['hf_losses']]}")
    if args.report and dist.get_rank() == 0:
        with open(args.report, "w") as f:
            json.dump(report, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":  # required: Megatron and bcp start helper processes that re-import __main__
    main()
    exit_without_teardown()
