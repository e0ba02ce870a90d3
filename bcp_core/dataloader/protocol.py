"""The loader protocol bcp checkpoints: replicated state, one sharded part per read unit.

A loader's state is split into a replicated part (configuration identical on every rank, saved once)
and sharded parts: one per *read unit*, i.e. per DP rank and read worker (one in-process unit when a
rank has no workers). Units are saved as sharded objects (`ObjectShard`), so a loading rank reads
only the units it needs. `ReshardableLoader` is the protocol a loader implements to be split and
merged when the DP degree changes (docs/dataloader.md); `OpaqueLoader` wraps any other stateful
loader (restored at the same DP degree only); `MappedLoader` maps a loader's batches and keeps its
state; `checkpointable` picks the right wrapper.
"""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Any

from ..engine import ShardReader
from ..errors import LoaderStateError
from ..shards import ObjectShard
from ..utils import this_rank

log = logging.getLogger("bcp")


# ----------------------------------------------------------------------------- the protocol

class ReshardableLoader:
    """Base of loaders whose state bcp saves in parts and splits/merges when the DP degree changes.

    A subclass sets `loader_format` (a string naming its state layout), `dp_rank`, `dp_size` and
    `units_per_rank`, and implements the five methods below. This class turns them into
    `state_dict()` / `load_state_dict()` / `bcp_load_template()`, so `bcp.save` and `bcp.load`
    handle the loader like any stateful object under `state["dataloader"]`.
    """

    loader_format: str = ""
    dp_rank: int = 0
    dp_size: int = 1
    units_per_rank: int = 1

    def loader_replicated_state(self) -> dict:
        """Configuration identical on every rank (sources, seeds). Saved once, from rank 0."""
        raise NotImplementedError

    def loader_unit_states(self, unconsumed: int = 0) -> tuple[Any, list]:
        """(rank_state, [unit_state] * units_per_rank) as of the last batch handed to the caller.

        Values in the safe codec. `rank_state` holds what is meaningful only in the same layout
        (which worker yields next); unit states hold the remaining work. With `unconsumed=k`, the
        state as of k batches earlier: the caller's framework fetched the last k batches ahead and
        has not trained on them, so a restore must deliver them again. Raise LoaderStateError when
        the loader cannot go back that far.
        """
        raise NotImplementedError

    def loader_check(self, replicated: dict) -> None:
        """Raise LoaderStateError if a saved state with this replicated part cannot be adopted here
        (other sources, another seed). Called before any sharded part is read. Optional."""

    def split_unit_state(self, unit: Any, lo: Fraction, hi: Fraction) -> Any:
        """The part [lo, hi) of a saved unit's remaining work, 0 <= lo < hi <= 1.

        For any cut points 0 = f0 < f1 < ... < fk = 1 the parts [f_i, f_i+1) must partition the
        unit's work: every remaining token in exactly one part.
        """
        raise NotImplementedError

    def merge_unit_states(self, parts: list) -> Any:
        """One unit doing the work of `parts` (pieces of consecutive saved units, in order)."""
        raise NotImplementedError

    def loader_check_units(self, replicated: dict, rank_state: Any, units: list) -> None:
        """Raise LoaderStateError if `loader_restore` could not adopt these (a malformed unit). Called
        before anything of the caller's state changes, so that `loader_restore` cannot fail. Optional."""

    def loader_restore(self, replicated: dict, rank_state: Any, units: list, resharded: bool) -> None:
        """Adopt a state. `rank_state` is None unless the layout (DP degree and units per rank) is the
        saved one; `resharded` is True when units were split or merged rather than copied."""
        raise NotImplementedError

    # -- generic part: how the protocol maps onto bcp's replicated values and sharded objects

    def state_dict(self, unconsumed: int = 0) -> dict:
        """The state to save; `unconsumed`: see loader_unit_states."""
        rank_state, units = self.loader_unit_states(unconsumed) if unconsumed else self.loader_unit_states()
        if len(units) != self.units_per_rank:
            raise LoaderStateError(f"{type(self).__name__}: loader_unit_states() gave {len(units)} units, "
                                   f"units_per_rank is {self.units_per_rank}")
        here, grid = (self.dp_rank,), (self.dp_size,)
        return {
            "format": self.loader_format,
            "layout": {"dp_size": self.dp_size, "units_per_rank": self.units_per_rank},
            "replicated": self.loader_replicated_state(),
            "rank": ObjectShard(rank_state, here, grid),
            "units": {str(w): ObjectShard(u, here, grid) for w, u in enumerate(units)},
        }

    def bcp_load_template(self) -> dict:
        # Which saved units this rank needs depends on the saved layout, so nothing is requested by
        # index: bcp hands every sharded part over as a ShardReader and load_state_dict picks.
        # `format` is asked for by name so that a checkpoint without loader state fails a strict load.
        return {"format": None}

    def load_state_dict(self, state: dict) -> None:
        self.bcp_read_state(state)()

    def bcp_read_state(self, state: dict) -> Callable[[], None]:
        """Read and check every sharded part this rank needs from `state`, changing nothing; the
        returned call adopts it. `bcp.load` reads before any byte of the caller's state changes and
        adopts once every read of the load succeeded."""
        name = type(self).__name__
        if state.get("format") != self.loader_format:
            raise LoaderStateError(f"{name}: the dataloader state has format {state.get('format')!r}, expected "
                                   f"{self.loader_format!r} (was it saved by another loader class?)")
        layout = state.get("layout") or {}
        try:
            old_dp, old_w = int(layout["dp_size"]), int(layout["units_per_rank"])
        except (KeyError, TypeError, ValueError):
            raise LoaderStateError(f"{name}: the dataloader state lacks its layout (dp_size, units_per_rank)") from None
        replicated = state.get("replicated") or {}
        if not isinstance(replicated, Mapping):
            raise LoaderStateError(f"{name}: the dataloader state's replicated part is a {type(replicated).__name__}, "
                                   "not a dict")
        self.loader_check(replicated)
        saved_units = state.get("units") or {}
        # The layout must name exactly the units saved: a unit it left out would be data skipped
        # without a word, and a layout claiming more units than saved would be read in vain.
        if not isinstance(saved_units, Mapping) or old_dp < 1 or old_w < 1 or old_w != len(saved_units) \
                or any(str(w) not in saved_units for w in range(old_w)):
            saved = sorted(saved_units) if isinstance(saved_units, Mapping) else type(saved_units).__name__
            raise LoaderStateError(f"{name}: the dataloader state's layout (dp_size={old_dp}, units_per_rank={old_w}) "
                                   f"does not match the units saved (of workers {saved})")
        for w in range(old_w):
            _check_grid(saved_units[str(w)], old_dp, f"{name}: read unit {w}")
        cache: dict[int, Any] = {}

        def saved_unit(u: int) -> Any:
            if u not in cache:  # a saved unit overlapping two of this rank's units is read once
                dp, w = divmod(u, old_w)
                cache[u] = _read_shard(saved_units[str(w)], dp, f"read unit {w} of DP rank {dp}")
            return cache[u]

        new_w = self.units_per_rank
        old_n, new_n = old_dp * old_w, self.dp_size * new_w
        mine = range(self.dp_rank * new_w, (self.dp_rank + 1) * new_w)
        rank_state, resharded = None, False
        if (old_dp, old_w) == (self.dp_size, new_w):
            rank_state = _read_shard(state.get("rank"), self.dp_rank, f"rank state of DP rank {self.dp_rank}")
            units = [saved_unit(j) for j in mine]
        elif old_n == new_n:  # same number of units, regrouped into ranks: each unit moves intact
            units = [saved_unit(j) for j in mine]
        else:
            units = [self.merge_unit_states([self.split_unit_state(saved_unit(u), lo, hi)
                                             for u, lo, hi in unit_overlaps(j, old_n, new_n)]) for j in mine]
            resharded = True
        self.loader_check_units(replicated, rank_state, units)
        return functools.partial(self.loader_restore, replicated, rank_state, units, resharded)


def unit_overlaps(j: int, old_n: int, new_n: int) -> list[tuple[int, Fraction, Fraction]]:
    """(saved unit u, lo, hi): new unit j of new_n takes the part [lo, hi) of saved unit u of old_n."""
    start, stop = Fraction(j * old_n, new_n), Fraction((j + 1) * old_n, new_n)  # in saved-unit lengths
    out = []
    for u in range(math.floor(start), math.ceil(stop)):
        lo, hi = max(start - u, Fraction(0)), min(stop - u, Fraction(1))
        if lo < hi:
            out.append((u, lo, hi))
    return out


def _check_grid(src: Any, dp_size: int, what: str) -> None:
    """`src` (a ShardReader, or an ObjectShard of a state_dict()) is sharded over `dp_size` DP ranks,
    and a ShardReader holds every one of them: the layout saved is the layout of the units."""
    grid = getattr(src, "grid", None)
    if isinstance(src, ShardReader) and (tuple(grid) != (dp_size,) or len(src.indices) != dp_size):
        raise LoaderStateError(f"{what} was saved at indices {sorted(src.indices)} of grid {list(grid)}, but "
                               f"the layout says dp_size={dp_size}")
    if isinstance(src, ObjectShard) and tuple(grid) != (dp_size,):
        raise LoaderStateError(f"{what} has grid {list(grid)}, but the layout says dp_size={dp_size}")


def _read_shard(src: Any, dp: int, what: str) -> Any:
    if isinstance(src, ShardReader):
        if (dp,) not in src:
            raise LoaderStateError(f"the checkpoint has no {what} (saved indices {src.indices})")
        return src[(dp,)]
    if isinstance(src, ObjectShard):  # a state_dict() handed to load_state_dict directly
        if src.index == (dp,):
            return src.value
        raise LoaderStateError(f"{what} is not in this state dict, which holds DP rank {src.index} only; "
                               "resharding needs the state loaded from a checkpoint with bcp.load")
    raise LoaderStateError(f"{what}: expected a sharded object, got {type(src).__name__}")


# ----------------------------------------------------------------------------- opaque loaders

class OpaqueLoader:
    """A stateful loader whose state bcp cannot split (torchdata's StatefulDataLoader, ...).

    Saved as one sharded item per DP rank; restored by DP rank when the DP degree is unchanged
    (TP/PP may change). A changed DP degree raises LoaderStateError: handing ranks other ranks'
    positions would silently skip or repeat data.
    """

    loader_format = "bcp.OpaqueLoader/1"

    def __init__(self, loader, dp_rank: int, dp_size: int):
        if not (callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))):
            raise TypeError(f"{type(loader).__name__} has no state_dict()/load_state_dict()")
        _check_rank(dp_rank, dp_size)
        self.loader, self.dp_rank, self.dp_size = loader, dp_rank, dp_size

    def __iter__(self):
        return iter(self.loader)

    def __len__(self):
        return len(self.loader)

    def state_dict(self) -> dict:
        return saved_loader_state(self.loader, self.loader.state_dict(), self.dp_rank, self.dp_size)

    def bcp_load_template(self) -> dict:
        return {"format": None}

    def load_state_dict(self, state: dict) -> None:
        self.bcp_read_state(state)()

    def bcp_read_state(self, state: dict) -> Callable[[], None]:
        """This DP rank's state read from `state`, nothing changed; the returned call loads it."""
        if state.get("format") != self.loader_format:
            raise LoaderStateError(f"the dataloader state has format {state.get('format')!r}, not that of an "
                                   f"opaque loader ({self.loader_format!r})")
        return functools.partial(self.loader.load_state_dict, loadable_loader_state(state, self.dp_rank, self.dp_size))


class MappedLoader:
    """`fn(batch)` for every batch of `loader`, checkpointed as `loader` itself.

    For trainers that want batches in another form than the loader yields, e.g. the dict of tensors
    a Hugging Face model takes, built from a PackedTokenLoader's token batches.
    """

    def __init__(self, loader, fn):
        self.loader, self.fn = loader, fn

    def __iter__(self):
        for batch in self.loader:
            yield self.fn(batch)

    def __len__(self):
        return len(self.loader)

    @property
    def dp_rank(self) -> int:
        return self.loader.dp_rank

    @property
    def dp_size(self) -> int:
        return self.loader.dp_size

    def state_dict(self, *args, **kwargs) -> dict:
        return self.loader.state_dict(*args, **kwargs)

    def bcp_load_template(self) -> dict:
        template = getattr(self.loader, "bcp_load_template", None)
        return template() if callable(template) else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)

    def bcp_read_state(self, state: dict) -> Callable[[], None]:
        read_state = getattr(self.loader, "bcp_read_state", None)
        return read_state(state) if callable(read_state) else functools.partial(self.loader.load_state_dict, state)


def checkpointable(loader, dp_rank: int | None = None, dp_size: int | None = None):
    """What to put under state["dataloader"]: the loader itself when it speaks bcp's loader protocol
    (ReshardableLoader, OpaqueLoader, MappedLoader over one), else an OpaqueLoader keyed by DP rank
    (which defaults to the global rank: pure data parallelism)."""
    if _speaks_bcp(loader):
        return loader
    if isinstance(loader, MappedLoader):
        return MappedLoader(checkpointable(loader.loader, dp_rank, dp_size), loader.fn)
    dp_rank, dp_size = _dp_position(dp_rank, dp_size)
    return OpaqueLoader(loader, dp_rank, dp_size)


def saved_loader_state(loader, state: dict, dp_rank: int | None = None, dp_size: int | None = None,
                       unconsumed: int = 0) -> dict:
    """`state`, which `loader.state_dict()` returned, in the form bcp saves under state["dataloader"].

    For integrations that receive a loader's state from their framework (Lightning's loop state)
    rather than the loader: a state in bcp's loader protocol is kept as it is; any other is saved
    as an opaque state per DP rank, restored only at the same DP degree (see OpaqueLoader).
    `unconsumed`: batches the framework fetched ahead and did not train on yet. A ReshardableLoader
    gives its state as of before them, so they are delivered again after a restore; other loaders
    cannot, and their state stays ahead by that many batches (a warning says so).
    """
    if _reshardable(loader):
        return loader.state_dict(unconsumed=unconsumed) if unconsumed else state
    base = loader.loader if isinstance(loader, MappedLoader) else loader
    if unconsumed:
        log.warning("bcp: %s was %d batch(es) ahead of training when its state was saved and cannot give an "
                    "earlier state: a restore skips those batches (a ReshardableLoader such as PackedTokenLoader "
                    "does not)", type(base).__name__, unconsumed)
    if isinstance(base, OpaqueLoader):
        return state  # already in bcp's form
    dp_rank, dp_size = _dp_position(dp_rank, dp_size)
    _check_rank(dp_rank, dp_size)
    kind = f"{type(base).__module__}.{type(base).__qualname__}"
    return {"format": OpaqueLoader.loader_format, "layout": {"dp_size": dp_size, "loader": kind},
            "rank": ObjectShard(state, (dp_rank,), (dp_size,))}


def loadable_loader_state(state: dict, dp_rank: int | None = None, dp_size: int | None = None) -> dict:
    """What to hand a live loader's `load_state_dict`, from a loader state that `bcp.load` put into
    a plain dict (the loader did not exist yet, as in Lightning): an opaque state becomes this DP
    rank's own state (LoaderStateError if the DP degree changed); a ReshardableLoader's state is
    returned as it is, its sharded parts still to be read by the loader's `load_state_dict`."""
    if not isinstance(state, Mapping) or "format" not in state:
        raise LoaderStateError(f"expected a dataloader state saved by bcp (a dict with 'format'), got "
                               f"{type(state).__name__}")
    if state.get("format") != OpaqueLoader.loader_format:
        return dict(state)
    dp_rank, dp_size = _dp_position(dp_rank, dp_size)
    layout = state.get("layout") or {}
    saved_dp = layout.get("dp_size")
    if saved_dp != dp_size:
        raise LoaderStateError(
            f"the dataloader state was saved at data-parallel degree {saved_dp} and this job has "
            f"{dp_size}: {layout.get('loader')} keeps an opaque state that bcp cannot split or merge, "
            f"so resuming would skip or repeat data. Resume at DP={saved_dp}, or use a loader implementing "
            "bcp_core.dataloader.ReshardableLoader (such as PackedTokenLoader)")
    return _read_shard(state.get("rank"), dp_rank, f"state of DP rank {dp_rank}")


def _speaks_bcp(loader) -> bool:
    if isinstance(loader, MappedLoader):
        return _speaks_bcp(loader.loader)
    return isinstance(loader, (ReshardableLoader, OpaqueLoader))


def _reshardable(loader) -> bool:
    return isinstance(loader.loader if isinstance(loader, MappedLoader) else loader, ReshardableLoader)


def _dp_position(dp_rank: int | None, dp_size: int | None) -> tuple[int, int]:
    import torch.distributed as dist
    on = dist.is_available() and dist.is_initialized()
    if dp_rank is None:
        dp_rank = this_rank()
    if dp_size is None:
        dp_size = dist.get_world_size() if on else 1
    return dp_rank, dp_size


def _check_rank(dp_rank: int, dp_size: int) -> None:
    if not (isinstance(dp_size, int) and dp_size >= 1 and isinstance(dp_rank, int) and 0 <= dp_rank < dp_size):
        raise ValueError(f"dp_rank={dp_rank!r} must lie in [0, dp_size) with dp_size={dp_size!r} >= 1")


