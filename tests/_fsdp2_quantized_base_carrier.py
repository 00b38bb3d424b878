"""Run by tests/test_distributed.py: 2 gloo CPU processes. Quantized bases (NF4, INT8; compute dtype and INT8
compute) whose integer codes are held in a floating-point carrier (``prepare_integer_params_for_fsdp2`` as it
acts on torch < 2.13, forced here with ``torch_version="2.11.0"``) are sharded by ``fully_shard`` under bf16
mixed precision and give outputs and input gradients bit-identical to the unsharded integer module.

torch 2.11's ``fully_shard`` (not installable in CI: its PyPI wheel is the CUDA build) differs from 2.13 in
two ways that matter here, read from its source (torch/distributed/fsdp/_fully_shard/_fsdp_param.py):
it creates each sharded parameter as ``nn.Parameter(dtensor)`` (``requires_grad=True``) before applying the
flag, and ``init_dtype_attrs`` casts every parameter whose dtype is not ``param_dtype``, integer or not.
Both are no-ops for a floating parameter already of ``param_dtype``: this script asserts that every
parameter the bases hand to ``fully_shard`` is one, then that sharding is real (each rank holds about half
the code bytes) and lossless.

    python tests/_fsdp2_quantized_base_carrier.py <free port>
"""

import copy
import os
import sys
from types import SimpleNamespace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_lowbit.integrations.distributed import prepare_integer_params_for_fsdp2  # noqa: E402
from hf_lowbit.mixed_precision import MixedPrecisionConfig  # noqa: E402
from hf_lowbit.qlora.base import QuantizedBaseConfig  # noqa: E402

WORLD = 2


def run(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = SimpleNamespace(mixed_precision_policy=mp, ignored_modules=None)
    # (out, in): 75 rows split unevenly over 2 ranks (FSDP2 pads the flat carrier)
    for shape in ((128, 256), (75, 128)):
        for fmt in ("nf4", "int8"):
            for compute in (None, MixedPrecisionConfig(format="int8")):
                torch.manual_seed(0)  # the same weights and inputs on every rank
                cfg = QuantizedBaseConfig(fmt, compute=compute)
                out_f, in_f = shape
                w = torch.randn(out_f, in_f) * torch.logspace(-2, 1, out_f)[:, None]
                plain = cfg.make(torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False))
                plain.load_weight(w)
                model = torch.nn.Sequential(copy.deepcopy(plain))
                name = f"{fmt} {shape}, compute={compute and compute.format}"
                carried, whole = prepare_integer_params_for_fsdp2(plugin, model, "cpu", torch_version="2.11.0")
                assert carried == ["0"] and whole == [] and plugin.ignored_modules is None, (name, carried, whole)
                # what 2.11's fully_shard needs: floating parameters, none of a dtype it would cast
                for pname, p in model.named_parameters():
                    assert p.is_floating_point() and p.dtype == mp.param_dtype, (name, pname, p.dtype)
                fully_shard(model, mp_policy=mp)
                base = model[0]
                q = base.qweight
                assert isinstance(q, DTensor), name
                local, full = q.to_local().numel(), q.numel()
                assert local <= -(-full // WORLD), (name, local, full)  # about half the codes per rank
                ref_codes = plain.qweight.view(torch.uint8).reshape(-1)
                assert torch.equal(q.full_tensor().view(torch.uint8).reshape(-1), ref_codes), name
                x = torch.randn(4, 8, in_f)
                xs, xp = x.clone().requires_grad_(), x.to(torch.bfloat16).requires_grad_()
                ys, yp = model(xs), plain(xp)
                assert ys.dtype == yp.dtype == torch.bfloat16, (name, ys.dtype, yp.dtype)
                ys.float().square().mean().backward()
                yp.float().square().mean().backward()
                assert torch.equal(ys, yp), f"{name}: outputs differ by {(ys.float() - yp.float()).abs().max().item():.3g}"
                assert torch.equal(xs.grad, xp.grad.float()), name
                # a checkpoint written with integer codes loads into a carrier by its bytes
                fresh = torch.nn.Sequential(copy.deepcopy(plain))
                prepare_integer_params_for_fsdp2(plugin, fresh, "cpu", torch_version="2.11.0")
                with torch.no_grad():
                    for code in fresh[0]._code_layout:
                        getattr(fresh[0], code).zero_()
                fresh.load_state_dict({"0." + k: v for k, v in plain.state_dict().items()})
                assert all(torch.equal(a, b) for a, b in zip(fresh[0]._stored(), plain._stored())), name
    if rank == 0:
        print("quantized bases in a float carrier under fully_shard (2 ranks) OK")
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
