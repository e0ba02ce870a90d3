"""Tabulate run.sh's results: per release, per test file, passed / run for torch_dist and bcp.

    .venv/bin/python tests/megatron_suite/summary.py [megatron_suite_results] [--failures]

A test (one node id) counts as run unless every rank skipped it, and as passed when no rank failed
or errored in it and every rank that wrote a report has it (a rank killed mid-file writes none:
such a run is flagged, not counted as a pass). --failures lists each failed id with its first line.
"""

from __future__ import annotations

import argparse
import collections
import glob
import json
import os
import xml.etree.ElementTree as ET

BACKENDS = ("torch_dist", "bcp")


def _test_id(classname: str, name: str) -> tuple[str, str]:
    """('tests.unit_tests.dist_checkpointing.models.test_x.TestY', 'test_z')
    -> ('models/test_x.py', 'TestY::test_z')."""
    parts = classname.split(".")
    start = parts.index("dist_checkpointing") + 1 if "dist_checkpointing" in parts else 0
    for i in range(start, len(parts)):
        if parts[i].startswith("test_"):
            return "/".join(parts[start:i + 1]) + ".py", "::".join([*parts[i + 1:], name])
    return classname, name


def _xml_outcomes(path: str) -> dict:
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error"):
                outcome, message = "failed", (child.get("message") or child.text or "").strip()
                break
            if child.tag == "skipped":
                outcome, message = "skipped", child.get("message") or ""
        out[_test_id(case.get("classname", ""), case.get("name", ""))] = (outcome, message)
    return out


def _jsonl_outcomes(path: str) -> dict:
    """The plugin's per-phase records (outcomes-rank<R>.jsonl), for a rank whose XML was never written."""
    out = {}
    with open(path) as f:
        for line in f:
            record = json.loads(line)
            file_part, _, name = record["nodeid"].partition("::")
            key = (file_part.split("dist_checkpointing/")[-1], name)
            outcome = {"passed": "passed", "skipped": "skipped"}.get(record["outcome"], "failed")
            if out.get(key, ("passed",))[0] != "failed":
                out[key] = (outcome, record["message"])
    return out


def read_run(folder: str) -> dict:
    """{"ranks": n, "tests": {(file, id): (outcome, message)}, "calls": Counter, "from_jsonl": [ranks]}."""
    ranks = {}
    from_jsonl = []
    for path in glob.glob(os.path.join(folder, "rank*.xml")):
        ranks[int(os.path.basename(path)[4:-4])] = _xml_outcomes(path)
    for path in glob.glob(os.path.join(folder, "outcomes-rank*.jsonl")):
        rank = int(os.path.basename(path)[len("outcomes-rank"):-len(".jsonl")])
        if rank not in ranks:
            ranks[rank] = _jsonl_outcomes(path)
            from_jsonl.append(rank)
    per_test = collections.defaultdict(list)
    for outcomes in ranks.values():
        for key, value in outcomes.items():
            per_test[key].append(value)
    tests = {}
    for key, outcomes in per_test.items():
        failed = [m for o, m in outcomes if o == "failed"]
        if failed:
            tests[key] = ("failed", failed[0].splitlines()[0] if failed[0] else "")
        elif all(o == "skipped" for o, _ in outcomes):
            tests[key] = ("skipped", outcomes[0][1])
        elif len(outcomes) < len(ranks):
            tests[key] = ("failed", f"reported by {len(outcomes)} of {len(ranks)} ranks")
        else:
            tests[key] = ("passed", "")
    calls = collections.Counter()
    for path in glob.glob(os.path.join(folder, "calls-rank*.json")):
        with open(path) as f:
            calls.update(json.load(f))
    return {"ranks": len(ranks), "tests": tests, "calls": calls, "from_jsonl": sorted(from_jsonl)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", nargs="?", default="megatron_suite_results")
    parser.add_argument("--failures", action="store_true", help="list every failed test id")
    args = parser.parse_args()
    # results/<release>/<backend>/<tag>/rank*.xml
    runs = collections.defaultdict(dict)
    for folder in sorted(glob.glob(os.path.join(args.results, "*", "*", "*"))):
        release, backend, tag = folder.split(os.sep)[-3:]
        if backend in BACKENDS and glob.glob(os.path.join(folder, "*rank*")):
            runs[release][(backend, tag)] = read_run(folder)
    for release in sorted(runs):
        print(f"\nmegatron-core {release}")
        by_file = collections.defaultdict(lambda: {b: collections.Counter() for b in BACKENDS})
        notes = []
        for (backend, tag), run in sorted(runs[release].items()):
            for (file, _), (outcome, _) in run["tests"].items():
                by_file[file][backend][outcome] += 1
            calls = ", ".join(f"{k} {v}" for k, v in sorted(run["calls"].items())) or "none recorded"
            lost = f" (no JUnit XML from ranks {run['from_jsonl']}: their outcomes-rank*.jsonl)" if run["from_jsonl"] \
                else ""
            notes.append(f"  {backend}/{tag}: {run['ranks']} ranks{lost}; strategy calls (all ranks): {calls}")
        print("| file | " + " | ".join(BACKENDS) + " |")
        print("|---|" + "---|" * len(BACKENDS))
        for file in sorted(by_file):
            cells = []
            for backend in BACKENDS:
                count = by_file[file][backend]
                ran = count["passed"] + count["failed"]
                cells.append(f"{count['passed']} / {ran}" + (f" ({count['skipped']} skipped)" if count["skipped"]
                                                              else "") if ran or count["skipped"] else "-")
            print(f"| {file} | " + " | ".join(cells) + " |")
        print("\n".join(notes))
        if args.failures:
            for (backend, _tag), run in sorted(runs[release].items()):
                for (file, name), (outcome, message) in sorted(run["tests"].items()):
                    if outcome == "failed":
                        print(f"  FAILED {backend} {file}::{name}: {message[:200]}")


if __name__ == "__main__":
    main()
