"""Run a function on N gloo ranks in fresh processes, with a hard timeout."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue as queue_mod
import time
import traceback
from datetime import timedelta


def _stacks_file(port: int, rank: int) -> str:
    import tempfile
    return os.path.join(tempfile.gettempdir(), f"bcp-test-stacks-{port}-{rank}.txt")


def _worker(rank, world_size, port, fn, args, queue, env, cwd):
    import faulthandler
    import signal
    import torch
    import torch.distributed as dist

    # the caller's environment and directory as of this call (the fork server has its own)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    # a hung rank's Python stacks, asked for by the parent on timeout (SIGUSR1), and a crashed
    # rank's (SIGSEGV and the like), read by the parent when it finds the rank dead
    stacks = open(_stacks_file(port, rank), "w")
    faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
    faulthandler.enable(file=stacks, all_threads=True)
    try:
        # the store is the parent's, as torchrun's agent hosts it: it outlives every rank, so a rank
        # that ends first does not cut the others off mid-exchange
        store = dist.TCPStore("127.0.0.1", port, world_size, is_master=False, timeout=timedelta(seconds=120))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=120))
        # pickled here, by value: the queue's own pickler would pass a tensor's storage as a file
        # descriptor that the parent can fetch only while this process lives, and it is about to end
        result = pickle.dumps(fn(rank, world_size, *args))
        queue.put((rank, "ok", result))
    except BaseException:  # noqa: BLE001 - reported to the parent
        queue.put((rank, "error", traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _context():
    """Ranks are forked from a server that imported torch and bcp once: a rank starts in
    milliseconds, not the seconds a fresh interpreter takes, and shares no state with pytest's
    process (its threads, its S3 server) or with other ranks."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "bcp_core", "dist"])
    return ctx


def wait_for_file(path: str, timeout: float = 120.0) -> None:
    """An event between processes: wait until another one has created `path`."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} was never created"
        time.sleep(0.01)


def mark(path: str) -> None:
    """The other side of `wait_for_file`."""
    with open(path, "w"):
        pass


def run_ranks(world_size: int, fn, *args, timeout: float = 180.0) -> list:
    """fn(rank, world_size, *args) on each rank; returns the results in rank order or raises."""
    import torch.distributed as dist
    ctx = _context()
    queue = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, world_size, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=120))
    port = store.port
    procs = [ctx.Process(target=_worker, args=(r, world_size, port, fn, args, queue, dict(os.environ), os.getcwd()))
             for r in range(world_size)]
    for p in procs:
        p.start()
    results: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(results) < world_size:
            left = deadline - time.monotonic()
            if left <= 0:
                hung = sorted(set(range(world_size)) - set(results))
                # a rank that failed first often leaves the others waiting in a collective: its error
                # is the telling part
                errors = [f"--- rank {r} failed ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
                raise TimeoutError(f"ranks {hung} did not finish within {timeout}s\n" + "\n".join(errors)
                                   + _stacks(procs, port, hung))
            try:
                rank, status, value = queue.get(timeout=min(left, 1.0))
                results[rank] = (status, value)
            except queue_mod.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in results]
                if dead:
                    # give the other ranks a moment to report their own (usually more telling) errors
                    end = time.monotonic() + 5

                    def silent() -> set:  # ranks alive that have not reported yet
                        return {r for r, p in enumerate(procs) if p.exitcode in (None, 0)} - set(results)
                    while time.monotonic() < end and silent():
                        try:
                            rank, status, value = queue.get(timeout=0.5)
                            results[rank] = (status, value)
                        except queue_mod.Empty:
                            pass
                    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
                    raise RuntimeError(f"ranks {dead} died with exit codes {[procs[r].exitcode for r in dead]}\n"
                                       + "\n".join(errors) + _read_stacks(port, dead))
    finally:
        # ranks that all succeeded exit at once; after a failure a survivor may sit in teardown
        # waiting for a dead peer: it is not waited for long
        failed = len(results) < world_size or any(status != "ok" for status, _ in results.values())
        end = time.monotonic() + (2 if failed else 10)
        for p in procs:
            p.join(timeout=max(0.0, end - time.monotonic()))
            if os.path.exists(_stacks_file(port, procs.index(p))):
                os.remove(_stacks_file(port, procs.index(p)))
            if p.is_alive():
                p.kill()
    errors = [f"--- rank {r} ---\n{v}" for r, (s, v) in sorted(results.items()) if s == "error"]
    if errors:
        raise AssertionError("\n".join(errors))
    return [pickle.loads(results[r][1]) for r in range(world_size)]


def _stacks(procs, port: int, ranks: list[int]) -> str:
    """The Python stacks of the given (hung) ranks, dumped by faulthandler."""
    import signal
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            continue
    time.sleep(1.0)
    return _read_stacks(port, ranks)


def _read_stacks(port: int, ranks: list[int]) -> str:
    out = []
    for r in ranks:
        try:
            with open(_stacks_file(port, r)) as f:
                out.append(f"--- rank {r} stacks ---\n{f.read()[-6000:]}")
        except OSError:
            pass
    return "\n" + "\n".join(out)


RECIPES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "recipes")


def run_recipe(name: str, nproc: int, *args: str, timeout: float = 240, torchrun_for_one: bool = True,
               env: dict | None = None) -> None:
    """`recipes/<name> --phase run *args` on `nproc` processes (torchrun), with a hard timeout."""
    import subprocess
    import sys
    script = os.path.join(RECIPES, name)
    if nproc == 1 and not torchrun_for_one:
        cmd = [sys.executable, script]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc), script]
    full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    full_env.update(env or {})
    proc = subprocess.Popen([*cmd, "--phase", "run", *args], env=full_env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc)  # torchrun and its workers: none is left behind to hang on
        out, err = proc.communicate()
        raise TimeoutError(f"{name} {' '.join(args)} did not end within {timeout}s:\n{out[-4000:]}\n"
                           f"{err[-8000:]}") from None
    assert proc.returncode == 0, f"{name} {' '.join(args)} failed:\n{out[-4000:]}\n{err[-8000:]}"


def kill_tree(proc) -> None:
    """SIGKILL a launched torchrun (`subprocess.Popen`) and every process under it (its workers run
    in sessions of their own), and reap it."""
    import signal
    for pid in [proc.pid, *_descendants(proc.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    proc.wait()


def losses_by_rank(d, rank: int = 0) -> dict[int, float]:
    """The `losses_rank<r>.json` a recipe wrote: step -> loss."""
    import json
    with open(os.path.join(d, f"losses_rank{rank}.json")) as f:
        return {step: loss for step, loss in json.load(f)}


JOBS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "jobs")


class Job:
    """A training job under torchrun, as a cluster runs one: started, maybe signalled, waited for.

    `launch` starts `tests/jobs/<name> *args` on `nproc` processes in a session of its own, so a
    hung job is killed whole when `finish` times out.
    """

    def __init__(self, name: str, nproc: int, *args: str, env: dict | None = None):
        import subprocess
        import sys
        import tempfile
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
               os.path.join(JOBS, name), *args]
        full_env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
        full_env.update(env or {})
        full_env.setdefault("PYTHONFAULTHANDLER", "1")  # a worker killed by a signal prints its stacks
        self.name = name
        self._out = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, env=full_env, stdout=self._out, stderr=subprocess.STDOUT, text=True,
                                     start_new_session=True)
        self.output = ""

    def wait_for(self, path: str, predicate, timeout: float = 120) -> None:
        """Until the file `path` exists and `predicate(its text)` holds (the job must still run)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"{self.name} ended (status {self.proc.returncode}) before {path} was "
                                     f"ready:\n{self.read_output()[-6000:]}")
            try:
                with open(path) as f:
                    text = f.read()
                if text and predicate(text):
                    return
            except FileNotFoundError:
                pass
            time.sleep(0.05)
        self.kill()
        raise TimeoutError(f"{path} not ready within {timeout}s")

    def signal(self, signum: int, pid: int | None = None) -> None:
        """Send `signum` to torchrun (which forwards it to every worker), or to process `pid` only."""
        os.kill(pid if pid is not None else self.proc.pid, signum)

    def signal_paused(self, root: str, step: int, signum: int, pid: int | None = None, receivers: int = 2,
                      line: str = "bcp: received {}", timeout: float = 120) -> None:
        """For a job paused at `step` (`--pause-at`, tests/pause.py): `signal`, then, once `receivers`
        workers have logged `line` (the signal's name in it: bcp's handler's), release the job."""
        import signal
        from pause import release
        self.signal(signum, pid)
        line = line.format(signal.Signals(signum).name)
        deadline = time.monotonic() + timeout
        while self.peek_output().count(line) < receivers:
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.kill()
                raise AssertionError(f"{self.name}: {receivers} worker(s) should have logged {line!r}:\n"
                                     f"{self.peek_output()[-6000:]}")
            time.sleep(0.05)
        release(root, step)

    def peek_output(self) -> str:
        """The output so far, read without moving the file offset the job's processes write at."""
        fd = self._out.fileno()
        return os.pread(fd, os.fstat(fd).st_size, 0).decode(errors="replace")

    def finish(self, timeout: float = 180) -> int:
        """Wait for the job; its exit status (the output is in `.output`)."""
        import subprocess
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise TimeoutError(f"{self.name} did not end within {timeout}s:\n{self.read_output()[-6000:]}") from None
        self.output = self.read_output()
        return self.proc.returncode

    def read_output(self) -> str:
        self._out.seek(0)
        return self._out.read()

    def kill(self) -> None:
        """SIGKILL torchrun and every process under it."""
        kill_tree(self.proc)


def _descendants(pid: int) -> list[int]:
    """The processes below `pid`, from /proc (children first found, then theirs)."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            parents.setdefault(ppid, []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def bcp_verify(path: str) -> str:
    """`bcp verify PATH` as a user runs it, through the command's entry point in this process (the
    console script's wiring is tested once, in test_cli and test_packaging; a process per check cost
    the suite a second and a half each); its output, asserting it passed."""
    import contextlib
    import io

    from bcp_core.tools.cli import main
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["verify", path])
    assert rc == 0, f"bcp verify {path} failed:\n{out.getvalue()}\n{err.getvalue()}"
    return out.getvalue()
