"""The background checkpoint writer: a process of its own (`Engine.save_checkpoint(background=True)`).

A thread writing a shard beside training holds the interpreter's lock while it pickles and
competes with the training loop's Python for it; Megatron's `--async-save` writes from another
process for that reason, and so does this module. The training process copies the shard's tensors
once, into one shared-memory file (in /dev/shm where there is one), hands the writer that file's
name and the shard's structure (each tensor a `_Slot`: where it lies in the file), and goes on;
the writer maps the file, rebuilds the tensors (each its own, so the file written is what
`torch.save` of the shard would write), saves it atomically and answers; the training process
then removes the shared file.

The writer is started with `subprocess` (`python -c SERVE`), not
`multiprocessing`: the ranks `octopipe.runtime.launch` starts are daemonic processes, which may not
have multiprocessing children. Messages go through its stdin and stdout, each a pickle behind its
8-byte length. When the training process ends, the writer's stdin closes and it leaves.
"""

from __future__ import annotations

import os
import pickle
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, Any

import torch

ALIGN = 64
"""Each tensor's bytes start at a multiple of this in the shared file."""


@dataclass(frozen=True)
class _Slot:
    """Where a tensor lies in the shared file: its bytes' offset, dtype and shape."""

    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]


def _send(stream: IO[bytes], message: Any) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(struct.pack("<Q", len(data)))
    stream.write(data)
    stream.flush()


def _receive(stream: IO[bytes]) -> Any:
    """The next message, or None where the stream has ended."""
    head = stream.read(8)
    if len(head) < 8:
        return None
    (size,) = struct.unpack("<Q", head)
    return pickle.loads(stream.read(size))


def map_leaves(value: Any, kinds: type | tuple[type, ...], function: Callable[[Any], Any]) -> Any:
    """`value` with `function` applied to every instance of `kinds` in it (through dicts, lists
    and tuples); `Engine`'s checkpoint copies use it too."""
    if isinstance(value, kinds):
        return function(value)
    if isinstance(value, dict):
        return {k: map_leaves(v, kinds, function) for k, v in value.items()}
    if isinstance(value, list):
        return [map_leaves(v, kinds, function) for v in value]
    if isinstance(value, tuple):
        return tuple(map_leaves(v, kinds, function) for v in value)
    return value


def _tensors(value: Any) -> list[torch.Tensor]:
    found: list[torch.Tensor] = []
    map_leaves(value, torch.Tensor, found.append)
    return found


def _replace(value: Any, function: Callable[[Any], Any]) -> Any:
    return map_leaves(value, (torch.Tensor, _Slot), function)


def _flat(path: str, size: int) -> torch.Tensor:
    """The shared file as one uint8 tensor (created at `size` bytes where it is new)."""
    storage = torch.UntypedStorage.from_file(path, True, max(size, 1))
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _view(flat: torch.Tensor, slot: _Slot) -> torch.Tensor:
    size = torch.Size(slot.shape).numel() * torch.empty(0, dtype=slot.dtype).element_size()
    return flat[slot.offset:slot.offset + size].view(slot.dtype).view(slot.shape)


def _shared_folder() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


class ShardWriter:
    """One training process's writer (see the module doc): `submit` a shard, `wait` for it.

    The shared file is kept from save to save while it is large enough (its pages, once touched,
    cost nothing the next time), and has no name for long: the writer removes it as soon as it
    has mapped it, so nothing is left in /dev/shm when either process ends."""

    def __init__(self) -> None:
        self._process: subprocess.Popen[bytes] | None = None
        self._mapped_by: subprocess.Popen[bytes] | None = None
        """The writer process that maps `_flat` (a new writer needs a new file)."""
        self._flat: torch.Tensor | None = None
        self._created: str | None = None
        """A new shared file's name until the writer has mapped (and removed) it."""

    def start(self) -> None:
        """Start the writer process now, if it is not running (`submit` starts it otherwise)."""
        self._start()

    def _start(self) -> subprocess.Popen[bytes]:
        if self._process is None or self._process.poll() is not None:
            self._process = subprocess.Popen([sys.executable, "-c", SERVE], stdin=subprocess.PIPE,
                                             stdout=subprocess.PIPE)
        return self._process

    def submit(self, shard: Any, path: str) -> None:
        """Copy `shard`'s tensors (on any device) into a shared file and have the writer save the
        shard to `path` (atomically); returns once the copy is made."""
        tensors = _tensors(shard)
        slots: dict[int, _Slot] = {}
        offset = 0
        for tensor in tensors:
            if id(tensor) not in slots:
                slots[id(tensor)] = _Slot(offset, tensor.dtype, tuple(tensor.shape))
                offset += -(-tensor.numel() * tensor.element_size() // ALIGN) * ALIGN
        process = self._start()
        shared = None
        if self._flat is None or self._flat.numel() < offset or process is not self._mapped_by:
            shared = os.path.join(_shared_folder(), f"octopipe-save-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            self._flat, self._created, self._mapped_by = _flat(shared, offset), shared, process
        flat = self._flat
        for tensor in tensors:
            _view(flat, slots[id(tensor)]).copy_(tensor.detach())
        skeleton = _replace(shard, lambda tensor: slots[id(tensor)])
        assert process.stdin is not None
        _send(process.stdin, {"path": path, "shared": shared, "size": flat.numel(), "shard": skeleton})

    def wait(self) -> BaseException | None:
        """Wait for the shard `submit` handed over: None where it was written, else the error."""
        process = self._process
        try:
            assert process is not None and process.stdout is not None
            reply = _receive(process.stdout)
            if reply is None:
                self._flat = None
                return OSError(f"the checkpoint writer process ended (exit code {process.wait()}) before it wrote "
                               "the shard")
            if reply == "ok":
                return None
            self._flat = None  # (the writer may not have mapped it: the next save makes a new one)
            return OSError(reply)
        finally:
            if self._created is not None:  # (the writer removed it, unless it failed before)
                try:
                    os.remove(self._created)
                except OSError:
                    pass
                self._created = None

    def __del__(self) -> None:  # (dropped without close: the writer leaves once its stdin closes)
        process = getattr(self, "_process", None)
        if process is not None and process.poll() is None and process.stdin is not None:
            try:
                process.stdin.close()
            except OSError:
                pass

    def close(self) -> None:
        """End the writer (its stdin closed, it leaves) and drop the shared memory."""
        process, self._process = self._process, None
        self._flat = self._mapped_by = None
        if process is not None and process.poll() is None:
            assert process.stdin is not None
            process.stdin.close()
            process.wait()


def _rebuilt(skeleton: Any, flat: torch.Tensor) -> Any:
    """The shard: every `_Slot` of `skeleton` a tensor of its own, copied out of the shared file."""
    return _replace(skeleton, lambda slot: _view(flat, slot).clone())


def _serve(requests: IO[bytes], replies: IO[bytes]) -> None:
    from octopipe.runtime.engine import atomic_save

    torch.set_num_threads(1)
    flat = None
    while True:
        message = _receive(requests)
        if message is None:
            return
        try:
            if message["shared"] is not None:  # a new shared file: map it, and take its name away
                flat = None
                flat = _flat(message["shared"], message["size"])
                os.remove(message["shared"])
            assert flat is not None, "no shared file mapped"
            shard = _rebuilt(message["shard"], flat)
            os.makedirs(os.path.dirname(os.path.abspath(message["path"])), exist_ok=True)
            atomic_save(shard, message["path"])
            del shard
            _send(replies, "ok")
        except Exception as exc:  # noqa: BLE001 - the training process reports it at the commit
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else f"{type(exc).__name__}: {exc}"
            _send(replies, str(why))



SERVE = "import sys; from octopipe.runtime.writer import _serve; _serve(sys.stdin.buffer, sys.stdout.buffer)"
"""The writer process's program (this module imported by its name, so that the `_Slot`s it
receives are this module's class)."""
