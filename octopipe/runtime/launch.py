"""Start a local multi-process job, or join one started by torchrun.

`launch(worker, nprocs, args)` is for one machine (tests, benchmarks, laptops): it starts `nprocs`
processes, initializes torch.distributed in each (gloo on CPU over 127.0.0.1, NCCL with one GPU per
process when there are enough GPUs), calls `worker(rank, world_size, *args)`, tears the process
group down and returns the workers' return values as a list indexed by rank. Any worker's exception,
crash or overrun of `timeout_s` ends the job: the parent kills the others and raises
`ExecutionError` naming the rank, with the worker's traceback text.

Start method: `fork` on Linux with a CPU-only build of torch (fast: workers inherit the parent's
imports and objects, so `worker` and `args` need not pickle), else `spawn` (then they must, and
they travel by value, as fork gives them; a compiled Pipeline pickles); see `fork_is_safe`.
Return values travel pickled by value (tensors included). CPU workers run with
`torch.set_num_threads(1)`: ranks already use the cores, and gloo runs transfers on its own threads.
The rendezvous store lives in rank 0 on a port the OS picked free just before: the parent runs no
server thread, so nothing can hold a lock across the fork.

`init_from_env()` is for real clusters under torchrun (env:// with RANK, WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, LOCAL_RANK set).
"""

from __future__ import annotations

import faulthandler
import multiprocessing
import os
import pickle
import queue as queue_module
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from octopipe.errors import ExecutionError
from octopipe.runtime.host_memory import keep_freed_host_memory

DEFAULT_TIMEOUT_S = 300.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def fork_is_safe() -> bool:
    """Whether forked workers can run torch: on Linux, with a CPU-only build of torch (a CUDA or
    ROCm build starts autograd's device threads at the parent's first backward, and a child forked
    after that cannot run backward at all), CUDA not initialized in the parent, nor a process group
    (a torchrun rank launching workers: a forked child would inherit its group and its threads)."""
    return (sys.platform.startswith("linux") and torch.version.cuda is None and torch.version.hip is None
            and not torch.cuda.is_initialized() and not dist.is_initialized())


def default_backend(nprocs: int) -> str:
    return "nccl" if torch.cuda.is_available() and torch.cuda.device_count() >= nprocs and dist.is_nccl_available() else "gloo"


def _child(rank: int, nprocs: int, port: int, backend: str, timeout_s: float,
           work: tuple[Callable[..., Any], Sequence[Any]] | bytes, results: Any, stack_file: str) -> None:
    try:
        worker, args = pickle.loads(work) if isinstance(work, bytes) else work
        # on a timeout the parent sends SIGUSR1 first: every thread's stack goes to stack_file
        stacks = open(stack_file, "w")  # noqa: SIM115 - lives as long as the process
        faulthandler.register(signal.SIGUSR1, file=stacks, all_threads=True)
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(nprocs), LOCAL_RANK=str(rank),
                          MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        if backend == "nccl":
            torch.cuda.set_device(rank)
        else:
            torch.set_num_threads(1)
            keep_freed_host_memory()
        store = dist.TCPStore("127.0.0.1", port, nprocs, is_master=rank == 0, wait_for_workers=False,
                              timeout=timedelta(seconds=timeout_s))
        dist.init_process_group(backend, store=store, rank=rank, world_size=nprocs, timeout=timedelta(seconds=timeout_s))
        try:
            value = worker(rank, nprocs, *args)
        finally:
            try:
                dist.destroy_process_group()
            except Exception:  # noqa: BLE001 - teardown after a failure must not mask it
                pass
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything goes back to the parent
        results.put((rank, "error", traceback.format_exc()))


def _terminated(signum: int, frame: Any) -> None:
    """`launch`'s SIGTERM handler: in the launching process, stop (its cleanup ends the ranks); in a
    forked rank that has not installed its own, end the rank (its parent reports it)."""
    if multiprocessing.parent_process() is None:
        print("octopipe: a SIGTERM arrived: stopping the local ranks", file=sys.stderr, flush=True)
    raise SystemExit(128 + signum)


def launch(
    worker: Callable[..., Any],
    nprocs: int,
    args: Sequence[Any] = (),
    timeout_s: float = DEFAULT_TIMEOUT_S,
    backend: str | None = None,
    start_method: str | None = None,
) -> list[Any]:
    """Run worker(rank, nprocs, *args) in nprocs processes; their return values, by rank."""
    if nprocs < 1:
        raise ExecutionError(f"launch needs nprocs >= 1, got {nprocs}")
    backend = backend or default_backend(nprocs)
    if start_method is None:
        start_method = "fork" if fork_is_safe() else "spawn"
    context = multiprocessing.get_context(start_method)
    port = _free_port()
    results = context.Queue()
    stack_dir = tempfile.mkdtemp(prefix="octopipe-launch-")
    stack_files = [os.path.join(stack_dir, f"rank{rank}.txt") for rank in range(nprocs)]
    work: tuple[Callable[..., Any], Sequence[Any]] | bytes = (worker, tuple(args))
    if start_method != "fork":
        # by value, as fork gives them: multiprocessing's own pickler would hand CPU tensors over in
        # shared memory, and the workers' training would change the caller's model
        limit = sys.getrecursionlimit()
        sys.setrecursionlimit(max(limit, 20_000))  # pickling recurses once per level of nested objects
        try:
            work = pickle.dumps(work)
        except Exception as exc:  # noqa: BLE001 - any pickling failure
            raise ExecutionError(f"launch: the worker and its args must pickle to start processes with "
                                 f"{start_method!r} (CUDA initialized, or a CUDA build of torch): {exc}; define the "
                                 "worker at module level and pass picklable args") from exc
        finally:
            sys.setrecursionlimit(limit)
    processes = [
        context.Process(target=_child, args=(rank, nprocs, port, backend, timeout_s, work, results, stack_files[rank]),
                        name=f"octopipe-rank{rank}", daemon=True)
        for rank in range(nprocs)
    ]
    # a SIGTERM to this process (a scheduler's, `timeout`'s) would end it at once and leave the
    # ranks running on their own: unless the caller catches it itself, it ends this process
    # through the cleanup below, which ends the ranks
    previous_handler = None
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) == signal.SIG_DFL:
        previous_handler = signal.signal(signal.SIGTERM, _terminated)
    try:
        for process in processes:
            process.start()
    except BaseException:
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
        raise
    values: dict[int, Any] = {}
    failures: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    grace_deadline: float | None = None
    try:
        while len(values) + len(failures) < nprocs:
            now = time.monotonic()
            if now > deadline or (grace_deadline is not None and now > grace_deadline):
                break
            try:
                rank, status, payload = results.get(timeout=0.05)
            except queue_module.Empty:
                for rank, process in enumerate(processes):
                    if rank not in values and rank not in failures and process.exitcode is not None:
                        # give its queued message a moment to arrive before calling it a crash
                        time.sleep(0.2)
                        try:
                            while True:
                                r, status, payload = results.get_nowait()
                                if status == "ok":
                                    values[r] = pickle.loads(payload)
                                else:
                                    failures[r] = payload
                        except queue_module.Empty:
                            pass
                        if rank not in values and rank not in failures:
                            failures[rank] = f"process exited with code {process.exitcode} without returning (crashed or killed)"
                if failures and grace_deadline is None:
                    grace_deadline = time.monotonic() + 5.0
                continue
            if status == "ok":
                values[rank] = pickle.loads(payload)
            else:
                failures[rank] = payload
                if grace_deadline is None:  # peers of a failed rank usually fail soon after; collect them briefly
                    grace_deadline = time.monotonic() + 5.0
    finally:
        if previous_handler is not None:  # (a second SIGTERM must not cut the cleanup short)
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        # only ranks that never reported are asked for their stacks: a rank that reported is
        # exiting, and faulthandler dumping a thread state the interpreter is tearing down
        # crashes the process ("Fatal Python error: Segmentation fault" in its stderr)
        stuck = [rank for rank, process in enumerate(processes)
                 if rank not in values and rank not in failures and process.is_alive()]
        for rank in stuck:
            try:
                os.kill(processes[rank].pid, signal.SIGUSR1)  # type: ignore[arg-type]
            except OSError:
                pass
        exiting_until = time.monotonic() + (0.5 if stuck else 5.0)
        for process in processes:  # let reported ranks finish exiting (and stuck ones write their stacks)
            process.join(max(0.0, exiting_until - time.monotonic()))
        for process in processes:
            if process.is_alive():
                process.kill()
        for process in processes:
            process.join(5)
        results.close()
        stacks = {}
        for rank in stuck:
            try:
                with open(stack_files[rank]) as handle:
                    stacks[rank] = handle.read()
            except OSError:
                pass
        for path in stack_files:
            if os.path.exists(path):
                os.remove(path)
        os.rmdir(stack_dir)
        if previous_handler is not None:
            signal.signal(signal.SIGTERM, previous_handler)
    if failures:
        # report the root cause: a rank that failed on its own, not one that lost its peer
        echoes = ("Connection closed by peer", "Connection reset by peer", "Timed out", "went away", "did not answer")
        causes = [rank for rank in sorted(failures) if not any(echo in failures[rank] for echo in echoes)]
        first = causes[0] if causes else min(failures)
        others = sorted(set(failures) - {first})
        also = f" (ranks {others} failed too)" if others else ""
        raise ExecutionError(f"worker rank {first} of {nprocs} failed{also}:\n{failures[first]}")
    missing = [rank for rank in range(nprocs) if rank not in values]
    if missing:
        where = "".join(f"\n--- rank {rank} stacks ---\n{stacks[rank].strip()}" for rank in missing if stacks.get(rank))
        raise ExecutionError(f"worker rank(s) {missing} of {nprocs} did not finish within timeout_s={timeout_s:g} s "
                             f"(hung, or waiting on a peer); they were killed{where}")
    return [values[rank] for rank in range(nprocs)]


def init_from_env(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> tuple[int, int]:
    """Join the job torchrun started (env://): returns (rank, world_size)."""
    for key in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        if key not in os.environ:
            raise ExecutionError(f"init_from_env needs {key} in the environment (run under torchrun), or use launch()")
    world_size = int(os.environ["WORLD_SIZE"])
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if backend is None:
        backend = "nccl" if torch.cuda.is_available() and dist.is_nccl_available() else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local_rank)
    else:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))))
        keep_freed_host_memory()
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s))
    return dist.get_rank(), world_size
