"""``hf_lowbit::quantize_dual`` off CUDA (the plain-torch references; the Triton kernels are checked in
test_triton_int8.py): its outputs, its argument checks, and that a compiled caller traces it without a graph break."""

import pytest
import torch

from hf_lowbit.kernels import FORMATS, quantize_dual, quantize_t


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_op_equals_both_references(fmt):
    g = (torch.randn(40, 24) * 3).to(torch.bfloat16)
    g[5, 3] = float("nan")
    w_scale = torch.rand(24, 1) + 0.5  # a weight's row scales, as the linear keeps them
    for col_mul in (w_scale, None):
        qr, sr, qc, sc = torch.ops.hf_lowbit.quantize_dual(g, fmt, col_mul)
        x = g.float() if col_mul is None else g.float() * col_mul.reshape(1, -1)
        rq, rs = FORMATS[fmt].quantize(x, dim=1)  # the input gradient's operand today (Inductor fuses it)
        tq, ts = quantize_t(g, fmt)  # the weight gradient's
        ok = torch.arange(40) != 5  # the NaN row's codes are undefined (its scale NaN)
        assert torch.equal(qr[ok].view(torch.uint8), rq[ok].view(torch.uint8)) and qr.is_contiguous()
        torch.testing.assert_close(sr, rs.reshape(-1), rtol=0, atol=0, equal_nan=True)
        cols = torch.arange(24) != 3
        assert torch.equal(qc[cols].view(torch.uint8), tq[cols].view(torch.uint8)) and qc.shape == (24, 40)
        torch.testing.assert_close(sc, ts, rtol=0, atol=0, equal_nan=True)
        assert torch.isnan(sr[5]) and torch.isnan(sc[3])


def test_op_refuses_what_it_does_not_do():
    g = torch.randn(8, 6)
    with pytest.raises(ValueError, match="nearest rounding only"):
        quantize_dual(g, "int8", None, True)
    with pytest.raises(ValueError, match="fmt must be one of"):
        quantize_dual(g, "int4")
    with pytest.raises(ValueError, match="col_mul must be 6 float32"):
        quantize_dual(g, "int8", torch.ones(5))
    with pytest.raises(ValueError, match="2-D"):
        quantize_dual(g[0], "int8")


def test_compiled_caller_has_no_graph_break():
    def step(g, w_scale):
        qr, sr, qc, sc = quantize_dual(g * 2, "int8", w_scale)
        return qr.float().sum() * sr.sum() + qc.float().sum() * sc.sum()

    g, w_scale = torch.randn(32, 16, dtype=torch.bfloat16), torch.rand(16) + 0.5
    explanation = torch._dynamo.explain(step)(g, w_scale)
    assert explanation.graph_break_count == 0 and explanation.graph_count == 1, explanation.break_reasons
    torch._dynamo.reset()
    assert torch.equal(torch.compile(step, backend="aot_eager", fullgraph=True)(g, w_scale), step(g, w_scale))
