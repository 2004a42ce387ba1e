"""Fixtures shared across the test tree."""

import importlib
from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def cpu_processes() -> Iterator[None]:
    """Local jobs of the tests run on CPU processes with gloo, also on a machine with GPUs (where
    `launch` would pick NCCL); the GPU tests ask for backend="nccl" themselves."""
    patch = pytest.MonkeyPatch()
    patch.setattr(importlib.import_module("octopipe.runtime.launch"), "default_backend", lambda nprocs: "gloo")
    yield
    patch.undo()


@pytest.fixture
def one_thread() -> Iterator[None]:
    """Run the test with one intra-op thread (as every rank does), then restore the count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
