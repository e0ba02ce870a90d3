"""Whether a copy of a data file is the file a save wrote, checked on its bytes as they go by.

A replica as it arrives (replication.py), a node's copy as the drain reads it (drain.py), a copy a
load found damaged (recovery.py): each is checked against the checksums the save's write computed
for its pieces, block by block. A replica and a drained copy are checked against the writing rank's
own report of every piece it wrote, so the bytes between them (padding) must be zeros too; a copy a
load found damaged is checked against the metadata, which lists only the pieces a load reads (it
keeps one rank's piece of a per-rank value that several ranks saved alike, while each rank wrote
its own into its file), so the bytes between those are not checked: no load reads them.
"""

from __future__ import annotations

import numpy as np
import xxhash

from ..metadata import num_blocks


class CopyCheck:
    """Why a copy is not the file its manifest entry describes, checked on its bytes as they arrive
    in order (`feed`), or None (`wrong`): its header's digest, each piece's block checksums (those of
    the write), and zeros in between (the padding) unless `only_pieces`."""

    def __init__(self, entry: list, block: int, only_pieces: bool = False):
        _, self.size, header, self.digest, pieces = entry
        self.problem: str | None = None
        # the file's runs in order: (start, end, what they must be: "header", "zeros", "any" or a checksum)
        self.runs: list[tuple[int, int, object]] = [(0, header, "header")]
        between = "any" if only_pieces else "zeros"
        pos = header
        for off, n, sums in sorted(pieces):
            if off < pos:
                self.problem = f"overlaps bytes [{off}, {pos}) of two pieces"
                break
            if len(sums) != num_blocks(n, block):
                self.problem = f"was described with {len(sums)} checksums for {n} bytes"
                break
            if off > pos:
                self.runs.append((pos, off, between))
            self.runs.extend((off + b * block, off + min(n, (b + 1) * block), s) for b, s in enumerate(sums))
            pos = off + n
        if pos < self.size:
            self.runs.append((pos, self.size, between))
        self.run, self.hash, self.pos = 0, xxhash.xxh3_64(), 0

    @classmethod
    def for_file(cls, data: memoryview, pieces, block: int, only_pieces: bool = False) -> CopyCheck:
        """A check of the file whose bytes are `data` (a node's copy in memory, read whole or fed in
        parts) against `pieces` ((byte offset, bytes, checksums), as the write computed them). Its
        header is taken as it is: a load reads the pieces, where the metadata places them.
        `only_pieces`: the bytes outside `pieces` are not checked (`pieces` are the metadata's, not
        every piece the write put in the file)."""
        size = len(data)
        header = min(8 + int.from_bytes(bytes(data[:8]), "little"), size) if size >= 8 else size
        return cls([None, size, header, xxhash.xxh3_64_hexdigest(data[:header]),
                    [[off, n, list(sums)] for off, n, sums in pieces]], block, only_pieces)

    def feed(self, data: memoryview, at: int) -> None:
        """The copy's bytes [at, at + len(data)), right after those fed before."""
        if at != self.pos:
            self.problem = self.problem or f"arrived out of order at byte {at}"
        self.pos = at + len(data)
        while len(data) and self.problem is None and self.run < len(self.runs):
            lo, hi, want = self.runs[self.run]
            take = min(len(data), hi - at)
            if want == "zeros":
                if np.frombuffer(data[:take], dtype=np.uint8).any():
                    self.problem = f"has bytes in [{lo}, {hi}) the original has not"
            elif want != "any":
                self.hash.update(data[:take])
            at, data = at + take, data[take:]
            if at == hi:
                if want == "header" and self.hash.hexdigest() != self.digest:
                    self.problem = "has another header than the original"
                elif want not in ("header", "zeros", "any") and self.hash.intdigest() != want:
                    self.problem = f"fails the checksum of bytes [{lo}, {hi})"
                self.run, self.hash = self.run + 1, xxhash.xxh3_64()

    def wrong(self) -> str | None:
        if self.problem is None and self.pos != self.size:
            return f"ended at byte {self.pos} of {self.size}"
        return self.problem
