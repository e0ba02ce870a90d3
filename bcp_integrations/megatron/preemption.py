"""Preemption for Megatron-core training loops: the last checkpoint, finalized, then exit.

Megatron-core has no training loop, so the loop asks bcp's `Preemption` at each iteration and, when
it says stop, schedules one more save and calls `exit_after_preemption`:

    preemption = bcp_core.handle_preemption()                 # SIGTERM handler, every rank
    queue = AsyncCallsQueue()
    for iteration in range(start, iterations):
        train_step()
        if preemption.stop_requested():                       # True on every rank at one iteration
            queue.schedule_async_request(dist_checkpointing.save(
                sharded_sd, ckpt_dir, sharded_strategy=("bcp", 1), async_sharded_save=True))
            exit_after_preemption(preemption, queue)          # finalize, then exit 143

(Megatron-LM has its own `--exit-signal-handler`, which saves at the next iteration and finalizes
the queue before exiting; with `--ckpt-format bcp` that save goes through bcp.)
"""

from __future__ import annotations

from typing import NoReturn

from bcp_core.preemption import Preemption


def exit_after_preemption(preemption: Preemption, async_calls_queue=None) -> NoReturn:
    """Finalize every save scheduled on `async_calls_queue`, then `preemption.exit()`.

    Finalizing (collective, as Megatron's queue always is) waits for bcp's commit of each save and
    then runs Megatron's own finalize functions: `metadata.json`, without which
    `dist_checkpointing.load` refuses the directory, and whatever the caller added to the
    requests (Megatron-LM's tracker file). `preemption.exit()` then waits for any other bcp save
    in flight and exits with 128 + the signal (143), or 1 if a save failed.
    """
    if async_calls_queue is not None:
        async_calls_queue.close()  # maybe_finalize_async_calls(blocking=True), then its workers stop
    preemption.exit()
