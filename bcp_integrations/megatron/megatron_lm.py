"""`--ckpt-format bcp` for Megatron-LM training scripts (written against Megatron-LM core_v0.16.1).

    from bcp_integrations.megatron import enable_megatron_lm
    enable_megatron_lm()          # before pretrain(...)
    pretrain(...)                 # then run with --ckpt-format bcp

Megatron-LM only knows the formats of its `--ckpt-format` Literal and compares `args.ckpt_format`
with "torch_dist" in a dozen places (RNG state as ShardedObject, `sharded_state_dict()` of model
and optimizer, async save, load dispatch). bcp is a torch_dist-style backend of dist_checkpointing,
so rather than touching each of those places this:

1. adds "bcp" to the choices of `--ckpt-format` and parses it as "torch_dist" (recording the
   choice), so every code path is the dist_checkpointing one, async save included;
2. makes the save strategy lookup of `megatron.training.checkpointing` return bcp's strategy when
   bcp was chosen (Megatron-LM still wraps it in `FullyParallelSaveStrategyWrapper`, harmless);
3. relies on loads resolving the strategy from the checkpoint's `metadata.json`, which names
   `bcp`: a bcp checkpoint loads whatever `--ckpt-format` the resuming run uses, and a torch_dist
   checkpoint still loads under `--ckpt-format bcp`.

Megatron-LM releases after 0.16 construct `TorchDistSaveShardedStrategy` directly instead of
looking it up; there, pass `checkpointing_context={"save_strategy": BcpSaveShardedStrategy()}`
to `save_checkpoint` instead of step 2.
"""

from __future__ import annotations

import argparse

from .strategy import BACKEND, BcpSaveShardedStrategy

_state = {"selected": False, "enabled": False}


def bcp_selected() -> bool:
    """Whether this run asked for `--ckpt-format bcp`."""
    return _state["selected"]


def _parse_ckpt_format(value: str) -> str:
    if value == BACKEND:
        _state["selected"] = True
        return "torch_dist"  # every Megatron-LM code path keyed on torch_dist is the one bcp needs
    return value


def add_ckpt_format_choice(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `--ckpt-format` accept "bcp" (an `extra_args_provider` for Megatron-LM's parse_args)."""
    actions = [a for a in parser._actions if "--ckpt-format" in a.option_strings]
    if not actions:
        raise RuntimeError("this Megatron-LM has no --ckpt-format argument; bcp cannot hook into it")
    for action in actions:
        if action.choices is not None and BACKEND not in action.choices:
            action.choices = [*action.choices, BACKEND]
        inner = action.type

        def parse(value, inner=inner):
            value = _parse_ckpt_format(value)
            return inner(value) if callable(inner) else value
        action.type = parse
    return parser


def enable_megatron_lm() -> None:
    """Make `--ckpt-format bcp` work in this process's Megatron-LM. Idempotent; call before pretrain."""
    if _state["enabled"]:
        return
    try:
        from megatron.training import checkpointing, initialize
    except ImportError as e:
        raise ImportError("enable_megatron_lm() needs Megatron-LM's `megatron.training` (a Megatron-LM "
                          "checkout on PYTHONPATH); megatron-core alone has no training loop") from e

    original_parse_args = initialize.parse_args

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        def provider(parser):
            parser = add_ckpt_format_choice(parser)
            return extra_args_provider(parser) if extra_args_provider is not None else parser
        return original_parse_args(provider, ignore_unknown_args)

    original_strategy = checkpointing.get_default_save_sharded_strategy

    def get_default_save_sharded_strategy(backend: str = "torch_dist", version: int = 1):
        if bcp_selected():
            return BcpSaveShardedStrategy()
        return original_strategy(backend, version)

    initialize.parse_args = parse_args
    checkpointing.get_default_save_sharded_strategy = get_default_save_sharded_strategy
    _state["enabled"] = True
