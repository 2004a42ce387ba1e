"""Full backward vs zero-bubble B + W (passes/split_backward.py), per reference model, same run.

For each model: one fx GraphModule of the whole model with its loss; `full` = forward, then one
plain backward; `B+W` = forward, backward under a WeightGradStash (input gradients plus the
non-linear parameters' gradients), then the stash (linear weight gradients). Times are the backward
part only, median of `--repeats` after a warm-up, in the same process. Target: B+W <= 1.15x full.

    python benchmarks/split_backward.py [--repeats 15] [--threads 1] [--batch-size 2] [--scale small|tiny]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from octopipe import models
from octopipe.passes.split_backward import split_backward
from octopipe.passes.trace import trace
from octopipe.runtime.stage import WeightGradStash, deferred_weight_grads

# Big enough that matmuls, not Python, dominate on a CPU; the families' structure is kept.
SMALL = {
    "llama": dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768, max_seq_len=128,
                  vocab_size=2048),
    "gemma": dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768, max_seq_len=128,
                  vocab_size=4096, sliding_window=64),
    "deepseek": dict(hidden_size=256, num_heads=8, num_kv_heads=8, head_dim=32, intermediate_size=768, max_seq_len=128,
                     expert_hidden_size=192, vocab_size=2048),
    "nemotron-h": dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768,
                       max_seq_len=128, mamba_num_heads=8, mamba_head_dim=32, d_state=16, vocab_size=2048),
    "multimodal": dict(hidden_size=256, num_heads=8, num_kv_heads=4, head_dim=32, intermediate_size=768,
                       max_seq_len=128, vision_hidden_size=256, vision_num_heads=8, vision_intermediate_size=768,
                       image_size=64, patch_size=8, vocab_size=2048),
}


def measure(name: str, overrides: dict, batch_size: int, repeats: int) -> tuple[float, float, int, int]:
    torch.manual_seed(0)
    model = models.build(name, **overrides)
    inputs = models.example_inputs(name, batch_size=batch_size, **overrides)
    target = models.example_target(name, batch_size=batch_size, **overrides)
    graph = trace(model, inputs, loss_fn=models.lm_loss, example_target=target)
    plain = graph.module
    split, deferred = split_backward(plain)

    def full() -> float:
        loss = plain(*inputs, target)
        start = time.perf_counter()
        loss.backward()
        return time.perf_counter() - start

    def split_bw() -> float:
        loss = split(*inputs, target)
        stash = WeightGradStash()
        start = time.perf_counter()
        with deferred_weight_grads(stash):
            loss.backward()
        stash.run()
        return time.perf_counter() - start

    for fn in (full, split_bw, full, split_bw):  # warm-up
        fn()
    full_times, split_times = [], []
    for _ in range(repeats):  # interleaved, so drift hits both alike
        model.zero_grad(set_to_none=True)
        full_times.append(full())
        model.zero_grad(set_to_none=True)
        split_times.append(split_bw())
    params = sum(1 for _ in plain.parameters())
    return statistics.median(full_times), statistics.median(split_times), len(deferred), params


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--scale", choices=["small", "tiny"], default="small")
    parser.add_argument("--models", nargs="*", default=list(models.MODEL_NAMES))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"split backward on CPU, {args.threads} threads, batch {args.batch_size}, scale {args.scale}, "
          f"median of {args.repeats}")
    print(f"{'model':<12} {'full ms':>9} {'B+W ms':>9} {'ratio':>7} {'split params':>13}  verdict")
    for name in args.models:
        overrides = SMALL[name] if args.scale == "small" else {}
        full_s, split_s, deferred, params = measure(name, overrides, args.batch_size, args.repeats)
        ratio = split_s / full_s
        verdict = "ok" if ratio <= 1.15 else "OVER 1.15x"
        print(f"{name:<12} {full_s * 1e3:9.2f} {split_s * 1e3:9.2f} {ratio:7.3f} {deferred:>6}/{params:<6}  {verdict}")


if __name__ == "__main__":
    main()
