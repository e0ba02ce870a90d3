"""bcp_core.storage.faults: storage that fails on demand, the seam the fault tests go through."""

from __future__ import annotations

import errno
import os
import threading

import pytest
import torch

import bcp_core as bcp
from bcp_core.storage import FsspecStorage, LocalStorage, MemoryStorage, storage_for, write_all
from bcp_core.storage.faults import Fault, inject


def _full_disk(path: str = "*") -> Fault:
    return Fault("write", error=OSError(errno.ENOSPC, "No space left on device"), path=path)


def _write(st, name: str, data: bytes = b"abc") -> None:
    write_all(st.open_writer(name), [memoryview(data)])  # a failed write is aborted


def test_every_backend_is_a_faulty_subclass_of_itself_while_injected(tmp_path):
    pytest.importorskip("s3fs")
    backends = {str(tmp_path): LocalStorage, "memory://bcp-faults-test": MemoryStorage, "s3://bucket/x": FsspecStorage}
    with inject(_full_disk()):
        for path, cls in backends.items():
            st = storage_for(path)
            assert isinstance(st, cls) and type(st) is not cls and type(st).__name__ == f"Faulty{cls.__name__}"
            assert type(st.child("step")) is type(st)  # a step directory of a faulty root fails too
    for path, cls in backends.items():
        assert type(storage_for(path)) is cls


def test_a_fault_hits_its_operation_on_matching_paths_only(tmp_path):
    st = storage_for(str(tmp_path))
    with inject(_full_disk(path="*/full/*")):
        st = storage_for(str(tmp_path))
        st.makedirs("full")
        st.makedirs("free")
        _write(st, "free/a")                      # another path
        st.write_atomic("full/meta", b"x")        # another operation
        for _ in range(2):                        # every call, a fresh error each time
            with pytest.raises(OSError, match="No space left on device") as e:
                _write(st, "full/a")
            assert e.value.errno == errno.ENOSPC
    _write(st, "full/a")  # a storage made during the injection works once it is removed
    assert sorted(os.listdir(tmp_path / "full")) == ["a", "meta"] and os.listdir(tmp_path / "free") == ["a"]


def test_a_storage_made_before_the_injection_is_not_affected(tmp_path):
    before = storage_for(str(tmp_path))
    with inject(_full_disk()):
        _write(before, "a")
    assert (tmp_path / "a").read_bytes() == b"abc"


def test_hooks_see_every_call_with_its_path_bytes_and_offset(tmp_path):
    calls = []
    every = [Fault(op, hook=calls.append) for op in ("open_writer", "write", "close", "read_into", "read_bytes")]
    with inject(*every):
        st = storage_for(str(tmp_path))
        _write(st, "a", b"0123456789")
        out = bytearray(4)
        st.read_into("a", 3, memoryview(out))
        assert st.read_bytes("a") == b"0123456789"
    path = f"{tmp_path}/a"
    assert [(c.op, c.path, c.nbytes, c.offset) for c in calls] == [
        ("open_writer", path, None, None), ("write", path, 10, None), ("close", path, None, None),
        ("read_into", path, 4, 3), ("read_bytes", path, None, None)]
    assert out == b"3456"


def test_injections_overlap_and_the_plain_backends_return_after_the_last(tmp_path):
    first, second = inject(_full_disk(path="*/one")), inject(_full_disk(path="*/two"))
    try:
        first.remove()
        st = storage_for(str(tmp_path))
        _write(st, "one")
        with pytest.raises(OSError):
            _write(st, "two")
        assert type(storage_for(str(tmp_path))) is not LocalStorage
    finally:
        second.remove()
        second.remove()  # removing twice is harmless
    assert type(storage_for(str(tmp_path))) is LocalStorage


def test_a_save_through_an_injected_fault_fails_and_the_next_commits(tmp_path):
    """Through the public API, in place: an async save whose writes stall until released keeps
    its handle pending; a full disk fails the save; both leave the previous checkpoint latest."""
    state = {"w": torch.arange(4096.0)}
    bcp.save(str(tmp_path), state, step=1, role="seam").wait()
    entered, release = threading.Event(), threading.Event()

    def stall(call):
        entered.set()
        assert release.wait(60)
    with inject(Fault("write", hook=stall, path="*/step_00000002/data/*")):
        handle = bcp.save(str(tmp_path), state, step=2, async_save=True, role="seam")
        assert entered.wait(60) and not handle.done()
        release.set()
        handle.wait()
    with inject(_full_disk()), pytest.raises(bcp.SaveError, match="No space left on device"):
        bcp.save(str(tmp_path), state, step=3, role="seam")
    assert (tmp_path / "latest").read_text() == "step_00000002"
    assert not (tmp_path / "step_00000003" / "bcp_metadata.json").exists()


def test_bad_faults_are_refused_naming_what_is_wrong():
    with pytest.raises(ValueError, match="unknown storage operation 'wirte'"):
        Fault("wirte", error=OSError())
    with pytest.raises(ValueError, match="give an error to raise, a hook to run, or both"):
        Fault("write")
    with pytest.raises(ValueError, match="error must be an exception instance"):
        Fault("write", error=OSError)
    with pytest.raises(TypeError, match="inject\\(\\) takes Fault objects"):
        inject("write")
