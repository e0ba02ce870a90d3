"""Storage backends: local, memory://, fsspec and S3 against a real S3 server on localhost.

The S3 server is moto's WSGI application served by werkzeug on 127.0.0.1, behind a
small WSGI layer that can fail chosen requests (HTTP 500 or 403) and that observes
how many uploads of parts and ranged reads are in flight at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import threading
import uuid

import numpy as np
import pytest
import torch

import bcp_core as bcp
from bcp_core.tools import cli
from bcp_core import storage as bst
from dist import run_ranks

BUCKET = "bcp-test"
PART = 256 << 10  # upload part / read chunk in these tests: a 1 MiB tensor becomes 4 parts


# ----------------------------------------------------------------------------- the S3 server

class FaultyS3:
    """WSGI middleware: fail requests matching a rule, and record concurrency of parts and ranged reads."""

    def __init__(self, app):
        self.app = app
        self.lock = threading.Condition()
        self.rules: list[dict] = []
        self.inflight = {"part": 0, "range": 0}
        self.reset_counts()

    def reset_counts(self, hold_for_overlap: bool = False):
        """Counts from zero. `hold_for_overlap`: hold the first request of each kind until a second
        one is in flight (an event: a parallel client overlaps them for sure, however slowly it runs;
        a sequential one fails after 120 s)."""
        self.max_inflight = {"part": 0, "range": 0}
        self.counts = {"part": 0, "range": 0, "failed": 0}
        self.holding = hold_for_overlap

    def fail(self, status: int, code: str, method: str, key_pattern: str, times: int | None, every: int = 1,
             attempts: int | None = 1):
        """Fail the first `attempts` attempts (None: every attempt) of one in `every` distinct requests (same
        key, range and part) of `method` on keys matching the regex `key_pattern`; `times` such requests at
        most (None: no limit). A request retried more often then succeeds, so the outcome does not depend
        on how requests interleave."""
        with self.lock:
            self.rules.append({"status": status, "code": code, "method": method, "key": re.compile(key_pattern),
                               "left": times, "every": every, "attempts": attempts, "failures": {}})

    def clear(self):
        with self.lock:
            self.rules.clear()

    def _kind(self, environ) -> str | None:
        """'part' for a part upload, 'range' for a ranged read; only requests of at least half a
        part count, so the tiny reads of small pieces never wait in __call__."""
        if environ["REQUEST_METHOD"] == "PUT" and "partNumber=" in environ.get("QUERY_STRING", ""):
            return "part" if int(environ.get("CONTENT_LENGTH") or 0) >= PART // 2 else None
        rng = environ.get("HTTP_RANGE", "")
        if environ["REQUEST_METHOD"] == "GET" and rng.startswith("bytes="):
            lo, _, hi = rng[6:].partition("-")
            return "range" if hi and int(hi) - int(lo) + 1 >= PART // 2 else None
        return None

    def _matching_rule(self, environ) -> dict | None:
        signature = (environ["REQUEST_METHOD"], environ.get("PATH_INFO", ""), environ.get("QUERY_STRING", ""),
                     environ.get("HTTP_RANGE", ""))
        with self.lock:
            for r in self.rules:
                if r["method"] != signature[0] or not r["key"].search(signature[1]):
                    continue
                failures = r["failures"]  # per distinct request: its failed attempts, or None if not chosen
                if signature not in failures:
                    chosen = len(failures) % r["every"] == 0 and (r["left"] is None or r["left"] > 0)
                    failures[signature] = 0 if chosen else None
                    if chosen and r["left"] is not None:
                        r["left"] -= 1
                done = failures[signature]
                if done is None or (r["attempts"] is not None and done >= r["attempts"]):
                    continue
                failures[signature] = done + 1
                self.counts["failed"] += 1
                return r
        return None

    def __call__(self, environ, start_response):
        rule = self._matching_rule(environ)
        if rule is not None:
            environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
            body = (f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{rule['code']}</Code>"
                    f"<Message>injected by the test</Message></Error>").encode()
            start_response(f"{rule['status']} Injected", [("Content-Type", "application/xml"),
                                                         ("Content-Length", str(len(body)))])
            return [body]
        kind = self._kind(environ)
        if kind is None:
            return self.app(environ, start_response)
        with self.lock:
            self.counts[kind] += 1
            self.inflight[kind] += 1
            self.max_inflight[kind] = max(self.max_inflight[kind], self.inflight[kind])
            self.lock.notify_all()
            if self.holding and self.max_inflight[kind] < 2:  # see reset_counts
                self.lock.wait_for(lambda: self.max_inflight[kind] >= 2, timeout=120)
        try:
            return list(self.app(environ, start_response))
        finally:
            with self.lock:
                self.inflight[kind] -= 1


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    pytest.importorskip("s3fs")
    pytest.importorskip("moto.server")
    import fsspec.config
    import moto.s3.models
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, create_backend_app
    from werkzeug.serving import make_server

    # Small parts keep the test light; real S3 needs 5 MiB.
    old_min = moto.s3.models.S3_UPLOAD_PART_MIN_SIZE
    moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = 1 << 10
    faults = FaultyS3(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, faults, threaded=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_port}"
    # Credentials and endpoint for this process, the rank processes and `bcp` subprocesses. bcp itself turns
    # botocore's and s3fs's retries off (its own are the one retry layer), keeping other client settings.
    options = {"endpoint_url": url, "key": "testing", "secret": "testing", "config_kwargs": {"read_timeout": 30}}
    env = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
           "FSSPEC_S3": json.dumps(options)}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    saved_conf = fsspec.config.conf.get("s3")
    fsspec.config.conf["s3"] = dict(options)
    import boto3
    boto3.client("s3", endpoint_url=url, region_name="us-east-1", aws_access_key_id="testing",
                 aws_secret_access_key="testing").create_bucket(Bucket=BUCKET)
    try:
        yield faults
    finally:
        server.shutdown()
        thread.join(timeout=10)
        moto.s3.models.S3_UPLOAD_PART_MIN_SIZE = old_min
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if saved_conf is None:
            fsspec.config.conf.pop("s3", None)
        else:
            fsspec.config.conf["s3"] = saved_conf


@pytest.fixture
def small_io():
    """Parts and read chunks of PART bytes, quick retries; restored afterwards."""
    old = {k: getattr(bst.CONFIG, k) for k in ("part_bytes", "chunk_bytes", "retry_base_delay", "retry_attempts")}
    bst.configure_storage(part_bytes=PART, chunk_bytes=PART, retry_base_delay=0.01, retry_attempts=5)
    bst.retry_stats(reset=True)
    yield
    bst.configure_storage(**old)


def _configure_rank():
    bst.configure_storage(part_bytes=PART, chunk_bytes=PART, retry_base_delay=0.01, retry_attempts=5)
    bst.retry_stats(reset=True)


# ----------------------------------------------------------------------------- multi-process round trips

def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    # Replicated 1 MiB tensors (written once, spread over the ranks) and one value that differs per rank.
    model = {f"w{i}": torch.randn(512, 512, generator=g) for i in range(4)}
    model["small"] = torch.arange(10, dtype=torch.int64) + step
    return {"model": model, "extra_state": {"rank": rank, "step": step}}


def _save_load_worker(rank, world_size, root, steps, load_world):
    _configure_rank()
    for step in steps:
        bcp.save(root, _state(rank, step), step=step).wait()
    out = {"save_retries": bst.retry_stats(reset=True)["retries"]}
    if rank < load_world:
        target = {"model": {k: torch.zeros_like(v) for k, v in _state(0, 0)["model"].items()}, "extra_state": {}}
        bcp.load(root, target)
        want = _state(rank, steps[-1])
        for k, v in want["model"].items():
            assert torch.equal(target["model"][k], v), k
        assert target["extra_state"] == want["extra_state"], target["extra_state"]
    out["load_retries"] = bst.retry_stats(reset=True)["retries"]
    return out


@pytest.mark.parametrize("kind", ["local", "memory", "s3"])
def test_multiprocess_round_trip(kind, tmp_path, request):
    if kind == "s3":
        faults = request.getfixturevalue("s3")
        faults.reset_counts(hold_for_overlap=True)
        root = f"s3://{BUCKET}/round-trip-{uuid.uuid4().hex[:8]}"
    elif kind == "memory":
        root = f"memory://bcp-test-{uuid.uuid4().hex[:8]}"
    else:
        root = str(tmp_path / "run")
    try:
        run_ranks(2, _save_load_worker, root, [1, 2], 2)
        # Saved by 2 ranks, loaded here by a third process layout (a single process).
        st = bst.storage_for(root)
        assert st.read_bytes("latest") == b"step_00000002"
        md = bcp.inspect(root)
        assert {p.rank for t in md.tensors.values() for p in t.pieces} == {0, 1}
        target = {"model": {k: torch.zeros_like(v) for k, v in _state(0, 0)["model"].items()}}
        bcp.load(root, target, strict=False)
        assert all(torch.equal(target["model"][k], v) for k, v in _state(0, 2)["model"].items())
        # The command line works on every backend too.
        assert cli.main(["-q", "verify", root]) == 0
        assert cli.main(["ls", root]) == 0
        if kind == "s3":
            # The 1 MiB tensors went up as parallel multipart uploads and came back as parallel ranged reads.
            assert faults.counts["part"] >= 16 and faults.max_inflight["part"] >= 2, (faults.counts,
                                                                                     faults.max_inflight)
            assert faults.counts["range"] >= 16 and faults.max_inflight["range"] >= 2
    finally:
        if kind == "s3":
            faults.reset_counts()  # no more holding
        bst.storage_for(root).remove("")
    assert not bst.storage_for(root).exists("latest")


def test_s3_transient_errors_are_retried(s3, small_io):
    root = f"s3://{BUCKET}/flaky-{uuid.uuid4().hex[:8]}"
    # HTTP 500 on every third part upload, on every other ranged read, and once on the metadata commit.
    s3.fail(500, "InternalError", "PUT", "/data/", times=None, every=3)
    s3.fail(503, "ServiceUnavailable", "PUT", "bcp_metadata.json", times=1)
    s3.fail(500, "InternalError", "GET", "/data/", times=None, every=2)
    try:
        results = run_ranks(2, _save_load_worker, root, [1], 2)
    finally:
        s3.clear()
        bst.storage_for(root).remove("")
    saved = sum(r["save_retries"] for r in results)
    loaded = sum(r["load_retries"] for r in results)
    print(f"retries: save {saved}, load {loaded}; injected failures {s3.counts['failed']}")
    assert saved >= 3 and loaded >= 2, results


def test_s3_permanent_error_keeps_previous_checkpoint(s3, small_io):
    root = f"s3://{BUCKET}/perm-{uuid.uuid4().hex[:8]}"
    try:
        # Step 1 saves; every upload of rank 1's data file for step 2 is refused.
        s3.fail(403, "AccessDenied", "PUT", r"step_00000002/data/[^/]*r1_\d+\.safetensors", times=None)
        with pytest.raises(AssertionError) as info:
            run_ranks(2, _save_load_worker, root, [1, 2], 2)
        s3.clear()
        msg = str(info.value)
        # Both ranks raise; the error names the failing rank, the stage and the file.
        assert msg.count("SaveError") >= 2, msg
        assert "rank 1" in msg and re.search(r"step_00000002/data/[^/ ]*r1_0\.safetensors", msg), msg
        assert "permanent" in msg and "upload part" in msg, msg
        st = bst.storage_for(root)
        assert st.read_bytes("latest") == b"step_00000001"
        assert not st.exists("step_00000002/bcp_metadata.json")
        assert bcp.resolve(root).root.endswith("step_00000001")
        # The aborted multipart uploads were cleaned up.
        uploads = st.fs.call_s3("list_multipart_uploads", Bucket=BUCKET)
        assert not [u for u in uploads.get("Uploads", []) if "perm-" in u["Key"]], uploads
        target = {"model": {k: torch.zeros_like(v) for k, v in _state(0, 0)["model"].items()}}
        bcp.load(root, target, strict=False)  # the previous checkpoint is the one loaded
        assert all(torch.equal(target["model"][k], v) for k, v in _state(0, 1)["model"].items())
    finally:
        s3.clear()
        bst.storage_for(root).remove("")


# ----------------------------------------------------------------------------- S3 details

def test_s3_compose_upload_and_ranged_reads(s3, small_io, monkeypatch):
    monkeypatch.setattr(bst.fsspec, "COMPOSE_FAN_IN", 4)  # 6 parts: composed in a tree of two levels
    url = f"s3://{BUCKET}/compose-{uuid.uuid4().hex[:8]}"
    st = bst.FsspecStorage(url, upload="compose")
    data = os.urandom(5 * PART + 123)
    w = st.open_writer("f.bin")
    for i in range(0, len(data), 100_000):
        w.write(memoryview(data)[i:i + 100_000])
    w.close()
    assert st.listdir() == ["f.bin"]  # parts were composed and deleted
    assert st.size("f.bin") == len(data)
    out = bytearray(3 * PART + 7)
    st.read_into("f.bin", PART - 5, memoryview(out))
    assert bytes(out) == data[PART - 5: PART - 5 + len(out)]
    with pytest.raises(bcp.StorageError, match="truncated"):
        st.read_into("f.bin", len(data) - 10, memoryview(bytearray(20)))
    st.remove("")
    assert st.listdir() == []


def test_s3_small_file_is_one_put_and_abort_discards(s3, small_io):
    st = bst.storage_for(f"s3://{BUCKET}/abort-{uuid.uuid4().hex[:8]}")
    assert isinstance(st, bst.FsspecStorage) and st.upload == "multipart"
    w = st.open_writer("small")
    w.write(memoryview(b"x" * 100))
    w.close()
    assert st.read_bytes("small") == b"x" * 100
    w = st.open_writer("big")
    w.write(memoryview(os.urandom(3 * PART)))
    w.abort()
    assert not st.exists("big")
    st.remove("")


def test_s3_aborted_upload_is_discarded_through_a_transient_error(s3, small_io):
    """The abort of a multipart upload is retried like every other request: a transient error on it
    left the upload's parts stored (and billed) for good, with nothing to list or remove them."""
    st = bst.storage_for(f"s3://{BUCKET}/abort-retry-{uuid.uuid4().hex[:8]}")
    w = st.open_writer("big")
    w.write(memoryview(os.urandom(3 * PART)))
    s3.reset_counts()
    s3.fail(503, "ServiceUnavailable", "DELETE", r"/abort-retry-[^/]*/big$", times=1)
    try:
        w.abort()
        assert s3.counts["failed"] == 1
    finally:
        s3.clear()
    uploads = st.fs.call_s3("list_multipart_uploads", Bucket=BUCKET).get("Uploads", [])
    assert not [u for u in uploads if "abort-retry-" in u["Key"]], uploads
    assert not st.exists("big")
    st.remove("")


def test_s3_one_retry_layer(s3, small_io):
    """A request that fails for good is sent exactly `retry_attempts` times: bcp's retries are the only
    ones, with botocore's and s3fs's own off (before, the three layers multiplied: 3 x 5 x 5 = 75 sends
    of a SlowDown PUT, each layer with its own delays). Other client settings of the user are kept."""
    bst.configure_storage(retry_attempts=3)
    url = f"s3://{BUCKET}/one-layer-{uuid.uuid4().hex[:8]}"
    st = bst.storage_for(url)
    assert st.fs.retries == 1 and st.fs.config_kwargs["retries"]["total_max_attempts"] == 1
    assert st.fs.config_kwargs["read_timeout"] == 30  # the fixture's fsspec config, merged
    st.write_atomic("blob", b"x" * 100)
    s3.reset_counts()
    s3.fail(503, "SlowDown", "PUT", r"/one-layer-[^/]*/latest$", times=None, attempts=None)  # every layer retries it
    s3.fail(500, "InternalError", "GET", r"/one-layer-[^/]*/blob$", times=None, attempts=None)
    try:
        with pytest.raises(bcp.StorageError, match=r"commit \(write\) s3://.*/latest failed after 3 attempts"):
            st.write_atomic("latest", b"step_00000001")
        assert s3.counts["failed"] == 3
        with pytest.raises(bcp.StorageError, match=r"read s3://.*/blob failed after 3 attempts"):
            st.read_bytes("blob")
        assert s3.counts["failed"] == 6
        assert bst.retry_stats()["retries"] == 4
    finally:
        s3.clear()
        st.remove("")
    # A retry policy the user gives botocore is theirs to keep.
    bst.set_storage_options("s3", config_kwargs={"retries": {"total_max_attempts": 2}})
    try:
        assert bst.storage_for(url).fs.config_kwargs["retries"]["total_max_attempts"] == 2
    finally:
        bst.base.FS_OPTIONS.pop("s3", None)


def test_prune_and_leftovers_on_s3(s3, small_io):
    """The root's layout works on object stores too: prune keeps the newest and the tracker's, and
    removes whole old checkpoints; a failed save's directory goes after the next commit."""
    from bcp_core import layout
    root = f"s3://{BUCKET}/prune-{uuid.uuid4().hex[:8]}"
    st = bst.storage_for(root)
    try:
        for step in (1, 2, 3, 4):
            bcp.save(root, {"w": torch.full((8,), float(step))}, step=step, async_save=False).wait()
        st.write_atomic("latest", b"step_00000002")  # the tracker names an older one
        st.write_atomic("step_00000005/data/partial.safetensors", b"never committed")  # a save in progress
        result = layout.prune(root, keep_last=1)
        assert result.removed == ("step_00000001", "step_00000003") and not result.failed
        assert result.kept == ("step_00000002", "step_00000004", "step_00000005")
        assert st.listdir() == ["latest", "step_00000002", "step_00000004", "step_00000005"]
        assert st.listdir("step_00000001") == [] and st.listdir("step_00000003") == []
        assert layout.remove_leftovers(root, "step_00000004").removed == ()  # step 5 may be a save in progress
        # older than the next commit but written just now: another job's save in progress
        assert layout.remove_leftovers(root, "step_00000006").removed == ()
        # a process of this host that died while writing it: a leftover
        dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
        st.write_atomic(f"step_00000005/data/r0.safetensors.bcp-tmp.{bst.base.this_host()}.{dead}.0123abcd", b"x")
        assert layout.remove_leftovers(root, "step_00000006").removed == ("step_00000005",)
        # a save that failed on every rank (marked so by its coordinator) goes at once
        st.write_atomic("step_00000005/data/partial.safetensors", b"never committed")
        st.write_atomic("step_00000005/bcp_failed.json", b"{}")
        assert layout.remove_leftovers(root, "step_00000006").removed == ("step_00000005",)
        target = {"w": torch.zeros(8)}
        bcp.load(root, target)
        assert torch.equal(target["w"], torch.full((8,), 2.0))
    finally:
        st.remove("")


# ----------------------------------------------------------------------------- fsspec, memory, retries

def test_fsspec_backend_on_fsspec_memory(small_io):
    st = bst.FsspecStorage(f"memory://bcp-fsspec-{uuid.uuid4().hex[:8]}/ckpt")
    assert st.upload == "stream"
    st.makedirs("data")
    data = os.urandom(3 * PART + 11)
    w = st.open_writer("data/a")
    w.write(memoryview(data))
    w.close()
    out = bytearray(len(data) - 20)
    st.read_into("data/a", 20, memoryview(out))  # 4 parallel ranged reads
    assert bytes(out) == data[20:]
    st.write_atomic("m.json", b"{}")
    st.write_atomic("m.json", b"{1}")
    assert st.read_bytes("m.json") == b"{1}"
    assert st.listdir() == ["data", "m.json"] and st.listdir("data") == ["a"] and st.listdir("nope") == []
    assert st.exists("data") and not st.exists("nope") and st.size("data/a") == len(data)
    with pytest.raises(FileNotFoundError):
        st.read_bytes("nope")
    st.remove("data")
    st.remove("data")  # missing is fine
    assert st.listdir() == ["m.json"]
    child = st.child("sub")
    assert child.fs is st.fs and child.root == st.root + "/sub"
    w = st.open_writer("aborted")
    w.write(memoryview(b"partial"))
    w.abort()
    assert not st.exists("aborted")


def test_memory_storage_is_shared_tmpfs(tmp_path, monkeypatch):
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    st = bst.storage_for("memory://job/ckpt")
    assert isinstance(st, bst.MemoryStorage) and st.root == "memory://job/ckpt" and not st.fsync
    st.makedirs()
    st.write_atomic("x", b"1")
    assert (tmp_path / "bcp-memory" / "job" / "ckpt" / "x").read_bytes() == b"1"
    assert st.child("a").root == "memory://job/ckpt/a"
    for bad in ("memory://", "memory://a/../b"):
        with pytest.raises(bcp.StorageError, match="memory://"):
            bst.storage_for(bad)


def test_memory_retire_keeps_one_checkpoints_files_for_the_next_writes(tmp_path, monkeypatch):
    """A retired checkpoint's data files are overwritten by the next save's files of the same kind
    (rank and index, whatever the save: their tmpfs pages reused), cut to the new size; only the
    last retired checkpoint's are kept; a spare that is a link, or has another link, is never
    written through; removing the name frees everything."""
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    root = bst.storage_for("memory://job/tiers")
    top = tmp_path / "bcp-memory" / "job"

    def write(st, rel, data: bytes, close=True):
        w = st.open_writer(rel)
        w.write(memoryview(data))
        w.close() if close else w.abort()

    one = root.child("step_1")
    one.makedirs("data")
    write(one, "data/c0ffee-1-r0_0.safetensors", b"a" * 4096)  # named as engine/write.py names them
    write(one, "data/c0ffee-1-r1_0.safetensors", b"b" * 100)
    (top / "tiers" / "step_1" / "data" / bst.base.temp_name("c0ffee-1-r2_0.safetensors")).write_bytes(b"unfinished")
    one.write_atomic("metadata.json", b"{}")
    inode = os.stat(top / "tiers" / "step_1" / "data" / "c0ffee-1-r0_0.safetensors").st_ino
    root.retire("step_1")
    assert root.listdir() == [] and sorted(os.listdir(top / ".spare")) == ["r0_0.safetensors", "r1_0.safetensors"]

    two = root.child("step_2")
    two.makedirs("data")
    write(two, "data/c0ffee-2-r0_0.safetensors", b"x" * 10)  # shorter than the spare: cut to size
    got = top / "tiers" / "step_2" / "data" / "c0ffee-2-r0_0.safetensors"
    assert got.read_bytes() == b"x" * 10 and os.stat(got).st_ino == inode
    write(two, "data/c0ffee-2-r1_0.safetensors", b"y" * 50, close=False)  # an aborted write takes its spare
    assert os.listdir(top / "tiers" / "step_2" / "data") == [got.name] and os.listdir(top / ".spare") == []
    outside = tmp_path / "outside"
    outside.write_bytes(b"keep")
    os.symlink(outside, top / ".spare" / "c")
    linked = tmp_path / "linked"  # a spare linked elsewhere too keeps its bytes
    linked.write_bytes(b"view")
    os.link(linked, top / ".spare" / "d")
    write(two, "data/d", b"w" * 3)
    assert linked.read_bytes() == b"view" and (top / "tiers" / "step_2" / "data" / "d").read_bytes() == b"www"
    write(two, "data/c", b"z" * 3)
    assert outside.read_bytes() == b"keep" and (top / "tiers" / "step_2" / "data" / "c").read_bytes() == b"zzz"
    assert not (top / "tiers" / "step_2" / "data" / "c").is_symlink()

    # what a retirer that ended between its two steps left goes too (not what a live process holds)
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    left = top / bst.base.temp_name(".spare").replace(f".{os.getpid()}.", f".{int(gone.stdout)}.")
    held = top / bst.base.temp_name(".spare")
    for d in (left, held):
        d.mkdir()
        (d / "a").write_bytes(b"old")
    root.retire("step_2")  # the spares of step 1 (the link) go: one retired checkpoint's files at most
    assert sorted(os.listdir(top / ".spare")) == ["c", "d", "r0_0.safetensors"] and outside.read_bytes() == b"keep"
    assert not left.exists() and held.exists()
    bst.storage_for("memory://job").remove("")
    assert not top.exists()


def test_a_memory_file_a_load_reads_is_not_overwritten_by_the_next_save(tmp_path, monkeypatch):
    """A load reads a memory:// file through a map after verifying it. If its checkpoint is retired
    meanwhile (another process's retention) the next save does not write into that file (it makes
    a new one), so the load copies the bytes it verified; a map of a file being overwritten is
    refused, never waited for."""
    from bcp_core import loader
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    root, n = "memory://job", 1 << 16
    bcp.save(root, {"w": torch.full((n,), 1.0)}, step=1).wait()
    verified = loader.finish_lazy_copies  # called once every read is verified, before the writes

    def retire_and_save_then_write():
        bst.storage_for(root).retire("step_00000001")
        bcp.save(root, {"w": torch.full((n,), 2.0)}, step=2).wait()
        verified()
    monkeypatch.setattr(loader, "finish_lazy_copies", retire_and_save_then_write)
    target = {"w": torch.zeros(n)}
    bcp.load(f"{root}/step_00000001", target)
    assert torch.equal(target["w"], torch.full((n,), 1.0))
    monkeypatch.setattr(loader, "finish_lazy_copies", verified)
    target = {"w": torch.zeros(n)}
    bcp.load(f"{root}/step_00000002", target)
    assert torch.equal(target["w"], torch.full((n,), 2.0))

    st = bst.storage_for(f"{root}/step_00000002")
    data = next(f for f in st.listdir("data"))
    with open(tmp_path / "bcp-memory" / "job" / "step_00000002" / "data" / data, "rb+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)  # as a writer that took the file holds it
        with pytest.raises(bst.StorageError, match="is being overwritten by a newer save"):
            st.map(f"data/{data}")
    bst.storage_for(root).remove("")


def test_file_urls_follow_rfc8089(tmp_path):
    """`file:///x` and `file://localhost/x` are the local path /x (before, the second was the relative
    path `localhost/x`); a URL naming another host is refused with an error naming it."""
    for url in (f"file://{tmp_path}/a", f"file://localhost{tmp_path}/a", f"FILE://LocalHost{tmp_path}/a"):
        st = bst.storage_for(url)
        assert isinstance(st, bst.LocalStorage) and st.root == f"{tmp_path}/a", url
        st.makedirs()
        st.write_atomic("x", url.encode())
        assert (tmp_path / "a" / "x").read_bytes() == url.encode()
    assert not os.path.exists("localhost")
    with pytest.raises(bcp.StorageError, match="not of host 'fileserver'"):
        bst.storage_for(f"file://fileserver{tmp_path}/a")


def test_local_writer_closes_its_descriptor_once(tmp_path, monkeypatch):
    """A data file whose close fails (EIO at fsync) is discarded, and its descriptor is closed exactly
    once: before, abort() closed the number again, which by then was another file's."""
    import errno

    from bcp_core.storage import local_writer
    st = bst.storage_for(str(tmp_path))
    w = st.open_writer("f.safetensors")
    w.write(memoryview(b"bytes that never reach the disk"))
    fd = w.fd
    real_fsync = os.fsync

    def fsync(n):
        if n == fd:
            raise OSError(errno.EIO, "Input/output error")
        return real_fsync(n)
    monkeypatch.setattr(local_writer.os, "fsync", fsync)
    with pytest.raises(OSError, match="Input/output"):
        w.close()
    monkeypatch.setattr(local_writer.os, "fsync", real_fsync)
    opened = []  # another component's files, until one gets the number the writer had
    while not opened or opened[-1] != fd:
        assert len(opened) < 64, opened
        opened.append(os.open(tmp_path / "other", os.O_WRONLY | os.O_CREAT, 0o644))
    try:
        w.abort()  # what the engine does after a failed close
        os.fstat(fd)  # still open: it is the other file's
        assert os.write(fd, b"ok") == 2
    finally:
        for n in opened:
            os.close(n)
    assert sorted(os.listdir(tmp_path)) == ["other"]  # nothing left of the failed file, not even its temp


def test_a_commit_record_whose_directory_sync_failed_is_not_left_in_place(tmp_path, monkeypatch):
    """The metadata is renamed into place, then its directory fsync'd; when that fsync fails (EIO) the
    save raises on every rank, and the metadata goes again: before, it stayed, and the checkpoint of
    a save that "failed and was not committed" was listed as complete and loaded."""
    from bcp_core.storage import local
    root = tmp_path / "root"
    bcp.save(str(root), {"w": torch.ones(4)}, step=1)
    real = local._fsync_dir

    def fsync_failing(step: int, metadata_in_place):
        """`_fsync_dir` failing (EIO) for step `step`'s directory while `metadata_in_place()`."""
        def fsync_dir(fd, shown):
            if shown.endswith(f"step_{step:08d}") and metadata_in_place():
                failures.append(shown)
                raise bcp.StorageError(f"fsync of directory {shown} failed: Input/output error")
            return real(fd, shown)
        return fsync_dir

    failures: list[str] = []
    meta = root / "step_00000002" / "bcp_metadata.json"
    monkeypatch.setattr(local, "_fsync_dir", fsync_failing(2, meta.exists))
    with pytest.raises(bcp.SaveError, match="Input/output error"):
        bcp.save(str(root), {"w": torch.full((4,), 2.0)}, step=2)
    monkeypatch.undo()
    assert not (root / "step_00000002" / "bcp_metadata.json").exists()
    with pytest.raises(bcp.IncompleteCheckpointError, match="its save failed"):
        bcp.load(str(root / "step_00000002"), {"w": torch.zeros(4)})
    from bcp_core import layout
    assert [e.name for e in layout.list_checkpoints(str(root)) if e.complete] == ["step_00000001"]
    # the same step saved again, failing so (once the new metadata is in place): the checkpoint it
    # was to replace is back, whole
    failures.clear()
    meta = root / "step_00000001" / "bcp_metadata.json"
    committed = meta.read_bytes()
    monkeypatch.setattr(local, "_fsync_dir", fsync_failing(1, lambda: not failures and meta.read_bytes() != committed))
    with pytest.raises(bcp.SaveError, match="Input/output error"):
        bcp.save(str(root), {"w": torch.full((4,), 3.0)}, step=1)
    monkeypatch.undo()
    target = {"w": torch.zeros(4)}
    bcp.load(str(root / "step_00000001"), target)
    assert failures and torch.equal(target["w"], torch.ones(4))


def test_a_damaged_checkpoint_is_replaced_by_a_save_to_its_path(tmp_path, monkeypatch):
    """A save into a directory whose metadata is garbage or larger than bcp reads (a sparse file of
    any size costs nothing to make): it commits all the same (the damaged checkpoint's files, unknown,
    are left to `bcp prune`)."""
    path = str(tmp_path / "c")
    for damage in ("garbage", "huge"):
        bcp.save(path, {"w": torch.ones(4)}, role=f"first-{damage}")  # another role: files of another token
        meta = os.path.join(path, "bcp_metadata.json")
        if damage == "garbage":
            with open(meta, "wb") as f:
                f.write(b"{not json")
        else:
            monkeypatch.setenv("BCP_MAX_METADATA_BYTES", str(1 << 20))
            os.truncate(meta, 2 << 20)
        bcp.save(path, {"w": torch.full((4,), 2.0)}, role=f"again-{damage}")
        target = {"w": torch.zeros(4)}
        bcp.load(path, target)
        assert torch.equal(target["w"], torch.full((4,), 2.0)), damage
        monkeypatch.delenv("BCP_MAX_METADATA_BYTES", raising=False)


@pytest.mark.timeout(60)
def test_a_write_that_writes_nothing_fails_the_save_instead_of_looping(tmp_path, monkeypatch):
    """`pwrite` returning 0 (never for a Linux file; a FUSE or network file system may): the save
    fails naming the write, where it used to retry the same call forever."""
    from bcp_core.storage import local_writer
    monkeypatch.setattr(local_writer.os, "pwrite", lambda fd, data, pos: 0)
    with pytest.raises(bcp.SaveError, match="wrote nothing"):
        bcp.save(str(tmp_path / "c"), {"w": torch.ones(1 << 16)})


def test_local_parallel_chunks(tmp_path, small_io):
    st = bst.storage_for(str(tmp_path))
    data = os.urandom(5 * PART + 3)
    w = st.open_writer("f")
    w.write(memoryview(b"head"))
    w.write(memoryview(data))  # 6 chunks written by parallel pwrite
    w.close()
    assert (tmp_path / "f").read_bytes() == b"head" + data
    out = bytearray(len(data))
    st.read_into("f", 4, memoryview(out))
    assert bytes(out) == data
    with pytest.raises(bcp.StorageError, match="truncated"):
        st.read_into("f", 10, memoryview(bytearray(len(data))))


def _direct_io_here(path) -> bool:
    """Whether the filesystem under `path` accepts O_DIRECT (ext4, xfs do; some tmpfs do not)."""
    if not hasattr(os, "O_DIRECT"):
        return False
    try:
        os.close(os.open(os.path.join(path, ".probe"), os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False


def _is_direct(fd: int) -> bool:
    import fcntl
    return bool(fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT)


@pytest.mark.parametrize("chunk", [4096, 10_000, PART])
def test_local_direct_writes_hold_every_byte(tmp_path, small_io, chunk):
    """Durable local files go around the page cache through aligned buffers: writes of any size at
    any offset (the aligned part now, the rest carried to the next write, the last block padded
    and the file cut to size) leave exactly the bytes written."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    bst.configure_storage(chunk_bytes=chunk)
    st = bst.storage_for(str(tmp_path))
    rng = torch.Generator().manual_seed(chunk)
    for case in range(12):
        sizes = torch.randint(0, 3 * PART, (int(torch.randint(0, 7, (1,), generator=rng)),), generator=rng)
        sizes = [int(n) for n in sizes] + [[0], [1], [4095], [4096], [4097], [8191, 1]][case % 6]
        w = st.open_writer(f"f{case}")
        assert w.direct and _is_direct(w.fd)
        want = bytearray()
        for n in sizes:
            data = os.urandom(n)
            w.write(memoryview(data))
            want += data
        w.close()
        assert (tmp_path / f"f{case}").read_bytes() == bytes(want), (case, sizes)


def test_direct_writes_take_large_buffers_in_place(tmp_path, small_io, monkeypatch):
    """write_in_place of a large buffer whose address agrees with the file position modulo ALIGN
    sends it to the device from the caller's memory: only its unaligned ends pass through the
    aligned buffers, and every byte lands, whatever was written before and after it (a plain
    `write` copies it all). A device refusing it (EINVAL) gets it buffered; a device error (ENOSPC)
    fails the file, and abort leaves nothing behind."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    import errno

    from bcp_core.storage import local_writer
    copied, real_copy = [], local_writer._copy
    monkeypatch.setattr(local_writer, "_copy", lambda dst, src: (copied.append(len(dst)), real_copy(dst, src)))
    st = bst.storage_for(str(tmp_path))
    big = np.random.default_rng(0).integers(0, 256, 3 * local_writer.IN_PLACE_BYTES, dtype=np.uint8)

    def aligned_slice(pos: int, n: int) -> memoryview:
        """n bytes of `big` whose address is `pos` modulo ALIGN."""
        start = (pos - big.ctypes.data) % local_writer.ALIGN
        return memoryview(big)[start:start + n]

    for head in (0, 5, local_writer.ALIGN + 100, 2 * PART + 7):  # bytes already in the file
        w = st.open_writer(f"f{head}")
        before = os.urandom(head)
        w.write(memoryview(before))
        data = aligned_slice(head, 2 * local_writer.IN_PLACE_BYTES + 777)
        assert w.can_write_in_place(data)
        assert not w.can_write_in_place(data[1:]) and not w.can_write_in_place(data[:local_writer.IN_PLACE_BYTES - 1])
        copied.clear()
        w.write_in_place(data)
        align = local_writer.ALIGN
        assert 0 < sum(copied) < 2 * align or (head % align == 0 and sum(copied) == 777), copied
        plain = aligned_slice(w.pos, local_writer.IN_PLACE_BYTES)
        copied.clear()
        w.write(plain)  # could go in place, but was not asked to
        assert sum(copied) == len(plain)
        w.write(memoryview(b"tail"))
        w.close()
        assert (tmp_path / f"f{head}").read_bytes() == before + bytes(data) + bytes(plain) + b"tail"

    real_pwrite = os.pwrite
    for err in (errno.EINVAL, errno.ENOSPC):
        def pwrite(fd, buf, pos, err=err):
            if len(buf) > local_writer.IN_PLACE_BYTES:  # the in-place write
                raise OSError(err, os.strerror(err))
            return real_pwrite(fd, buf, pos)
        monkeypatch.setattr(local_writer.os, "pwrite", pwrite)
        w = st.open_writer(f"e{err}")
        w.write(memoryview(b"head"))
        data = aligned_slice(4, 2 * local_writer.IN_PLACE_BYTES)
        if err == errno.EINVAL:
            w.write_in_place(data)
            w.close()
            assert not w.direct and (tmp_path / f"e{err}").read_bytes() == b"head" + bytes(data)
        else:
            with pytest.raises(OSError, match="No space left"):
                w.write_in_place(data)
            w.abort()
            assert not (tmp_path / f"e{err}").exists()
    monkeypatch.setattr(local_writer.os, "pwrite", real_pwrite)
    left = sorted(f.name for f in tmp_path.iterdir() if ".bcp-tmp." in f.name)
    assert not left, left  # the failed file's temporary is gone


def test_pages_shared_with_a_forked_process_are_not_written_in_place(tmp_path):
    """A page a forked process still shares copy-on-write would be copied by the kernel if pinned for
    a direct write from it: while a child shares a buffer's pages, can_write_in_place refuses them
    (the engine then writes them through the buffers); once the parent has written them again, in
    place. The bytes land either way."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    import multiprocessing as mp

    from bcp_core.storage import local_writer
    st = bst.storage_for(str(tmp_path))
    n = 2 * local_writer.IN_PLACE_BYTES
    big = np.random.default_rng(1).integers(0, 256, 2 * n + local_writer.ALIGN, dtype=np.uint8)
    start = -big.ctypes.data % local_writer.ALIGN  # agrees with file position 0
    first, second = memoryview(big)[start:start + n], memoryview(big)[start + n:start + 2 * n]
    w = st.open_writer("f")
    assert w.can_write_in_place(first)
    ctx = mp.get_context("fork")
    release = ctx.Event()
    child = ctx.Process(target=release.wait, args=(60,))
    child.start()
    try:
        assert not w.can_write_in_place(first)
        written = bytes(first)
        w.write(first)  # what the engine does then: through the buffers
        assert not w.can_write_in_place(second)  # still shared
        big[start + n:start + 2 * n] ^= 0xFF  # the parent writes these pages: its own copies now
        assert w.can_write_in_place(second)
        w.write_in_place(second)
    finally:
        release.set()
        child.join(30)
    w.close()
    assert (tmp_path / "f").read_bytes() == written + bytes(second)


def test_direct_io_falls_back_to_buffered_writes(tmp_path, small_io, monkeypatch):
    """A filesystem without direct I/O (EINVAL at open) or a device wanting another alignment
    (EINVAL at a write) gets buffered writes; no byte is lost. memory:// and
    `configure_storage(direct_io=False)` write buffered."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    import errno

    from bcp_core.storage import local_writer
    monkeypatch.setattr(local_writer, "IN_FLIGHT", 1)  # a write's error met by the next write, not only at close
    st = bst.storage_for(str(tmp_path))
    data = os.urandom(3 * PART + 5)

    def written(name, *, direct):
        w = st.open_writer(name)
        w.write(memoryview(b"header"))
        w.write(memoryview(data))
        assert w.direct is direct and _is_direct(w.fd) is direct
        w.close()
        assert (tmp_path / name).read_bytes() == b"header" + data

    real_pwrite = os.pwrite
    fails = []

    def pwrite(fd, buf, pos):
        if _is_direct(fd):
            fails.append(pos)
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_pwrite(fd, buf, pos)
    monkeypatch.setattr(local_writer.os, "pwrite", pwrite)
    written("einval_at_write", direct=False)
    assert fails  # direct was tried first
    w = st.open_writer("einval_at_close")  # under one block: the only direct write is at close
    w.write(memoryview(b"tiny"))
    w.close()
    assert (tmp_path / "einval_at_close").read_bytes() == b"tiny" and not w.direct
    monkeypatch.setattr(local_writer.os, "pwrite", real_pwrite)

    real_open = os.open

    def open_(path, flags, *a, **kw):
        if flags & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument", path)
        return real_open(path, flags, *a, **kw)
    monkeypatch.setattr(local_writer.os, "open", open_)
    written("einval_at_open", direct=False)
    monkeypatch.setattr(local_writer.os, "open", real_open)

    written("direct", direct=True)
    bst.configure_storage(direct_io=False)
    try:
        written("buffered", direct=False)
    finally:
        bst.configure_storage(direct_io=True)
    monkeypatch.setenv("BCP_MEMORY_DIR", str(tmp_path))
    mem = bst.storage_for("memory://job")
    mem.makedirs()
    w = mem.open_writer("x")  # memory:// lives in the page cache by design
    assert not w.direct
    w.abort()
    with pytest.raises(ValueError, match="direct_io"):
        bst.configure_storage(direct_io=1)


def _pwrite_failing_at_the_second_call(monkeypatch) -> list[int]:
    """The local writer's pwrite, failing with ENOSPC at its second call; the offsets it was called
    with (clear it to start counting again)."""
    import errno

    from bcp_core.storage import local_writer
    real_pwrite, calls = os.pwrite, []

    def pwrite(fd, buf, pos):
        calls.append(pos)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_pwrite(fd, buf, pos)
    monkeypatch.setattr(local_writer.os, "pwrite", pwrite)
    return calls


@pytest.mark.parametrize("in_flight", [1, 4])
def test_direct_write_failing_in_flight_fails_the_file(tmp_path, small_io, monkeypatch, in_flight):
    """Full aligned buffers are written by the writer's own threads (up to IN_FLIGHT at once) while
    the next one fills: a device error there (ENOSPC) is raised by a later write or by close, the
    temporary file is removed, and the aligned buffers go back to the pool."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    from bcp_core.storage import local_writer
    monkeypatch.setattr(local_writer, "IN_FLIGHT", in_flight)
    st = bst.storage_for(str(tmp_path))
    calls = _pwrite_failing_at_the_second_call(monkeypatch)
    for size in (4 * PART, 2 * PART + 7):  # the error met by a later write / only at close
        calls.clear()
        w = st.open_writer(f"f{size}")
        with pytest.raises(OSError, match="No space left"):
            for i in range(0, size, PART // 2):
                w.write(memoryview(os.urandom(min(PART // 2, size - i))))
            w.close()
        w.abort()  # what the engine does on any error; a second abort is harmless
        left = [f.name for f in tmp_path.iterdir() if f.name != ".probe"]
        assert not left, left
        assert w.inflight == [] and w.buf is None and w.pool is None
    assert len(local_writer._ALIGNED._free) <= local_writer._AlignedBuffers.KEEP


def test_failed_direct_write_leaves_nothing_behind_when_the_buffer_pool_is_full(tmp_path, small_io, monkeypatch):
    """The error of a write on the I/O thread keeps a view of its aligned buffer alive (its traceback)
    while the writer gives the buffer back: with the pool already full (other files gave theirs back
    meanwhile) the buffer must be dropped, not closed (BufferError), so that abort still closes the
    descriptors, ends the I/O thread and removes the temporary file."""
    if not _direct_io_here(tmp_path):
        pytest.skip(f"{tmp_path} has no O_DIRECT")
    import mmap

    from bcp_core.storage import local_writer
    monkeypatch.setattr(local_writer, "IN_FLIGHT", 1)  # the error met by the third write
    st = bst.storage_for(str(tmp_path))
    _pwrite_failing_at_the_second_call(monkeypatch)
    w = st.open_writer("f")
    with pytest.raises(OSError, match="No space left"):  # the engine aborts with the error still alive
        for _ in range(3):
            w.write(memoryview(os.urandom(PART)))
    for _ in range(local_writer._AlignedBuffers.KEEP):
        local_writer._ALIGNED.put(mmap.mmap(-1, local_writer._ALIGNED.size()))
    w.abort()
    assert w.fd is None and w.dir_fd is None and w.pool is None
    left = [f.name for f in tmp_path.iterdir() if f.name != ".probe"]
    assert not left, left


def test_write_after_close_or_abort_is_refused(tmp_path):
    """A direct-I/O writer takes a small write into its aligned buffer: after close or abort nothing
    would ever write it, so the write is refused instead of the bytes being dropped."""
    st = bst.storage_for(str(tmp_path))
    for end in ("close", "abort"):
        w = st.open_writer(f"f_{end}")
        w.write(memoryview(b"abc"))
        getattr(w, end)()
        with pytest.raises(bst.StorageError, match=f"f_{end} after it was closed or aborted"):
            w.write(memoryview(b"more"))
        assert w.buf is None and w.pool is None
    assert (tmp_path / "f_close").read_bytes() == b"abc" and not (tmp_path / "f_abort").exists()


def test_forked_child_shares_no_aligned_buffer_or_lock_with_its_parent():
    """A fork snapshot's child writes through aligned buffers of its own: the parent's are shared
    maps (the child's bytes would land in a buffer the parent fills too), and the pool's lock may be
    held by another thread of the parent at the fork."""
    import signal

    from bcp_core.storage import local_writer
    buf = local_writer._ALIGNED.get()
    buf[:5] = b"....."
    local_writer._ALIGNED.put(buf)
    held, release = threading.Event(), threading.Event()

    def hold():
        with local_writer._ALIGNED._lock:
            held.set()
            release.wait(30)
    t = threading.Thread(target=hold)
    t.start()
    try:
        assert held.wait(30)
        pid = os.fork()
        if pid == 0:  # the child: never returns
            code = 1
            try:
                signal.signal(signal.SIGALRM, signal.SIG_DFL)
                signal.alarm(10)  # a deadlock ends the child, not the test
                child = local_writer._ALIGNED.get()
                child[:5] = b"child"
                code = 0
            finally:
                os._exit(code)
    finally:
        release.set()
        t.join()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child could not take an aligned buffer"
    mine = local_writer._ALIGNED.get()
    try:
        assert mine is buf and bytes(mine[:5]) == b"....."
    finally:
        local_writer._ALIGNED.put(mine)


def test_retry_classification_and_messages(small_io):
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionResetError("connection reset by peer")
        return "ok"

    assert bst.with_retries("read", "s3://b/k", flaky) == "ok"
    assert bst.retry_stats()["retries"] == 2
    with pytest.raises(bcp.StorageError) as info:
        bst.with_retries("upload part 3 of", "s3://b/data/r1_0.safetensors", lambda: (_ for _ in ()).throw(
            PermissionError("Access Denied")))
    msg = str(info.value)
    assert "rank 0" in msg and "upload part 3 of s3://b/data/r1_0.safetensors" in msg and "permanent" in msg
    with pytest.raises(bcp.StorageError, match="after 5 attempts"):
        bst.with_retries("read", "x", lambda: (_ for _ in ()).throw(TimeoutError("timed out")))

    botocore = pytest.importorskip("botocore.exceptions")

    def client_error(status, code):
        return botocore.ClientError({"Error": {"Code": code}, "ResponseMetadata": {"HTTPStatusCode": status}}, "Op")

    assert bst.is_transient(client_error(503, "SlowDown"))
    assert bst.is_transient(client_error(500, "InternalError"))
    assert not bst.is_transient(client_error(403, "AccessDenied"))
    wrapped = OSError(5, "I/O error")
    wrapped.__cause__ = client_error(503, "ServiceUnavailable")  # how s3fs reports it
    assert bst.is_transient(wrapped)
    assert not bst.is_transient(FileNotFoundError("gone"))


class _FlakyMemory(bst.FsspecStorage):
    """A backend in one class: `flaky://` is fsspec's in-process memory filesystem whose every
    third ranged read and first metadata write fail with a connection error."""

    schemes = ("flaky",)

    def __init__(self, root, fsync=True, *, fs=None, upload=None):
        import fsspec
        super().__init__(root, fsync, fs=fs or fsspec.filesystem("memory"), upload=upload)
        self.fs = _FaultyFS(self.fs)

    def child(self, relpath):
        return type(self)(self.join(relpath), self.fsync, fs=self.fs.inner, upload=self.upload)


class _FaultyFS:
    count = {"cat": 0, "pipe": 0}

    def __init__(self, inner):
        self.inner = inner

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def cat_file(self, path, start=None, end=None):
        _FaultyFS.count["cat"] += 1
        if start is not None and _FaultyFS.count["cat"] % 3 == 0:
            raise ConnectionResetError("injected")
        return self.inner.cat_file(path, start=start, end=end)

    def pipe_file(self, path, data):
        _FaultyFS.count["pipe"] += 1
        if path.endswith("bcp_metadata.json") and _FaultyFS.count["pipe"] == 1:
            raise TimeoutError("injected")
        return self.inner.pipe_file(path, data)


def test_register_backend_in_one_class(small_io):
    bst.register_storage(_FlakyMemory)
    try:
        root = f"flaky://ckpt-{uuid.uuid4().hex[:8]}"
        state = _state(0, 5)
        bcp.save(root, state, step=5).wait()
        assert isinstance(bst.storage_for(root), _FlakyMemory)
        target = {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()}, "extra_state": {}}
        bcp.load(root, target)
        assert all(torch.equal(target["model"][k], v) for k, v in state["model"].items())
        assert bst.retry_stats()["retries"] >= 3
        bst.storage_for(root).remove("")
    finally:
        bst.base._REGISTRY.pop("flaky", None)


def test_configure_storage_rejects_unknown_and_bad_values():
    with pytest.raises(ValueError, match="unknown storage setting"):
        bst.configure_storage(part_size=1)
    with pytest.raises(ValueError, match=">= 1"):
        bst.configure_storage(part_bytes=0)
