"""Megatron-LM's own training loop, `pretrain_gpt.py`, saving and resuming as its users run it, with
`--ckpt-format torch_dist` and `--ckpt-format bcp` (`enable_megatron_lm()`), on each Megatron-LM
release of $BCP_MEGATRON_LM (0.16.1, 0.17.1, 0.19.0 source trees; tests/megatron_releases.py).

Every launch is tests/jobs/megatron_lm_pretrain.py under torchrun: 2 ranks, gloo, fp32, a 2-layer GPT
(hidden 64, 4 heads, sequence 32) on `--mock-data`, 6 iterations of global batch 4, checkpoints every
3 iterations; the CPU stand-ins are recipes/_megatron_lm_cpu.py's. Losses are the ones Megatron
computed, recorded exactly by the launcher.

- slow tier, per release (`--ckpt-format bcp`, two launches; every test of this file is slow:
  the default tier must stay under 6 minutes and CI runs both): with the distributed
  optimizer, saving through the persistent async worker, fully parallel, a run resumed from the
  iteration-3 checkpoint of an uninterrupted run logs the same losses and writes the same
  iteration-6 checkpoint tensors, bit for bit.
- slow tier: the same with torch_dist, and with Megatron's plain optimizer saving synchronously;
  a bcp checkpoint resumed under `--ckpt-format torch_dist` and a torch_dist one under bcp;
  SIGTERM mid-run with `--exit-signal-handler` (checkpoint, exit, resume: bit for bit); TP=2 -> TP=1
  and PP=2 -> PP=1 with the distributed optimizer's fully reshardable layout (losses within 1e-4;
  PP=2 -> PP=1 fails with torch_dist, Megatron's own save of that layout being wrong: xfail).

Resumes start from a copy of the uninterrupted run's checkpoints with the tracker set back to
iteration 3 (a stopped run would write the same checkpoint: its iterations 1-3 are the same, bit for
bit), which saves a launch per case; SIGTERM's is a real stop.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import time
from dataclasses import dataclass

import pytest

import megatron_releases

megatron_releases.skip_without_megatron_core()  # its compiled dataset helpers serve every release

import torch  # noqa: E402

from dist import Job  # noqa: E402

# every test here launches whole Megatron-LM jobs (30-45 s a case): the slow tier runs them all, on
# every release (the default tier must stay under 6 minutes; CI runs both tiers)
pytestmark = pytest.mark.slow
RELEASES = megatron_releases.params(need_tree=True)
FORMATS = ("torch_dist", "bcp")
ITERATIONS, SAVE_INTERVAL = 6, 3
LAUNCH_TIMEOUT = 420  # seconds for one torchrun launch (about 20 s on an idle 2-core machine)
RESHARD_TOLERANCE = 1e-4

MODEL = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
    "--max-position-embeddings", "32", "--micro-batch-size", "2", "--global-batch-size", "4",
    "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "0",
    "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000", "--seed", "1234",
    "--attention-dropout", "0", "--hidden-dropout", "0", "--mock-data", "--tokenizer-type", "NullTokenizer",
    # 128 token ids with 0.16/0.17's tokenizer (127 + end of document), 127 with 0.19's: padded to 128
    # rows at TP=1 and TP=2 alike (padding to 128 x TP would change the model between the layouts, and
    # Megatron loads a padded embedding of another size without a word)
    "--vocab-size", "127", "--make-vocab-size-divisible-by", "64",
    # CPU: gloo, Megatron's own (non-Transformer-Engine) layers, no CUDA kernels
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--no-persist-layer-norm",
    "--use-cpu-initialization", "--no-gradient-accumulation-fusion", "--no-bias-gelu-fusion",
    "--no-bias-dropout-fusion", "--no-masked-softmax-fusion", "--no-rope-fusion",
]
DISTRIBUTED_OPTIMIZER = ["--use-distributed-optimizer"]
FULLY_RESHARDABLE = ["--use-distributed-optimizer", "--dist-ckpt-optim-fully-reshardable"]
ASYNC = ["--async-save", "--use-persistent-ckpt-worker", "--ckpt-fully-parallel-save", "--ckpt-fully-parallel-load"]


def async_flags(release: str) -> list[str]:
    """ASYNC, and from 0.17 on Megatron-core's own async strategy: the default, "nvrx", needs
    nvidia-resiliency-ext (a CUDA package)."""
    version = tuple(int(x) for x in release.split("."))
    return ASYNC + (["--async-strategy", "mcore"] if version >= (0, 17) else [])


@dataclass
class Run:
    losses: dict[int, float]  # iteration -> lm loss
    output: str
    returncode: int
    seconds: float


def pretrain(release: str, workdir: str, *flags: str, fmt: str = "torch_dist", sigterm_after: int | None = None,
             expect_rc: int | None = 0, enable_bcp: bool | None = None, ranks: int = 2, device: str = "cpu") -> Run:
    """One launch of Megatron-LM's pretrain_gpt.py on `ranks` ranks, saving to and loading from
    workdir/ckpt. sigterm_after=i: SIGTERM goes to torchrun once iteration i is logged (each logged
    iteration then waits a second, so the signal arrives mid-run). enable_bcp: whether the script
    calls enable_megatron_lm() (default: for --ckpt-format bcp only). device "cuda": Megatron-LM as
    it runs on GPUs (NCCL, no CPU stand-ins)."""
    ckpt = os.path.join(workdir, "ckpt")
    records = os.path.join(workdir, f"records_{time.monotonic_ns()}")
    launcher = ["--release", release, "--record", records, "--device", device]
    if fmt == "bcp" if enable_bcp is None else enable_bcp:
        launcher.append("--bcp")
    if sigterm_after is not None:
        launcher += ["--pause-at", str(sigterm_after)]
    model = [("nccl" if device == "cuda" and a == "gloo" else a) for a in MODEL]
    argv = [*model, "--train-iters", str(ITERATIONS), "--save", ckpt, "--load", ckpt,
            "--save-interval", str(SAVE_INTERVAL), "--ckpt-format", fmt, *flags]
    # TORCH_ELASTIC_SHUTDOWN_TIMEOUT: the grace torchrun gives its workers after a SIGTERM before it
    # kills them (30 s by default; a loaded machine may take longer to write the checkpoint)
    env = {"OMP_NUM_THREADS": "1", "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(LAUNCH_TIMEOUT)}
    if device == "cuda":  # cuBLAS's reductions in a fixed order: two launches compute the same bits
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    start = time.monotonic()
    job = Job("megatron_lm_pretrain.py", ranks, *launcher, "--", *argv, env=env)
    if sigterm_after is not None:
        def logged(text: str) -> bool:  # the lines written whole
            return any(json.loads(line)["iteration"] >= sigterm_after for line in text.split("\n")[:-1])
        job.wait_for(os.path.join(records, "losses_rank0.jsonl"), logged, timeout=LAUNCH_TIMEOUT)
        job.signal_paused(records, sigterm_after, signal.SIGTERM, line="megatron_lm_pretrain: received {}")
    rc = job.finish(timeout=LAUNCH_TIMEOUT)
    seconds = time.monotonic() - start
    if expect_rc is not None:
        assert rc == expect_rc, f"pretrain_gpt.py {release} {' '.join(flags)} exited {rc}:\n{job.output[-8000:]}"
    print(f"[{release} {fmt} {' '.join(flags)}] {seconds:.1f} s")
    return Run(_losses(records), job.output, rc, seconds)


def resumes_torch_dist(release: str, saved_fmt: str) -> None:
    """Skip, saying why, a resume from a checkpoint whose common.pt Megatron pickled itself where this
    Python's pickles of it cannot be loaded (megatron_releases.megatron_common_pt_unloadable)."""
    reason = megatron_releases.megatron_common_pt_unloadable(release) if saved_fmt == "torch_dist" else None
    if reason is not None:
        pytest.skip(reason)


def _losses(records: str) -> dict[int, float]:
    """iteration -> loss from every rank that logged one (DP ranks log the same reduced loss)."""
    losses: dict[int, float] = {}
    for path in sorted(glob.glob(os.path.join(records, "losses_rank*.jsonl"))):
        with open(path) as f:
            for line in f:
                entry = json.loads(line)
                it, loss = entry["iteration"], entry["lm loss"]
                assert losses.setdefault(it, loss) == loss, f"ranks logged different losses at iteration {it}"
    return losses


def backend(path: str) -> str:
    """The format dist_checkpointing's metadata.json names for a checkpoint directory (iter_<n>)."""
    with open(os.path.join(path, "metadata.json")) as f:
        return json.load(f)["sharded_backend"]


def checkpoint_tensors(path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint directory (iter_<n>), read in this process: with bcp's reader, or
    torch DCP's for torch_dist (the pickled values beside them need the release's own classes, so
    they are left out)."""
    if backend(path) == "bcp":
        from bcp_core.tools.read import open_checkpoint, read_tensor
        storage, metadata = open_checkpoint(path)
        return {key: read_tensor(storage, metadata, key) for key in metadata.tensors}
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    metadata = dcp.FileSystemReader(path).read_metadata()
    tensors = {key: torch.empty(meta.size, dtype=meta.properties.dtype)
               for key, meta in metadata.state_dict_metadata.items() if isinstance(meta, TensorStorageMetadata)}
    dcp.load(tensors, checkpoint_id=path, no_dist=True)
    return tensors


def assert_same_checkpoint(a: str, b: str, fmt: str, fmt_b: str | None = None) -> None:
    """Checkpoint directories a (in format `fmt`) and b (in `fmt_b`, default `fmt`) hold the same
    tensors, bit for bit."""
    fmt_b = fmt if fmt_b is None else fmt_b
    assert (backend(a), backend(b)) == (fmt, fmt_b), f"{a}: {backend(a)}, {b}: {backend(b)}, not {fmt}, {fmt_b}"
    ta, tb = checkpoint_tensors(a), checkpoint_tensors(b)
    assert ta.keys() == tb.keys(), f"tensors only in {a}: {sorted(ta.keys() - tb.keys())}; " \
                                   f"only in {b}: {sorted(tb.keys() - ta.keys())}"
    differ = [k for k in sorted(ta) if not torch.equal(ta[k], tb[k])]
    assert not differ, f"{len(differ)} of {len(ta)} tensors differ between {a} and {b}: {differ[:10]}"
    assert ta, f"no tensors in {a}"


def iteration_dir(workdir: str, iteration: int) -> str:
    return os.path.join(workdir, "ckpt", f"iter_{iteration:07d}")


def tracked_iteration(workdir: str) -> int:
    """The iteration Megatron-LM's tracker file names (the one a resuming run loads)."""
    with open(os.path.join(workdir, "ckpt", "latest_checkpointed_iteration.txt")) as f:
        return int(f.read().strip())


def resumed_at(run: Run, iteration: int) -> None:
    """The run resumed after `iteration`: it logged the iterations after it only."""
    assert run.losses, f"the resumed run logged no loss:\n{run.output[-4000:]}"
    assert min(run.losses) == iteration + 1, f"the resumed run logged iterations {sorted(run.losses)}, " \
                                             f"not from {iteration + 1}: it did not load iteration {iteration}"


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The uninterrupted 6-iteration run of (release, format, training flags), launched once per module."""
    runs: dict[tuple, tuple[Run, str]] = {}

    def get(release: str, fmt: str, *flags: str) -> tuple[Run, str]:
        key = (release, fmt, flags)
        if key not in runs:
            workdir = str(tmp_path_factory.mktemp(f"uninterrupted-{release}-{fmt}"))
            run = pretrain(release, workdir, *flags, fmt=fmt)
            assert sorted(run.losses) == list(range(1, ITERATIONS + 1)), run.output[-4000:]
            print(f"[{release} {fmt} {' '.join(flags)}] uninterrupted losses {run.losses}")
            runs[key] = run, workdir
        return runs[key]
    return get


def resume_from(ref_dir: str, workdir: str, iteration: int) -> None:
    """workdir/ckpt: ref_dir's checkpoints up to `iteration`, its tracker naming `iteration` (as a
    Megatron-LM user resumes from an earlier iteration): a run there resumes where ref_dir's run was
    after `iteration`, without a launch that stops there."""
    shutil.copytree(os.path.join(ref_dir, "ckpt"), os.path.join(workdir, "ckpt"),
                    ignore=lambda d, names: [n for n in names if n.startswith("iter_") and int(n[5:]) > iteration])
    with open(os.path.join(workdir, "ckpt", "latest_checkpointed_iteration.txt"), "w") as f:
        f.write(str(iteration))


# ----------------------------------------------------------------------------- bit-identical resume

@pytest.mark.timeout(1800)
@pytest.mark.parametrize("variant", ["distributed_optimizer_async", "optimizer_sync"])
@pytest.mark.parametrize("fmt", ["bcp", "torch_dist"])
@pytest.mark.parametrize("release", RELEASES)
def test_resume_is_bit_identical(release, fmt, variant, uninterrupted, tmp_path):
    """Resumed from the uninterrupted run's iteration-3 checkpoint: iterations 4-6 log the same losses
    and the iteration-6 checkpoint holds the same tensors, bit for bit. distributed_optimizer_async:
    the distributed optimizer; both runs save through the persistent async worker, fully parallel
    (the iteration-6 save is still being written when training ends, and the process exits after
    it), and load fully parallel. optimizer_sync: Megatron's plain optimizer, synchronous saves."""
    flags = [] if variant == "optimizer_sync" else [*DISTRIBUTED_OPTIMIZER, *async_flags(release)]
    resumes_torch_dist(release, fmt)
    reference, ref_dir = uninterrupted(release, fmt, *flags)
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    resumed = pretrain(release, workdir, *flags, fmt=fmt)
    resumed_at(resumed, SAVE_INTERVAL)
    assert resumed.losses == {i: reference.losses[i] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)}
    assert_same_checkpoint(iteration_dir(ref_dir, ITERATIONS), iteration_dir(workdir, ITERATIONS), fmt)


# ----------------------------------------------------------------------------- slow tier

@pytest.mark.timeout(1800)
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("release", RELEASES)
def test_sigterm_checkpoints_and_resumes(release, fmt, uninterrupted, tmp_path):
    """SIGTERM to torchrun after iteration 2 with `--exit-signal-handler` (Megatron's plain
    optimizer): Megatron-LM checkpoints the iteration it is in and exits; the resumed run goes on to
    iteration 6 with the uninterrupted run's losses and final checkpoint, bit for bit."""
    resumes_torch_dist(release, fmt)
    reference, ref_dir = uninterrupted(release, fmt)
    workdir = str(tmp_path)
    stopped = pretrain(release, workdir, "--exit-signal-handler", fmt=fmt, sigterm_after=2, expect_rc=None)
    assert "exiting program after receiving SIGTERM" in stopped.output, stopped.output[-6000:]
    last = tracked_iteration(workdir)
    print(f"[{release} {fmt}] SIGTERM after iteration 2: checkpoint of iteration {last}, torchrun exited "
          f"{stopped.returncode}")
    assert 2 <= last < ITERATIONS and max(stopped.losses) == last, (last, sorted(stopped.losses))
    assert stopped.losses == {i: reference.losses[i] for i in range(1, last + 1)}
    resumed = pretrain(release, workdir, "--exit-signal-handler", fmt=fmt)
    resumed_at(resumed, last)
    assert resumed.losses == {i: reference.losses[i] for i in range(last + 1, ITERATIONS + 1)}
    assert_same_checkpoint(iteration_dir(ref_dir, ITERATIONS), iteration_dir(workdir, ITERATIONS), fmt)


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("saved,resumed_fmt", [("bcp", "torch_dist"), ("torch_dist", "bcp")])
@pytest.mark.parametrize("release", RELEASES)
def test_resume_across_formats(release, saved, resumed_fmt, uninterrupted, tmp_path):
    """A run saved with one `--ckpt-format` resumes under the other (Megatron's plain optimizer,
    synchronous saves), the script calling enable_megatron_lm() either way: the iteration-3
    checkpoint loads, iterations 4-6 log the uninterrupted run's losses, and the iteration-6
    checkpoint, written in the new format, holds its tensors bit for bit."""
    resumes_torch_dist(release, saved)
    reference, ref_dir = uninterrupted(release, saved)
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    resumed = pretrain(release, workdir, fmt=resumed_fmt, enable_bcp=True)
    resumed_at(resumed, SAVE_INTERVAL)
    assert backend(iteration_dir(workdir, SAVE_INTERVAL)) == saved
    assert resumed.losses == {i: reference.losses[i] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)}
    assert_same_checkpoint(iteration_dir(ref_dir, ITERATIONS), iteration_dir(workdir, ITERATIONS), saved, resumed_fmt)


MEGATRON_FULLY_RESHARDABLE_DEFECT = (
    "Megatron's own save of the distributed optimizer's fully_reshardable layout cuts each parameter's state "
    "out of the DP-gathered buffer at its padded offset, the gather having dropped the padding between "
    "buckets: at PP=2 the tied embedding's state is saved shifted, and every resume reads it so "
    "(docs/megatron.md; bcp saves the layout gather-free)")


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("source,fmt", [
    pytest.param(["--tensor-model-parallel-size", "2"], "torch_dist", id="tp2_to_tp1-torch_dist"),
    pytest.param(["--tensor-model-parallel-size", "2"], "bcp", id="tp2_to_tp1-bcp"),
    pytest.param(["--pipeline-model-parallel-size", "2"], "torch_dist", id="pp2_to_pp1-torch_dist",
                 marks=pytest.mark.xfail(strict=True, reason=MEGATRON_FULLY_RESHARDABLE_DEFECT)),
    pytest.param(["--pipeline-model-parallel-size", "2"], "bcp", id="pp2_to_pp1-bcp"),
])
@pytest.mark.parametrize("release", RELEASES)
def test_reshard_on_resume(release, source, fmt, uninterrupted, tmp_path):
    """The iteration-3 checkpoint of a run at TP=2 (or PP=2), DP=1, resumed at TP=1, PP=1, DP=2, with
    the distributed optimizer's fully reshardable layout: iterations 4-6 within 1e-4 of the
    uninterrupted run at the source layout (pipeline stages are seeded apart, so PP=2 starts from
    other weights than PP=1)."""
    resumes_torch_dist(release, fmt)
    reference, ref_dir = uninterrupted(release, fmt, *FULLY_RESHARDABLE, *source)
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    resumed = pretrain(release, workdir, *FULLY_RESHARDABLE, fmt=fmt)
    resumed_at(resumed, SAVE_INTERVAL)
    report = {i: (resumed.losses[i], reference.losses[i]) for i in resumed.losses}
    print(f"[{release} {fmt} {' '.join(source)} -> 1] iteration: (resumed, uninterrupted) {report}")
    assert backend(iteration_dir(workdir, ITERATIONS)) == fmt
    for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1):
        assert abs(resumed.losses[i] - reference.losses[i]) <= RESHARD_TOLERANCE, (i, report)


# ----------------------------------------------------------------------------- mixture of experts at another EP

# a tiny MoE: 4 experts, top-2, aux-loss routing, alltoall dispatch (SequentialMLP; no grouped GEMM), the
# distributed optimizer fully reshardable; --disable-bias-linear: with expert biases Megatron's MLP adds its
# bias in place on a view, which autograd refuses on CPU
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--moe-token-dispatcher-type", "alltoall",
       "--moe-aux-loss-coeff", "0.01", "--disable-bias-linear", *FULLY_RESHARDABLE]
EP_CASES = {"ep2_to_ep2": (2, 2), "ep2_to_ep1": (2, 1), "ep1_to_ep2": (1, 2)}
MOE_RELEASES = megatron_releases.params(need_tree=True, releases=("0.16.1", "0.19.0"))
MOE_TOLERANCE = 1e-5  # relative


def ep(size: int) -> list[str]:
    return ["--expert-model-parallel-size", str(size)]


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(EP_CASES))
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("release", MOE_RELEASES)
def test_moe_resumes_at_another_expert_parallel_size(release, fmt, case, uninterrupted, tmp_path):
    """The iteration-3 checkpoint of a 2-rank MoE run at EP=2 (or EP=1), resumed by pretrain_gpt.py with only
    --expert-model-parallel-size changed, in a run that called enable_megatron_lm() (which regroups the
    loaded optimizer state for the run's chain of optimizers and ignores the RNG state across an EP change),
    with bcp and with torch_dist: at the same EP the resumed run logs the uninterrupted run's losses and
    writes its iteration-6 checkpoint bit for bit; at another EP its losses are within 1e-5 (relative) of the
    uninterrupted run's at the source EP."""
    resumes_torch_dist(release, fmt)
    saved, resumed_ep = EP_CASES[case]
    reference, ref_dir = uninterrupted(release, fmt, *MOE, *ep(saved))
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    resumed = pretrain(release, workdir, *MOE, *ep(resumed_ep), fmt=fmt, enable_bcp=True)
    resumed_at(resumed, SAVE_INTERVAL)
    diffs = {i: resumed.losses[i] - reference.losses[i] for i in resumed.losses}
    print(f"[{release} {fmt} {case}] iteration: resumed - uninterrupted loss {diffs}")
    assert backend(iteration_dir(workdir, ITERATIONS)) == fmt
    if saved == resumed_ep:
        assert resumed.losses == {i: reference.losses[i] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)}
        assert_same_checkpoint(iteration_dir(ref_dir, ITERATIONS), iteration_dir(workdir, ITERATIONS), fmt)
        return
    assert "RNG state will be ignored" in resumed.output
    for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1):
        assert abs(diffs[i]) <= MOE_TOLERANCE * abs(reference.losses[i]), (i, diffs)


# what Megatron-LM's own load of an EP=2 torch_dist checkpoint at EP=1 fails on, per release
ALONE_FAILURE = {"0.16.1": "rng_state", "0.19.0": "KeyError: 'optimizer'"}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("release", MOE_RELEASES)
def test_megatron_lm_alone_does_not_resume_at_another_expert_parallel_size(release, uninterrupted, tmp_path):
    """What enable_megatron_lm() mends: the same EP=2 -> EP=1 resume of a torch_dist checkpoint in a run that
    did not make the call fails in Megatron-LM's own load (0.16: the RNG state is sharded by DP rank at EP>1
    only; 0.19: the optimizer state of two chained optimizers handed to one, KeyError: 'optimizer')."""
    resumes_torch_dist(release, "torch_dist")
    _, ref_dir = uninterrupted(release, "torch_dist", *MOE, *ep(2))
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    run = pretrain(release, workdir, *MOE, *ep(1), fmt="torch_dist", enable_bcp=False, expect_rc=None)
    assert run.returncode != 0 and ALONE_FAILURE[release] in run.output, run.output[-4000:]


# ----------------------------------------------------------------------------- the recipe

@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("release", megatron_releases.params(need_tree=True, releases=("0.19.0",)))
def test_recipe_trains_at_tp2_and_resumes_at_tp1(release, tmp_path):
    """recipes/megatron_lm_pretrain.sh as the README runs it, on the newest release: both runs
    finish, the resumed run logs iterations 4-6 with the first run's gradient norms, and the two
    iteration-6 checkpoints agree within 1e-5 in every tensor."""
    import re
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = {**os.environ, **megatron_releases.env(release, need_tree=True), "PYTHON": sys.executable}
    done = subprocess.run(["bash", os.path.join(root, "recipes", "megatron_lm_pretrain.sh"),
                           megatron_releases.tree(release), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=2 * LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = {int(m[0]): m[1:] for m in re.findall(r"^(\d) \| (\S+) \| (\S+) \| (\S+) \| (\S+)$", done.stdout, re.M)}
    assert sorted(rows) == list(range(1, ITERATIONS + 1)), done.stdout
    assert all(rows[i][2:] == ("-", "-") for i in range(1, SAVE_INTERVAL + 1)), done.stdout
    assert all(rows[i][1] == rows[i][3] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)), done.stdout
    largest = float(re.search(r"largest difference (\S+)", done.stdout)[1])
    assert largest <= 1e-5, done.stdout


@pytest.mark.timeout(2 * LAUNCH_TIMEOUT + 60)
@pytest.mark.parametrize("release", megatron_releases.params(need_tree=True, releases=("0.16.1",)))
def test_recipe_resumes_a_moe_run_at_another_expert_parallel_size(release, tmp_path):
    """recipes/megatron_lm_moe_ep.sh as docs/megatron.md runs it: both runs finish, the resumed run at EP=1
    logs iterations 4-6 with the EP=2 run's gradient norms and iteration 4's loss (Megatron-LM's log line
    averages the losses logged since a load: its iteration 5 is the mean of 4 and 5), says it ignored the RNG
    state, and the two iteration-6 checkpoints agree within 1e-6 in every tensor."""
    import re
    import subprocess
    import sys
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = {**os.environ, **megatron_releases.env(release, need_tree=True), "PYTHON": sys.executable}
    done = subprocess.run(["bash", os.path.join(root, "recipes", "megatron_lm_moe_ep.sh"),
                           megatron_releases.tree(release), str(tmp_path)],
                          env=env, capture_output=True, text=True, timeout=2 * LAUNCH_TIMEOUT)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    rows = {int(m[0]): m[1:] for m in re.findall(r"^(\d) \| (\S+) \| (\S+) \| (\S+) \| (\S+)$", done.stdout, re.M)}
    assert sorted(rows) == list(range(1, ITERATIONS + 1)), done.stdout
    assert all(rows[i][2:] == ("-", "-") for i in range(1, SAVE_INTERVAL + 1)), done.stdout
    assert all(rows[i][1] == rows[i][3] for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1)), done.stdout
    assert rows[SAVE_INTERVAL + 1][0] == rows[SAVE_INTERVAL + 1][2], done.stdout
    assert "ignored the RNG state" in done.stdout
    assert float(re.search(r"largest difference (\S+)", done.stdout)[1]) <= 1e-6, done.stdout


LAYOUT_CASES = {
    "ep2_to_tp2ep1": (ep(2), ["--tensor-model-parallel-size", "2", "--sequence-parallel", *ep(1)]),
    "ep2_to_etp1": (ep(2), ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                            "--expert-tensor-parallel-size", "1", *ep(2)]),
    "ep2_to_pp2ep1": (ep(2), ["--pipeline-model-parallel-size", "2", *ep(1)]),
}


@pytest.mark.timeout(1800)
@pytest.mark.parametrize("case", list(LAYOUT_CASES))
@pytest.mark.parametrize("release", MOE_RELEASES)
def test_moe_resumes_at_another_tensor_or_pipeline_layout(release, case, uninterrupted, tmp_path):
    """The iteration-3 bcp checkpoint of the 2-rank MoE run at EP=2, TP=1 resumed by pretrain_gpt.py at TP=2
    (experts at EP=1 and ETP=2, or at EP=2 and ETP=1; sequence parallel, as Megatron asks of MoE with TP)
    or at PP=2 (EP=1): the run is at that layout, and its losses are within 1e-5 (relative) of the
    uninterrupted run's."""
    saved, resumed_flags = LAYOUT_CASES[case]
    reference, ref_dir = uninterrupted(release, "bcp", *MOE, *saved)
    workdir = str(tmp_path)
    resume_from(ref_dir, workdir, SAVE_INTERVAL)
    resumed = pretrain(release, workdir, *MOE, *resumed_flags, fmt="bcp", enable_bcp=True)
    resumed_at(resumed, SAVE_INTERVAL)
    sized = [f for f in resumed_flags if f != "--sequence-parallel"]
    for flag, size in zip(sized[::2], sized[1::2]):  # the run is at the layout asked for (Megatron-LM prints its args)
        name = flag.lstrip("-").replace("-", "_")
        assert re.search(rf"^\s*{name} \.+ {size}$", resumed.output, re.M), (name, size)
    diffs = {i: resumed.losses[i] - reference.losses[i] for i in resumed.losses}
    print(f"[{release} bcp {case}] iteration: resumed - uninterrupted loss {diffs}")
    for i in range(SAVE_INTERVAL + 1, ITERATIONS + 1):
        assert abs(diffs[i]) <= MOE_TOLERANCE * abs(reference.losses[i]), (i, diffs)
