"""Child process of tests/test_fault.py: trains a tiny model and, in the *_kill modes, SIGKILLs itself in
the middle of a Trainer checkpoint save or of ``save_quantized``."""

import os
import signal
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

from conftest import ARITH_TOKENIZER, arithmetic_blocks, tiny_model  # noqa: E402
from transformers import Trainer  # noqa: E402

from hf_lowbit import LowBitTrainer, LowBitTrainingArguments  # noqa: E402


def die():
    sys.stdout.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def args(out, **kw):
    base = dict(output_dir=out, per_device_train_batch_size=4, learning_rate=1e-3, report_to="none", logging_steps=1,
                disable_tqdm=True, use_cpu=True, dataloader_pin_memory=False, seed=0, save_strategy="no")
    base.update(kw)
    return LowBitTrainingArguments(**base)


mode, out = sys.argv[1], sys.argv[2]
if mode in ("checkpoint_kill", "resume"):
    a = args(out, max_steps=6, save_strategy="steps", save_steps=2, int8_mixed_precision=True, lowbit_min_features=16)
    trainer = LowBitTrainer(tiny_model(), args=a, train_dataset=arithmetic_blocks(64, 32))
    if mode == "checkpoint_kill":
        original = Trainer._save_optimizer_and_scheduler

        def save_then_die_at_step_4(self, output_dir):
            if self.state.global_step == 4:  # the model is written; the optimizer state half written
                with open(os.path.join(output_dir, "optimizer.pt"), "wb") as f:
                    f.write(b"partial")
                die()
            return original(self, output_dir)

        Trainer._save_optimizer_and_scheduler = save_then_die_at_step_4
        trainer.train()
    else:
        trainer.train(resume_from_checkpoint=True)
        print(f"GLOBAL_STEP {trainer.state.global_step}")
elif mode in ("export", "export_kill"):
    a = args(out + "-run", max_steps=1 if mode == "export" else 3, qat_scheme="8da4w", qat_group_size=32)
    trainer = LowBitTrainer(tiny_model(), args=a, train_dataset=arithmetic_blocks(16, 32), processing_class=ARITH_TOKENIZER)
    trainer.train()
    if mode == "export_kill":
        from transformers import PreTrainedModel

        original = PreTrainedModel.save_pretrained

        def write_then_die(self, *pargs, **kw):  # the new weights are on disk, nothing else is
            original(self, *pargs, **kw)
            die()

        PreTrainedModel.save_pretrained = write_then_die
    trainer.save_quantized(out)
    print("EXPORTED")
