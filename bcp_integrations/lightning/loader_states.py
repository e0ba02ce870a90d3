"""Lightning's train loaders' states as bcp saves them: out of the fit loop's replicated state into
bcp's dataloader entries (each DP rank's part, resharded when the DP degree changes), back where
Lightning looks for them after a load, and checked from a checkpoint's metadata before a load."""

from __future__ import annotations

import re
from typing import Any

from lightning.fabric.utilities.types import _Stateful
from lightning.pytorch.strategies import Strategy

from bcp_core import codec
from bcp_core.dataloader import loadable_loader_state, saved_loader_state
from bcp_core.engine.read import ShardReader
from bcp_core.metadata import ObjectValue
from bcp_core.utils import this_rank

# bcp keys of the train loaders' states: "dataloader", "dataloader_1", ... (one per stateful loader)
LOADER_KEY = re.compile(r"^dataloader(_\d+)?$")



def fit_loop_state(checkpoint: dict) -> dict | None:
    sd = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict")
    return sd if isinstance(sd, dict) else None


def _dp_position(strategy: Strategy) -> tuple[int, int]:
    """This rank's data-parallel rank and degree, as Lightning gives them to samplers."""
    kwargs = getattr(strategy, "distributed_sampler_kwargs", None) or {}
    return int(kwargs.get("rank", 0)), int(kwargs.get("num_replicas", 1)) or 1


def move_loader_states(strategy: Strategy, rest: dict, state: dict) -> dict:
    """Take the train loaders' states out of Lightning's loop state into bcp's dataloader entries.

    Lightning keeps them in ``loops.fit_loop.state_dict.combined_loader``, one per stateful train
    loader. In that replicated dict one rank's state would stand for all; as ``state["dataloader"]``
    (``dataloader_1``, ...) each DP rank's part is saved, and a ReshardableLoader's state is split
    and merged when the DP degree changes. The loop state keeps the entries' names.
    """
    fit = fit_loop_state(rest)
    states = fit.get("combined_loader") if fit else None
    if not states:
        return rest
    combined = strategy.lightning_module.trainer.fit_loop._combined_loader
    loaders = [ld for ld in combined.flattened if isinstance(ld, _Stateful)] if combined is not None else []
    if len(loaders) != len(states):
        raise RuntimeError(f"Lightning's loop state holds {len(states)} train loader states, the train "
                           f"dataloader has {len(loaders)} stateful loaders")
    dp_rank, dp_size = _dp_position(strategy)
    # Lightning's fetcher draws a batch ahead of the one being trained on (to know when the epoch
    # ends); the state saved is the one before the batches it holds, so they are not lost.
    fetcher = strategy.lightning_module.trainer.fit_loop._data_fetcher
    unconsumed = len(getattr(fetcher, "batches", None) or ())
    names = []
    for i, (loader, loader_state) in enumerate(zip(loaders, states)):
        name = "dataloader" if i == 0 else f"dataloader_{i}"
        state[name] = saved_loader_state(loader, loader_state, dp_rank, dp_size, unconsumed)
        names.append(name)
    # copies along the path: Lightning's own dict stays as it was
    loops = dict(rest["loops"])
    loops["fit_loop"] = dict(loops["fit_loop"])
    loops["fit_loop"]["state_dict"] = {**fit, "combined_loader": names}
    return {**rest, "loops": loops}


def restore_loader_states(strategy: Strategy, checkpoint: dict, state: dict) -> None:
    """Put the loaded loader states back where Lightning looks for them (the fit loop hands them to
    the live loaders' load_state_dict once it has built them)."""
    fit = fit_loop_state(checkpoint)
    names = fit.get("combined_loader") if fit else None
    if not names:
        return
    dp_rank, dp_size = _dp_position(strategy)
    fit["combined_loader"] = [loadable_loader_state(state[name], dp_rank, dp_size) for name in names]


def saved_value(md, key: str, allow_pickle: bool) -> Any:
    """The value saved under `key`, from the metadata `md` (this rank's, where ranks saved different
    ones), decoded; `NOT_SAVED` if `md` holds no value there (a tensor, nothing)."""
    if key in md.objects:
        return codec.decode(md.objects[key].encoded, key, allow_pickle)
    if key in md.per_rank:
        variant = md.per_rank[key].variant_for(this_rank())
        if isinstance(variant, ObjectValue):
            return codec.decode(variant.encoded, key, allow_pickle)
    return NOT_SAVED


NOT_SAVED = object()


class _SavedIndices(ShardReader):
    """A sharded object's saved indices, from the metadata; reads nothing (its shards are None)."""

    def __init__(self, md, fqn: str):
        super().__init__(None, md, fqn, False, False)

    def __getitem__(self, index) -> None:
        if index not in self:
            return super().__getitem__(index)  # raises, naming the index
        return None


def check_loader_states(strategy: Strategy, checkpoint: dict, md, allow_pickle: bool) -> None:
    """Raise now what `restore_loader_states` would raise after the load (an opaque loader's state
    saved at another DP degree: LoaderStateError), from the metadata: each loader state Lightning's
    loop state names, built from its saved values, its shards standing in by their indices."""
    fit = fit_loop_state(checkpoint)
    names = fit.get("combined_loader") if fit else None
    if not names:
        return
    dp_rank, dp_size = _dp_position(strategy)
    for name in names:
        if not isinstance(name, str):
            continue  # not a name `move_loader_states` wrote: `restore_loader_states` says what it is
        loader_state = saved_value(md, name, allow_pickle)
        if loader_state is NOT_SAVED:
            loader_state = {}
            for key in md.keys():
                if not key.startswith(name + "."):
                    continue
                value = _SavedIndices(md, key) if key in md.sharded_objects else saved_value(md, key, allow_pickle)
                if value is NOT_SAVED:
                    continue
                *parents, last = key[len(name) + 1:].split(".")
                node = loader_state
                for part in parents:
                    node = node.setdefault(part, {})
                    if not isinstance(node, dict):
                        break
                else:
                    node[last] = value
        loadable_loader_state(loader_state, dp_rank, dp_size)
