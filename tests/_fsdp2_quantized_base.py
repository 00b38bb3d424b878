"""Run by tests/test_distributed.py in its own process (a gloo process group of one): frozen quantized
bases (NF4, INT8; compute dtype and INT8 compute) built from a float32 model under ``fully_shard`` with
FSDP2's bf16 mixed precision (``MixedPrecisionPolicy(param_dtype=bfloat16)``, as accelerate's fsdp2.yaml
sets) give outputs and input gradients bit-identical to the unsharded module fed bf16 inputs: FSDP2
must not cast the float scales (it casts every floating-point *parameter* it shards to ``param_dtype``).

    python tests/_fsdp2_quantized_base.py <free port>
"""

import copy
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard  # noqa: E402

from hf_lowbit.mixed_precision import MixedPrecisionConfig  # noqa: E402
from hf_lowbit.qlora.base import QuantizedBaseConfig  # noqa: E402

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="0", WORLD_SIZE="1")
dist.init_process_group("gloo")
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for fmt in ("nf4", "int8"):
    for compute in (None, MixedPrecisionConfig(format="int8")):
        torch.manual_seed(0)
        cfg = QuantizedBaseConfig(fmt, compute=compute)
        # float32 weights with a spread of row scales, so bf16-rounded scales would show
        w = torch.randn(128, 256) * torch.logspace(-2, 1, 128)[:, None]
        plain = cfg.make(torch.nn.Linear(256, 128, bias=False).requires_grad_(False))
        plain.load_weight(w)
        sharded = copy.deepcopy(plain)
        fully_shard(sharded, mp_policy=mp)
        x = torch.randn(4, 8, 256)
        xs, xp = x.clone().requires_grad_(), x.to(torch.bfloat16).requires_grad_()
        ys, yp = sharded(xs), plain(xp)
        assert ys.dtype == yp.dtype == torch.bfloat16, (ys.dtype, yp.dtype)
        ys.float().square().mean().backward(); yp.float().square().mean().backward()
        name = f"{fmt}, compute={compute and compute.format}"
        assert torch.equal(ys, yp), f"{name}: outputs differ by {(ys.float() - yp.float()).abs().max().item():.3g}"
        assert torch.equal(xs.grad, xp.grad.float()), name
print("quantized bases under fully_shard + bf16 mixed precision OK")
dist.destroy_process_group()
