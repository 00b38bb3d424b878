"""Run by tests/test_distributed.py: 2 gloo CPU processes. The low-bit FSDP2 all-gather
(``enable_lowbit_all_gather``, ``lowbit_fsdp_lowbit_all_gather``) against FSDP2's default bf16 gather, INT8 and
FP8, fp32 master weights, bf16 ``param_dtype``, fp32 ``reduce_dtype``:

* the same model sharded with and without it, 3 AdamW steps on per-rank data: losses, outputs, input
  gradients and the reduce-scattered weight gradients are bit-identical at every step (the per-row scales of
  a dim-0 shard are the unsharded weight's, and both paths quantize the same bf16 cast), and the optimizer's
  state stays plain tensors;
* against the unsharded model (its weights cast to bf16, per-call quantization; the same batch on both
  ranks): output and input gradient bit-identical, weight gradients equal to the unsharded bf16 gradient
  (FSDP2 sums the two ranks' identical bf16 gradients in fp32 and halves: exact);
* what ``fsdp_pre_all_gather`` hands FSDP2: 1 + 4/K bytes a weight, about half of bf16's 2;
* ``state_dict()`` (sharded and unsharded), ``get_model_state_dict`` (full) and a DCP save/load hold plain
  tensors, and a DCP load into a flagged model keeps the flag working;
* a weight whose rows do not split evenly falls back to the bf16 gather (a ``LowBitWarning``), same outputs
  and gradients.

    python tests/_fsdp2_lowbit_all_gather.py <free port>
"""

import os
import sys
import tempfile
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,  # noqa: E402
                                                     set_model_state_dict)
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_lowbit.integrations.distributed import enable_lowbit_all_gather  # noqa: E402
from hf_lowbit.mixed_precision.fsdp_all_gather import LowBitAllGatherWeight  # noqa: E402
from hf_lowbit.mixed_precision import MixedPrecisionConfig, MixedPrecisionLinear  # noqa: E402
from hf_lowbit.warnings import LowBitWarning  # noqa: E402

WORLD = 2
MP = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
GATHERED: list[tuple[int, torch.Size]] = []  # (bytes handed to the all-gather, shape of the weight shard)

_pre = LowBitAllGatherWeight.fsdp_pre_all_gather


def _recording_pre(self, mesh, outer_size, outer_stride, module, mp_policy):  # FSDP2 reads the arity
    inputs, meta = _pre(self, mesh, outer_size, outer_stride, module, mp_policy)
    GATHERED.append((sum(t.numel() * t.element_size() for t in inputs), self._tensor.shape))
    return inputs, meta


LowBitAllGatherWeight.fsdp_pre_all_gather = _recording_pre


def make(fmt: str, out2: int = 64) -> torch.nn.Sequential:
    torch.manual_seed(0)  # the same weights on every rank
    cfg = MixedPrecisionConfig(format=fmt)
    return torch.nn.Sequential(MixedPrecisionLinear.from_linear(torch.nn.Linear(64, 128), cfg), torch.nn.GELU(),
                               MixedPrecisionLinear.from_linear(torch.nn.Linear(128, out2), cfg))


def shard(model: torch.nn.Sequential, lowbit: bool) -> torch.nn.Sequential:
    if lowbit:
        assert enable_lowbit_all_gather(model) == ["0", "2"]
    for m in model:
        if isinstance(m, MixedPrecisionLinear):
            fully_shard(m, mp_policy=MP)
    fully_shard(model, mp_policy=MP)
    return model


def plain_state(sd: dict) -> None:
    for k, v in sd.items():
        local = v._local_tensor if isinstance(v, DTensor) else v
        assert type(local) in (torch.Tensor, torch.nn.Parameter), (k, type(local))


def run(rank: int, port: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)
    warnings.simplefilter("error", LowBitWarning)
    for fmt in ("int8", "fp8"):
        # 1. with vs without the flag, training on each rank's own data
        default, lowbit = shard(make(fmt), False), shard(make(fmt), True)
        assert isinstance(lowbit[0].weight._local_tensor, LowBitAllGatherWeight), fmt
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (default, lowbit)]
        for step in range(3):
            torch.manual_seed(100 + 10 * step + rank)
            x = torch.randn(4, 8, 64)
            outs = []
            for m, opt in zip((default, lowbit), opts):
                xi = x.clone().requires_grad_()
                y = m(xi)
                loss = y.float().square().mean()
                loss.backward()
                grads = [p.grad.full_tensor() for p in m.parameters()]
                outs.append((loss, y, xi.grad, grads))
                opt.step()
                opt.zero_grad()
            (l0, y0, dx0, g0), (l1, y1, dx1, g1) = outs
            where = f"{fmt} step {step}"
            assert torch.equal(l0, l1) and torch.equal(y0, y1) and torch.equal(dx0, dx1), where
            assert all(torch.equal(a, b) for a, b in zip(g0, g1)), where
        for p in lowbit.parameters():
            assert all(type(s._local_tensor if isinstance(s, DTensor) else s) is torch.Tensor
                       for s in opts[1].state[p].values()), fmt
        # all-gather inputs: 1 byte per code + 4 per row scale, vs 2 per weight in bf16
        assert len(GATHERED) >= 2 * 3 * 2, len(GATHERED)  # 2 layers, forward + backward, 3 steps
        for nbytes, (rows, k) in GATHERED:
            assert nbytes == rows * (k + 4) and nbytes / (2 * rows * k) <= 0.5 + 2 / 64, (nbytes, rows, k)
        if rank == 0:
            ratio = max(n / (2 * r * k) for n, (r, k) in GATHERED)
            print(f"{fmt}: all-gather input bytes / bf16 bytes <= {ratio:.4f}")
        GATHERED.clear()

        # 2. against the unsharded model with per-call quantization, the same batch on both ranks
        ref, lowbit = make(fmt).to(torch.bfloat16), shard(make(fmt), True)
        torch.manual_seed(7)
        x = torch.randn(4, 8, 64)
        xr, xl = x.to(torch.bfloat16).requires_grad_(), x.clone().requires_grad_()
        yr, yl = ref(xr), lowbit(xl)
        yr.float().square().mean().backward()
        yl.float().square().mean().backward()
        assert torch.equal(yr, yl) and torch.equal(xr.grad.float(), xl.grad), fmt
        for (n, a), b in zip(ref.named_parameters(), lowbit.parameters()):
            assert torch.equal(a.grad.float(), b.grad.full_tensor()), (fmt, n)

        # 3. state dicts hold plain tensors; a DCP checkpoint round-trips into a flagged model
        sd = lowbit.state_dict()
        plain_state(sd)
        full = get_model_state_dict(lowbit, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        plain_state(full)
        master = make(fmt).state_dict()
        assert rank != 0 or all(torch.equal(full[k], master[k]) for k in master), fmt
        path = [tempfile.mkdtemp() if rank == 0 else None]
        dist.broadcast_object_list(path)
        dcp.save(get_model_state_dict(lowbit), checkpoint_id=path[0])
        fresh = make(fmt)
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh = shard(fresh, True)
        sharded_sd = get_model_state_dict(fresh)
        plain_state(sharded_sd)
        dcp.load(sharded_sd, checkpoint_id=path[0])
        set_model_state_dict(fresh, sharded_sd)
        assert isinstance(fresh[2].weight._local_tensor, LowBitAllGatherWeight), fmt
        for a, b in zip(fresh.parameters(), lowbit.parameters()):
            assert torch.equal(a.full_tensor(), b.full_tensor()), fmt
        assert torch.equal(fresh(x), lowbit(x)), fmt
        GATHERED.clear()

    # 4. 75 rows over 2 ranks: FSDP2 needs padded-shard-sized inputs, so the layer falls back to bf16
    default, lowbit = shard(make("int8", out2=75), False), make("int8", out2=75)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lowbit = shard(lowbit, True)
        torch.manual_seed(11 + rank)
        x = torch.randn(2, 8, 64)
        x0, x1 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y0, y1 = default(x0), lowbit(x1)
        y0.float().square().mean().backward()
        y1.float().square().mean().backward()
    assert torch.equal(y0, y1) and torch.equal(x0.grad, x1.grad)
    for (n, a), b in zip(default.named_parameters(), lowbit.parameters()):  # reduce-scattered, fallback included
        assert torch.equal(a.grad.full_tensor(), b.grad.full_tensor()), n
    assert any(issubclass(w.category, LowBitWarning) and "lowbit_fsdp_lowbit_all_gather" in str(w.message)
               for w in caught), [str(w.message) for w in caught]
    if rank == 0:
        print("low-bit all-gather under fully_shard (2 ranks) OK")
    dist.barrier()  # no rank tears gloo down while the other is still in it (a SIGABRT at exit, seen in CI)
    dist.destroy_process_group()


if __name__ == "__main__":
    torch.multiprocessing.spawn(run, args=(sys.argv[1],), nprocs=WORLD)
