"""trace: reference models and Hugging Face models -> LayerGraph; grouping rules, fidelity, errors."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from octopipe import LayerGraph, TraceError
from octopipe.models import MODEL_NAMES, build, config, example_inputs, example_target, lm_loss
from octopipe.passes.trace import trace

pytestmark = pytest.mark.usefixtures("one_thread")


def tiny(name: str):
    torch.manual_seed(0)
    model = build(name, "tiny")
    return model, example_inputs(name, "tiny", batch_size=2), example_target(name, "tiny", batch_size=2)


def check_graph(graph: LayerGraph, model: nn.Module) -> None:
    """The invariants every traced graph keeps."""
    gm = graph.module
    nodes = list(gm.graph.nodes)
    owner = graph.layer_of_node()
    # every node but the placeholders is in exactly one layer
    members = [name for layer in graph.layers for name in layer.nodes]
    assert len(members) == len(set(members))
    assert set(members) == {n.name for n in nodes if n.op != "placeholder"}
    assert [n.name for n in nodes if n.op == "placeholder"] == list(graph.inputs)
    # layers are contiguous and in order in the graph
    sequence = [owner[n.name] for n in nodes if n.op != "placeholder"]
    assert sequence == sorted(sequence)
    assert [layer.index for layer in graph.layers] == list(range(len(graph)))
    # every edge goes forward, and every cross-layer use is an edge
    edges = {edge.name: edge for edge in graph.edges}
    for edge in graph.edges:
        assert all(consumer > edge.producer for consumer in edge.consumers), edge
    for node in nodes:
        for user in node.users:
            if node.op == "placeholder":
                assert owner[user.name] in edges[node.name].consumers
            elif owner[user.name] != owner[node.name]:
                assert owner[user.name] in edges[node.name].consumers
    # parameters are the model's own, under their original names
    named = dict(model.named_parameters(remove_duplicate=False))
    for node in nodes:
        if node.op == "get_attr" and isinstance(parameter_or_none(gm, node.target), nn.Parameter):
            assert parameter_or_none(gm, node.target) is named[node.target]
    canonical = dict(model.named_parameters())
    for layer in graph.layers:
        assert set(layer.parameters) <= set(canonical)
        assert layer.num_params == sum(canonical[p].numel() for p in layer.parameters)
    modules = dict(model.named_modules())
    for node in nodes:
        if node.op == "call_module" and node.target in modules:
            assert gm.get_submodule(node.target) is modules[node.target]
    # the text form round-trips
    assert LayerGraph.parse(str(graph)) == graph


def parameter_or_none(module: nn.Module, target: str) -> nn.Parameter | None:
    try:
        return module.get_parameter(target)
    except AttributeError:
        return None


def expected_names(name: str) -> list[str]:
    cfg = config(name, "tiny")
    names = [f"layers.{i}" for i in range(cfg.num_layers)]
    if name == "multimodal":
        vision = [f"vision.layers.{i}" for i in range(cfg.vision_num_layers)]
        return ["vision.patch_embed", *vision, "vision.norm", "projector", "embed", *names, "norm", "head", "loss"]
    return ["embed", *names, "norm", "head", "loss"]


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_reference_models_trace_into_cuttable_layers(name):
    model, inputs, target = tiny(name)
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target)
    assert graph.method == "fx"
    assert [layer.name for layer in graph.layers] == expected_names(name)
    kinds = {layer.name: layer.kind for layer in graph.layers}
    assert kinds["embed"] == "embedding" and kinds["norm"] == "norm" and kinds["head"] == "head"
    assert kinds["loss"] == "loss" and kinds["layers.0"] == "block"
    assert graph.inputs[-1] == "target"
    check_graph(graph, model)
    # the traced module computes what the model computes
    torch.testing.assert_close(graph.module(*inputs, target), lm_loss(model(*inputs), target))
    # edges carry the example's shapes: the hidden state between blocks is [batch, seq, hidden]
    cfg = config(name, "tiny")
    into_block = [e for e in graph.edges if e.producer >= 0 and graph.layers[e.producer].name == "layers.0"]
    assert into_block and into_block[0].shape == (2, cfg.max_seq_len, cfg.hidden_size)
    assert into_block[0].dtype == "float32"


def test_trace_without_loss_returns_the_model_output():
    model, inputs, _ = tiny("llama")
    graph = trace(model, inputs)
    assert graph.layers[-1].name == "head" and graph.inputs == ("input_ids",)
    torch.testing.assert_close(graph.module(*inputs), model(*inputs))


def test_tied_embedding_and_head_share_one_parameter():
    model, inputs, target = tiny("gemma")
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target)
    embed, head = graph.layers[0], graph.layers[-2]
    assert embed.parameters == head.parameters == ("embed.weight",)
    assert [(s.name, s.layers) for s in graph.shared] == [("embed.weight", (embed.index, head.index))]
    # one get_attr per reading layer: the weight never travels as an activation
    assert "embed.weight" not in {edge.name for edge in graph.edges}


def test_vision_features_are_a_skip_edge_into_the_cross_attention_blocks():
    model, inputs, target = tiny("multimodal")
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target)
    projector = next(layer.index for layer in graph.layers if layer.name == "projector")
    (edge,) = [e for e in graph.edges if e.producer == projector]
    consumers = [graph.layers[i].name for i in edge.consumers]
    assert consumers == ["layers.1", "layers.3"]
    assert edge.is_skip and edge in graph.skip_edges
    assert [layer.kind for layer in graph.layers[:3]] == ["embedding", "vision_block", "vision_block"]
    assert graph.layers[projector].kind == "projector"


def test_export_method_gives_the_same_layers():
    model, inputs, target = tiny("deepseek")
    fx_graph = trace(model, inputs, loss_fn=lm_loss, example_target=target)
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target, method="export")
    assert graph.method == "export"
    assert [layer.name for layer in graph.layers] == [layer.name for layer in fx_graph.layers]
    assert [layer.parameters for layer in graph.layers] == [layer.parameters for layer in fx_graph.layers]
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(*inputs, target), lm_loss(model(*inputs), target))


# ---------------------------------------------------------------------------- split points, leaves, merges


def test_split_point_inside_a_block_cuts_it_before_the_module():
    model, inputs, target = tiny("llama")
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target, split_points=("layers.1.mlp", "layers.3"))
    names = [layer.name for layer in graph.layers]
    assert names[names.index("layers.1") : names.index("layers.1") + 3] == ["layers.1", "layers.1.mlp", "layers.2"]
    first, second = graph.layers[names.index("layers.1")], graph.layers[names.index("layers.1.mlp")]
    assert "layers.1.mlp_norm.weight" in first.parameters  # the norm runs before the mlp
    assert "layers.1.mlp.down_proj.weight" in second.parameters
    # the residual stream and the normed input both cross the new boundary
    assert len([e for e in graph.edges if e.producer == first.index]) == 2
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(*inputs, target), lm_loss(model(*inputs), target))


def test_unknown_split_point_and_leaf_are_clear_errors():
    model, inputs, _ = tiny("llama")
    with pytest.raises(
        TraceError, match=r"split point 'layers.1.mpl' is not a module of the model; did you mean 'layers.1.mlp'"
    ):
        trace(model, inputs, split_points=("layers.1.mpl",))
    with pytest.raises(
        TraceError, match=r"leaf module 'layer.0' is not a module of the model; did you mean 'layers.0'"
    ):
        trace(model, inputs, leaf_modules=("layer.0",))


def test_leaf_modules_stay_one_call():
    from octopipe.models.common import GatedMLP

    model, inputs, target = tiny("llama")
    graph = trace(model, inputs, loss_fn=lm_loss, example_target=target, leaf_modules=("layers.0", GatedMLP))
    calls = {n.target for n in graph.module.graph.nodes if n.op == "call_module"}
    assert "layers.0" in calls and "layers.1.mlp" in calls
    assert graph.layers[1].name == "layers.0" and graph.layers[1].num_params == graph.layers[2].num_params
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(*inputs, target), lm_loss(model(*inputs), target))


class Twice(nn.Module):
    """Calls `shared` before and after `middle`: the two cannot be separate layers."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.shared = nn.Linear(8, 8)
        self.middle = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        x = self.embed(ids)
        x = self.shared(x)
        x = self.middle(x)
        x = self.shared(x)
        return self.head(x)


def test_mutually_dependent_modules_are_merged_not_given_a_backward_edge():
    torch.manual_seed(0)
    model, ids = Twice(), torch.randint(0, 16, (2, 5))
    graph = trace(model, (ids,))
    assert [layer.name for layer in graph.layers] == ["embed", "shared+middle", "head"]
    assert graph.layers[1].modules == ("shared", "middle")
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(ids), model(ids))
    with pytest.raises(TraceError, match=r"cannot put a layer boundary before 'middle'.*merged with 'shared'"):
        trace(model, (ids,), split_points=("middle",))


class Loose(nn.Module):
    """Work between modules at the top level: a mask from the inputs, a residual, a scale."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList([nn.Linear(8, 8), nn.Linear(8, 8)])
        self.head = nn.Linear(8, 16)

    def forward(self, ids):
        mask = (ids > 3).unsqueeze(-1).float()  # depends on inputs only
        x = self.embed(ids)
        for layer in self.layers:
            x = x + layer(x) * mask  # residual + masking between modules
        return self.head(x * 0.5)


def test_code_between_modules_joins_its_latest_producer_or_first_consumer():
    torch.manual_seed(0)
    model, ids = Loose(), torch.randint(0, 16, (2, 5))
    graph = trace(model, (ids,))
    assert [layer.name for layer in graph.layers] == ["embed", "layers.0", "layers.1", "head"]
    node_layer = graph.layer_of_node()
    ops = {n.name: n for n in graph.module.graph.nodes}
    mask_nodes = [name for name in ops if name.startswith(("gt", "unsqueeze", "float"))]
    assert {node_layer[name] for name in mask_nodes} == {1}  # computed where first needed
    mask_edge = next(e for e in graph.edges if e.name == "float_1")
    assert mask_edge.producer == 1 and mask_edge.consumers == (2,)
    scale = next(n for n in ops.values() if n.op == "call_function" and n.args and n.args[-1] == 0.5)
    assert node_layer[scale.name] == 2  # goes with the layer that produced its input
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(ids), model(ids))


# ---------------------------------------------------------------------------- errors


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x):
        if x.sum() > 0:  # data-dependent control flow: neither fx nor export can follow it
            return self.proj(x)
        return x


class BranchyModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.layers = nn.ModuleList([Branchy(), Branchy()])
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_untraceable_model_raises_one_clear_trace_error(capfd):
    torch.manual_seed(0)
    model, x = BranchyModel(), torch.randn(2, 4)
    with pytest.raises(TraceError) as info:
        trace(model, (x,))
    message = str(info.value)
    assert "cannot trace BranchyModel: neither torch.fx nor torch.export could trace it" in message
    assert "torch.fx failed in module 'layers.0' (Branchy) at test_trace.py" in message
    assert "torch.export failed in module 'layers.0' (Branchy)" in message
    assert "`if x.sum() > 0:" in message
    assert "leaf_modules=('layers.0',)" in message and "torch.where" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__
    assert len(info.value.causes) == 2  # the tracers' own errors, kept for debugging
    assert "def forward" not in capfd.readouterr().err  # torch.export's partial graph dump is not shown

    with pytest.raises(TraceError, match=r"torch.fx could not trace it(.|\n)*pass method='export'"):
        trace(model, (x,), method="fx")
    # the suggested fix works: a leaf module runs as one call on real tensors
    graph = trace(model, (x,), leaf_modules=("layers.0", "layers.1"))
    torch.testing.assert_close(graph.module(x), model(x))


def test_shape_propagation_failure_names_the_node_and_layer():
    with torch.device("meta"):
        model, x = BranchyModel(), torch.randn(2, 4)
    with pytest.raises(
        TraceError, match=r"shape propagation failed at node 'layers_0' \(call_module layers.0\) in layer 'layers.0'"
    ):
        trace(model, (x,), leaf_modules=(Branchy,))


def test_an_error_in_loss_fn_is_reported_in_the_loss_not_the_models_last_layer():
    # found by fuzzing: fx made the loss's attribute read a node only after the loss returned,
    # outside its module, so the error named the model's last layer and hinted at its branches
    model, x = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4)), torch.randn(2, 4)
    with pytest.raises(TraceError, match=r"in layer 'loss': AttributeError.*check that example_target is the target"):
        trace(model, (x,), loss_fn=lambda output, target: output.no_such_field, example_target=torch.randn(2, 4))


def test_bad_arguments_are_trace_errors():
    model, inputs, target = tiny("llama")
    with pytest.raises(TraceError, match="loss_fn needs example_target"):
        trace(model, inputs, loss_fn=lm_loss)
    with pytest.raises(TraceError, match="example_target was given without loss_fn"):
        trace(model, inputs, example_target=target)
    with pytest.raises(TraceError, match="method must be 'auto', 'fx' or 'export'"):
        trace(model, inputs, method="jit")
    with pytest.raises(TraceError, match=r"example_inputs\[0\] is a list"):
        trace(model, ([1, 2],))
    with pytest.raises(TraceError, match="trace expects an nn.Module"):
        trace(lm_loss, inputs)


# ---------------------------------------------------------------------------- Hugging Face models


def hf_model(kind: str) -> nn.Module:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if kind == "llama":
            cfg = transformers.LlamaConfig(
                vocab_size=96,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                max_position_embeddings=64,
                use_cache=False,
            )
            return transformers.LlamaForCausalLM(cfg).eval()
        cfg = transformers.GPT2Config(
            vocab_size=96,
            n_embd=32,
            n_layer=2,
            n_head=4,
            n_positions=64,
            use_cache=False,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            bos_token_id=0,
            eos_token_id=0,
        )
        return transformers.GPT2LMHeadModel(cfg).eval()


@pytest.mark.parametrize(
    ("kind", "names"),
    [
        (
            "llama",
            [
                "model.embed_tokens",
                "model.rotary_emb",
                "model.layers.0",
                "model.layers.1",
                "model.norm",
                "lm_head",
                "loss",
            ],
        ),
        (
            "gpt2",
            [
                "transformer.wte",
                "transformer.wpe",
                "transformer.drop",
                "transformer.h.0",
                "transformer.h.1",
                "transformer.ln_f",
                "lm_head",
                "loss",
            ],
        ),
    ],
)
def test_hugging_face_models_fall_back_to_export(kind, names):
    model = hf_model(kind)
    ids, target = torch.randint(0, 96, (2, 12)), torch.randint(0, 96, (2, 12))
    graph = trace(model, (ids,), loss_fn=lm_loss, example_target=target)
    assert graph.method == "export"
    assert [layer.name for layer in graph.layers] == names
    kinds = [layer.kind for layer in graph.layers]
    assert kinds[0] == "embedding" and kinds[-3:] == ["norm", "head", "loss"] and "block" in kinds
    check_graph(graph, model)
    torch.testing.assert_close(graph.module(ids, target), lm_loss(model(ids).logits, target))
    # exported with dynamic batch and sequence: it runs on another microbatch size
    ids2, target2 = ids[:1, :7], target[:1, :7]
    torch.testing.assert_close(graph.module(ids2, target2), lm_loss(model(ids2).logits, target2))
    if kind == "gpt2":  # tied wte / lm_head
        assert [(s.name, s.layers) for s in graph.shared] == [("transformer.wte.weight", (0, 6))]


class _ModeBranch(nn.Module):
    """A forward whose ops depend on the training mode as `kind` says."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))
        self.drop = nn.Dropout(0.5)

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
        if self.kind == "branch" and self.training:
            x = x + 1
        if self.kind in ("functional", "functional p=0"):
            x = nn.functional.dropout(x, p=0.0 if self.kind == "functional p=0" else 0.3, training=self.training)
        return self.drop(x)  # a leaf module: follows the engine's mode, no difference


@pytest.mark.parametrize(("kind", "warns"), [("branch", True), ("functional", True), ("functional p=0", False),
                                             ("module", False)])
def test_a_forward_that_depends_on_the_training_mode_is_named(kind, warns):
    # found by fuzzing: `if self.training:` was traced in one mode and run in both, silently
    from octopipe.errors import OctopipeWarning

    model = _ModeBranch(kind)
    model.layers[1].eval()  # mixed modes are put back as they were
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trace(model, (torch.randn(4, 8),))
    named = [w for w in caught if issubclass(w.category, OctopipeWarning) and "training mode" in str(w.message)]
    assert bool(named) == warns, [str(w.message) for w in caught]
    if warns:
        assert "runs the training-mode forward it was traced in" in str(named[0].message)
    assert model.training and model.drop.training and not model.layers[1].training
