"""LayerGraph text form: exact dumps, round trips (hand-written and generated), parse errors."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe import ParseError
from octopipe.ir.graph import Layer, LayerGraph, SharedParameter, TensorEdge

EXAMPLE = """graph model=Tiny method=fx inputs=input_ids,target layers=4
layer 0 name=embed kind=embedding type=Embedding modules=embed params=embed.weight num_params=64
layer 1 name=layers.0 kind=block type=Block modules=layers.0 params=layers.0.w num_params=16
layer 2 name=head kind=head type=Linear modules=head params=embed.weight num_params=64
layer 3 name=loss kind=loss type=lm_loss modules=loss params=- num_params=0
edge name=input_ids from=-1 to=0 shape=2x8 dtype=int64
edge name=target from=-1 to=3 shape=2x8 dtype=int64
edge name=embed from=0 to=1,2 shape=2x8x4 dtype=float32
edge name=block from=1 to=2 shape=2x8x4 dtype=float32
edge name=head from=2 to=3 shape=2x8x16 dtype=float32
shared name=embed.weight layers=0,2
"""


def test_example_round_trips_exactly():
    graph = LayerGraph.parse(EXAMPLE)
    assert str(graph) == EXAMPLE
    assert LayerGraph.parse(str(graph)) == graph
    assert graph.inputs == ("input_ids", "target")
    assert [layer.kind for layer in graph.layers] == ["embedding", "block", "head", "loss"]
    assert graph.shared == (SharedParameter("embed.weight", (0, 2)),)
    assert [edge.name for edge in graph.skip_edges] == ["embed"]
    assert not graph.edges[0].is_skip  # model inputs are never skip edges


def test_nodes_and_module_are_not_part_of_equality_or_text():
    layer = Layer(0, "a", "block", "Block", ("a",), (), 0, nodes=("x", "y"))
    graph = LayerGraph("m", ("x",), (layer,), module=object())
    assert "nodes" not in str(graph)
    assert LayerGraph.parse(str(graph)) == graph
    assert graph.layer_of_node() == {"x": 0, "y": 0}


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("", "graph text is empty"),
        ("layers 3\n", "expected 'graph ...'"),
        ("graph model=m method=fx layers=2\nlayer 0 name=a kind=block\n", "header says layers=2, found 1"),
        ("graph model=m method=fx layers=1\nlayer x name=a kind=block\n", "layer index must be an integer"),
        ("graph model=m method=fx layers=1\nlayer 0 kind=block\n", "missing field 'name'"),
        ("graph model=m method=fx layers=1\nlayer 0 name=a kind=block color=red\n", "unknown field"),
        ("graph model=m method=fx layers=0\nedge name=e from=0 to=1 shape=2xq\n", "shape must look like"),
        ("graph model=m method=fx layers=0\nnode name=e\n", "expected 'layer', 'edge' or 'shared'"),
        ('graph model="m method=fx layers=0\n', "unterminated quoted value"),
    ],
)
def test_parse_errors_name_the_line(text, message):
    with pytest.raises(ParseError, match=message):
        LayerGraph.parse(text)


# Awkward strings: spaces, quotes, commas, '=', brackets, unicode, control characters, newlines.
awkward = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from(list(" ,=\"'[]\\\n\t-=x")),
    max_size=12,
)
# Includes "-" (quoted, so it is not the absent marker) and trailing newlines (quoted too).
names = awkward
nonempty_names = names.filter(bool)


@st.composite
def graphs(draw):
    num_layers = draw(st.integers(0, 6))
    layers = []
    for index in range(num_layers):
        layers.append(
            Layer(
                index=index,
                name=draw(names),
                kind=draw(
                    st.sampled_from(
                        ["embedding", "block", "norm", "head", "loss", "vision_block", "projector", "other"]
                    )
                    | names
                ),
                module_type=draw(nonempty_names),
                modules=tuple(draw(st.lists(names, max_size=3))),
                parameters=tuple(draw(st.lists(names, max_size=3))),
                num_params=draw(st.integers(0, 10**12)),
            )
        )
    edges = []
    for _ in range(draw(st.integers(0, 6))):
        producer = draw(st.integers(-1, max(num_layers - 1, -1)))
        consumers = tuple(sorted(set(draw(st.lists(st.integers(0, max(num_layers - 1, 0)), max_size=4)))))
        edges.append(
            TensorEdge(
                name=draw(names),
                producer=producer,
                consumers=consumers,
                shape=tuple(draw(st.lists(st.integers(1, 10**6), max_size=4))),
                dtype=draw(st.sampled_from(["", "float32", "bfloat16", "int64", "bool"]) | names),
            )
        )
    shared = tuple(
        SharedParameter(draw(names), tuple(draw(st.lists(st.integers(0, 9), min_size=1, max_size=3))))
        for _ in range(draw(st.integers(0, 2)))
    )
    return LayerGraph(
        model=draw(names),
        inputs=tuple(draw(st.lists(names, max_size=3))),
        layers=tuple(layers),
        edges=tuple(edges),
        shared=shared,
        method=draw(st.sampled_from(["fx", "export"]) | names),
    )


@given(graphs())
@settings(max_examples=120, deadline=None)
def test_generated_graphs_round_trip(graph):
    text = str(graph)
    assert LayerGraph.parse(text) == graph
    assert str(LayerGraph.parse(text)) == text


def test_empty_module_type_round_trips():
    graph = LayerGraph("m", (), (Layer(0, "a", "block"),))
    assert LayerGraph.parse(str(graph)) == graph


def test_trailing_newline_round_trips():
    graph = LayerGraph("model\n", (), ())
    assert LayerGraph.parse(str(graph)) == graph


def test_a_name_that_is_just_a_dash_is_not_the_absent_marker():
    graph = LayerGraph("-", ("-",), (Layer(0, "-", "-", "-", ("-",), ("-", "x")),))
    assert LayerGraph.parse(str(graph)) == graph
