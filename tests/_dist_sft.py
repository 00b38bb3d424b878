"""Test launcher: ``hf_lowbit.sft.main`` in CPU processes (gloo), under FSDP2 when accelerate asks for it.

accelerate 1.15 turns FSDP on only for accelerator devices: in CPU processes (``ACCELERATE_USE_CPU``)
``AcceleratorState`` keeps ``MULTI_CPU`` and the Trainer silently wraps the model in DDP instead.
torch's ``fully_shard`` itself works on a CPU device mesh with gloo, so this launcher (tests only)
lets the state take the FSDP plugin that the launcher configured, as it does on GPUs. Several runs,
separated by ``---``, share one launch (process start-up is most of a tiny run's time):

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/fsdp2.yaml \
        --num_processes 2 --mixed_precision no tests/_dist_sft.py <sft flags> [--- <sft flags> ...]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from accelerate.state import AcceleratorState, PartialState  # noqa: E402
from accelerate.utils import DistributedType  # noqa: E402

_init = AcceleratorState.__init__


def _init_with_cpu_fsdp(self, *args, fsdp_plugin=None, **kwargs):
    _init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
    if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
        if self.mixed_precision != "no":
            fsdp_plugin.set_mixed_precision(self.mixed_precision)
        # what AcceleratorState does for GPU processes (it keeps PartialState in step the same way)
        self.distributed_type = PartialState._shared_state["distributed_type"] = DistributedType.FSDP
        self.fsdp_plugin = fsdp_plugin


AcceleratorState.__init__ = _init_with_cpu_fsdp

from hf_lowbit.sft import main  # noqa: E402


def split_runs(argv: list[str]) -> list[list[str]]:
    runs = [[]]
    for a in argv:
        if a == "---":
            runs.append([])
        else:
            runs[-1].append(a)
    return [r for r in runs if r]


if __name__ == "__main__":
    for run in split_runs(sys.argv[1:]):
        main(run)
