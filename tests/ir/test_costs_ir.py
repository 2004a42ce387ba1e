"""CostTable / LayerCost: text form, JSON and YAML files, and errors that name file, layer and field."""

import json
import math
from dataclasses import replace

import pytest
import sympy
from hypothesis import given, settings
from hypothesis import strategies as st

from octopipe import CostTable, CostTableError, LayerCost, ParseError
from octopipe.ir import SkipTensor, TiedParameter
from octopipe.ir.costs import DEFAULT_WEIGHT_FRACTION


def small_table() -> CostTable:
    return CostTable(
        (
            LayerCost("embed", "embedding", 0.4, 0.6, 0.2, 1024, 2048, 4096, (("forward_flops", "0"),)),
            LayerCost(
                "layers.0", "block", 1.0, 2.0, None, 10, 20, 30, (("forward_flops", "24*b*s**2 + b*s*Min(2048, s)"),)
            ),
            LayerCost("head", "head", 2.5, 3.0),
        ),
        model="tiny",
    )


def test_text_round_trip_and_formulas():
    table = small_table()
    text = str(table)
    assert CostTable.parse(text) == table
    assert str(CostTable.parse(text)) == text
    formula = table[1].formula("forward_flops")
    assert formula.subs({sympy.Symbol("b"): 2, sympy.Symbol("s"): 4096}) == 24 * 2 * 4096**2 + 2 * 4096 * 2048
    assert table.weight == (0.2, 1.0, 1.5)  # stated, else weight_fraction of the backward
    with pytest.raises(KeyError, match="has no formula 'bytes'"):
        table[0].formula("bytes")


@pytest.mark.parametrize("suffix", [".json", ".yaml"])
def test_file_round_trip(tmp_path, suffix):
    table = small_table()
    path = tmp_path / f"profile{suffix}"
    table.save(path)
    assert CostTable.load(path) == table


def test_model_name_defaults_to_the_file_stem(tmp_path):
    path = tmp_path / "gpt-13B.json"
    path.write_text(json.dumps({"layers": [{"name": "l0", "forward_ms": 1, "backward_ms": 2}], "source": "ignored"}))
    table = CostTable.load(path)
    assert table.model == "gpt-13B"
    assert table[0].backward_weight_ms is None and table.weight_fraction == DEFAULT_WEIGHT_FRACTION


# ---------------------------------------------------------------------------- generated tables

awkward = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs",)) | st.sampled_from(list(" ,=\"'[]\\\n\t-=x")),
    max_size=12,
)
# Includes "-" and trailing newlines: both are quoted, so neither is read back as "absent".
names = awkward.filter(bool)
times = st.floats(0, 1e6, allow_nan=False, allow_infinity=False)
byte_counts = st.none() | st.integers(0, 2**60)
formula_keys = st.from_regex(r"[a-z][a-z_]{0,15}", fullmatch=True)
# valid formulas only (they are checked when read), with the spaces and commas that need quoting
formula_texts = st.lists(st.sampled_from(["24*b*s**2", "Min(b, 4) * s", " b + s ", "1e-3*b", "0", "(b - 1)/2",
                                          "Max(s,b)**2"]), min_size=1, max_size=3).map(" + ".join)


@st.composite
def tables(draw):
    layers = []
    for index in range(draw(st.integers(1, 6))):
        backward = draw(times)
        weight = draw(st.none() | st.floats(0, 1, allow_nan=False).map(lambda f, total=backward: total * f))
        formulas = draw(st.dictionaries(formula_keys, formula_texts, max_size=3))
        layers.append(
            LayerCost(
                name=draw(names) + f"#{index}",
                kind=draw(names),
                forward_ms=draw(times),
                backward_ms=backward,
                backward_weight_ms=weight,
                activation_bytes=draw(byte_counts),
                output_bytes=draw(byte_counts),
                param_bytes=draw(byte_counts),
                formulas=tuple(formulas.items()),
                backward_full_ms=draw(st.none() | times),
                forward_no_grad_ms=draw(st.none() | times),
                weight_stash_bytes=draw(byte_counts),
                unsaved_input_bytes=draw(byte_counts),
            )
        )
    model = draw(st.just("") | names)
    tied = []
    if len(layers) >= 2:
        for number in range(draw(st.integers(0, 2))):
            members = draw(st.lists(st.integers(0, len(layers) - 1), min_size=2, max_size=len(layers), unique=True))
            tied.append(TiedParameter(draw(names) + f"#{number}", tuple(sorted(members)), draw(st.integers(0, 2**40))))
    skips = []
    if len(layers) >= 3:
        for number in range(draw(st.integers(0, 2))):
            producer = draw(st.integers(0, len(layers) - 3))
            readers = draw(st.lists(st.integers(producer + 1, len(layers) - 1), min_size=1, max_size=3, unique=True))
            readers = sorted(set(readers) | {draw(st.integers(producer + 2, len(layers) - 1))})
            skips.append(SkipTensor(draw(names) + f"#{number}", producer, tuple(readers), draw(st.integers(0, 2**40))))
    return CostTable(tuple(layers), model=model, weight_fraction=draw(st.floats(0, 1, allow_nan=False)), tied=tuple(tied),
                     skips=tuple(skips))


@given(tables())
@settings(max_examples=120, deadline=None)
def test_generated_tables_round_trip_as_text_and_json(table):
    assert CostTable.parse(str(table)) == table
    assert CostTable.from_dict(json.loads(table.to_json())) == table


# ---------------------------------------------------------------------------- errors


def write(tmp_path, name, content):
    path = tmp_path / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


GOOD = {"name": "l0", "kind": "block", "forward_ms": 1.0, "backward_ms": 2.0}


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        ('{"layers": [', r"not valid JSON at line 1 column"),
        ([1, 2], r"expected an object with a 'layers' list, got list"),
        ({"layers": []}, r"'layers' must be a non-empty list"),
        ({"layers": [GOOD], "weight_fraction": 2}, r"'weight_fraction' must be a number in \[0, 1\]"),
        ({"layers": [GOOD, "oops"]}, r"layer 1: expected an object with forward_ms/backward_ms, got str"),
        ({"layers": [GOOD, {"name": "l1", "backward_ms": 1}]}, r"layer 1 \('l1'\): missing field 'forward_ms'"),
        (
            {"layers": [{**GOOD, "forward_ms": -1}]},
            r"layer 0 \('l0'\): field 'forward_ms' must be a number of milliseconds in",
        ),
        (  # found by a CLI sweep: 1e20 overflowed the solvers' integer times
            {"layers": [{**GOOD, "forward_ms": 1e20}]},
            r"layer 0 \('l0'\): field 'forward_ms' must be a number of milliseconds in \[0, 1e\+09\]",
        ),
        (
            {"layers": [{**GOOD, "forward_ms": "fast"}]},
            r"layer 0 \('l0'\): field 'forward_ms' must be a number of milliseconds in",
        ),
        (
            {"layers": [{**GOOD, "backward_weight_ms": 3.0}]},
            r"layer 0 \('l0'\): backward_weight_ms=3.0 exceeds backward_ms=2.0",
        ),
        (
            {"layers": [{**GOOD, "activation_bytes": 1.5}]},
            r"layer 0 \('l0'\): field 'activation_bytes' must be a non-negative integer",
        ),
        ({"layers": [{**GOOD, "kind": 3}]}, r"layer 0 \('l0'\): field 'kind' must be a string"),
        ({"layers": [{**GOOD, "name": ""}]}, r"layer 0: field 'name' must be a non-empty string"),
        (
            {"layers": [{**GOOD, "formulas": {"forward_flops": 3}}]},
            r"layer 0 \('l0'\): field 'formulas' must map names",
        ),
        ({"layers": [GOOD, GOOD]}, r"layer 1 \('l0'\): name already used by layer 0"),
        # found by a bad-input sweep: misspelt keys were dropped silently
        (
            {"layers": [{**GOOD, "backward_weight_m": 1.0}]},
            r"layer 0 \('l0'\): unknown field 'backward_weight_m'; did you mean 'backward_weight_ms'\?",
        ),
        ({"layers": [GOOD], "weight_fracton": 0.3}, r"unknown key 'weight_fracton'; did you mean 'weight_fraction'\?"),
    ],
)
def test_load_errors_name_file_layer_and_field(tmp_path, content, expected):
    path = write(tmp_path, "bad.json", content)
    with pytest.raises(CostTableError, match=expected) as info:
        CostTable.load(path)
    assert str(path) in str(info.value)


def test_load_errors_for_missing_and_bad_yaml_files(tmp_path):
    with pytest.raises(CostTableError, match="cannot read cost table"):
        CostTable.load(tmp_path / "missing.json")
    path = write(tmp_path, "bad.yaml", "layers: [unclosed\n")
    with pytest.raises(CostTableError, match=f"{path}: not valid YAML"):
        CostTable.load(path)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "cost table text is empty"),
        ("costs layers=1\nstage 0\n", "expected 'layer ...'"),
        ("costs layers=2\nlayer name=a kind=b forward_ms=1 backward_ms=2\n", "header says layers=2, found 1"),
        ("costs layers=1\nlayer name=a kind=b forward_ms=x backward_ms=2\n", "field 'forward_ms' must be a number"),
        ("costs layers=1\nlayer name=a kind=b forward_ms=1 backward_ms=2 color=red\n", "unknown field 'color'"),
    ],
)
def test_text_parse_errors(text, expected):
    with pytest.raises(ParseError, match=expected):
        CostTable.parse(text)


def test_constructor_checks_layers():
    with pytest.raises(CostTableError, match="has no layers"):
        CostTable(())
    # found by a bad-input sweep: the constructor took what loading refuses, so a saved plan's
    # table could not be read back, and a formula name with a space broke the text form
    with pytest.raises(CostTableError, match=r"layer 1 \('a'\): name already used by layer 0"):
        CostTable((LayerCost("a", forward_ms=1.0, backward_ms=2.0), LayerCost("a", forward_ms=1.0, backward_ms=2.0)))
    with pytest.raises(CostTableError, match="formula 'forward flops': names are letters"):
        CostTable((LayerCost("a", forward_ms=1.0, backward_ms=2.0, formulas=(("forward flops", "b*s"),)),))
    with pytest.raises(CostTableError, match=r"layer 0 \('a'\): field 'backward_ms'"):
        CostTable((LayerCost("a", forward_ms=1.0, backward_ms=math.nan),))


def test_a_measured_full_backward_replaces_b_plus_w_only_for_ops_that_run_them_together():
    table = CostTable((LayerCost("a", forward_ms=1.0, backward_ms=2.0, backward_weight_ms=0.8, backward_full_ms=1.7),
                       LayerCost("b", forward_ms=1.0, backward_ms=2.0, backward_weight_ms=0.8)))
    assert table.backward_full == (1.7, 2.0)
    assert table.backward_input == (1.2, 1.2) and table.weight == (0.8, 0.8)
    assert CostTable.parse(str(table)) == table
    assert CostTable.from_dict(table.to_dict()) == table
    with pytest.raises(CostTableError, match=r"layer 0 \('l0'\): field 'backward_full_ms' must be a number of milliseconds in"):
        CostTable.from_dict({"layers": [{**GOOD, "backward_full_ms": -1.0}]})


def test_skip_tensors_round_trip_and_bad_ones_name_the_entry(tmp_path):
    table = CostTable(small_table().layers, model="m", tied=(TiedParameter("embed.weight", (0, 2), 4096),),
                      skips=(SkipTensor("vision", 0, (2,), 8192),))
    text = str(table)
    assert text.splitlines()[-2:] == ["tied name=embed.weight layers=0,2 bytes=4096",
                                      "skip name=vision from=0 to=2 bytes=8192"]
    assert CostTable.parse(text) == table
    for suffix in (".json", ".yaml"):
        path = tmp_path / f"t{suffix}"
        table.save(path)
        assert CostTable.load(path) == table
    data = table.to_dict()
    assert data["skips"] == [{"name": "vision", "from": 0, "to": [2], "bytes": 8192}]
    for bad, message in (([{"name": "v", "from": 0, "to": [2, 1], "bytes": 1}], "ascending"),
                         ([{"name": "v", "from": 1, "to": [0, 2], "bytes": 1}], "after the producer"),
                         ([{"name": "v", "from": 0, "to": [1], "bytes": 1}], "only read by the next layer"),
                         ([{"name": "v", "from": 0, "to": [9], "bytes": 1}], "outside"),
                         ([{"name": "v", "from": 5, "to": [9], "bytes": 1}], "producer layer 5 outside"),
                         ([{"name": "v", "from": 0, "to": [2], "bytes": -1}], "non-negative"),
                         ([{"name": "v", "from": 0, "to": 2, "bytes": 1}], "list of layer indices"),
                         ([{"name": "v", "from": 0, "to": [2], "size": 1}], "keys name, from, to, bytes"),
                         ({"name": "v"}, "must be a list")):
        with pytest.raises(CostTableError, match=message) as info:
            CostTable.from_dict({**data, "skips": bad}, source="f.json")
        assert "f.json" in str(info.value)
    with pytest.raises(ParseError, match="after a 'skip' line"):
        CostTable.parse(str(replace(table, tied=())) + "layer name=x forward_ms=1 backward_ms=1\n")
    with pytest.raises(ParseError, match="outside"):
        CostTable.parse(text.replace("from=0 to=2", "from=0 to=2,7"))


def test_tied_parameters_round_trip_and_bad_ones_name_the_entry(tmp_path):
    table = CostTable(small_table().layers, model="m", tied=(TiedParameter("embed.weight", (0, 2), 4096),))
    text = str(table)
    assert text.splitlines()[-1] == "tied name=embed.weight layers=0,2 bytes=4096"
    assert CostTable.parse(text) == table
    path = tmp_path / "t.json"
    table.save(path)
    assert CostTable.load(path).tied == table.tied
    data = table.to_dict()
    for bad, message in (([{"name": "w", "layers": [2, 0], "bytes": 1}], "ascending"),
                         ([{"name": "w", "layers": [0, 9], "bytes": 1}], "outside"),
                         ([{"name": "w", "layers": [0, 1], "bytes": -1}], "non-negative"),
                         ([{"name": "w", "layers": [0, 1]}], "bytes"),
                         ({"name": "w"}, "must be a list")):
        with pytest.raises(CostTableError, match=message) as info:
            CostTable.from_dict({**data, "tied": bad}, source="f.json")
        assert "f.json" in str(info.value)
    with pytest.raises(ParseError, match="after a 'tied' line"):
        CostTable.parse(text + "layer name=x forward_ms=1 backward_ms=1\n")
    with pytest.raises(ParseError, match="outside"):
        CostTable.parse(text.replace("layers=0,2", "layers=0,7"))


def test_a_table_re_costs_its_gradient_accumulation_for_another_microbatch_count(tmp_path):
    # costed for M=4: the backward carries 3/4 of the addition, W 3/4 of its part
    layers = (LayerCost("a", forward_ms=1.0, backward_ms=2.0 + 0.75 * 0.4, backward_weight_ms=0.8 + 0.75 * 0.1,
                        accumulate_ms=0.4, accumulate_weight_ms=0.1),
              LayerCost("b", forward_ms=1.0, backward_ms=2.0 + 0.75 * 0.8, backward_full_ms=2.5 + 0.75 * 0.8,
                        accumulate_ms=0.8),
              LayerCost("c", forward_ms=1.0, backward_ms=2.0))  # nothing to accumulate known
    table = CostTable(layers, model="m", num_microbatches=4)
    one = table.for_microbatches(1)
    assert one.num_microbatches == 1
    assert [layer.backward_ms for layer in one] == pytest.approx([2.0, 2.0, 2.0])
    assert one[0].backward_weight_ms == pytest.approx(0.8) and one[1].backward_weight_ms is None
    assert one[1].backward_full_ms == pytest.approx(2.5)
    eight = one.for_microbatches(8)
    assert [layer.backward_ms for layer in eight] == pytest.approx([2.0 + 0.875 * 0.4, 2.0 + 0.875 * 0.8, 2.0])
    assert eight[0].backward_weight_ms == pytest.approx(0.8 + 0.875 * 0.1)
    back = eight.for_microbatches(4)
    assert [a.backward_ms for a in back] == pytest.approx([b.backward_ms for b in table])
    assert back[0].backward_weight_ms == pytest.approx(table[0].backward_weight_ms)
    assert table.for_microbatches(4) is table and table.for_microbatches(2) is table.for_microbatches(2)  # cached
    # a table that does not know what accumulation costs stays as it is
    plain = CostTable((LayerCost("a", forward_ms=1.0, backward_ms=2.0),))
    assert not plain.accumulates and plain.for_microbatches(8) is plain
    # the fields and the count survive the text form and files
    assert CostTable.parse(str(table)) == table
    assert str(table).splitlines()[0] == "costs model=m weight_fraction=0.5 num_microbatches=4 layers=3"
    for suffix in (".json", ".yaml"):
        table.save(tmp_path / f"t{suffix}")
        assert CostTable.load(tmp_path / f"t{suffix}") == table
    with pytest.raises(CostTableError, match="accumulate_weight_ms=0.5 exceeds accumulate_ms=0.4"):
        CostTable((replace(layers[0], accumulate_weight_ms=0.5),))
    with pytest.raises(CostTableError, match="num_microbatches must be a positive integer"):
        CostTable(layers, num_microbatches=0)
    with pytest.raises(CostTableError, match="'num_microbatches' must be a positive integer"):
        CostTable.from_dict({**table.to_dict(), "num_microbatches": 2.5})
    with pytest.raises(CostTableError, match="for_microbatches needs a positive integer"):
        table.for_microbatches(0)


def test_a_table_must_hold_the_accumulation_share_it_claims():
    # found by a bad-input sweep: a backward smaller than (M-1)/M of its accumulation loaded, and
    # re-costing clamped it to 0 (not reversible); W's part was ignored without backward_weight_ms
    good = LayerCost("a", forward_ms=1.0, backward_ms=4.0, accumulate_ms=4.0, accumulate_weight_ms=2.0)
    CostTable((good,), num_microbatches=8)  # 3.5 ms of accumulation within 4.0
    for bad, field in ((replace(good, backward_ms=1.0), "backward_ms=1 is less"),
                       (replace(good, backward_weight_ms=1.0), "backward_weight_ms=1 is less"),
                       (replace(good, backward_weight_ms=3.9), "backward_ms - backward_weight_ms=0.1 is less"),
                       (replace(good, backward_full_ms=2.0), "backward_full_ms=2 is less")):
        with pytest.raises(CostTableError, match=field):
            CostTable((bad,), num_microbatches=8)
        CostTable((bad,), num_microbatches=1)  # M=1 includes none of it
    table = CostTable((good,), num_microbatches=4)  # W (by weight_fraction) 2.0 holds 0.75 x 2.0
    one = table.for_microbatches(1)
    assert (one[0].backward_ms, one[0].backward_weight_ms) == pytest.approx((1.0, 0.5))  # all of W's part left W
    back = one.for_microbatches(4)
    assert (back[0].backward_ms, back[0].backward_weight_ms) == pytest.approx((4.0, 2.0))


def test_load_reads_the_text_form_too(tmp_path):
    # what `octopipe dump --level costs` writes; `--costs` said "not valid JSON" before
    table = small_table()
    path = tmp_path / "02_costs.txt"
    path.write_text(str(table))
    assert CostTable.load(path) == table
    path.write_text(str(table).replace("forward_ms=0.4", "forward_ms=oops"))
    with pytest.raises(CostTableError, match="02_costs.txt"):
        CostTable.load(path)


def test_text_numbers_are_plain_ascii_numbers():
    text = str(small_table())
    for bad in ("forward_ms=0_4", "forward_ms=\uff10.4"):
        with pytest.raises(ParseError, match="'forward_ms' must be a number"):
            CostTable.parse(text.replace("forward_ms=0.4", bad))


def test_a_yaml_number_read_as_text_gets_the_spelling_that_works(tmp_path):
    path = tmp_path / "t.yaml"
    path.write_text("layers:\n- forward_ms: 1e-3\n  backward_ms: 2.0\n")
    with pytest.raises(CostTableError, match="write 1.0e-3"):
        CostTable.load(path)


def test_formulas_are_checked_when_read_and_never_run_as_python(tmp_path):
    from octopipe.ir.costs import parse_formula

    assert parse_formula("Min(b, 4)*s**2 + 1e-3*b") == sympy.Min(sympy.Symbol("b"), 4) * sympy.Symbol("s") ** 2 \
        + sympy.Float(1e-3) * sympy.Symbol("b")
    assert parse_formula(".5*b") == sympy.Float(0.5) * sympy.Symbol("b")
    assert parse_formula("S*b").free_symbols == {sympy.Symbol("S"), sympy.Symbol("b")}  # names are symbols
    marker = tmp_path / "ran"
    for text, message in ((f"__import__('pathlib').Path({str(marker)!r}).touch()", "cannot read"),
                          ("open(1)", "not a formula function"), ("b.__class__", "cannot read"),
                          ("b*(s", "cannot parse"), ("", "empty"), ("b if s else b", "keyword"),
                          ("b**(9**9**9)", "power of a power"), ("10**400*b", "too large"),
                          ("((9)**16)**16*b", "power of a power"), ("+".join(["b"] * 500), "longer than")):
        table = {"layers": [{"name": "l0", "forward_ms": 1, "backward_ms": 2, "formulas": {"forward_flops": text}}]}
        path = tmp_path / "t.json"
        path.write_text(json.dumps(table))
        with pytest.raises(CostTableError, match=message):
            CostTable.load(path)  # refused when the table is read, not when a formula is first used
    assert not marker.exists()
