"""PackedTokenLoader: the reference reshardable loader — token documents packed into sequences.

Each read unit owns disjoint remaining work: documents not read yet and a token buffer. Resharding:
the saved units, in global order (DP rank major, worker minor), tile [0, 1) in equal intervals, and
so do the new units. A new unit takes from every saved unit it overlaps the same fraction of that
unit's remaining work (`split_unit_state`) and joins the pieces (`merge_unit_states`). Every
remaining token therefore lands in exactly one new unit. Read workers are processes that pack
ahead and report their states, so a checkpoint never waits for them (read_workers.py).
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import time
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from fractions import Fraction
from typing import Any

import numpy as np
import torch

from ..errors import LoaderStateError
from .protocol import ReshardableLoader, _check_rank
from .read_workers import ReadWorkerPool

log = logging.getLogger("bcp")

# How many batches back PackedTokenLoader can give its state (state_dict(unconsumed=k)). Read workers
# keep prefetch_factor + 4 states behind the newest batch and are at most prefetch_factor + 1 ahead.
_MAX_UNCONSUMED = 3


# ----------------------------------------------------------------------------- deterministic hashing

_M64 = (1 << 64) - 1


def _splitmix(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _M64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _M64
    return x ^ (x >> 31)


def _mix(*values: int) -> int:
    """A 64-bit hash of integers: counter-based randomness, so a unit's RNG state is one counter."""
    h = 0
    for v in values:
        h = _splitmix(h ^ (v & _M64))
    return h


def _permute(i: int, n: int, key: int) -> int:
    """A keyed bijection of range(n): a 4-round Feistel network with cycle walking. Documents are
    shuffled by position, so remaining work stays a few ranges of positions however it is split."""
    if n <= 1:
        return i
    bits = max(2, (n - 1).bit_length())
    bits += bits & 1
    half = bits // 2
    mask = (1 << half) - 1
    x = i
    while True:
        left, right = x >> half, x & mask
        for rnd in range(4):
            left, right = right, left ^ (_mix(key, rnd, right) & mask)
        x = (left << half) | right
        if x < n:  # the domain is < 4n, so this loops a few times at most on average
            return x


# ----------------------------------------------------------------------------- packing

@dataclass(frozen=True)
class _Unit:
    """One read unit's state. Never mutated: a snapshot is a reference, so a worker can keep the
    state after each of its last few batches at no cost."""

    epoch: int
    docs: tuple[tuple[range, ...], ...]  # per source: positions not read yet, in reading order
    buffer: np.ndarray                   # int64 tokens read but not delivered, in delivery order
    stream: int                          # selects this unit's source-mixing random stream
    draws: int                           # source choices made so far on that stream

    @property
    def exhausted(self) -> bool:
        return self.buffer.size == 0 and not any(self.docs)

    def compacted(self) -> _Unit:
        """The same state with its buffer as small as it goes (`_compact`), to send or to save."""
        return replace(self, buffer=_compact(self.buffer))


def _frozen(a: np.ndarray) -> np.ndarray:
    a.flags.writeable = False
    return a


_EMPTY = _frozen(np.zeros(0, dtype=np.int64))


def _compact(buf: np.ndarray) -> np.ndarray:
    """The buffer as int32 when every id fits (nearly always: half the bytes), else int64."""
    if buf.dtype == np.int32:
        return buf
    if buf.size == 0 or (buf.min() >= -2 ** 31 and buf.max() < 2 ** 31):
        return _frozen(buf.astype(np.int32))
    return buf


class _Packer:
    """Reads documents into a unit's token buffer and cuts batches from it. Runs in read workers."""

    def __init__(self, sources: list, counts: list[int], weights: list[float], seq_len: int, batch_size: int,
                 seed: int, shuffle: bool, eos_id: int | None, pad_id: int):
        self.sources, self.counts, self.weights = sources, counts, weights
        self.seq_len, self.batch_size = seq_len, batch_size
        self.seed, self.shuffle, self.eos_id, self.pad_id = seed, shuffle, eos_id, pad_id

    def fresh(self, epoch: int, unit: int, n_units: int) -> _Unit:
        docs = tuple(((range(unit, n, n_units),) if unit < n else ()) for n in self.counts)
        return _Unit(epoch, docs, _EMPTY, unit, 0)

    def exhausted(self, epoch: int) -> _Unit:
        return _Unit(epoch, ((),) * len(self.counts), _EMPTY, 0, 0)

    def _pick(self, docs, unit: _Unit, draws: int) -> int | None:
        live = [s for s, d in enumerate(docs) if d]
        if not live:
            return None
        x = _mix(self.seed, unit.epoch, unit.stream, draws) / 2.0 ** 64 * sum(self.weights[s] for s in live)
        for s in live:
            x -= self.weights[s]
            if x < 0:
                return s
        return live[-1]

    def _document(self, epoch: int, s: int, pos: int) -> np.ndarray:
        index = _permute(pos, self.counts[s], _mix(self.seed, epoch, s, 0x5EED)) if self.shuffle else pos
        return np.asarray(self.sources[s][index], dtype=np.int64).reshape(-1)

    def next_batch(self, unit: _Unit, between_docs=None) -> tuple[_Unit, np.ndarray, int] | None:
        """(unit after, batch (batch_size, seq_len), real tokens in it), or None once exhausted.

        The last batch of a unit is padded with pad_id at the end; `real` counts the tokens before it.
        """
        need = self.seq_len * self.batch_size
        pieces, have = [unit.buffer], unit.buffer.size
        docs, draws = list(unit.docs), unit.draws
        while have < need:
            s = self._pick(docs, unit, draws)
            if s is None:
                break
            draws += 1
            head, rest = docs[s][0], docs[s][0][1:]
            docs[s] = ((rest,) if len(rest) else ()) + docs[s][1:]
            tokens = self._document(unit.epoch, s, head[0])
            pieces.append(tokens)
            have += tokens.size
            if self.eos_id is not None:
                pieces.append(np.array([self.eos_id], dtype=np.int64))
                have += 1
            if between_docs is not None:
                between_docs()  # a read worker answers state requests while it reads
        buf = pieces[0] if len(pieces) == 1 else np.concatenate(pieces)
        if buf.size == 0:
            return None
        real = min(need, buf.size)
        out = np.full(need, self.pad_id, dtype=np.int64)
        out[:real] = buf[:real]
        after = replace(unit, docs=tuple(docs), buffer=_frozen(buf[real:]), draws=draws)
        return after, out.reshape(self.batch_size, self.seq_len), real


# ----------------------------------------------------------------------------- the reference loader

class PackedTokenLoader(ReshardableLoader):
    """Mixes token sources by weight and packs them into (batch_size, seq_len) batches for one DP rank.

    `sources` maps a name to a sequence of documents, each a sequence of token ids. Every DP rank
    reads through `num_workers` read workers (in-process when 0); each owns a disjoint share of every
    source's documents (shuffled per epoch when `shuffle`) and a token buffer. A worker picks the
    source of its next document at random by `weights` among sources it still has documents of,
    appends the document (and `eos_id`, if given) to its buffer, and cuts batches from the buffer.
    Batches from a rank's workers come in round-robin order. The epoch ends when every unit is
    exhausted; a unit's last batch is padded with `pad_id`. Everything is a function of `seed`.

    With `checkpoint_interval=k` the workers prepare their states for every k-th batch this loader
    yields (counted from construction or restore) ahead of time, so `state_dict()` at those steps
    does not wait on them (paper §4.5).
    """

    loader_format = "bcp.PackedTokenLoader/1"

    def __init__(self, sources: Mapping[str, Sequence[Sequence[int]]], seq_len: int, batch_size: int, *,
                 dp_rank: int = 0, dp_size: int = 1, weights: Mapping[str, float] | None = None,
                 num_workers: int = 0, seed: int = 0, shuffle: bool = True, eos_id: int | None = None,
                 pad_id: int = -1, checkpoint_interval: int | None = None, prefetch_factor: int = 2,
                 multiprocessing_context: str | None = None, timeout: float = 300.0):
        _check_rank(dp_rank, dp_size)
        if not isinstance(sources, Mapping) or not sources:
            raise ValueError("sources must be a non-empty mapping of name -> sequence of documents")
        if seq_len < 1 or batch_size < 1 or num_workers < 0 or prefetch_factor < 1:
            raise ValueError(f"need seq_len >= 1, batch_size >= 1, num_workers >= 0, prefetch_factor >= 1; got "
                             f"{seq_len}, {batch_size}, {num_workers}, {prefetch_factor}")
        if checkpoint_interval is not None and checkpoint_interval < 1:
            raise ValueError(f"checkpoint_interval must be >= 1 or None, got {checkpoint_interval}")
        self.names = [str(n) for n in sources]
        weights = dict(weights) if weights is not None else {n: 1.0 for n in self.names}
        unknown = set(map(str, weights)) - set(self.names)
        if unknown:
            raise ValueError(f"weights name sources that do not exist: {sorted(unknown)}")
        ws = [float(weights.get(n, 0.0)) for n in self.names]
        if any(not math.isfinite(x) or x <= 0 for x in ws):
            raise ValueError(f"every source needs a finite weight > 0, got {dict(zip(self.names, ws))}")
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.num_workers = num_workers
        self.units_per_rank = max(num_workers, 1)
        self.seq_len, self.batch_size, self.seed, self.shuffle = seq_len, batch_size, int(seed), bool(shuffle)
        self.checkpoint_interval, self.prefetch_factor, self.timeout = checkpoint_interval, prefetch_factor, timeout
        self._ctx = mp.get_context(multiprocessing_context or ("fork" if "fork" in mp.get_all_start_methods()
                                                               else "spawn"))
        self._packer = _Packer([sources[n] for n in self.names], [len(sources[n]) for n in self.names], ws,
                               seq_len, batch_size, self.seed, self.shuffle, eos_id, pad_id)
        self._generation = 0  # how often the units were split/merged; seeds the new units' streams
        self._pool: ReadWorkerPool | None = None
        # per worker state collected: asked for ahead of the checkpoint step, or only when it came
        self.stats = {"prefetched": 0, "on_demand": 0, "last_state_wait_s": 0.0}
        self._yielded = 0  # batches yielded since construction or restore: the prefetch schedule's clock
        # (worker, its unit before the batch when in-process) of the last batches yielded this epoch,
        # to give the state as of before batches a framework fetched ahead (state_dict(unconsumed=k))
        self._recent: deque = deque(maxlen=_MAX_UNCONSUMED)
        self._ended = False  # the epoch's end was signalled (StopIteration): iterating starts the next
        self._start_epoch(0)

    # -- iteration

    @property
    def epoch(self) -> int:
        return self._epoch

    def _start_epoch(self, epoch: int) -> None:
        self._epoch = epoch
        n = self.dp_size * self.units_per_rank
        first = self.dp_rank * self.units_per_rank
        self._units = [self._packer.fresh(epoch, first + w, n) for w in range(self.units_per_rank)]
        self._next_worker = 0
        self._recent.clear()
        self._ended = False

    def __iter__(self):
        """Continue the current epoch, or start the next one once it has ended (StopIteration).

        An epoch whose last batch was delivered but whose end was not signalled yet ends first: a
        state saved right after the last batch resumes into a loop that ends at once, as the
        interrupted loop's next call would have."""
        if self._ended:
            self._start_epoch(self._epoch + 1)
        return self

    def __next__(self) -> torch.Tensor:
        try:
            return self._next_batch()
        except StopIteration:
            self._ended = True
            raise

    def _next_batch(self) -> torch.Tensor:
        if self.num_workers == 0:
            before = self._units[0]
            step = self._packer.next_batch(before)
            if step is None:
                raise StopIteration
            self._units[0], batch, _ = step
            self._recent.append((0, before))
            self._yielded += 1
            return torch.from_numpy(batch)
        if self._pool is None:
            if all(u.exhausted for u in self._units):
                raise StopIteration
            self._pool = ReadWorkerPool(self._packer, self._units, self._ctx, self.prefetch_factor, self.timeout)
            self._prefetch_next()
        pool = self._pool
        while not all(pool.ended):
            w = self._next_worker
            self._next_worker = (w + 1) % self.num_workers
            if pool.ended[w]:
                continue
            msg = pool.get(w)
            if msg[0] == "end":
                pool.ended[w] = True
                continue
            _, count, batch, _ = msg
            pool.consumed[w] = count
            self._recent.append((w, None))
            self._yielded += 1
            if self.checkpoint_interval and self._yielded % self.checkpoint_interval == 0:
                self._prefetch_next()  # this is a checkpoint step: prepare the next one already
            return torch.from_numpy(batch)
        self._units = [self._packer.exhausted(self._epoch)] * self.num_workers
        self._close_pool()
        self._recent.clear()  # the workers and the states they kept are gone; nothing is left to fetch
        raise StopIteration

    def _prefetch_next(self) -> None:
        """Ask each worker now for its state at the next checkpoint step (every k-th batch yielded).

        Workers answer as soon as they have produced that batch, or at once from their recent states
        if they are past it, so the answer is waiting when the checkpoint step comes.
        """
        k, pool = self.checkpoint_interval, self._pool
        if k is None or pool is None:
            return
        counts, ended, w = list(pool.consumed), list(pool.ended), self._next_worker
        for _ in range((self._yielded // k + 1) * k - self._yielded):  # replay the round robin ahead
            if all(ended):
                break
            while ended[w]:
                w = (w + 1) % self.num_workers
            counts[w] += 1
            w = (w + 1) % self.num_workers
        for w, n in enumerate(counts):
            pool.prune(w, pool.consumed[w])
            if not ended[w]:
                pool.request(w, n)  # a worker that ends first makes this a miss, answered on demand

    def close(self) -> None:
        """Stop the read workers (they restart, from the current state, on the next batch)."""
        if self._pool is not None:
            try:
                self._units = self._current_units()
            finally:
                self._close_pool()
                self._recent.clear()

    def _close_pool(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def __del__(self):
        try:
            self._close_pool()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    def _current_units(self, counts: list[int] | None = None) -> list[_Unit]:
        """Each unit's state as of the last batch yielded (or as of batch `counts[w]` of worker w): no
        worker may be ahead in what is saved."""
        pool = self._pool
        if pool is None:
            return list(self._units)
        counts = list(pool.consumed) if counts is None else counts
        t0 = time.perf_counter()
        units: list[_Unit | None] = [None] * self.num_workers
        for w in range(self.num_workers):
            if pool.ended[w] and counts[w] == pool.consumed[w]:
                units[w] = self._packer.exhausted(self._epoch)
                continue
            ahead = (w, counts[w]) in pool.requested
            self.stats["prefetched" if ahead else "on_demand"] += 1
            pool.request(w, counts[w])
        for w in range(self.num_workers):
            if units[w] is None:
                units[w] = pool.take_state(w, counts[w])
        self.stats["last_state_wait_s"] = time.perf_counter() - t0
        return units

    # -- the ReshardableLoader protocol

    def loader_replicated_state(self) -> dict:
        return {"sources": [[n, c] for n, c in zip(self.names, self._packer.counts)], "seed": self.seed,
                "shuffle": self.shuffle, "generation": self._generation}

    def loader_unit_states(self, unconsumed: int = 0) -> tuple[Any, list]:
        if unconsumed == 0:
            return ({"next_worker": self._next_worker, "ended": self._ended},
                    [self._encode(u) for u in self._current_units()])
        if not 0 < unconsumed <= len(self._recent):
            raise LoaderStateError(f"PackedTokenLoader can give its state as of at most {len(self._recent)} "
                                   f"batches back here (asked for {unconsumed}; it keeps {_MAX_UNCONSUMED} within "
                                   "an epoch while its read workers run)")
        back = list(self._recent)[-unconsumed:]
        if self.num_workers == 0:
            return {"next_worker": 0, "ended": False}, [self._encode(back[0][1])]
        counts = list(self._pool.consumed)
        for w, _ in back:
            counts[w] -= 1
        units = self._current_units(counts)
        return {"next_worker": back[0][0], "ended": False}, [self._encode(u) for u in units]

    def split_unit_state(self, unit: Any, lo: Fraction, hi: Fraction) -> Any:
        u = self._decode(unit)

        def cut(n: int, f: Fraction, align: int = 1) -> int:
            # Buffer cuts fall on sequence boundaries so that whole sequences stay together.
            return n if f >= 1 else min(n, math.floor(n * f) // align * align)

        docs = []
        for ranges in u.docs:
            n = sum(len(r) for r in ranges)
            docs.append(_slice_ranges(ranges, cut(n, lo), cut(n, hi)))
        nb = u.buffer.size
        buffer = u.buffer[cut(nb, lo, self.seq_len):cut(nb, hi, self.seq_len)]
        return self._encode(replace(u, docs=tuple(docs), buffer=buffer))

    def merge_unit_states(self, parts: list) -> Any:
        units = [self._decode(p) for p in parts]
        epochs = sorted({u.epoch for u in units})
        if len(epochs) > 1:
            raise LoaderStateError(f"the saved read units to merge are in different epochs {epochs}: the DP ranks "
                                   "were not at the same point of the data when the checkpoint was taken")
        docs = tuple(_join_ranges([r for u in units for r in u.docs[s]]) for s in range(len(self.names)))
        buffer = np.concatenate([u.buffer for u in units]) if units else _EMPTY
        return self._encode(_Unit(epochs[0], docs, buffer, 0, 0))

    def loader_check(self, replicated: dict) -> None:
        try:
            saved_sources = [tuple(x) for x in replicated.get("sources", [])]
        except TypeError:
            raise LoaderStateError(f"malformed sources {replicated.get('sources')!r} in a saved loader state") from None
        mine = [(n, c) for n, c in zip(self.names, self._packer.counts)]
        if saved_sources != mine:
            raise LoaderStateError(f"the checkpoint's loader read sources {saved_sources} (name, documents); this "
                                   f"loader has {mine}. The remaining work names documents by position, so the "
                                   "sources must be the same")
        for key in ("seed", "shuffle"):
            if replicated.get(key) != getattr(self, key):
                raise LoaderStateError(f"the checkpoint's loader has {key}={replicated.get(key)!r}, this one "
                                       f"{getattr(self, key)!r}; the remaining documents are positions in the saved "
                                       "shuffle, so it must match")

    def loader_check_units(self, replicated: dict, rank_state: Any, units: list) -> None:
        epochs = sorted({self._decode(u).epoch for u in units})
        if len(epochs) != 1:
            raise LoaderStateError(f"this rank's restored read units are in different epochs {epochs}")
        if rank_state is not None and not (isinstance(rank_state, Mapping)
                                           and type(rank_state.get("next_worker")) is int
                                           and type(rank_state.get("ended", True)) is bool):
            raise LoaderStateError(f"malformed rank state of a saved loader: {rank_state!r}")
        if type(replicated.get("generation", 0)) is not int:
            raise LoaderStateError(f"malformed generation {replicated.get('generation')!r} in a saved loader state")

    def loader_restore(self, replicated: dict, rank_state: Any, units: list, resharded: bool) -> None:
        # bcp_read_state checked everything below (loader_check_units): nothing here fails
        decoded = [self._decode(u) for u in units]
        epochs = sorted({u.epoch for u in decoded})
        self._close_pool()
        self._generation = int(replicated.get("generation", 0)) + (1 if resharded else 0)
        if resharded:  # new units draw from fresh streams of their own
            n = self.dp_size * self.units_per_rank
            first = self.dp_rank * self.units_per_rank
            decoded = [replace(u, stream=_mix(self._generation, n, first + w), draws=0)
                       for w, u in enumerate(decoded)]
        self._units, self._epoch = decoded, epochs[0]
        self._next_worker = int(rank_state["next_worker"]) % self.units_per_rank if rank_state else 0
        # a state without "ended" (an older checkpoint, a resharded state) starts the next epoch
        # at once when it has no batch left
        self._ended = all(u.exhausted for u in decoded) and (bool(rank_state.get("ended", True)) if rank_state
                                                             else True)
        self._yielded = 0
        self._recent.clear()

    # -- unit states as safe-codec values

    def _encode(self, u: _Unit) -> dict:
        return {"epoch": u.epoch, "stream": u.stream, "draws": u.draws, "buffer": _compact(u.buffer),
                "docs": {n: [[r.start, r.stop, r.step] for r in rs] for n, rs in zip(self.names, u.docs)}}

    def _decode(self, v: Any) -> _Unit:
        try:
            docs = v["docs"]
            if sorted(docs) != sorted(self.names):
                raise LoaderStateError(f"a saved read unit has sources {sorted(docs)}, this loader {self.names}")
            ranges = []
            for n, count in zip(self.names, self._packer.counts):
                rs = tuple(r for r in (range(int(a), int(b), int(c)) for a, b, c in docs[n]) if len(r))
                if any(min(r) < 0 or max(r) >= count for r in rs):
                    raise LoaderStateError(f"a saved read unit names documents of source {n!r} beyond its "
                                           f"{count} documents")
                if sum(len(r) for r in rs) > count or _overlap(rs):  # documents that would be read twice
                    raise LoaderStateError(f"a saved read unit names some documents of source {n!r} more than once")
                ranges.append(rs)
            buf = np.asarray(v["buffer"])
            if buf.ndim != 1 or (buf.size and buf.dtype.kind not in "iu"):
                raise LoaderStateError(f"a saved read unit's token buffer is not a 1-D integer array "
                                       f"(shape {buf.shape}, dtype {buf.dtype})")
            return _Unit(int(v["epoch"]), tuple(ranges), _frozen(buf.astype(np.int64)), int(v["stream"]),
                         int(v["draws"]))
        except (KeyError, TypeError, ValueError) as e:
            raise LoaderStateError(f"malformed read unit state: {type(e).__name__}: {e}") from None


def _slice_ranges(ranges: tuple[range, ...], a: int, b: int) -> tuple[range, ...]:
    """Items [a, b) of the concatenation of `ranges`, as ranges."""
    out, pos = [], 0
    for r in ranges:
        lo, hi = max(a - pos, 0), min(b - pos, len(r))
        if lo < hi:
            out.append(r[lo:hi])
        pos += len(r)
    return tuple(out)


def _overlap(ranges: tuple[range, ...]) -> bool:
    """Whether two of `ranges` (non-empty, at most a source's document count in all) share a position.

    The ranges of one source in a unit bcp saved all have the step of the epoch's first layout
    (`fresh` steps by the number of units; slices and joins keep it), so they are checked by residue
    and start; other ranges are expanded."""
    if len(ranges) < 2:
        return False
    steps = {r.step for r in ranges}
    if len(steps) == 1 and next(iter(steps)) > 0:
        last: dict[int, int] = {}
        for r in sorted(ranges, key=lambda r: r.start):
            residue = r.start % r.step
            if last.get(residue, -1) >= r.start:
                return True
            last[residue] = r[-1]
        return False
    positions = np.concatenate([np.arange(r.start, r.stop, r.step, dtype=np.int64) for r in ranges])
    return np.unique(positions).size != positions.size


def _join_ranges(ranges: list[range]) -> tuple[range, ...]:
    """Concatenate, fusing a range with the next when the next continues it (state stays small)."""
    out: list[range] = []
    for r in ranges:
        if not len(r):
            continue
        if out and len(out[-1]) and out[-1].step == r.step and out[-1][-1] + r.step == r.start:
            out[-1] = range(out[-1].start, r[-1] + r.step, r.step)
        else:
            out.append(r)
    return tuple(out)
