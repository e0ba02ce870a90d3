"""Checkpoint-step stall of collecting dataloader state, with and without prefetching (paper §4.5).

A PackedTokenLoader with read workers feeds a simulated training loop; every `--interval` steps the
loop calls `state_dict()` (what bcp.save does for state["dataloader"]) and we time that call. With
prefetching (`checkpoint_interval=interval`) the workers send their state for the checkpoint step
ahead of time; without it the call asks each worker then and waits for the answer, which comes when
the worker is between two documents, and then for the state to travel.

Two regimes: "loader_bound" (documents take longer to read than the step: workers are always in
the middle of a document) and "step_bound" (workers are idle, waiting for room in their queue).

    python bench/loader_prefetch.py [--workers 4] [--checkpoints 6] [--quick]

Prints one JSON object. Timings are wall-clock on this machine; compare the two modes of one run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

from bcp_core.dataloader import PackedTokenLoader


class SlowDocuments:
    """`n` documents of `length` tokens; reading one takes `read_s` (decode / tokenise stand-in)."""

    def __init__(self, n: int, length: int, read_s: float, base: int):
        self.n, self.length, self.read_s, self.base = n, length, read_s, base

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.read_s)
        return np.arange(self.length, dtype=np.int64) + self.base + i * self.length


def run(mode: str, regime: dict, workers: int, checkpoints: int, interval: int) -> dict:
    sources = {"video": SlowDocuments(4000, regime["doc_tokens"], regime["read_s"], 0),
               "text": SlowDocuments(4000, regime["doc_tokens"] // 8, regime["read_s"] / 8, 10 ** 9)}
    loader = PackedTokenLoader(sources, regime["seq_len"], regime["batch_size"], num_workers=workers,
                               weights={"video": 1.0, "text": 1.0}, seed=0, prefetch_factor=2,
                               checkpoint_interval=interval if mode == "prefetch" else None)
    stalls, waits, state_bytes, stats = [], [], [], {}
    step = 0
    try:
        for _ in loader:
            step += 1
            time.sleep(regime["step_s"])  # forward/backward
            if step % interval == 0:
                t0 = time.perf_counter()
                sd = loader.state_dict()
                stalls.append(time.perf_counter() - t0)
                waits.append(loader.stats["last_state_wait_s"])
                state_bytes.append(sum(u.value["buffer"].nbytes for u in sd["units"].values()))
                if len(stalls) == checkpoints:
                    stats = dict(loader.stats)  # before close(), which collects the states once more
                    break
    finally:
        loader.close()
    return {"stall_ms_median": round(statistics.median(stalls) * 1e3, 2),
            "stall_ms_max": round(max(stalls) * 1e3, 2),
            "stall_ms_all": [round(s * 1e3, 2) for s in stalls],
            # the part of the stall spent waiting for the workers' states (the rest builds the dict)
            "worker_wait_ms_median": round(statistics.median(waits) * 1e3, 2),
            "state_mb_median": round(statistics.median(state_bytes) / 2 ** 20, 2),
            "worker_states_prefetched": stats.get("prefetched"), "worker_states_on_demand": stats.get("on_demand")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--checkpoints", type=int, default=6)
    ap.add_argument("--interval", type=int, default=8, help="steps between checkpoints")
    ap.add_argument("--quick", action="store_true", help="smaller documents, fewer checkpoints")
    args = ap.parse_args()
    scale = 8 if args.quick else 1
    regimes = {
        "loader_bound": {"doc_tokens": 2 ** 21 // scale, "read_s": 0.25, "step_s": 0.02,
                         "seq_len": 4096, "batch_size": 8},
        "step_bound": {"doc_tokens": 2 ** 21 // scale, "read_s": 0.01, "step_s": 0.05,
                       "seq_len": 4096, "batch_size": 8},
    }
    checkpoints = min(args.checkpoints, 3) if args.quick else args.checkpoints
    out: dict = {"workers": args.workers, "interval": args.interval, "checkpoints": checkpoints, "regimes": {}}
    for name, regime in regimes.items():
        res = {mode: run(mode, regime, args.workers, checkpoints, args.interval) for mode in ("on_demand", "prefetch")}
        med_on, med_pre = res["on_demand"]["stall_ms_median"], res["prefetch"]["stall_ms_median"]
        res["median_stall_ratio"] = round(med_on / med_pre, 1) if med_pre > 0 else None
        res["config"] = regime
        out["regimes"][name] = res
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
