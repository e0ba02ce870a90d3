"""A job whose nodes do not share the checkpoint storage is refused at its first save (issue 22,
item 9): two torchrun node groups on this host, one process each, rendezvous on localhost.

With memory:// and a RAM directory of each node's own (as on two machines), every node wrote
its part into storage the other cannot read: the save must fail on both, naming the storage,
and commit nothing. With storage both reach (a local directory here, a shared file system or an
object store on a cluster), the same job commits a checkpoint that loads; a collective load reads
the metadata file once per node. Both in one job: the refused save, then the shared one.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import torch

import bcp_core as bcp
from dist import JOBS, bcp_verify


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _two_nodes(paths: list[str], out, memory_dirs: list[str] | None) -> list[list[str]]:
    """Each path's result on rank 0 and rank 1."""
    port = _port()
    procs = []
    for node in (0, 1):
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT",
                                                                 "LOCAL_WORLD_SIZE", "BCP_LOCAL_WORLD_SIZE")}
        if memory_dirs:
            env["BCP_MEMORY_DIR"] = memory_dirs[node]
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node_rank", str(node),
               "--nproc_per_node", "1", "--master_addr", "127.0.0.1", "--master_port", str(port),
               os.path.join(JOBS, "two_nodes.py"), *[a for p in paths for a in ("--path", p)], "--out", str(out)]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      start_new_session=True))
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=180)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
    for p, text in zip(procs, outputs):
        assert p.returncode == 0, text[-4000:]
    return [[open(out / f"result_rank{r}_{i}").read() for r in (0, 1)] for i in range(len(paths))]


def test_storage_not_shared_by_the_nodes_is_refused(tmp_path):
    dirs = [str(tmp_path / f"node{n}_ram") for n in (0, 1)]
    for d in dirs:
        os.makedirs(d)
    shared = tmp_path / "shared"
    # one job: its save to node-local storage is refused, then it saves to storage both nodes reach
    results, shared_results = _two_nodes(["memory://two-nodes/ckpt", str(shared)], tmp_path, dirs)
    for text in results:
        assert text.startswith("REFUSED"), text
        assert "memory://two-nodes/ckpt/step_00000001 is not shared by every node of the job" in text, text
    for d in dirs:  # nothing committed on either node
        assert not os.path.exists(os.path.join(d, "bcp-memory", "two-nodes", "ckpt", "step_00000001",
                                               "bcp_metadata.json"))

    assert all(text.startswith("COMMITTED") for text in shared_results), shared_results
    # and a collective load reads the metadata once per node, each node's share back exactly
    assert all(text.endswith("LOADED True metadata_reads=1") for text in shared_results), shared_results
    bcp_verify(str(shared))
    target = {"w": torch.zeros(8), "b": torch.zeros(3)}
    bcp.load(str(shared), target)
    assert torch.equal(target["w"], torch.arange(8.0)) and torch.equal(target["b"], torch.ones(3))
    assert not [n for n in os.listdir(shared / "step_00000001") if n.startswith(".bcp-probe")]
