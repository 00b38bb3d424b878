"""The mma GEMV (``decode="triton_mma"``) beside the factored one (one row at a time, CUDA cores) and tinygemm on a real
torchao tinygemm export (``tests/test_triton_int4._tinygemm_model``): per layer, group size, M and split-K, the largest
|difference| and where. Needs CUDA and torchao. On the device: ``PYTHONPATH=<wheels>:. python3 tools/int4_mma_diag.py``
(issue 26; its output for 51cd30c: docs/results/diag/int4_mma_vs_factored_h200_51cd30c.txt, when the mma GEMV
summed the factored form on tensor cores; since session 26 it forms tinygemm's bf16 weight instead, so it should sit
by tinygemm, not by the factored GEMV: not yet run)."""
import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))


def main() -> None:
    from test_triton_int4 import _tinygemm_model

    from hf_lowbit.kernels.triton_int4 import int4_tile_decode_triton

    for gs in (128, 256):
        model = _tinygemm_model(gs)
        for li in (0, 1):
            w = model[li].weight
            N, K = w.shape
            for M in (1, 3, 8, 16):
                torch.manual_seed(M)
                x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16) * (1 if li == 0 else 0.3)
                mma = lambda sk=None: int4_tile_decode_triton(  # noqa: E731
                    x, w.qdata, w.scale_and_zero, gs, N, split_k=sk, kernel="mma").float()
                fact = torch.cat([int4_tile_decode_triton(x[i:i + 1], w.qdata, w.scale_and_zero, gs, N,
                                                          kernel="factored") for i in range(M)]).float()
                tiny = torch.ops.aten._weight_int4pack_mm(x, w.qdata, gs, w.scale_and_zero)[:, :N].float()
                d, dt = (mma() - fact).abs(), (tiny - fact).abs()
                r, c = divmod(int(d.argmax()), N)
                rows = [f"{v:.1e}" for v in d.max(1).values.tolist()]
                print(f"gs{gs} layer{li} N{N} K{K} M{M}: |mma-fact| max {d.max():.3e} at ({r},{c}) y={fact[r, c]:.4f}; "
                      f"rows {rows}; |tiny-fact| max {dt.max():.3e}; mean|y| {fact.abs().mean():.3f}; "
                      f"cols>1e-2 {sorted(set((d > 1e-2).nonzero()[:, 1].tolist()))[:20]}", flush=True)
                for sk in (1, 3):
                    print(f"   split_k={sk}: |mma-fact| max {(mma(sk) - fact).abs().max():.3e}", flush=True)


if __name__ == "__main__":
    main()
