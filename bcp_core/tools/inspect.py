"""`bcp inspect`: what a checkpoint holds, from its JSON metadata only (a pickle is never opened)."""

from __future__ import annotations

import json
from typing import Any

from ..foreign import foreign_format
from ..metadata import CHECKSUM_ALGORITHM, Piece, TensorMeta
from ..utils import human_bytes
from .read import box_str, open_checkpoint, sections


def _value_summary(encoded: Any, limit: int = 70) -> str:
    """A short description of a codec value, from its JSON form only (a pickle is never opened)."""
    if isinstance(encoded, dict) and len(encoded) == 1:
        tag, v = next(iter(encoded.items()))
        if tag == "__pickle__":
            return f"<pickled value, {len(v) * 3 // 4} bytes, not decoded>"
        if tag in ("__tensor__", "__ndarray__") and isinstance(v, dict):
            return f"<{tag.strip('_')} {v.get('dtype')} {v.get('shape')}>"
    text = json.dumps(encoded, separators=(",", ":"))
    return text if len(text) <= limit else text[:limit - 3] + "..."


def inspect_checkpoint(path: str) -> dict:
    """A JSON-able description of the checkpoint: tensors, pieces and who wrote them, values, files."""
    st, md = open_checkpoint(path)
    per_rank_bytes: dict[int, int] = {}
    per_rank_files: dict[int, set[str]] = {}
    file_bytes = [0] * len(md.files)

    def piece_json(p: Piece) -> dict:
        per_rank_bytes[p.rank] = per_rank_bytes.get(p.rank, 0) + p.nbytes
        per_rank_files.setdefault(p.rank, set()).add(md.files[p.file])
        file_bytes[p.file] += p.nbytes
        return {"offsets": list(p.offsets), "lengths": list(p.lengths), "file": md.files[p.file],
                "byte_offset": p.byte_offset, "nbytes": p.nbytes, "rank": p.rank}

    tensors = {}
    for fqn, tm in sorted(md.tensors.items()):
        tensors[fqn] = {"dtype": str(tm.dtype).removeprefix("torch."), "shape": list(tm.shape),
                        "nbytes": tm.nbytes, "pieces": [piece_json(p) for p in tm.pieces]}
    per_rank = {}
    for fqn, pr in sorted(md.per_rank.items()):
        variants = []
        for v in pr.variants:
            if isinstance(v, TensorMeta):
                variants.append({"tensor": {"dtype": str(v.dtype).removeprefix("torch."), "shape": list(v.shape),
                                            "nbytes": v.nbytes, "pieces": [piece_json(p) for p in v.pieces]}})
            else:
                variants.append({"object": _value_summary(v.encoded)})
        per_rank[fqn] = {"ranks": list(pr.ranks), "variants": variants}
    objects = {k: _value_summary(o.encoded) for k, o in sorted(md.objects.items())}
    sharded = {}
    for fqn, so in sorted(md.sharded_objects.items()):
        for p in so.shards:
            per_rank_bytes[p.rank] = per_rank_bytes.get(p.rank, 0) + p.nbytes
            per_rank_files.setdefault(p.rank, set()).add(md.files[p.file])
            file_bytes[p.file] += p.nbytes
        sharded[fqn] = {"grid": list(so.grid), "shards": [
            {"index": list(p.index), "file": md.files[p.file], "byte_offset": p.byte_offset, "nbytes": p.nbytes,
             "rank": p.rank} for p in so.shards]}
    by_section = sections(md.keys())
    return {
        "path": st.root, "format_version": md.version, "world_size": md.world_size, "framework": md.framework,
        "read_as_it_is": foreign_format(st),
        "checksum": {"algorithm": CHECKSUM_ALGORITHM, "block_bytes": md.checksum_block_bytes},
        "total_tensor_bytes": sum(t["nbytes"] for t in tensors.values()),
        "files": [{"path": f, "piece_bytes": b} for f, b in zip(md.files, file_bytes)],
        "ranks": {str(r): {"bytes": per_rank_bytes[r], "files": sorted(per_rank_files[r])}
                  for r in sorted(per_rank_bytes)},
        "sections": {s: len(keys) for s, keys in by_section.items()},
        "tensors": tensors, "objects": objects, "per_rank": per_rank, "sharded_objects": sharded,
        "dataloader": sorted(k for k in md.keys() if k.startswith("dataloader.") or k == "dataloader"),
        "extra_state": sorted(k for k in md.keys() if k.startswith("extra_state.") or k == "extra_state"),
        "user": md.user,
    }


def format_inspect(rep: dict, show_pieces: bool = False) -> str:
    lines = [
        f"checkpoint   {rep['path']}",
        (f"format       {rep['read_as_it_is']}'s own files, read as they are (bcp metadata built from them), "
         if rep.get("read_as_it_is") else f"format       bcp v{rep['format_version']}, ")
        + f"saved by {rep['world_size']} rank(s), framework {rep['framework'] or '?'}",
        f"tensors      {len(rep['tensors'])} ({human_bytes(rep['total_tensor_bytes'])}) in {len(rep['files'])} "
        f"data file(s); {rep['checksum']['algorithm']} per {human_bytes(rep['checksum']['block_bytes'])} block",
        "sections     " + ", ".join(f"{s} ({n})" for s, n in rep["sections"].items()),
        "", "ranks (who wrote what):",
    ]
    for r, info in rep["ranks"].items():
        lines.append(f"  rank {r:>4}  {human_bytes(info['bytes']):>12}  {', '.join(info['files'])}")
    lines += ["", "tensors:"]
    width = max([len(k) for k in rep["tensors"]] + [10])
    for fqn, t in rep["tensors"].items():
        ranks = sorted({p["rank"] for p in t["pieces"]})
        lines.append(f"  {fqn:<{width}}  {t['dtype']:<9} {str(tuple(t['shape'])):<18} {human_bytes(t['nbytes']):>11}"
                     f"  {len(t['pieces'])} piece(s) from rank(s) {','.join(map(str, ranks))}")
        if show_pieces:
            for p in t["pieces"]:
                lines.append(f"      {box_str(p['offsets'], p['lengths'])} rank {p['rank']} {p['file']}"
                             f" @{p['byte_offset']} ({human_bytes(p['nbytes'])})")
    if rep["objects"]:
        lines += ["", "values:"]
        for k, v in rep["objects"].items():
            lines.append(f"  {k} = {v}")
    if rep["per_rank"]:
        lines += ["", "per-rank values (extra state):"]
        for k, pr in rep["per_rank"].items():
            desc = [f"tensor {v['tensor']['dtype']} {tuple(v['tensor']['shape'])}" if "tensor" in v else v["object"]
                    for v in pr["variants"]]
            lines.append(f"  {k}: {len(pr['variants'])} distinct value(s) over {len(pr['ranks'])} rank(s)"
                         f" (rank->variant {pr['ranks'][:16]}{'...' if len(pr['ranks']) > 16 else ''})")
            for i, d in enumerate(desc[:4]):
                lines.append(f"      [{i}] {d}")
    if rep["sharded_objects"]:
        lines += ["", "sharded values (e.g. dataloader state per DP rank):"]
        for k, so in rep["sharded_objects"].items():
            ranks = sorted({p["rank"] for p in so["shards"]})
            size = sum(p["nbytes"] for p in so["shards"])
            lines.append(f"  {k}: grid {tuple(so['grid'])}, {len(so['shards'])} shard(s), {human_bytes(size)}, "
                         f"written by rank(s) {','.join(map(str, ranks))}")
    for section in ("dataloader", "extra_state"):
        if rep[section]:
            lines += ["", f"{section} entries: " + ", ".join(rep[section][:20])
                      + (" ..." if len(rep[section]) > 20 else "")]
    if rep["user"]:
        lines += ["", "user metadata: " + json.dumps(rep["user"])[:400]]
    return "\n".join(lines)
