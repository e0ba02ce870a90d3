"""The `bcp` command: inspect, verify, export, import, rename and manage checkpoints.

Every PATH may be a local directory or a URL (s3://, gs://, hdfs://, memory://...).
A PATH that is a checkpoint root (holding step_* directories) means its latest
complete checkpoint.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys

from ..errors import BCPError, MissingExtraError, ToolError
from ..utils import human_bytes
from . import convert, importing, inspect, manage, rename, verify

_EPILOG = """\
examples:
  bcp inspect ckpts/                         what is in the latest checkpoint under ckpts/
  bcp verify s3://bucket/run1/step_00001000  check completeness and every checksum
  bcp export ckpts/ hf_out --to hf --dtype bf16 --config my_model_dir
  bcp export megatron_ckpt/ hf_out --to hf --mapping megatron-to-hf --config hf_config.json
  bcp import hf_model_dir ckpts/step_00000000 --from hf
  bcp prune ckpts/ --keep-last 3 --keep-every 1000

A PATH may be a local directory or any URL fsspec understands (s3://, gs://, hdfs://,
...), or memory://NAME for checkpoints kept in RAM on this machine. A checkpoint root
(a directory of step_* checkpoints) stands for its latest complete checkpoint.
S3 endpoints and credentials come from the usual AWS variables or FSSPEC_S3_* (see
docs/storage.md). Results go to stdout (--json: one JSON document), progress bars and
errors to stderr. Exit status: 0 success, 1 a fault was found (verify) or the operation
failed, 2 bad usage or a missing optional dependency.

`python -m bcp_core` is the same command (useful where Microsoft SQL Server's own `bcp`
tool comes first on PATH).
"""


def _add_rename(p: argparse.ArgumentParser, flag: str = "--rename") -> None:
    p.add_argument(flag, action="append", default=[], metavar="'REGEX=REPL'",
                   help="rewrite keys with re.sub(REGEX, REPL, key); repeatable, applied in order "
                        "(e.g. '^_orig_mod\\.=' or '^model\\.layers\\.=model.blocks.')")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bcp", formatter_class=argparse.RawDescriptionHelpFormatter, epilog=_EPILOG,
        description="Inspect, verify, convert and manage bcp checkpoints.")
    parser.add_argument("-q", "--quiet", action="store_true", help="no progress bars")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("inspect", help="show tensors, shapes, pieces, ranks and values (reads metadata only)",
                       description="Show what a checkpoint holds: every tensor with its global shape, dtype "
                                   "and bytes, the saved pieces and the rank that wrote each, non-tensor "
                                   "values, per-rank (extra state) and dataloader entries. Reads only the "
                                   "JSON metadata; never unpickles anything.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--pieces", action="store_true", help="list every saved piece (box, rank, file, offset)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("verify", help="check completeness, framing and every checksum",
                       description="Check that the checkpoint is complete (metadata present and valid, every "
                                   "data file present and long enough, each piece where the file's header "
                                   "says, no overlapping pieces) and that every block matches its XXH3-64 "
                                   "checksum. Exits 1 and lists each fault (file, byte range, tensor) if "
                                   "anything is wrong.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--threads", type=int, default=4, help="parallel reads (default 4)")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("export", help="merge into a Hugging Face directory or a torch.save file",
                       description="Merge the saved shards into full tensors and write them as a Hugging Face "
                                   "directory (sharded safetensors + model.safetensors.index.json) or one "
                                   "torch.save file. Tensors are streamed in blocks of ~64 MiB, so memory "
                                   "stays flat however large the model is.")
    p.add_argument("path", metavar="PATH", help="checkpoint (or root) to export")
    p.add_argument("out", metavar="OUT", help="output directory (hf) or file (torch)")
    p.add_argument("--to", choices=["hf", "torch"], required=True, help="output format")
    p.add_argument("--model-only", action="store_true",
                   help="only keys under 'model.', with that prefix removed (always the case for --to hf "
                        "when the checkpoint has such keys)")
    p.add_argument("--dtype", help="cast floating-point tensors: bf16, fp16 or fp32")
    _add_rename(p)
    p.add_argument("--shard-size", default="5GB", help="largest safetensors file for --to hf (default 5GB)")
    p.add_argument("--config", metavar="PATH",
                   help="config.json, or a directory whose non-weight files (config, tokenizer) are copied "
                        "into OUT so that from_pretrained(OUT) works")
    p.add_argument("--mapping", choices=list(convert.MAPPINGS),
                   help="write another framework's checkpoint as the Hugging Face model --config describes "
                        "(megatron-to-hf: a Megatron-core GPTModel or HybridModel as the Hugging Face model of "
                        "a declared family; docs/mapping.md)")
    p.add_argument("--overwrite", action="store_true",
                   help="--to hf: replace an OUT directory that is not empty, once the new export is complete "
                        "(without it such an OUT is refused; a local directory only)")
    p.add_argument("--allow-pickle", action="store_true",
                   help="decode pickled values (only for --to torch without --model-only; runs code from "
                        "the checkpoint: only for checkpoints you trust)")
    p.add_argument("--threads", type=int, default=4, help="parallel reads (default 4)")

    p = sub.add_parser("import", help="make a bcp checkpoint from a HF directory, a DCP checkpoint or a torch file",
                       description="Build a bcp checkpoint from a Hugging Face safetensors directory (or file), "
                                   "a PyTorch Distributed Checkpoint (DCP) directory, or a torch.save file, so "
                                   "training can start from it at any world size. HF and torch inputs are "
                                   "memory-mapped; torch files are read with weights_only=True. Reading a DCP "
                                   "checkpoint unpickles its .metadata file (DCP's format): import only DCP "
                                   "checkpoints you trust.")
    p.add_argument("src", metavar="SRC")
    p.add_argument("out", metavar="OUT", help="checkpoint directory or URL to create")
    p.add_argument("--from", dest="source", choices=["hf", "dcp", "torch"], required=True, help="input format")
    p.add_argument("--prefix", default=None,
                   help="top-level key to put the tensors under (default 'model' for hf/torch, so that "
                        "bcp.load(OUT, {'model': model}) works; none for dcp, whose keys have theirs)")
    _add_rename(p)
    p.add_argument("--allow-pickle", action="store_true",
                   help="store values the safe codec cannot represent as pickles")

    p = sub.add_parser("rename", help="rewrite keys in place (metadata only)",
                       description="Rename keys by regular expression rules, rewriting only the metadata file "
                                   "(atomically); data files are untouched. Optimizer param_groups follow the "
                                   "renamed optimizer state keys.")
    p.add_argument("path", metavar="PATH")
    _add_rename(p, "--rule")
    p.add_argument("--dry-run", action="store_true", help="print the renames without writing")

    p = sub.add_parser("ls", help="list the checkpoints under a root, complete or not",
                       description="List step_* checkpoints under ROOT, oldest first, marking incomplete "
                                   "ones (saves that never committed) and the latest complete one.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    p = sub.add_parser("latest", help="print the path of the latest complete checkpoint",
                       description="Print the checkpoint that bcp.load(ROOT) would use; exit 1 if none.")
    p.add_argument("root", metavar="ROOT")

    p = sub.add_parser("prune", help="delete old checkpoints",
                       description="Delete complete checkpoints except the newest K, every step divisible by "
                                   "N, the one the tracker names and the latest; delete incomplete checkpoints "
                                   "older than the latest (newer ones may be saves in progress and are kept). "
                                   "Links are removed as links, never followed. Exit status 1 if anything "
                                   "could not be deleted (each is named on stderr).")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=int, required=True, metavar="K")
    p.add_argument("--keep-every", type=int, metavar="N", help="also keep steps that are multiples of N")
    p.add_argument("--dry-run", action="store_true", help="show what would be deleted")

    p = sub.add_parser("report", help="per-rank phase timings: heat map, timeline, slowest rank",
                       description="Read a checkpoint's bcp_metrics.jsonl (or a metrics JSON-lines file) and "
                                   "write OUT.png and OUT.html: a heat map of ranks x phases and the timeline "
                                   "of one rank (the slowest by default); print a summary naming the slowest "
                                   "rank and phase. Drawing needs matplotlib (the report extra).")
    p.add_argument("path", metavar="PATH", help="checkpoint, root, or .jsonl file")
    p.add_argument("--out", default="bcp_report", metavar="OUT", help="output prefix (default bcp_report)")
    p.add_argument("--rank", type=int, help="rank whose timeline to draw (default: the slowest)")
    p.add_argument("--op", choices=["save", "load"], help="which records (default: save if present)")
    p.add_argument("--text", action="store_true", help="only print the summary (no matplotlib needed)")
    for p in sub.choices.values():  # every command can answer in JSON for scripts
        if "json" not in {a.dest for a in p._actions}:
            p.add_argument("--json", action="store_true", help="machine-readable output (one JSON document)")
    return parser


def _print_json(obj) -> None:
    print(json.dumps(obj, indent=2))


def run(args: argparse.Namespace) -> int:
    progress = not args.quiet and not args.json
    if args.command == "inspect":
        rep = inspect.inspect_checkpoint(args.path)
        _print_json(rep) if args.json else print(inspect.format_inspect(rep, args.pieces))
        return 0
    if args.command == "verify":
        rep = verify.verify_checkpoint(args.path, args.threads, progress=progress)
        if args.json:
            _print_json(rep)
        else:
            for f in rep["faults"]:
                print(f"{'WARNING' if f['kind'] == 'stray-file' else 'FAULT'} [{f['kind']}] {f['where']}: "
                      f"{f['detail']}")
            status = "OK" if rep["ok"] else "FAILED"
            print(f"{status}: {rep['path']}: {rep.get('pieces', 0)} pieces in {rep.get('files', 0)} files, "
                  f"{human_bytes(rep['checked_bytes'])} checked, "
                  f"{sum(f['kind'] != 'stray-file' for f in rep['faults'])} fault(s)")
        return 0 if rep["ok"] else 1
    if args.command == "export":
        rep = convert.export_checkpoint(args.path, args.out, args.to, args.model_only or None, args.dtype,
                                        args.rename, args.shard_size, args.config, args.allow_pickle, args.threads,
                                        progress, args.mapping, args.overwrite)
        _print_json(rep) if args.json else print(
            f"exported {rep['tensors']} tensors ({human_bytes(rep['bytes'])}) to {rep['out']}: "
            + ", ".join(rep["files"][:6]) + (" ..." if len(rep["files"]) > 6 else ""))
        return 0
    if args.command == "import":
        rep = importing.import_checkpoint(args.src, args.out, args.source, args.prefix, args.allow_pickle, args.rename)
        _print_json(rep) if args.json else print(
            f"imported {rep['tensors']} tensors ({human_bytes(rep['bytes'])}) and {rep['values']} "
            f"values into {rep['out']}")
        return 0
    if args.command == "rename":
        if not args.rule:
            raise ToolError("give at least one --rule 'REGEX=REPL'")
        changed = rename.rename_checkpoint(args.path, args.rule, args.dry_run)
        if args.json:
            _print_json({"renamed": changed, "dry_run": args.dry_run})
            return 0
        for old, new in changed.items():
            print(f"{old} -> {new}")
        print(f"{len(changed)} key(s) {'would be ' if args.dry_run else ''}renamed")
        return 0
    if args.command == "ls":
        ckpts = manage.list_checkpoints(args.root)
        if args.json:
            _print_json(ckpts)
            return 0
        for c in ckpts:
            state = "complete" if c["complete"] else "INCOMPLETE (never committed)"
            mark = "  <- latest" if c["latest"] else ""
            print(f"{c['name'] or c['path']:<16} {state}{mark}")
        if not ckpts:
            print(f"no checkpoints under {args.root}")
        return 0
    if args.command == "latest":
        path = manage.latest_checkpoint(args.root)
        _print_json({"path": path}) if args.json else print(path)
        return 0
    if args.command == "prune":
        rep = manage.prune_checkpoints(args.root, args.keep_last, args.keep_every, args.dry_run)
        verb = "would remove" if args.dry_run else "removed"
        _print_json(rep) if args.json else print(
            f"{verb}: {', '.join(rep['removed']) or 'nothing'}; kept: {', '.join(rep['kept']) or 'nothing'}")
        for f in rep["failed"]:
            print(f"bcp prune: could not remove {f['name']}: {f['error']}", file=sys.stderr)
        return 1 if rep["failed"] else 0
    if args.command == "report":
        from . import report
        rep = report.build(*report.read_records(args.path), op=args.op)
        files = None if args.text else report.write(rep, args.out, args.rank)
        if args.json:
            _print_json({"source": rep.source, "op": rep.op, "ranks": rep.ranks, "phases": rep.phases,
                 "slowest_rank": max(rep.ranks, key=rep.rank_time),
                 "busy_s": {f"{r}/{p}": t for (r, p), t in sorted(rep.busy.items())},
                 "files": list(files) if files else []})
            return 0
        print(report.summary(rep))
        if files:
            print("wrote {} and {}".format(*files))
        return 0
    raise AssertionError(args.command)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not logging.getLogger().handlers:  # library warnings (bcp's logger) go to stderr, one line each
        logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stderr)
    try:
        return run(args)
    except MissingExtraError as e:  # one line, no traceback: what to install
        print(e, file=sys.stderr)
        return 2
    except (BCPError, OSError, ValueError) as e:
        print(f"bcp {args.command}: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"bcp {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
