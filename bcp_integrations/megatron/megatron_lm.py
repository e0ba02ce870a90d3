"""`--ckpt-format bcp` for Megatron-LM training scripts (Megatron-LM core_v0.16 to core_v0.19).

    from bcp_integrations.megatron import enable_megatron_lm
    enable_megatron_lm()          # before Megatron-LM parses its arguments (pretrain, parse_and_validate_args)
    pretrain(...)                 # then run with --ckpt-format bcp

Megatron-LM only knows the formats of its `--ckpt-format` choices and compares `args.ckpt_format`
with "torch_dist" in many places (RNG state as ShardedObject, `sharded_state_dict()` of model and
optimizer, async save, load dispatch), all of which bcp wants: bcp is a torch_dist-style backend of
dist_checkpointing. So rather than touching each of those places:

1. every argument parser Megatron-LM builds (`arguments.add_megatron_arguments`, which each release's
   `parse_args` calls — also the early parses of in-process restart and fault tolerance) accepts
   "bcp" for `--ckpt-format`, parses it as "torch_dist" and records the choice (`bcp_selected()`);
2. the routing of dist_checkpointing's save (routing.py) then gives every save of the run, whatever
   strategy Megatron-LM built for it (looked up on 0.16, constructed directly from 0.17 on, wrapped
   for `--ckpt-fully-parallel-save`), to bcp;
3. loads need nothing: the routing reads a checkpoint whose `metadata.json` names bcp with bcp, so in
   a process that made this call a bcp checkpoint resumes under any `--ckpt-format`, and a
   torch_dist one still loads under `--ckpt-format bcp`;
4. `--non-persistent-ckpt-type local` is served by bcp's tiers (local_checkpoints.py);
5. the distributed optimizer's `fully_reshardable` state (`--dist-ckpt-optim-fully-reshardable`) is
   saved gather-free (`optimizer.fully_reshardable_param_state`), which also avoids Megatron's own
   save of that layout misplacing the state of every parameter after a padded bucket boundary
   (docs/megatron.md, "Distributed optimizer"). Megatron's own loader reads it;
5. a resume at another expert-parallel size works in Megatron-LM's own `load_checkpoint`, whichever
   format saved: the loaded optimizer state is regrouped for the run's chain of optimizers
   (`optimizer.chained_optimizer_state`: EP>1 chains a second DistributedOptimizer for the experts,
   EP=1 does not) before Megatron hands it to `optimizer.load_state_dict`, and the RNG state is
   ignored with a message, as Megatron ignores it when TP or PP change (its tracker holds the
   expert-parallel RNG of each EP rank; 0.16-0.18 also shard the RNG state by DP rank at EP>1 only,
   so a resume across EP=1 would ask for shards the checkpoint lacks).
"""

from __future__ import annotations

import argparse

_BACKEND = "bcp"  # strategy.BACKEND; not imported: routing imports this module
_state = {"selected": False, "enabled": False}


def bcp_selected() -> bool:
    """Whether this run asked for `--ckpt-format bcp`."""
    return _state["selected"]


def _parse_ckpt_format(value: str) -> str:
    if value == _BACKEND:
        _state["selected"] = True
        return "torch_dist"  # every Megatron-LM code path keyed on torch_dist is the one bcp needs
    return value


def add_ckpt_format_choice(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Let `--ckpt-format` accept "bcp" (also usable alone as an `extra_args_provider`). Idempotent."""
    actions = [a for a in parser._actions if "--ckpt-format" in a.option_strings]
    if not actions:
        raise RuntimeError("this Megatron-LM has no --ckpt-format argument; bcp cannot hook into it")
    for action in actions:
        if getattr(action.type, "_bcp", False):
            continue
        if action.choices is not None and _BACKEND not in action.choices:
            action.choices = [*action.choices, _BACKEND]
        inner = action.type

        def parse(value, inner=inner):
            value = _parse_ckpt_format(value)
            return inner(value) if callable(inner) else value
        parse._bcp = True
        action.type = parse
    return parser


def enable_megatron_lm() -> None:
    """Make `--ckpt-format bcp` work in this process's Megatron-LM. Idempotent; call before its
    arguments are parsed."""
    if _state["enabled"]:
        return
    try:
        from megatron.training import arguments
    except ImportError as e:
        raise ImportError("enable_megatron_lm() needs Megatron-LM's `megatron.training` (a Megatron-LM "
                          "checkout on PYTHONPATH); megatron-core alone has no training loop") from e
    if not hasattr(arguments, "add_megatron_arguments"):
        from bcp_core.errors import UnsupportedFrameworkError
        raise UnsupportedFrameworkError("this Megatron-LM's megatron.training.arguments has no "
                                        "add_megatron_arguments (Megatron-LM core_v0.16 to core_v0.19 are "
                                        "supported); pass add_ckpt_format_choice as its extra_args_provider")
    original = arguments.add_megatron_arguments
    from . import local_checkpoints  # --non-persistent-ckpt-type local served by bcp's tiers

    def add_megatron_arguments(parser: argparse.ArgumentParser, *args, **kwargs):
        return local_checkpoints.hook_parser(add_ckpt_format_choice(original(parser, *args, **kwargs)),
                                             bcp_selected)

    arguments.add_megatron_arguments = add_megatron_arguments
    local_checkpoints.enable()
    _save_fully_reshardable_gather_free()
    _resume_at_another_expert_parallel_size()
    _state["enabled"] = True


def _save_fully_reshardable_gather_free() -> None:
    """In a run that chose bcp, `DistributedOptimizer`'s fully_reshardable param state for a save is
    bcp's gather-free one (the same keys and shapes; its loader is unchanged)."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    from .optimizer import fully_reshardable_param_state
    original = DistributedOptimizer.sharded_param_state_fully_reshardable

    def sharded_param_state_fully_reshardable(self, model_sharded_state_dict, is_loading=False, metadata=None):
        if bcp_selected() and not is_loading:
            return fully_reshardable_param_state(self, model_sharded_state_dict)
        return original(self, model_sharded_state_dict, is_loading, metadata)

    DistributedOptimizer.sharded_param_state_fully_reshardable = sharded_param_state_fully_reshardable


def _resume_at_another_expert_parallel_size() -> None:
    """Megatron-LM's `load_checkpoint` (in `checkpointing`, and where `training` imported it), made to
    resume at another EP (module docstring, 5): while it runs, the optimizer it loads takes the state
    regrouped for its own chain, and its first read of the checkpoint (the common state, `rank0=True`)
    tells whether EP changed, which turns the RNG state's load off for this call."""
    from megatron.training import checkpointing, training

    from .optimizer import chained_optimizer_state
    original_load = checkpointing.load_checkpoint
    original_base = checkpointing._load_base_checkpoint
    loading: list[dict] = []  # the load_checkpoint calls under way (a stack: it is not re-entered in practice)

    def _load_base_checkpoint(load_dir, args, rank0=False, *rest, **kwargs):
        result = original_base(load_dir, args, rank0, *rest, **kwargs)
        state_dict = result[0] if isinstance(result, tuple) else None
        if rank0 and loading and isinstance(state_dict, dict) and not args.no_load_rng:
            saved = getattr(state_dict.get("args"), "expert_model_parallel_size", None)
            if saved is not None and saved != args.expert_model_parallel_size:
                from megatron.training.utils import print_rank_0
                print_rank_0(f"expert-parallel size changed at resume ({args.expert_model_parallel_size} vs {saved} "
                             "from checkpoint): RNG state will be ignored")
                args.no_load_rng = True
                loading[-1]["restore_no_load_rng"] = args
        return result

    def load_checkpoint(ddp_model, optimizer, *rest, **kwargs):
        call: dict = {}
        loading.append(call)
        regroup = optimizer is not None and callable(getattr(optimizer, "load_state_dict", None))
        if regroup:
            own = optimizer.load_state_dict

            def load_state_dict(state_dict):
                if _distributed_optimizer_state(state_dict):
                    state_dict = chained_optimizer_state(optimizer, state_dict)
                return own(state_dict)
            optimizer.load_state_dict = load_state_dict  # this call only: an attribute over the method
        try:
            return original_load(ddp_model, optimizer, *rest, **kwargs)
        finally:
            loading.pop()
            if regroup:
                del optimizer.load_state_dict
            if "restore_no_load_rng" in call:
                call["restore_no_load_rng"].no_load_rng = False

    checkpointing._load_base_checkpoint = _load_base_checkpoint
    for module in (checkpointing, training):
        if getattr(module, "load_checkpoint", None) is original_load:
            module.load_checkpoint = load_checkpoint


def _distributed_optimizer_state(state_dict) -> bool:
    """Whether `state_dict` is a dist checkpoint's state of a DistributedOptimizer or a chain of them (what
    `chained_optimizer_state` regroups): its param groups under "optimizer", once or per member. Megatron's
    plain optimizers' state (torch's `state` / `param_groups`) and the legacy format's lists pass unchanged."""
    if not isinstance(state_dict, dict):
        return False
    members = [v for k, v in state_dict.items() if isinstance(k, int)]
    return "optimizer" in state_dict or bool(members) and all(isinstance(v, dict) and "optimizer" in v
                                                              for v in members)
