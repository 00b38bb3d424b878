"""The int4 serving kernels (hf_lowbit/kernels/triton_int4.py, the op in hf_lowbit/kernels/int4.py) and the module
that serves int4_tinygemm exports with them (hf_lowbit/qat/int4_serving.py): interpreted on CPU, compiled on CUDA;
the repack from torchao's Int4TilePackedTo4dTensor on CUDA only (tinygemm unpacks its own layout)."""

import pytest
import torch
from torch import nn

from hf_lowbit.kernels.int4 import (
    from_tinygemm,
    int4_dequantize,
    int4_linear,
    int4_linear_reference,
    int4_tile_linear,
    pack_int4,
    pack_tinygemm_tiles,
    unpack_int4,
    unpack_tinygemm_tiles,
)
from hf_lowbit.qat.int4_serving import Int4ServingLinear, use_int4_kernels

pytest.importorskip("triton")


def test_triton_int4_interpreted():
    """Dequantized weights bit for bit, decode (M 1, 3, 16; split K 1, 3 and the default) and dequant + mm
    (M 17, 33) within the float32-order bound, on 3 shapes (_triton_checks.check_int4)."""
    from test_triton_int8 import run_interpreted

    assert "checked 36 int4 dequantizations and matmuls" in run_interpreted("int4")


def test_triton_int4_tile_interpreted():
    """The kernels on tinygemm's tile layout: dequantized weights bit for bit, the tile GEMV (M 1, 3, 16; split K
    1, 3, default) and the tensor-core GEMV (M 1, 3, 16; the same splits) within the order bound, the factored GEMV
    (M 1) within its bound of the exact product, 4 shapes (_triton_checks.check_int4_tile)."""
    from test_triton_int8 import run_interpreted

    assert "checked 104 int4 tile-layout dequantizations and GEMVs" in run_interpreted("int4_tile")


def test_triton_int4_dequant_rows_past_2gb_interpreted():
    """The dequantize kernels write a weight whose rows lie 2**26 elements apart (as a weight of 2**31 elements),
    the plain one reading codes, scales and zeros as far apart: bit for bit
    (_triton_checks.check_int4_large_offsets)."""
    from test_triton_int8 import run_interpreted

    assert "checked 2 int4 dequantizations with rows past 2**31 elements" in run_interpreted("int4_large_offsets")


def test_int4_kernels_refuse_operands_past_32bit_offsets(monkeypatch):
    """The decode GEMVs (and the tile dequantize's words) address in 32 bits: an operand or output spanning 2**31
    elements (2**31 bytes of codes, x rows 2**31 apart, split-K partials) is refused in one line naming the
    function and the shape, before any launch (meta tensors: nothing allocated; ``wrap_triton`` fails the test)."""
    from test_triton_int8 import no_launch
    from test_triton_int8 import refused_past_32bit

    def _refused(fn, shape, span):  # the serving kernels' advice
        return refused_past_32bit(fn, shape, span, serving=True)

    from hf_lowbit.kernels import triton_int4
    from hf_lowbit.kernels.triton_int4 import int4_decode_triton, int4_tile_decode_triton, int4_tile_dequant_triton

    monkeypatch.setattr(triton_int4, "wrap_triton", no_launch)

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(shape, dtype=dtype, device="meta")

    def far_rows(K):  # x [2, K] whose second row starts 2**31 elements from the first
        return meta(2 ** 31 + K).as_strided((2, K), (2 ** 31, 1))

    # plain layout: 2**31 bytes of codes (two a byte: a [262144, 16384] weight)
    N, K, gs = 262144, 16384, 128
    packed, scales = meta(N, K // 2, dtype=torch.uint8), meta(N, K // gs)
    with _refused("int4_decode_triton", (N, K // 2), 2 ** 31):
        int4_decode_triton(meta(1, K), packed, scales, scales, gs)
    small = meta(64, 64, dtype=torch.uint8), meta(64, 1), meta(64, 1)
    with _refused("int4_decode_triton", (2, 128), 2 ** 31 + 128):
        int4_decode_triton(far_rows(128), *small, 128)
    # split-K partials [16, 16, 2**23] float32: 2**31 elements, of a weight of 2**28
    wide = meta(2 ** 23, 16, dtype=torch.uint8), meta(2 ** 23, 1), meta(2 ** 23, 1)
    with _refused("int4_decode_triton", (16, 16, 2 ** 23), 2 ** 31):
        int4_decode_triton(meta(16, 32), *wide, 32, split_k=16)
    # tile layout: words [N/8, K/128, 32, 4] of 2**31 int32 (a 2**17 x 2**17 weight)
    N = K = 2 ** 17
    qdata, sz = meta(N // 8, K // 128, 32, 4, dtype=torch.int32), meta(K // gs, N, 2)
    with _refused("int4_tile_decode_triton", tuple(qdata.shape), 2 ** 31):
        int4_tile_decode_triton(meta(1, K), qdata, sz, gs, N)
    with _refused("int4_tile_dequant_triton", tuple(qdata.shape), 2 ** 31):
        int4_tile_dequant_triton(qdata, sz, gs, (N, K))
    tile = meta(8, 1, 32, 4, dtype=torch.int32), meta(1, 64, 2)
    for kernel in ("tile", "factored", "mma"):
        with _refused("int4_tile_decode_triton", (2, 128), 2 ** 31 + 128):
            int4_tile_decode_triton(far_rows(128), *tile, 128, 64, kernel=kernel)
    # split-K partials [4, 16, 2**25] float32, of a weight of 2**32 (its words 2**29)
    N = 2 ** 25
    with _refused("int4_tile_decode_triton", (4, 16, N), 2 ** 31):
        int4_tile_decode_triton(meta(16, 128), meta(N // 8, 1, 32, 4, dtype=torch.int32), meta(1, N, 2), 128, N,
                                split_k=4)


@pytest.mark.cuda
def test_triton_int4_tile_cuda():
    from _triton_checks import check_int4_tile

    assert check_int4_tile("cuda") == 9 * 26


@pytest.mark.cuda
def test_pack_tinygemm_tiles_is_torchs_cuda_layout():
    """pack_tinygemm_tiles (plain torch, what the CPU tests build) equals aten._convert_weight_to_int4pack on CUDA
    (the bytes torchao feeds it: even columns in the high nibble), and unpacks back."""
    for N, K in ((24, 1024), (20, 2048), (4096, 4096)):
        q = torch.randint(0, 16, (N, K), device="cuda", dtype=torch.int32)
        tiny = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous(), 8)
        ours = pack_tinygemm_tiles(q)
        assert tiny.shape == ours.shape and torch.equal(tiny, ours), (N, K)
        assert torch.equal(unpack_tinygemm_tiles(tiny)[:N], q.to(torch.uint8))


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["tinygemm", "triton", "triton_factored", "triton_mma"])
def test_int4_tile_linear_cuda(decode):
    """The dispatch on CUDA: decode rows (1, 8, 16) through tinygemm or our tile GEMV, prefill rows (17, 300) through
    our dequantize + cuBLAS, all within the order bound of the reference (tinygemm's weight may differ from ours by
    one bf16 step on rare ties: the bound's 2**-7 |ref| term covers an output, checked here with twice the bound);
    the factored GEMV's rows (M = 1) within its own bound of the exact product (it does not round the weight)."""
    from _triton_checks import _factored_tol, _int4_tol, tile_operands

    for N, K, gs in ((4096, 4096, 128), (1000, 1024, 64), (520, 2048, 256)):
        p, s, z, qdata, sz = tile_operands(N, K, gs, "cuda")
        ref_w = int4_dequantize(p, s, z, gs)
        for M in (1, 8, 16, 17, 300):
            x = torch.randn(M, K, device="cuda").bfloat16()
            ref = int4_linear_reference(x, p, s, z, gs)
            y = int4_tile_linear(x, qdata, sz, gs, N, decode)
            assert y.shape == (M, N) and y.is_contiguous()
            if decode == "triton_factored" and M == 1:  # else the tile GEMV or the prefill path
                exact, tol = _factored_tol(x, p, s, z, gs)
                err = (y.double() - exact).abs()
            else:
                err, tol = (y.double() - ref.double()).abs(), 2 * _int4_tol(x, ref_w, ref)
            assert (err <= tol).all(), (N, K, gs, M, err.max().item())


def test_tile_split_k_stays_under_inductors_unroll():
    """Under torch.compile the tile GEMVs' split-K slices are summed in the graph; Inductor unrolls that sum into
    the output's consumer only below its unroll_reductions_threshold (at or above: a reduction kernel a call, 0.21
    ms a token at split 8 in the session-26 profile), so the cap stays under it; the mma GEMV's split on Llama-8B's
    served shapes (132 SMs) reaches the cap (7, not a power of two) where 8 programs an SM want more."""
    import torch._inductor.config as inductor_config

    from hf_lowbit.kernels.triton_int4 import _MMA_WAVES, _TILE_MAX_SPLIT_K, MMA_TILES, decode_split_k

    assert _TILE_MAX_SPLIT_K < inductor_config.unroll_reductions_threshold
    bn, bk = MMA_TILES[:2]
    splits = {(n, k): decode_split_k(n, k, bn, bk, 132, _TILE_MAX_SPLIT_K, _MMA_WAVES)
              for n, k in ((4096, 4096), (6144, 4096), (28672, 4096), (4096, 14336), (128256, 4096), (4096, 512))}
    assert splits == {(4096, 4096): 7, (6144, 4096): 7, (28672, 4096): 7, (4096, 14336): 7, (128256, 4096): 2,
                      (4096, 512): 1}, splits


def test_tinygemm_tiles_round_trip_and_layout():
    """The tile layout in plain torch: an 8-row x 128-column block is 128 contiguous words; word [t, 4r + c, w]
    holds row 8t + r, columns 32w + 2c + 8ab (nibble ab) and + 1 (nibble 4 + ab); padded rows are code 0."""
    q = torch.randint(0, 16, (20, 256))
    t = pack_tinygemm_tiles(q)
    assert t.shape == (3, 2, 32, 4) and t.dtype == torch.int32
    assert torch.equal(unpack_tinygemm_tiles(t), torch.cat([q, torch.zeros(4, 256, dtype=q.dtype)]).to(torch.uint8))
    word = int(t[1, 0, 4 * 3 + 2, 1]) & 0xFFFFFFFF  # row 8 + 3, c = 2, w = 1
    for ab in range(4):
        assert (word >> (4 * ab)) & 15 == q[11, 32 + 4 + 8 * ab]
        assert (word >> (16 + 4 * ab)) & 15 == q[11, 32 + 4 + 8 * ab + 1]
    with pytest.raises(ValueError, match="multiple of 128"):
        pack_tinygemm_tiles(q[:, :96])


def test_tile_op_reference_and_checks():
    """int4_tile_linear off CUDA: the plain-torch reference of the same weight as int4_linear's; its checks."""
    from _triton_checks import tile_operands

    p, s, z, qdata, sz = tile_operands(20, 256, 64, "cpu")
    x = torch.randn(3, 256).bfloat16()
    for decode in ("tinygemm", "triton", "triton_factored", "triton_mma"):
        assert torch.equal(int4_tile_linear(x, qdata, sz, 64, 20, decode), int4_linear_reference(x, p, s, z, 64))
    with pytest.raises(RuntimeError, match="decode 'cuda' is not one of"):
        int4_tile_linear(x, qdata, sz, 64, 20, "cuda")
    with pytest.raises(RuntimeError, match="scale_and_zero must be bf16"):
        int4_tile_linear(x, qdata, sz[:2], 64, 20)
    with pytest.raises(RuntimeError, match="out_features 30"):
        int4_tile_linear(x, qdata, sz, 64, 30)


@pytest.mark.cuda
def test_triton_int4_cuda():
    from _triton_checks import check_int4

    assert check_int4("cuda") == 8 * 12


def _operands(N=24, K=128, gs=32, seed=0):
    from _triton_checks import int4_operands

    return int4_operands(N, K, gs, "cpu", seed)


def test_pack_round_trip_and_layout():
    q = torch.randint(0, 16, (5, 12))
    p = pack_int4(q)
    assert p.dtype == torch.uint8 and p.shape == (5, 6)
    assert torch.equal(p[:, 0], (q[:, 0] | (q[:, 1] << 4)).to(torch.uint8))  # even column in the low nibble
    assert torch.equal(unpack_int4(p), q.to(torch.uint8))


def test_dequantize_is_tinygemm_fake_quant():
    """The weight a layer serves equals what QAT's fake quant trained with (fake_quant_int4_tinygemm), bit for bit,
    when its codes, scales and zeros are torchao's tinygemm quantization of the same weight."""
    from torchao.quantization.quant_primitives import (
        MappingType,
        _choose_qparams_affine_tinygemm,
        _quantize_affine_tinygemm,
    )

    from hf_lowbit.kernels.fake_quant import fake_quant_int4_tinygemm

    gs = 32
    w = (torch.randn(16, 128) * 0.05).bfloat16()
    scale, zero = _choose_qparams_affine_tinygemm(w, MappingType.ASYMMETRIC, (1, gs), torch.int32, 0, 15,
                                                  scale_dtype=torch.bfloat16, zero_point_dtype=torch.bfloat16)
    q = _quantize_affine_tinygemm(w, [1, gs], scale, zero, torch.int32, 0, 15)
    deq = int4_dequantize(pack_int4(q), scale.reshape(16, -1), zero.reshape(16, -1), gs)
    assert torch.equal(deq, fake_quant_int4_tinygemm(w, gs))


def test_from_tinygemm_layout():
    """torchao's scale_and_zero ([G_pad, N_pad, 2], packed by its own pack_tinygemm_scales_and_zeros) and padded codes
    to our layout: padding dropped, exact."""
    from torchao.quantization.utils import pack_tinygemm_scales_and_zeros

    N, K, gs, N_pad, K_pad = 20, 96, 32, 24, 1024
    q = torch.randint(0, 16, (N_pad, K_pad), dtype=torch.uint8)
    s = torch.rand(N_pad, K_pad // gs).bfloat16()
    z = torch.randn(N_pad, K_pad // gs).bfloat16()
    sz = pack_tinygemm_scales_and_zeros(s, z)
    assert sz.shape == (K_pad // gs, N_pad, 2)
    packed, scales, zeros = from_tinygemm(q, sz, (N, K), gs)
    assert torch.equal(packed, pack_int4(q[:N, :K]))
    assert torch.equal(scales, s[:N, :K // gs]) and torch.equal(zeros, z[:N, :K // gs])
    assert scales.is_contiguous() and zeros.is_contiguous()
    with pytest.raises(ValueError, match="not a multiple"):
        from_tinygemm(q, sz, (N, 100), gs)


def test_op_checks_and_reference_path():
    _, p, s, z = _operands()
    x = torch.randn(3, 128).bfloat16()
    assert torch.equal(int4_linear(x, p, s, z, 32), int4_linear_reference(x, p, s, z, 32))
    with pytest.raises(RuntimeError, match="bf16"):
        int4_linear(x.float(), p, s, z, 32)
    with pytest.raises(RuntimeError, match="group_size"):
        int4_linear(x, p, s, z, 48)
    with pytest.raises(RuntimeError, match="group_size 16 must be a power of 2 >= 32"):  # tl.dot's K >= 16 on a GPU
        int4_linear(x, p, s[:, :8].repeat(1, 2), z[:, :8].repeat(1, 2), 16)


def _tile_module(bias=None, decode="tinygemm"):
    from _triton_checks import tile_operands

    p, s, z, qdata, sz = tile_operands(20, 256, 32, "cpu")
    return Int4ServingLinear(qdata, sz, 32, 256, 20, bias, decode), (p, s, z)


def test_module_forward_equals_reference():
    bias = torch.randn(20).bfloat16()
    m, (p, s, z) = _tile_module(bias)
    x = torch.randn(2, 5, 256)  # float32 in, float32 out, computed in bf16
    y = m(x)
    ref = int4_linear_reference(x.reshape(-1, 256).bfloat16(), p, s, z, 32).reshape(2, 5, 20)
    assert y.dtype == torch.float32 and torch.equal(y, (ref + bias).float())
    assert {n for n, _ in m.named_buffers()} == {"qdata", "scale_and_zero", "bias"}
    assert list(m.parameters()) == []
    assert "group_size=32" in repr(m) and "decode=tinygemm" in repr(m)
    with pytest.raises(ValueError, match="decode 'gemv'"):
        _tile_module(decode="gemv")


def test_op_compiles_without_graph_breaks():
    """The op traces into one compiled graph (fullgraph; a graph break would raise), forward and module alike."""
    from torch._dynamo.utils import counters

    m, _ = _tile_module(decode="triton")
    x = torch.randn(4, 256).bfloat16()
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(m, backend="aot_eager", fullgraph=True)
    assert torch.equal(compiled(x), m(x))
    assert sum(counters["graph_break"].values()) == 0
    torch._dynamo.reset()


def test_traced_inside_a_triton_op_under_compile(monkeypatch):
    """int4_tile_decode_triton sums its split-K slices in the graph when traced: the check must hold inside a
    triton_op's body while AOTAutograd traces it, also where torch.compiler.is_compiling() is False there (torch
    2.11, the device image: the profile still showed the split-sum kernel), and must not hold eagerly."""
    from hf_lowbit.kernels.triton_int4 import _traced

    seen = []

    @torch.library.triton_op("hf_lowbit_test::traced_probe", mutates_args=())
    def probe(x: torch.Tensor) -> torch.Tensor:
        seen.append(_traced(x))
        return x * 2

    probe(torch.ones(3))
    assert seen == [False]
    seen.clear()
    torch._dynamo.reset()
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: False)
    torch.compile(lambda x: probe(x) + 1, backend="aot_eager", fullgraph=True)(torch.ones(3))
    assert seen and all(seen), seen
    torch._dynamo.reset()


def test_use_int4_kernels_skips_with_reasons():
    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 8))
    report = use_int4_kernels(model)
    assert not report.swapped and len(report.skipped) == 2
    assert all("not Int4TilePackedTo4dTensor" in e.reason for e in report.skipped)
    assert type(model[0]) is nn.Linear


# ---- CUDA only: a real Int4TilePackedTo4dTensor, repacked ----

def _tinygemm_model(gs, N=1024, K=4096, seed=0):
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    torch.manual_seed(seed)
    # the second layer's out_features (520) is padded by torchao to a multiple of 8 (528), its bias kept aside
    model = nn.Sequential(nn.Linear(K, N, bias=False), nn.Linear(N, 520, bias=True)).to("cuda", torch.bfloat16)
    quantize_(model, Int4WeightOnlyConfig(group_size=gs, int4_packing_format="tile_packed_to_4d"))
    return model


@pytest.mark.cuda
@pytest.mark.parametrize("decode", ["tinygemm", "triton", "triton_factored", "triton_mma"])
@pytest.mark.parametrize("gs", [32, 64, 128, 256])
def test_repack_from_torchao_cuda(gs, decode):
    """Repacked from a real export's weight: the codes exactly (tinygemm's own product with the repacked bf16 weight
    equals ours within the order bound), and the swapped model's outputs (decode and prefill rows, eager and
    compiled) equal tinygemm's within a bf16 rounding of the result; the factored GEMV (which does not round the
    weight to bf16, so differs from tinygemm by up to that rounding, 2**-9 of each weight) layer by layer within
    its own bound of the exact product of the export's codes."""
    from _triton_checks import _factored_tol, exact_weight_parts

    from hf_lowbit.kernels.int4 import tinygemm_operands

    model = _tinygemm_model(gs)
    assert type(model[0].weight).__name__ == "Int4TilePackedTo4dTensor"
    ours = _tinygemm_model(gs)  # the same seed: the same weights, quantized the same
    qdata_ptr = ours[0].weight.qdata.data_ptr()
    report = use_int4_kernels(ours, decode=decode)
    swapped = {e.name for e in report.swapped}
    assert swapped == {"0", "1"}, report.summary()
    assert ours[0].qdata.data_ptr() == qdata_ptr and ours[0].decode == decode  # one copy: the export's own
    if decode == "triton_factored":
        layers = []
        for layer in ours:
            p, s, z = tinygemm_operands(layer.qdata, layer.scale_and_zero, (layer.out_features, layer.in_features), gs)
            q8, sd, zd = exact_weight_parts(p, s, z, gs)
            layers.append((layer, (p, s, z), (q8 * sd + zd).abs()))  # |W|, exact: once a layer
        for M in (1, 8, 16, 17, 300):
            x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
            for (layer, (p, s, z), w_abs), x in zip(layers, (x, model[0](x))):
                # the factored sums' bound plus, where the tile GEMV or the prefill path runs on the bf16 weight
                # instead, that weight's rounding, plus the bias added in bf16
                exact, tol = _factored_tol(x, p, s, z, gs)
                tol = tol + 2.0 ** -9 * x.double().abs() @ w_abs.T
                if layer.bias is not None:
                    exact = exact + layer.bias.double()
                    tol = tol + 2.0 ** -8 * exact.abs()
                for fn in (layer, torch.compile(layer, fullgraph=True)):
                    err = (fn(x).double() - exact).abs()
                    assert (err <= tol).all(), (M, layer.out_features, (err - tol).max().item())
            torch._dynamo.reset()
        return
    for M in (1, 8, 16, 17, 300):
        x = torch.randn(M, 4096, device="cuda", dtype=torch.bfloat16)
        ref = model(x)
        for fn in (ours, torch.compile(ours, fullgraph=True)):
            y = fn(x)
            err = (y.float() - ref.float()).abs()
            # the same bf16 weight and exact products; float32 sums in different orders, each layer's output
            # rounded to bf16 (the second layer's input differs by the first's roundings)
            assert (err <= 2 ** -6 * ref.float().abs() + 1e-2 * ref.float().abs().mean()).all(), (M, err.max())
        torch._dynamo.reset()


@pytest.mark.cuda
def test_repacked_weight_is_tinygemm_weight_cuda():
    """The bf16 weight our kernels form from an export's tile layout is tinygemm's: its product with the identity
    (every column of Wᵀ) equal."""
    from hf_lowbit.kernels.int4 import int4_tile_dequantize

    model = _tinygemm_model(128, K=2048)
    weight = model[1].weight  # 520 x 1024: N padded to 528 in torchao's layout
    gs = int(weight.block_size[-1])
    eye = torch.eye(1024, device="cuda", dtype=torch.bfloat16)
    tiny = torch.ops.aten._weight_int4pack_mm(eye, weight.qdata, gs, weight.scale_and_zero)[:, :520]
    ours = int4_tile_dequantize(weight.qdata, weight.scale_and_zero, gs, (520, 1024)).T
    # equal, unless tinygemm's bf16 FMA (one rounding) and our float32 sum then bf16 (two) differ somewhere: then
    # by one bf16 step, rarely (a float32 sum landing exactly on a bf16 tie); the count says how often
    diff = ours != tiny
    assert diff.float().mean().item() < 1e-4, f"{diff.sum().item()} of {diff.numel()} weights differ"
    assert ((ours.float() - tiny.float()).abs() <= 2 ** -7 * tiny.float().abs()).all()


def test_benchmark_int4_on_cpu(capsys):
    """benchmarks/benchmark_int4.py: parses its flags, says on a CPU that it needs CUDA; its table from a row."""
    import importlib.util
    import os

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "benchmark_int4.py")
    spec = importlib.util.spec_from_file_location("benchmark_int4", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    if not torch.cuda.is_available():
        bench.main(["--ms", "1", "--shapes", "64x1024", "--sweep"])
        assert "no CUDA device" in capsys.readouterr().out
    row = {"N": 4096, "K": 4096, "M": 1, "split_k": 2, "ours_us": 5.0, "ours_gb_s": 1800.0, "tile_us": 4.0,
           "tile_gb_s": 2200.0, "tinygemm_us": 9.0, "tinygemm_gb_s": 1000.0, "bf16_us": 12.0, "bf16_gb_s": 2800.0,
           "ours_vs_tinygemm": 1.8, "ours_vs_bf16": 2.4, "tile_vs_tinygemm": 2.25, "tile_vs_bf16": 3.0,
           "max_diff_vs_tinygemm": 0.0, "tile_max_diff_vs_tinygemm": 0.0, "max_abs_tinygemm": 1.0}
    sweep = {"N": 4096, "K": 4096, "M": 1, "kernel": "factored", "sweep": [128, 128, 4, 3], "split_k": 1,
             "ours_us": 5.0, "ours_gb_s": 1800.0}
    fact = dict(row, factored_us=3.0, factored_gb_s=3000.0, factored_vs_tinygemm=3.0, factored_vs_bf16=4.0,
                factored_max_diff_vs_tinygemm=0.01)
    lines = bench.markdown([row, fact, sweep])
    assert len({line.count("|") for line in lines[:4]}) == 1  # every row has the header's columns
    assert "| 4096x4096 | 1 | 2 | 5.0 | 1800 | 4.0 | 2200 |" in lines[2] and "2.25x" in lines[2]
    assert "| – | – | – | – | – | – | – | – | – | – | not installed |" in lines[2]
    assert "| 3.0 | 3000 | 3.00x | 4.00x | 1.00e-02 | – | – | – | – | – | not installed |" in lines[3]
    assert "| factored | (128, 128, 4, 3) |" in lines[-1]
