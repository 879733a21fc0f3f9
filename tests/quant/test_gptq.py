"""GPTQ rounding for int4 (quant/gptq.py): on the stored grid, equal to rounding to nearest when inputs are
uncorrelated, and a smaller output error than rounding to nearest when they are correlated."""

from __future__ import annotations

import pytest
import torch

from edgeinfer.corpus import wiki_prose
from edgeinfer.engine.config import EngineConfig
from edgeinfer.engine.quant import QuantizationError, get_weight_method
from edgeinfer.engine.quant.gptq import gptq_int4
from edgeinfer.engine.quant.smoothing import scale_for_quantization

G = 32


def output_error(method, state, w: torch.Tensor, h: torch.Tensor) -> float:
    """tr((W - Q) H (W - Q)^T) / tr(W H W^T): the layer's relative output error on inputs with X^T X = H."""
    d = (method.dequantize(state, torch.float32) - w).double()
    wd = w.double()
    return float(
        torch.einsum("nk,kl,nl->", d, h.double(), d) / torch.einsum("nk,kl,nl->", wd, h.double(), wd)
    )


def correlated_inputs(rows: int, k: int, seed: int = 0) -> torch.Tensor:
    """Inputs with a few dominant shared directions and uneven channel energy, as a decoder layer's are;
    `seed` draws other rows of the same distribution."""
    mix = torch.randn(8, k, generator=torch.Generator().manual_seed(1234)) * torch.linspace(0.2, 3.0, k)
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 8, generator=g) @ mix + 0.3 * torch.randn(rows, k, generator=g)


def test_uncorrelated_inputs_give_round_to_nearest():
    """With a diagonal Hessian no error has anywhere to go: GPTQ is rounding to nearest, bit for bit."""
    m = get_weight_method("int4", group_size=G)
    w = torch.randn(48, 128) * 0.05
    h = torch.diag(torch.rand(128) + 0.5)
    got, want = gptq_int4(m, w, h), m.quantize(w)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_correlated_inputs_lower_the_output_error():
    m = get_weight_method("int4", group_size=G)
    w = torch.randn(64, 256) * 0.05
    x_fit, x_new = correlated_inputs(2048, 256, seed=0), correlated_inputs(2048, 256, seed=1)
    state = gptq_int4(m, w, x_fit.t() @ x_fit)
    rtn = m.quantize(w)
    h_new = x_new.t() @ x_new  # held-out inputs from the same distribution: not just a fit
    assert output_error(m, state, w, h_new) < 0.7 * output_error(m, rtn, w, h_new)
    # same grids as rounding to nearest (the format stores them), only the codes moved
    unpacked, plain = m.unpack(state), m.unpack(rtn)
    assert torch.equal(unpacked["scale"], plain["scale"]) and torch.equal(unpacked["zero"], plain["zero"])
    assert not torch.equal(unpacked["q"], plain["q"])


def test_grid_comes_from_the_energy_weighted_fit():
    m = get_weight_method("int4", group_size=G)
    w = torch.randn(16, 64) * 0.05
    x = correlated_inputs(512, 64)
    energy = x.square().mean(0)
    unpacked = m.unpack(gptq_int4(m, w, x.t() @ x, energy))
    scale, zero = m.fit(w.unflatten(-1, (2, G)), energy)
    assert torch.equal(unpacked["scale"], scale) and torch.equal(unpacked["zero"], zero)
    assert not torch.equal(m.fit(w.unflatten(-1, (2, G)))[0], scale)  # the energies moved the grids


def test_gptq_is_refused_for_other_methods_and_without_calibration():
    with pytest.raises(QuantizationError, match="int4"):
        never = lambda ids: pytest.fail("refused before any prefill")  # noqa: E731
        scale_for_quantization(torch.nn.Module(), get_weight_method("int8"), [1, 2], None, never, gptq=True)
    with pytest.raises(ValueError, match="int4"):
        EngineConfig(quantization="int8", gptq_calibration="enwiki")
    with pytest.raises(ValueError, match="calibrate"):
        EngineConfig(quantization="int4", gptq_calibration="enwiki", calibrate_quantization=False)


def test_wiki_prose_strips_markup():
    xml = (
        "<page><title>X</title><text>{{Infobox|a={{b}}}}\n== Heading ==\n"
        "'''Anarchism''' is a [[political philosophy]] that [[Advocacy|advocates]] self-governed "
        "societies.&lt;ref&gt;{{cite book|title=T}}&lt;/ref&gt; It is described at "
        "[http://example.org length] as stateless, and this sentence pads the paragraph past the limit "
        "so that it counts as running prose rather than a caption or a list item.\n"
        "* a list item that is long enough " + "x" * 200 + "\n</text></page>"
    )
    (line,) = wiki_prose(xml).splitlines()
    assert line.startswith("Anarchism is a political philosophy that advocates self-governed societies.")
    assert "It is described at length as stateless" in line
    assert not any(c in line for c in "[]{}<>'=")
