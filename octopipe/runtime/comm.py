"""Point-to-point transport over torch.distributed (gloo on CPU, NCCL on GPU), with per-message timeouts.

Consumed by `runtime/engine.py`. A message is one or more tensors between two ranks; each tensor
is its own isend/irecv.

Tags (gloo matches a receive to a send by source rank and tag; NCCL ignores tags and matches by
order per rank pair): a tensor's tag packs (microbatch mod 512, producer stage mod 256, consumer
stage mod 256, kind act=0/grad=1, tensor index mod 32) into 31 bits, so within one iteration every
tensor in flight has its own tag up to 512 microbatches, 256 stages and 32 tensors per message.
Beyond that tags repeat, which is still correct: `lower` posts the receives from each peer in the
order the peer sends (both ranks of a pair issue their operations in one total order), and both
transports deliver messages of one tag in order.

Timeouts: every wait names the rank, the instruction and the peer, and gives up after `timeout_s`
with `ExecutionError` (gloo: `Work.wait(timeout)`; a dead peer's closed socket fails at once). On
NCCL, waits only order streams; the process group's own timeout (set by `launch`/`init_from_env`
to the same bound) ends a stalled collective, and the engine's host-side waits at `step` use it.

On CUDA, sends and receives are issued from a dedicated communication stream: a send first waits
for the compute stream (its data), a received buffer is handed to the compute stream with
`wait_stream` + `record_stream`, so transfers run beside compute without host synchronization.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from octopipe.errors import ExecutionError

KIND_ACT = 0
KIND_GRAD = 1


def tag(kind: int, producer: int, consumer: int, microbatch: int, index: int) -> int:
    """The 31-bit tag of tensor `index` of a message (see the module docstring)."""
    return ((((microbatch % 512) * 256 + producer % 256) * 256 + consumer % 256) * 2 + kind) * 32 + index % 32


class Pending:
    """Outstanding sends or receives of one message. `where` describes the instruction that
    started it (a string, or a callable making one: formatted only for an error)."""

    __slots__ = ("works", "tensors", "peer", "where")

    def __init__(self, works: list[Any], tensors: list[torch.Tensor], peer: int, where: str | Callable[[], str]) -> None:
        self.works = works
        self.tensors = tensors
        self.peer = peer
        self.where = where

    @property
    def what(self) -> str:
        return self.where if isinstance(self.where, str) else self.where()


class Transport:
    """isend / irecv / all-reduce / broadcast with bounded waits, for one rank."""

    def __init__(self, rank: int, world_size: int, device: torch.device, timeout_s: float = 60.0) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.timeout = timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None

    # -- point to point -------------------------------------------------------------------------
    def isend(self, tensors: list[torch.Tensor], peer: int, tags: list[int], what: str | Callable[[], str]) -> Pending:
        try:
            return self._isend(tensors, peer, tags, what)
        except RuntimeError as exc:  # the peer's connection is already gone when posting
            raise self.error(what if isinstance(what, str) else what(), peer, exc) from exc

    def _isend(self, tensors: list[torch.Tensor], peer: int, tags: list[int], what: str | Callable[[], str]) -> Pending:
        works = []
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for tensor, t in zip(tensors, tags):
                    tensor.record_stream(self.stream)
                    works.append(dist.isend(tensor, peer, tag=t))
        else:
            for tensor, t in zip(tensors, tags):
                works.append(dist.isend(tensor, peer, tag=t))
        return Pending(works, tensors, peer, what)

    def irecv(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], peer: int, tags: list[int],
              what: str | Callable[[], str]) -> Pending:
        """Post receives into fresh buffers of the given (shape, dtype); on CUDA they are
        allocated on the communication stream, so no pending compute kernel still uses the memory."""
        try:
            return self._irecv(specs, peer, tags, what)
        except RuntimeError as exc:
            raise self.error(what if isinstance(what, str) else what(), peer, exc) from exc

    def _irecv(self, specs: Sequence[tuple[tuple[int, ...], torch.dtype]], peer: int, tags: list[int],
               what: str | Callable[[], str]) -> Pending:
        works = []
        if self.stream is not None:
            with torch.cuda.stream(self.stream):
                buffers = [torch.empty(shape, dtype=dtype, device=self.device) for shape, dtype in specs]
                for buffer, t in zip(buffers, tags):
                    works.append(dist.irecv(buffer, peer, tag=t))
        else:
            buffers = [torch.empty(shape, dtype=dtype) for shape, dtype in specs]
            for buffer, t in zip(buffers, tags):
                works.append(dist.irecv(buffer, peer, tag=t))
        return Pending(works, buffers, peer, what)

    def wait(self, pending: Pending, waiter: str | Callable[[], str] = "") -> list[torch.Tensor]:
        """Block (CPU) or order the compute stream (CUDA) until the message is through; `waiter`
        names the instruction that needs it, for the error."""
        try:
            if self.stream is not None:
                for work in pending.works:
                    work.wait()
                compute = torch.cuda.current_stream(self.device)
                compute.wait_stream(self.stream)
                for tensor in pending.tensors:
                    tensor.record_stream(compute)
            else:
                for work in pending.works:
                    work.wait(self.timeout)
        except RuntimeError as exc:
            waiter = waiter if isinstance(waiter, str) else waiter()
            what = f"{waiter} waiting for {pending.what}" if waiter else pending.what
            raise self.error(what, pending.peer, exc) from exc
        return pending.tensors

    # -- collectives ------------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, what: str, group: Any = None) -> Any:
        """Start a sum all-reduce; finish it with `finish`."""
        return Pending([dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=group, async_op=True)], [tensor], -1, what)

    def reduce(self, tensor: torch.Tensor, dst: int, what: str, group: Any = None) -> Any:
        """Start a sum reduce of `tensor` onto global rank `dst` (elsewhere it ends partly summed);
        finish it with `finish`. Every rank of the group takes part, so a failure names none."""
        return Pending([dist.reduce(tensor, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True)], [tensor], -1,
                       what)

    def broadcast(self, tensor: torch.Tensor, src: int, what: str, group: Any = None) -> Any:
        """Start a broadcast of `tensor` from global rank `src`; finish it with `finish`."""
        return Pending([dist.broadcast(tensor, src=src, group=group, async_op=True)], [tensor], src, what)

    def finish(self, pending: Pending) -> None:
        try:
            for work in pending.works:
                if self.cuda:
                    work.wait()
                else:
                    work.wait(self.timeout)
        except RuntimeError as exc:
            raise self.error(pending.what, pending.peer, exc) from exc

    def error(self, what: str, peer: int, cause: BaseException) -> ExecutionError:
        text = str(cause).splitlines()[0] if str(cause) else type(cause).__name__
        who = f"rank {peer}" if peer >= 0 else "the other ranks"
        if "Timed out" in text or "timeout" in text.lower():
            reason = f"{who} did not answer within {self.timeout_s:g} s (stalled, or waiting on something else)"
        elif "closed" in text.lower() or "reset" in text.lower() or "broken pipe" in text.lower():
            reason = f"{who} went away ({'its' if peer >= 0 else 'a'} process died or closed the connection)"
        else:
            reason = f"communication with {who} failed"
        return ExecutionError(f"rank {self.rank}: {what}: {reason}: {text}")
