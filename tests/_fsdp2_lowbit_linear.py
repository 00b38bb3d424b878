"""Run by tests/test_distributed.py in its own process (it initializes a gloo process group of one):
LowBitLinear under torch's ``fully_shard`` gets plain all-gathered tensors in its forward and gives
outputs and gradients bit-identical to the unsharded module, INT8 and FP8.

    python tests/_fsdp2_lowbit_linear.py <free port>
"""

import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import fully_shard  # noqa: E402
from torch.distributed.tensor import DTensor  # noqa: E402

from hf_lowbit.mixed_precision import LowBitLinear, MixedPrecisionConfig  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
for fmt in ("int8", "fp8"):
    torch.manual_seed(0)
    cfg = MixedPrecisionConfig(format=fmt)
    plain = torch.nn.Sequential(LowBitLinear.from_linear(torch.nn.Linear(64, 128), cfg), torch.nn.GELU(),
                                LowBitLinear.from_linear(torch.nn.Linear(128, 64), cfg))
    sharded = copy.deepcopy(plain)
    seen = []
    for m in sharded:
        if isinstance(m, LowBitLinear):
            m.register_forward_pre_hook(lambda m, args: seen.append(type(m.weight)))
            fully_shard(m)
    fully_shard(sharded)
    x = torch.randn(4, 8, 64)
    xs, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
    ys, yp = sharded(xs), plain(xp)
    ys.square().mean().backward(); yp.square().mean().backward()
    assert seen == [torch.nn.Parameter] * 2, seen  # the Function gets the all-gathered plain tensors
    assert isinstance(sharded[0].weight, DTensor)  # resharded after the step
    assert torch.equal(ys, yp) and torch.equal(xs.grad, xp.grad)
    for a, b in zip(sharded.parameters(), plain.parameters()):
        assert torch.equal(a.grad.full_tensor(), b.grad), fmt
print("fully_shard OK")
dist.barrier()  # no rank tears gloo down while the other is still in it (a SIGABRT at exit, seen in CI)
dist.destroy_process_group()
