"""Reference heterogeneous models in plain PyTorch, each in a `tiny` (CPU tests) and a `paper` size.

| name         | what makes it hard to pipeline                       | paper config follows    |
|--------------|------------------------------------------------------|-------------------------|
| llama        | nothing: the homogeneous reference                   | LLaMA-2-13B             |
| gemma        | 256K tied vocabulary, local/global attention         | Gemma-2-2B              |
| deepseek     | dense layer then MoE layers                          | DeepSeek-MoE-16B        |
| nemotron-h   | irregular Mamba-2 / MLP / attention pattern          | Nemotron-Nano-9B-v2     |
| multimodal   | ViT + projector feeding cross-attention deep in LLM  | LLaVA-1.5-7B-sized      |

Every model: forward takes tensors only (input_ids [batch, seq]; multimodal: pixel_values
[batch, 3, H, W] then input_ids) and returns logits [batch, seq, vocab]; top-level `embed`,
`layers` (ModuleList, one block = one pipeline layer), `norm`, `head` (multimodal adds `vision`
with `patch_embed`, `layers`, `norm`, and `projector`); traces with `torch.fx.symbolic_trace`;
builds and runs on the meta device; deterministic; per-sample, so microbatching is exact.

    model = build("gemma", size="tiny", num_layers=6)      # kwargs override config fields
    inputs = example_inputs("gemma", size="tiny", batch_size=4)
    loss = lm_loss(model(*inputs), example_target("gemma", size="tiny", batch_size=4))
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from octopipe.models.common import ModelConfig, ModelConfigError, init_module
from octopipe.models.deepseek import DeepSeekConfig, DeepSeekModel, MoE
from octopipe.models.gemma import GemmaConfig, GemmaModel
from octopipe.models.llama import LlamaConfig, LlamaModel
from octopipe.models.multimodal import MultimodalConfig, MultimodalModel
from octopipe.models.nemotron_h import Mamba2Mixer, NemotronHConfig, NemotronHModel

__all__ = [
    "MODEL_NAMES",
    "SIZES",
    "DeepSeekConfig",
    "GemmaConfig",
    "LlamaConfig",
    "Mamba2Mixer",
    "ModelConfigError",
    "MoE",
    "MultimodalConfig",
    "NemotronHConfig",
    "build",
    "config",
    "example_inputs",
    "example_target",
    "init_module",
    "lm_loss",
    "lm_tokens",
]

_FAMILIES: dict[str, tuple[type[ModelConfig], type[nn.Module]]] = {
    "llama": (LlamaConfig, LlamaModel),
    "gemma": (GemmaConfig, GemmaModel),
    "deepseek": (DeepSeekConfig, DeepSeekModel),
    "nemotron-h": (NemotronHConfig, NemotronHModel),
    "multimodal": (MultimodalConfig, MultimodalModel),
}
MODEL_NAMES: tuple[str, ...] = tuple(_FAMILIES)
SIZES: tuple[str, ...] = ("tiny", "paper")

# Fixed seeds make example data identical on every rank and every run.
_TOKEN_SEED = 1234
_PIXEL_SEED = 5678


def config(name: str, size: str = "tiny", **overrides: Any) -> Any:
    """The family's frozen config dataclass at `size`, with `overrides` applied."""
    if name not in _FAMILIES:
        raise ModelConfigError(f"unknown model {name!r}; known models: {', '.join(MODEL_NAMES)}")
    if size not in SIZES:
        raise ModelConfigError(f"unknown size {size!r} for {name}; sizes: {', '.join(SIZES)}")
    config_class = _FAMILIES[name][0]
    base = config_class.tiny() if size == "tiny" else config_class.paper()
    return base.replace(**overrides) if overrides else base


def build(name: str, size: str = "tiny", **overrides: Any) -> nn.Module:
    """A freshly initialized model (on the default device: use `torch.device("meta")` for paper).

    Initialization draws from torch's global RNG: call `torch.manual_seed` first for
    reproducible weights.
    """
    cfg = config(name, size, **overrides)
    return _FAMILIES[name][1](cfg)


def _tokens(cfg: Any, batch_size: int, seq_len: int | None) -> Tensor:
    """[batch, seq + 1] token ids on the CPU: inputs are [:, :-1], targets [:, 1:]."""
    length = cfg.max_seq_len if seq_len is None else seq_len
    if not 1 <= length <= cfg.max_seq_len:
        raise ModelConfigError(f"seq_len={length} must be in 1..max_seq_len={cfg.max_seq_len}; for longer sequences "
                               f"raise the model's max_seq_len (CLI: --set max_seq_len={max(length, 1)})")
    if batch_size < 1:
        raise ModelConfigError(f"batch_size={batch_size} must be >= 1")
    generator = torch.Generator(device="cpu").manual_seed(_TOKEN_SEED)
    return torch.randint(0, cfg.vocab_size, (batch_size, length + 1), generator=generator, device="cpu")


def example_inputs(
    name: str, size: str = "tiny", batch_size: int = 4, seq_len: int | None = None, **overrides: Any
) -> tuple[Tensor, ...]:
    """Deterministic model inputs on the default device (meta included).

    (input_ids,) for the language models, (pixel_values, input_ids) for multimodal. seq_len
    defaults to the config's max_seq_len; `overrides` must match the ones given to `build`.
    """
    cfg = config(name, size, **overrides)
    device = torch.get_default_device()
    input_ids = _tokens(cfg, batch_size, seq_len)[:, :-1].contiguous().to(device)
    if name != "multimodal":
        return (input_ids,)
    generator = torch.Generator(device="cpu").manual_seed(_PIXEL_SEED)
    shape = (batch_size, cfg.num_channels, cfg.image_size, cfg.image_size)
    pixel_values = torch.randn(shape, generator=generator, device="cpu").to(device)
    return (pixel_values, input_ids)


def example_target(
    name: str, size: str = "tiny", batch_size: int = 4, seq_len: int | None = None, **overrides: Any
) -> Tensor:
    """Next-token labels [batch, seq] (LongTensor) for `example_inputs` with the same arguments."""
    cfg = config(name, size, **overrides)
    return _tokens(cfg, batch_size, seq_len)[:, 1:].contiguous().to(torch.get_default_device())


def lm_loss(logits: Tensor, target: Tensor) -> Tensor:
    """Mean cross entropy over every token: logits [.., vocab], target [..] of class ids (those
    equal to -100, cross_entropy's ignore_index, are left out)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def lm_tokens(target: Tensor) -> Tensor:
    """The tokens `lm_loss` averages over (those not -100): its `compile(loss_weight=...)`, which
    makes a padded batch's pipelined loss the token mean of plain training."""
    return (target != -100).sum()
