"""A Megatron model made ready to train as Megatron-LM's loop makes it, and one pass of Megatron's own
schedule over it, for the mapping tests (tests/test_mapping_megatron.py, tests/test_mapping_moe.py,
tests/test_megatron_hybrid.py, tests/test_megatron_deepseek.py)."""

from __future__ import annotations

import torch


def megatron_distributed(cfg, model):
    """`model` in Megatron's DDP with its distributed Adam, as Megatron-LM's training loop sets them up:
    after backward, the gradients are reduced over DP and the tied embedding's summed over the first
    and last pipeline stages (they hold one weight each). Returns (ddp, optimizer)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    cfg.finalize_model_grads_func = finalize_model_grads
    ddp = DistributedDataParallel(cfg, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                     grad_reduce_in_fp32=True), model)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.01,
                                                 use_distributed_optimizer=True, params_dtype=torch.float32), [ddp])
    return ddp, opt


def megatron_pass(ddp, batch: torch.Tensor, forward_only: bool, seq: int, vocab: int):
    """Megatron's forward-backward schedule, one microbatch: the full-vocabulary logits [batch, seq, vocab]
    (`forward_only`), or the loss of a training pass; None on an earlier pipeline stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region
    out = {}
    pos = torch.arange(seq)[None].expand(batch.shape[0], seq)

    def step(_, model):
        if forward_only:
            logits = model(batch, pos, None)

            def keep(o):
                out["logits"] = gather_from_tensor_model_parallel_region(o).detach()
                return o.sum() * 0, {}
            return logits, keep
        loss = model(batch, pos, None, labels=batch)

        def reduce(o):
            out["loss"] = float(o.float().mean())
            return o.float().mean(), {}
        return loss, reduce

    get_forward_backward_func()(forward_step_func=step, data_iterator=iter([None]), model=[ddp], num_microbatches=1,
                                seq_length=seq, micro_batch_size=batch.shape[0], forward_only=forward_only)
    if not out:
        return None
    if forward_only:
        logits = out["logits"][..., :vocab]
        return (logits.transpose(0, 1) if logits.shape[0] == seq else logits).clone()
    return out["loss"]
