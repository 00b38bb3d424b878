"""Child process of tests/test_fault.py: ``hf_lowbit.cli.sft.main(<sft flags>)`` -- the command a user runs --
SIGKILLed at one phase of the run, or run to the end (``none``):

    python tests/_fault_child.py PHASE <sft flags>

* ``step``: inside the 3rd optimizer step, after its backward, before the optimizer updates anything;
* ``checkpoint``: saving checkpoint-4, after the model is written and with optimizer.pt half written;
* ``final_write``: in the final ``save_model``, after the weights are written to its staging directory;
* ``final_publish``: in the final ``save_model``, with the first staged file moved into ``--output_dir``;
* ``export``: in ``save_quantized``, after the new weights are written to its staging directory.

Each logged loss is printed as ``LOSS <step> <repr>`` as it is logged, so the test sees the losses of a run
that dies later.
"""

import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from transformers import PreTrainedModel, Trainer  # noqa: E402

from hf_lowbit import atomic  # noqa: E402
from hf_lowbit.cli.sft import main  # noqa: E402
from hf_lowbit.trainer import LowBitTrainerMixin  # noqa: E402


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(phase: str) -> None:
    if phase == "step":
        training_step = Trainer.training_step

        def step_then_die(self, *args, **kwargs):
            loss = training_step(self, *args, **kwargs)
            if self.state.global_step == 2:  # the 3rd step's gradients are in, the weights not updated yet
                die()
            return loss

        Trainer.training_step = step_then_die
    elif phase == "checkpoint":
        save_optimizer = Trainer._save_optimizer_and_scheduler

        def save_then_die_at_step_4(self, output_dir):
            if self.state.global_step == 4:  # the model is written; the optimizer state half written
                with open(os.path.join(output_dir, "optimizer.pt"), "wb") as f:
                    f.write(b"partial")
                die()
            return save_optimizer(self, output_dir)

        Trainer._save_optimizer_and_scheduler = save_then_die_at_step_4
    elif phase in ("final_write", "export"):
        staging = atomic.MODEL_STAGING if phase == "final_write" else atomic.TMP + "quantized"
        save_pretrained = PreTrainedModel.save_pretrained

        def write_then_die(self, save_directory, *args, **kwargs):  # the new weights are on disk, nothing else is
            save_pretrained(self, save_directory, *args, **kwargs)
            if os.path.basename(os.path.normpath(save_directory)) == staging:
                die()

        PreTrainedModel.save_pretrained = write_then_die
    elif phase == "final_publish":
        replace = os.replace

        def move_one_then_die(src, dst, *args, **kwargs):
            replace(src, dst, *args, **kwargs)
            if os.path.basename(os.path.dirname(src)) == atomic.MODEL_STAGING:
                die()

        atomic.os.replace = move_one_then_die
    elif phase != "none":
        raise SystemExit(f"unknown phase {phase}")


def print_losses() -> None:
    log = LowBitTrainerMixin.log

    def log_and_print(self, logs, *args, **kwargs):
        if "loss" in logs:
            print(f"LOSS {self.state.global_step} {logs['loss']!r}", flush=True)
        return log(self, logs, *args, **kwargs)

    LowBitTrainerMixin.log = log_and_print


if __name__ == "__main__":
    kill_at(sys.argv[1])
    print_losses()
    main(sys.argv[2:])
    print("COMPLETED", flush=True)
