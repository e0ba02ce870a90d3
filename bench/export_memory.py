"""Peak memory of `bcp export` on a checkpoint larger than 2 GiB.

Two gloo ranks save a model whose tensors are sharded on dim 0 (each rank
allocates only its half), so export has to merge pieces from both ranks. Then
`bcp export --to hf` and `--to torch` run as child processes and their peak
resident memory (ru_maxrss from wait4) is printed next to the checkpoint size,
the largest tensor and the peak of a process that only imports bcp.

    python bench/export_memory.py [--gib 2.25] [--dir /tmp/bcp_export_bench] [--keep]
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time

import torch
import torch.multiprocessing as mp

TENSOR_MIB = 256  # largest tensor


def _save(rank: int, world: int, path: str, n_tensors: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    import bcp_core as bcp

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    rows = TENSOR_MIB * (1 << 20) // 4 // 1024
    model = {}
    for i in range(n_tensors):
        local = torch.full((rows // world, 1024), float(i), dtype=torch.float32)
        local[0, :8] = torch.arange(8) + rank  # a few distinct values per piece
        model[f"layers.{i}.weight"] = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
    model["norm.weight"] = torch.ones(1024)
    bcp.save(path, {"model": model}).wait()
    dist.destroy_process_group()


def _peak_rss(cmd: list[str]) -> tuple[float, float]:
    """(peak RSS in MiB, seconds) of a child process."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return usage.ru_maxrss / 1024, time.monotonic() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gib", type=float, default=2.25, help="checkpoint size (default 2.25 GiB)")
    ap.add_argument("--dir", default="/tmp/bcp_export_bench")
    ap.add_argument("--keep", action="store_true", help="keep the files")
    args = ap.parse_args()
    shutil.rmtree(args.dir, ignore_errors=True)
    os.makedirs(args.dir)
    ckpt = os.path.join(args.dir, "ckpt")
    n_tensors = max(1, round(args.gib * 1024 / TENSOR_MIB))
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t = time.monotonic()
    mp.spawn(_save, args=(2, ckpt, n_tensors, port), nprocs=2, join=True)
    size = sum(os.path.getsize(os.path.join(ckpt, "data", f)) for f in os.listdir(os.path.join(ckpt, "data")))
    print(f"checkpoint: {size / 2**30:.2f} GiB in {n_tensors} tensors of {TENSOR_MIB} MiB, saved by 2 ranks "
          f"in {time.monotonic() - t:.1f}s")

    py = sys.executable
    base, _ = _peak_rss([py, "-c", "import bcp_core.tools.cli"])
    print(f"peak RSS of a process that imports bcp:          {base:8.0f} MiB")
    runs = {
        "bcp export --to hf": [py, "-m", "bcp_core", "-q", "export", ckpt, os.path.join(args.dir, "hf"),
                               "--to", "hf"],
        "bcp export --to hf --dtype bf16": [py, "-m", "bcp_core", "-q", "export", ckpt,
                                            os.path.join(args.dir, "hf16"), "--to", "hf", "--dtype", "bf16"],
        "bcp export --to torch": [py, "-m", "bcp_core", "-q", "export", ckpt,
                                  os.path.join(args.dir, "model.pt"), "--to", "torch"],
    }
    for name, cmd in runs.items():
        peak, secs = _peak_rss(cmd)
        print(f"peak RSS of {name:<34} {peak:8.0f} MiB  ({peak - base:.0f} MiB above the import baseline; "
              f"{size / 2**20 / secs:.0f} MiB/s)")
    # Spot check of the outputs: values from both ranks' pieces landed in place.
    from safetensors import safe_open
    with safe_open(os.path.join(args.dir, "hf", "model-00001-of-00001.safetensors")
                   if not os.path.exists(os.path.join(args.dir, "hf", "model.safetensors"))
                   else os.path.join(args.dir, "hf", "model.safetensors"), "pt") as f:
        w = f.get_slice("layers.1.weight")
        rows = w.get_shape()[0]
        assert w[0:1, 0:8].flatten().tolist() == list(range(8))
        assert w[rows // 2: rows // 2 + 1, 0:8].flatten().tolist() == [x + 1 for x in range(8)]
    sd = torch.load(os.path.join(args.dir, "model.pt"), mmap=True, weights_only=True)
    assert sd["model.layers.1.weight"][rows // 2, :8].tolist() == [x + 1 for x in range(8)]
    print("outputs checked")
    if not args.keep:
        shutil.rmtree(args.dir, ignore_errors=True)


if __name__ == "__main__":
    main()
