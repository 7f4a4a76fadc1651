"""The generated files (fastops/_specs/codegen.py: the C++ argument structs and bindings of every op from its spec,
csrc/cuda/qmaps.cuh from fastops/_quant.py) are what their generators write now, whole; no GPU or build needed."""

from __future__ import annotations

import os

import pytest
import torch

from fastops import _quant
from fastops._specs import codegen


@pytest.mark.parametrize("path", list(codegen.GENERATED))
def test_generated_file_is_current(path):
    with open(os.path.join(codegen.ROOT, path)) as f:
        text = f.read()
    assert text == codegen.GENERATED[path](), f"{path} is stale: regenerate the generated files: `{codegen.COMMAND}`"


def test_every_spec_argument_reaches_the_cpp_struct():
    """Each op's struct holds its arguments in the schema's order: the binding fills it positionally."""
    text = codegen.op_args_header()
    for spec in codegen._generated():
        body = text.split(f"struct {codegen.camel(spec.name)}Args {{")[1].split("};")[0]
        names = [n.strip(" &;\n") for decl in body.split(";") if decl.strip() for n in decl.split(",")]
        assert [n.split()[-1].lstrip("&") for n in names] == [a.name for a in spec.arguments], spec.name


def test_an_unknown_argument_type_names_itself():
    bad = codegen.OpSpec("f(Tensor[][] x) -> ()", None, None, None, None, None)
    with pytest.raises(ValueError, match="f: argument x has type List\\[List\\[Tensor\\]\\]"):
        codegen._cpp(bad, bad.arguments[0])


def test_hex_literals_are_the_fp32_values():
    for v in _quant.QMAP_SIGNED.tolist() + _quant.constants(False)["F"]:
        assert torch.tensor(float.fromhex(_quant._hex_literal(v)[:-1]), dtype=torch.float32).item() == v
