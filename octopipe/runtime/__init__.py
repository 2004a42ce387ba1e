"""The runtime: runs RankPrograms over stage modules with torch.distributed (gloo on CPU, NCCL on GPU).

Imports nothing from passes/ or the search: a RankProgram and StageModules are all it needs.

    results = launch(worker, nprocs=2, args=(...))      # local processes; init_from_env() under torchrun
    engine = Engine(rank, world_size, stages, program, num_microbatches)
    loss = engine.step(inputs, target)                  # mean loss on every rank; .grad filled
"""

from octopipe.runtime.engine import (
    Engine,
    atomic_save,
    load_into_model,
    load_optimizer_state,
    merge_state_dicts,
    named_optimizer_state,
)
from octopipe.runtime.launch import init_from_env, launch
from octopipe.runtime.stage import BATCH, StageModule, TensorSource, TensorSpec, stage_links

__all__ = [
    "BATCH", "Engine", "StageModule", "TensorSource", "TensorSpec", "atomic_save", "init_from_env", "launch",
    "load_into_model", "load_optimizer_state", "merge_state_dicts", "named_optimizer_state", "stage_links",
]
