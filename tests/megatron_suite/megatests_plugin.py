"""pytest plugin: Megatron-LM's own dist_checkpointing unit tests on CPU/gloo, with torch_dist or bcp.

Loaded by run.sh (`-p megatests_plugin`) in every rank of a torchrun job, inside a patched copy of a
Megatron-LM tree (core_v0.16.1, core_v0.17.1, core_v0.19.0; README.md beside this). It changes no
test's logic, and does the same for both backends except where MEGATESTS_BACKEND=bcp says:

* CPU stand-ins: `torch.cuda.synchronize` is a no-op and `torch.cuda.current_device()` answers "cpu"
  (Megatron's torch_dist strategy and its async queue call them for CPU tensors), `Module.cuda()`
  leaves a module where it is; TransformerEngine is absent, so `is_te_min_version` answers False
  (Megatron's raises on `None >= Version`); the conftest's dataset download (no internet) fails at
  once. The 0.17+ trees also need tests/megatron_py311 (run.sh puts it on PYTHONPATH).
* MEGATESTS_BACKEND=bcp: bcp replaces torch_dist the way a Megatron-LM user gets it with
  `--ckpt-format bcp` (bcp_integrations.megatron.add_ckpt_format_choice parses that flag here), so
  every dist_checkpointing save whose strategy is torch_dist's (none given, a
  TorchDistSaveShardedStrategy, its fully parallel wrapper, ("torch_dist", 1)) writes bcp, and
  every load of a checkpoint whose metadata.json names bcp reads bcp. Test modules that call a
  strategy object's save/load themselves (not through dist_checkpointing) get bcp's strategies
  under the names TorchDistSaveShardedStrategy / TorchDistLoadShardedStrategy; `isinstance` against
  those names still means torch_dist's classes.
* Tests that need CUDA or TransformerEngine are skipped, by node-id substring (NEEDS_GPU below).
* After every test all ranks meet on torchrun's store, then tear down the default process group
  and Megatron's parallel state; the next test builds them afresh under a new store prefix (the
  tree's test_utilities.py is patched to use MEGATESTS_PG_GEN). So a failure on some ranks does not
  leave the others out of step for the rest of the file, and the gloo groups each test's
  `initialize_model_parallel` makes are released (Megatron's teardown only forgets them: on gloo
  each holds threads and sockets, 60 threads per rank per test at TP2 x PP4, thousands per file,
  which on a 2-core machine slowed later tests past their timeout). MEGATESTS_RESET=failed resets
  only after a failure, as Megatron's own runs on GPUs do not reset at all.
* Every call of the two backends' strategy save/async_save/load is counted per rank and written
  beside the JUnit XML (calls-rank<R>.json), so a run shows which backend actually wrote and read
  (summary.py prints the totals): a bcp run in which torch_dist still saved would be no test of bcp.
* The default process group is made at session start (pytest_sessionstart says why).
* JUnit XML per rank in MEGATESTS_JUNIT_DIR; per-rank --basetemp under MEGATESTS_TEMPROOT (the
  ranks share its tmp_dist_ckpt, as Megatron's fixture expects).
"""

import collections
import datetime
import functools
import json
import os
import time

import pytest
import torch

BACKEND = os.environ.get("MEGATESTS_BACKEND", "torch_dist")
if BACKEND not in ("torch_dist", "bcp"):
    raise pytest.UsageError(f"MEGATESTS_BACKEND must be torch_dist or bcp, not {BACKEND!r}")
RANK = os.environ.get("RANK", "0")

torch.cuda.synchronize = lambda *args, **kwargs: None
torch.cuda.current_device = lambda: "cpu"
if not torch.cuda.is_available():
    torch.nn.Module.cuda = lambda self, device=None: self

import megatron.core.utils as megatron_utils  # noqa: E402

if megatron_utils.get_te_version() is None:
    megatron_utils.is_te_min_version = lambda *args, **kwargs: False

try:  # imported by the unit tests' conftest at its import
    import tests.test_utils.python_scripts.download_unit_tests_dataset as _download

    def _no_download(*args, **kwargs):
        raise RuntimeError("megatests: this machine has no internet; the unit-test dataset is not downloaded")

    _download.download_and_extract_asset = _no_download
except ImportError as e:
    print(f"megatests: no dataset download module to stand in for ({e})")


class _BcpUnderTorchDistName(type):
    """A stand-in for a torch_dist strategy class in a test module: calling it builds bcp's strategy
    (the arguments are torch_dist's own options, which bcp has no use for); isinstance/issubclass
    checks still test torch_dist's class."""

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.torch_dist_class)

    def __subclasscheck__(cls, sub):
        return issubclass(sub, cls.torch_dist_class)

    def __call__(cls, *args, **kwargs):
        return cls.bcp_class()


STAND_INS = {}
if BACKEND == "bcp":
    import argparse

    from megatron.core.dist_checkpointing.strategies import torch as megatron_torch

    from bcp_integrations.megatron import (BcpLoadShardedStrategy, BcpSaveShardedStrategy, add_ckpt_format_choice,
                                           bcp_selected)

    _parser = argparse.ArgumentParser()
    _parser.add_argument("--ckpt-format", choices=["torch", "torch_dist"], default="torch_dist")
    assert add_ckpt_format_choice(_parser).parse_args(["--ckpt-format", "bcp"]).ckpt_format == "torch_dist"
    assert bcp_selected(), "--ckpt-format bcp did not select bcp"
    for _name, _torch_dist, _bcp in (
            ("TorchDistSaveShardedStrategy", megatron_torch.TorchDistSaveShardedStrategy, BcpSaveShardedStrategy),
            ("TorchDistLoadShardedStrategy", megatron_torch.TorchDistLoadShardedStrategy, BcpLoadShardedStrategy)):
        STAND_INS[_name] = _BcpUnderTorchDistName(_name, (), {"torch_dist_class": _torch_dist, "bcp_class": _bcp})

CALLS = collections.Counter()


def _count_calls(cls, method: str, label: str) -> None:
    original = getattr(cls, method)  # inherited in 0.16 (from the strategy base classes)

    @functools.wraps(original)
    def counted(*args, **kwargs):
        CALLS[label] += 1
        return original(*args, **kwargs)
    setattr(cls, method, counted)


def _count_backend_calls() -> None:
    from megatron.core.dist_checkpointing.strategies import torch as megatron_torch
    for method in ("save", "async_save"):
        _count_calls(megatron_torch.TorchDistSaveShardedStrategy, method, f"torch_dist.{method}")
    _count_calls(megatron_torch.TorchDistLoadShardedStrategy, "load", "torch_dist.load")
    if BACKEND != "bcp":
        return  # a torch_dist run does not import bcp at all
    from bcp_integrations.megatron import BcpLoadShardedStrategy, BcpSaveShardedStrategy
    for method in ("save", "async_save"):
        _count_calls(BcpSaveShardedStrategy, method, f"bcp.{method}")
    _count_calls(BcpLoadShardedStrategy, "load", "bcp.load")


_count_backend_calls()

# node-id substring -> why it is skipped, for both backends alike.
NEEDS_GPU = {
    "test_memory_usage": "measures torch.cuda.memory_allocated",
    "test_fp8.py": "FP8 tensors need TransformerEngine and CUDA",
    "test_stream_ckpt_dequant.py": "FP8/MXFP8/NVFP4 quantizers need TransformerEngine and CUDA",
    "test_mlp_glu.py::TestParallelMLPWithGLU::test_oom_is_handled": "uses torch.cuda memory counters",
    # FullyParallelLoadStrategyWrapper's exchange allocates its buffers on CUDA. (In the two
    # TestCrossRanksReads cases, the ranks that fail there first leave their TempNamedDir to its
    # weakref finalizer, which deletes the checkpoint under the ranks still reading it.)
    "test_fully_parallel.py::TestFullyParallelSaveAndLoad::test_load_distribution": "load exchange on CUDA",
    "test_fully_parallel.py::TestFullyParallelSaveAndLoad::test_only_necessary_exchanges_performed_during_load":
        "load exchange on CUDA",
    "test_fully_parallel.py::TestCrossRanksReads::test_full_dp_reads": "load exchange on CUDA",
    "test_fully_parallel.py::TestCrossRanksReads::test_cross_dp_access_does_not_disturb_the_distribution":
        "load exchange on CUDA",
    # model setup calls model_parallel_cuda_manual_seed (CUDA's RNG)
    "test_global_metadata_reuse.py": "GPT model setup seeds CUDA's RNG",
    "test_nonpersistent.py::TestLegacySaveAndLoad": "GPT model setup seeds CUDA's RNG",
}


def pytest_report_header(config):
    return f"megatests: backend {BACKEND}, CPU/gloo, rank {RANK}"


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config):
    junit_dir = os.environ.get("MEGATESTS_JUNIT_DIR")
    if junit_dir:
        os.makedirs(junit_dir, exist_ok=True)
        config.option.xmlpath = os.path.join(junit_dir, f"rank{RANK}.xml")
    temp_root = os.environ.get("MEGATESTS_TEMPROOT")
    if temp_root:
        # tmp_path_dist_ckpt is <basetemp>/../tmp_dist_ckpt: one folder shared by the ranks. Only
        # rank 0's fixture creates it, with no barrier: made here, no rank writes into it before.
        config.option.basetemp = os.path.join(temp_root, f"rank{RANK}")
        os.makedirs(os.path.join(temp_root, "tmp_dist_ckpt"), exist_ok=True)


def pytest_sessionstart(session):
    """The default process group exists from the start, as in Megatron's own runs of the whole
    suite, where earlier tests made it: tests that synchronise only when it exists (test_safe_globals
    writes a file on rank 0 that the others read) do not depend on which test ran before."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from tests.unit_tests.test_utilities import Utils
        Utils.initialize_distributed()


def pytest_unconfigure(config):
    junit_dir = os.environ.get("MEGATESTS_JUNIT_DIR")
    if junit_dir and os.path.isdir(junit_dir):
        with open(os.path.join(junit_dir, f"calls-rank{RANK}.json"), "w") as f:
            json.dump(dict(CALLS), f)


def pytest_collection_modifyitems(session, config, items):
    for item in items:
        for pattern, why in NEEDS_GPU.items():
            if pattern in item.nodeid:
                item.add_marker(pytest.mark.skip(reason=f"megatests: {why}"))
        module = getattr(item, "module", None)
        for name, stand_in in STAND_INS.items():
            if module is not None and getattr(module, name, None) is stand_in.torch_dist_class:
                setattr(module, name, stand_in)


# ---- ranks meet after every test --------------------------------------------------------------
_store = None
_tests_done = 0
MEET_TIMEOUT_S = int(os.environ.get("MEGATESTS_MEET_TIMEOUT", "900"))
RESET_AFTER_EVERY_TEST = os.environ.get("MEGATESTS_RESET", "every") != "failed"


def _meeting_store():
    global _store
    if _store is None and "MASTER_PORT" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from torch.distributed import PrefixStore, TCPStore

        client = TCPStore(os.environ.get("MASTER_ADDR", "localhost"), int(os.environ["MASTER_PORT"]),
                          int(os.environ["WORLD_SIZE"]), is_master=False,
                          timeout=datetime.timedelta(seconds=MEET_TIMEOUT_S))
        _store = PrefixStore("megatests_meet_" + os.environ.get("TORCHELASTIC_RUN_ID", ""), client)
    return _store


def pytest_runtest_logreport(report):
    """One line per test phase, written as it ends: a rank killed later (torchrun stops every rank
    when one exits) still leaves its record, where its JUnit XML, written at session end, is lost."""
    if report.failed:
        _FAILED.add(report.nodeid)
    junit_dir = os.environ.get("MEGATESTS_JUNIT_DIR")
    if not junit_dir or (report.when != "call" and not report.failed and not report.skipped):
        return
    message = ""
    if report.failed or report.skipped:
        message = str(report.longrepr.reprcrash.message if hasattr(report.longrepr, "reprcrash") and
                      report.longrepr.reprcrash else report.longrepr)[-400:]
    os.makedirs(junit_dir, exist_ok=True)
    with open(os.path.join(junit_dir, f"outcomes-rank{RANK}.jsonl"), "a") as f:
        f.write(json.dumps({"nodeid": report.nodeid, "when": report.when, "outcome": report.outcome,
                            "seconds": round(report.duration, 3), "threads": len(os.listdir("/proc/self/task")),
                            "message": message}) + "\n")


_FAILED = set()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _tests_done
    yield
    store = _meeting_store()
    if store is None:
        return
    _tests_done += 1
    key = f"test{_tests_done}"
    if item.nodeid in _FAILED:
        store.add(f"{key}/failed", 1)
    store.add(f"{key}/arrived", 1)
    world_size = int(os.environ["WORLD_SIZE"])
    start = time.monotonic()
    while store.add(f"{key}/arrived", 0) < world_size:
        if time.monotonic() - start > MEET_TIMEOUT_S:
            print(f"megatests: rank {RANK} waited {MEET_TIMEOUT_S} s for the other ranks after {item.nodeid}; "
                  "giving up", flush=True)
            os._exit(3)
        time.sleep(0.2)
    if RESET_AFTER_EVERY_TEST or store.add(f"{key}/failed", 0) > 0:
        _rebuild_distributed_next_time()


def _rebuild_distributed_next_time():
    """Every rank, at the same point: drop Megatron's parallel state and the default process group
    with all groups made on it, then make a default group again if there was one (some tests use
    the one an earlier test made). Megatron's model-parallel groups are made by the next test."""
    had_default_group = torch.distributed.is_initialized()
    try:
        import megatron.core.parallel_state as parallel_state
        parallel_state.destroy_model_parallel()
    except Exception as e:  # noqa: BLE001 - best effort after a failed test
        print(f"megatests: destroy_model_parallel: {e}")
    try:
        if had_default_group:
            torch.distributed.destroy_process_group()
    except Exception as e:  # noqa: BLE001
        print(f"megatests: destroy_process_group: {e}")
    os.environ["MEGATESTS_PG_GEN"] = str(int(os.environ.get("MEGATESTS_PG_GEN", "0")) + 1)
    from tests.unit_tests.test_utilities import Utils
    Utils.inited = False
    if had_default_group:
        Utils.initialize_distributed()
