"""Run by tests/test_distributed.py: frozen quantized bases (NF4, INT8; compute dtype and INT8 compute) built from
a float32 model under ``fully_shard`` with FSDP2's bf16 mixed precision (``MixedPrecisionPolicy(param_dtype=
bfloat16)``, as accelerate's fsdp2.yaml sets) give outputs and input gradients bit-identical to the unsharded module
fed bf16 inputs: FSDP2 must not cast the float scales (it casts every floating-point *parameter* it shards to
``param_dtype``).

    python tests/_fsdp2_quantized_base.py <free port>              # one process, the integer codes as they are
    python tests/_fsdp2_quantized_base_carrier.py <free port>      # two, the codes in a float carrier (below)

The carrier: torch < 2.13's ``fully_shard`` (2.11, not installable in CI: its PyPI wheel is the CUDA build) cannot
shard integer parameters, so ``prepare_integer_params_for_fsdp2`` (forced here with ``torch_version="2.11.0"``) holds
the codes in a floating-point carrier of ``param_dtype``. 2.11 differs from 2.13 in two ways that matter here, read
from its source (torch/distributed/fsdp/_fully_shard/_fsdp_param.py): it creates each sharded parameter as
``nn.Parameter(dtensor)`` (``requires_grad=True``) before applying the flag, and ``init_dtype_attrs`` casts every
parameter whose dtype is not ``param_dtype``, integer or not. Both are no-ops for a floating parameter already of
``param_dtype``: the check asserts that every parameter the bases hand to ``fully_shard`` is one, that sharding is
real (each rank holds about half the code bytes, also for 75 rows split unevenly) and lossless, and that a
checkpoint written with integer codes loads into a carrier by its bytes.
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
from hf_lowbit.qlora import QuantizedBaseConfig  # noqa: E402


def run(rank: int, port: str, world: int, carrier: bool) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    plugin = SimpleNamespace(mixed_precision_policy=mp, ignored_modules=None)
    # (out, in); with the carrier also 75 rows split unevenly over 2 ranks (FSDP2 pads the flat carrier)
    for shape in ((128, 256), (75, 128)) if carrier else ((128, 256),):
        for fmt in ("nf4", "int8"):
            for compute in (None, MixedPrecisionConfig(format="int8")):
                torch.manual_seed(0)  # the same weights and inputs on every rank
                cfg = QuantizedBaseConfig(fmt, compute=compute)
                out_f, in_f = shape
                # float32 weights with a spread of row scales, so bf16-rounded scales would show
                w = torch.randn(out_f, in_f) * torch.logspace(-2, 1, out_f)[:, None]
                plain = cfg.make(torch.nn.Linear(in_f, out_f, bias=False).requires_grad_(False))
                plain.load_weight(w)
                model = torch.nn.Sequential(copy.deepcopy(plain))
                name = f"{fmt} {shape}, compute={compute and compute.format}"
                if carrier:
                    carried, whole = prepare_integer_params_for_fsdp2(plugin, model, "cpu", torch_version="2.11.0")
                    assert carried == ["0"] and whole == [] and plugin.ignored_modules is None, (name, carried, whole)
                    # what 2.11's fully_shard needs: floating parameters, none of a dtype it would cast
                    for pname, p in model.named_parameters():
                        assert p.is_floating_point() and p.dtype == mp.param_dtype, (name, pname, p.dtype)
                fully_shard(model, mp_policy=mp)
                if carrier:
                    q = model[0].qweight
                    assert isinstance(q, DTensor), name
                    local, full = q.to_local().numel(), q.numel()
                    assert local <= -(-full // world), (name, local, full)  # about half the codes per rank
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
                if carrier:  # a checkpoint written with integer codes loads into a carrier by its bytes
                    fresh = torch.nn.Sequential(copy.deepcopy(plain))
                    prepare_integer_params_for_fsdp2(plugin, fresh, "cpu", torch_version="2.11.0")
                    with torch.no_grad():
                        for code in fresh[0]._code_layout:
                            getattr(fresh[0], code).zero_()
                    fresh.load_state_dict({"0." + k: v for k, v in plain.state_dict().items()})
                    assert all(torch.equal(a, b) for a, b in zip(fresh[0]._stored(), plain._stored())), name
    if rank == 0:
        print("quantized bases in a float carrier under fully_shard (2 ranks) OK" if carrier else
              "quantized bases under fully_shard + bf16 mixed precision OK")
    dist.barrier()  # no rank tears gloo down while the other is still in it (a SIGABRT at exit, seen in CI)
    dist.destroy_process_group()


def main(port: str, carrier: bool = False) -> None:
    world = 2 if carrier else 1
    torch.multiprocessing.spawn(run, args=(port, world, carrier), nprocs=world)


if __name__ == "__main__":
    main(sys.argv[1])
