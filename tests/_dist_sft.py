"""Test launcher: ``hf_lowbit.cli.sft.main`` in CPU processes (gloo), under FSDP2 when accelerate asks for it.

accelerate 1.15 turns FSDP on only for accelerator devices (the Trainer would silently use DDP in CPU
processes); ``benchmarks.driver.allow_fsdp_on_cpu`` lets it shard on a CPU mesh with gloo. Several runs,
separated by ``---``, share one launch (process start-up is most of a tiny run's time):

    ACCELERATE_USE_CPU=1 accelerate launch --config_file accelerate_configs/fsdp2.yaml \
        --num_processes 2 --mixed_precision no tests/_dist_sft.py <sft flags> [--- <sft flags> ...]
"""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from benchmarks.driver import allow_fsdp_on_cpu  # noqa: E402


def allow_deepspeed_on_cpu() -> None:
    """Let accelerate count DeepSpeed's CPU processes (``DS_ACCELERATOR=cpu``, gloo).

    accelerate 1.15 picks a backend only for accelerator devices or ``cpu=True``, and ``cpu=True`` turns DeepSpeed
    off. Without a device it leaves the backend ``None`` after DeepSpeed has initialised gloo itself, and then
    counts ONE process, so DeepSpeed's batch check fails (train_batch_size 4 != 4 * 1 * 2). This reports what
    DeepSpeed set up: gloo over the launcher's processes."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    prepare = PartialState._prepare_backend

    def prepare_gloo(self, cpu=False, sagemaker_dp=False, backend=None):
        found = prepare(self, cpu, sagemaker_dp, backend)
        if found == (None, DistributedType.NO) and os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true":
            return "gloo", DistributedType.MULTI_CPU
        return found

    PartialState._prepare_backend = prepare_gloo


allow_fsdp_on_cpu()
if os.environ.get("DS_ACCELERATOR") == "cpu":
    allow_deepspeed_on_cpu()

from hf_lowbit.cli.sft import main  # noqa: E402


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
    # A clean end on every rank: wait for the others, take the process group down, then leave without the
    # interpreter's C++ teardown. Once (CI at 14a9df5, 2 xdist workers busy) a rank of a 2-process gloo run aborted
    # there ("terminate called without an active exception", exit -6) after its runs had finished and saved.
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
