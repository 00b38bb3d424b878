"""Every landed recipe under accelerate_configs/ddp.yaml, fsdp2.yaml and the DeepSpeed configs, in 2 CPU
processes (gloo; DeepSpeed through its CPU accelerator, where deepspeed is installed).

For each config, one ``accelerate launch`` (tests/_dist_sft.py) runs scripts/sft.py's embedded
default for every recipe in ``RECIPES`` (4 steps, 2 processes x 4 blocks, checkpoint every 2 steps)
and resumes the first recipe from its step-2 checkpoint. Compared with one process x 8 blocks:

* step 1 (same weights, same 8 blocks): equal within ``STEP1_ATOL`` -- only the order of the loss's float32
  sums differs. (``accelerate launch --cpu --num_processes 2`` starts ONE process; CPU multi-process needs the
  config's torchrun launcher with ``ACCELERATE_USE_CPU=1``. A wrong data split shows here at once.)
* later steps: within ``later_atol`` (derived there: 10% of the loss's descent since step 1). INT8/FP8 quantize
  the weight-gradient matmul dW = dYᵀ·X per feature across the tokens *of each process*, so each rank's
  scales differ from the single process's.
* FSDP2 vs DDP: within ``STEP1_ATOL`` at step 1 only. Later they differ as two runs of different reduction
  orders do: a one-ulp difference in an updated weight can flip one INT8 code (or QAT's int4 code), which
  moves a loss by more than any float32 rounding bound (seen: 7.5e-5 at step 4). Both are within ``later_atol``
  of the single process, so within twice that of each other; no tighter bound holds.
* resume from the step-2 checkpoint (sharded for FSDP2 and ZeRO-3): steps 3-4 equal the uninterrupted run
  (one process count, the same arithmetic on restored state; measured bit-identical).
"""

import importlib.util
import json
import os
import socket
import subprocess
import sys

import pytest
import torch
from conftest import once_per_run, run_root
from safetensors.torch import load_file

from hf_lowbit.cli.sft import main
from hf_lowbit.integrations.distributed import fsdp2_shards_integer_params

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# Adding a recipe is one entry: the scripts/sft.py flags that switch it on (the embedded default
# turns INT8 on, so each entry says what it wants of both).
RECIPES = {
    "int8_mixed_precision": ["--int8_mixed_precision", "True", "--fp8_mixed_precision", "False"],
    "fp8_mixed_precision": ["--int8_mixed_precision", "False", "--fp8_mixed_precision", "True"],
    "qat": ["--int8_mixed_precision", "False", "--fp8_mixed_precision", "False", "--qat_scheme", "8da4w"],
    "lora_base_quant": ["--int8_mixed_precision", "True", "--fp8_mixed_precision", "False", "--lora_base_quant", "nf4"],
    "lora_int8_base": ["--int8_mixed_precision", "True", "--fp8_mixed_precision", "False", "--lora_base_quant", "int8"],
}
REPORT = {"lora_int8_base": "lora_base_quant"}  # recipe -> the swap report it prints (default: its own name)
CONFIGS = {"ddp": "MULTI_CPU", "fsdp2": "FSDP", "deepspeed_zero2": "DEEPSPEED"}  # config -> accelerate's type
HAS_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
NEEDS_DEEPSPEED = pytest.mark.skipif(not HAS_DEEPSPEED, reason="deepspeed is not installed (not in requirements/ci.txt; "
                                     "its refusals are tested without it)")
STEPS, GLOBAL_BATCH, PROCESSES = 4, 8, 2
# Step 1: the loss is a mean of 8 x 32 token losses (~2.8 each), summed pairwise or by blocks in float32 in
# either layout; each way errs by at most log2(256) * 2**-24 * 2.8 = 1.3e-6, so two ways differ by < 3e-6 (1e-5).
STEP1_ATOL = 1e-5
# Later steps: a quantized dW carries a relative error of at most 4.8% (FP8's 26.4 dB floor in test_numerics;
# INT8's 29.0 dB: 3.5%), placed differently in the two runs (per-process scales, other rounding flips), so to
# first order the two runs' updates move the loss by amounts that differ by up to 2 * 4.8% < 10% of what the
# updates move it: by step k the runs may differ by 10% of the single process's descent since step 1.
DESCENT_FRACTION = 0.1


def later_atol(ref: list[float], k: int) -> float:
    """How far a run may be from the single-process losses ``ref`` at step ``k + 1`` (see DESCENT_FRACTION)."""
    return STEP1_ATOL + DESCENT_FRACTION * max(abs(ref[0] - r) for r in ref[: k + 1])


RUN = ["--max_steps", str(STEPS), "--logging_steps", "1", "--block_size", "32", "--arithmetic_train_records", "400",
       "--arithmetic_eval_records", "4", "--eval_strategy", "no", "--lr_scheduler_type", "constant",
       "--warmup_steps", "0", "--report_to", "none", "--disable_tqdm", "True", "--seed", "0"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _losses(output_dir) -> tuple[dict, list[float]]:
    with open(os.path.join(output_dir, "sft_metrics.json")) as f:
        metrics = json.load(f)
    return metrics, metrics["train_losses"]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """Losses of each recipe in one process with the whole global batch (once per test run, whichever pytest-xdist
    workers run the configs)."""
    def compute():
        out = {}
        for recipe, flags in RECIPES.items():
            d = tmp_path_factory.mktemp(f"one-{recipe}")
            metrics = main(RUN + flags + ["--per_device_train_batch_size", str(GLOBAL_BATCH), "--save_strategy", "no",
                                          "--output_dir", str(d)])
            assert metrics["num_processes"] == 1
            out[recipe] = metrics["train_losses"]
        return out

    return once_per_run(tmp_path_factory, "distributed_one_process", compute)


def test_lowbit_linear_under_fully_shard():
    """fully_shard's DTensor parameters reach the INT8/FP8 Function as plain all-gathered tensors."""
    _run_script("_fsdp2_lowbit_linear.py", "fully_shard OK")


@pytest.mark.skipif(not fsdp2_shards_integer_params(), reason="this torch's fully_shard cannot shard integer "
                    "parameters (LowBitTrainer leaves quantized bases unsharded there)")
def test_quantized_bases_under_fully_shard_with_bf16_mixed_precision():
    """FSDP2's bf16 param_dtype casts floating parameters it shards: the bases' float scales must not be
    cast (they are buffers), so a sharded NF4 / INT8 base equals the unsharded one bit for bit."""
    _run_script("_fsdp2_quantized_base.py", "bf16 mixed precision OK")


def test_quantized_bases_sharded_in_a_float_carrier_as_on_torch_2_11():
    """torch < 2.13 cannot shard integer parameters: the bases' codes travel in a floating-point carrier of
    FSDP2's param_dtype instead; 2 ranks, bit-identical to the unsharded integer module."""
    _run_script("_fsdp2_quantized_base_carrier.py", "float carrier under fully_shard (2 ranks) OK")


def test_lowbit_all_gather_under_fully_shard():
    """lowbit_fsdp_lowbit_all_gather: weights all-gathered as INT8/FP8 codes + row scales (~0.53x bf16's bytes),
    bit-identical to FSDP2's bf16 gather and to unsharded per-call quantization; plain state dicts, DCP round trip."""
    _run_script("_fsdp2_lowbit_all_gather.py", "low-bit all-gather under fully_shard (2 ranks) OK")


def test_trainer_lowbit_all_gather_matches_the_bf16_gather(tmp_path):
    """LowBitTrainer under accelerate_configs/fsdp2.yaml (2 gloo processes, INT8, 2 steps) with and without
    lowbit_fsdp_lowbit_all_gather: the same losses and the same saved model.safetensors, bit for bit (this
    caught accelerate mapping the optimizer onto the sharded parameters by data_ptr(), 0 for a wrapper)."""
    common = [*RUN, "--max_steps", "2", "--arithmetic_train_records", "100", "--per_device_train_batch_size", "4",
              "--save_strategy", "no", *RECIPES["int8_mixed_precision"]]  # later flags win
    runs = common + ["--output_dir", str(tmp_path / "off"), "---"] + common + [
        "--lowbit_fsdp_lowbit_all_gather", "True", "--output_dir", str(tmp_path / "on")]
    proc = _accelerate("fsdp2", runs, timeout=300)
    assert proc.returncode == 0, _errors(proc.stderr)
    assert "lowbit_fsdp_lowbit_all_gather: 14 layers all-gather" in proc.stdout, proc.stdout[-3000:]
    metrics = [json.load(open(tmp_path / d / "sft_metrics.json")) for d in ("off", "on")]
    assert all(m["distributed_type"] == "FSDP" and m["num_processes"] == 2 for m in metrics)
    assert len(metrics[0]["train_losses"]) == 2 and metrics[0]["train_losses"] == metrics[1]["train_losses"], metrics
    off, on = (load_file(str(tmp_path / d / "model.safetensors")) for d in ("off", "on"))
    assert off.keys() == on.keys() and all(type(on[k]) is torch.Tensor and torch.equal(off[k], on[k]) for k in off)


def _launch(config: str, tmp_path) -> subprocess.CompletedProcess:
    per_rank = ["--per_device_train_batch_size", str(GLOBAL_BATCH // PROCESSES), "--save_strategy", "steps",
                "--save_steps", "2"]
    runs = []
    for recipe, flags in RECIPES.items():
        runs += RUN + flags + per_rank + ["--output_dir", str(tmp_path / recipe), "---"]
    first, first_flags = next(iter(RECIPES.items()))
    runs += RUN + first_flags + per_rank + ["--output_dir", str(tmp_path / "resumed"),
                                            "--resume_from_checkpoint", str(tmp_path / first / "checkpoint-2")]
    return _accelerate(config, runs, timeout=600)


def _accelerate(config: str, runs: list[str], timeout: int) -> subprocess.CompletedProcess:
    """``tests/_dist_sft.py runs`` under ``accelerate launch`` with ``accelerate_configs/<config>.yaml``, in
    PROCESSES gloo processes. ACCELERATE_USE_CPU: gloo processes from the config's (torchrun) launcher; DeepSpeed
    runs on its CPU accelerator instead (DS_ACCELERATOR=cpu: gloo; ACCELERATE_USE_CPU would turn DeepSpeed off).
    ACCELERATE_TORCH_DEVICE=cpu: the Trainer maps a resumed DDP optimizer state to args.device, and "cpu:0" is
    not a location torch.load knows."""
    cpu = {"DS_ACCELERATOR": "cpu"} if config.startswith("deepspeed") else {"ACCELERATE_USE_CPU": "1"}
    env = dict(os.environ, **cpu, ACCELERATE_TORCH_DEVICE="cpu", OMP_NUM_THREADS="1",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
           os.path.join(ROOT, "accelerate_configs", f"{config}.yaml"), "--num_processes", str(PROCESSES),
           "--mixed_precision", "no", "--main_process_port", str(_free_port()), os.path.join(ROOT, "tests", "_dist_sft.py"), *runs]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _errors(stderr: str) -> str:
    """The end of ``stderr`` without the warnings FSDP2 repeats per parameter, so the error that failed shows."""
    noise = ("UserWarning", "warnings.warn", "returned a view tensor")
    return "\n".join(line for line in stderr.splitlines() if not any(n in line for n in noise))[-3000:]


def _run_script(name: str, marker: str) -> None:
    """``tests/<name> PORT`` (a 2-process gloo check); it must exit 0 and print ``marker``."""
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", name), str(_free_port())],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0 and marker in proc.stdout, _errors(proc.stderr) + proc.stdout[-1000:]


@pytest.mark.slow
@pytest.mark.parametrize("config", [c if c in ("ddp", "fsdp2") else pytest.param(c, marks=NEEDS_DEEPSPEED)
                                    for c in CONFIGS])
def test_two_processes_match_one_and_resume(config, one_process, tmp_path, tmp_path_factory):
    proc = _launch(config, tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    run_losses = {}
    for recipe in RECIPES:
        metrics, losses = _losses(tmp_path / recipe)
        assert (metrics["distributed_type"], metrics["num_processes"]) == (CONFIGS[config], PROCESSES)
        ref = one_process[recipe]
        assert len(losses) == len(ref) == STEPS
        assert abs(losses[0] - ref[0]) <= STEP1_ATOL, (recipe, losses, ref)
        assert all(abs(a - b) <= later_atol(ref, k) for k, (a, b) in enumerate(zip(losses, ref))), (recipe, losses, ref)
        # the swap report prints on rank 0 only (the first recipe also prints for the resumed run)
        report = REPORT.get(recipe, recipe)
        printed = sum(REPORT.get(r, r) == report for r in RECIPES) + (report == next(iter(RECIPES)))
        assert proc.stdout.count(f"[hf_lowbit] {report}: 14 modules swapped") == printed
        # the final model is whole (FSDP2 gathers it for the last save) and holds every weight
        if report == "lora_base_quant":  # QLoRA saves the adapter (whole: gathered like the model)
            state = load_file(tmp_path / recipe / "adapter_model.safetensors")
            assert len([k for k in state if "lora_A" in k]) == 14 and all(v.numel() for v in state.values())
        else:
            state = load_file(tmp_path / recipe / "model.safetensors")
            assert "model.layers.1.mlp.down_proj.weight" in state and state["lm_head.weight"].shape == (16, 128)
        if recipe == "qat":  # save_quantized from a distributed run: gathered, converted, written once by rank 0
            with open(tmp_path / recipe / "quantized" / "config.json") as f:
                assert json.load(f)["quantization_config"]["quant_method"] == "torchao"
            assert (tmp_path / recipe / "quantized" / "model.safetensors").is_file()
        run_losses[recipe] = losses

    checkpoint = tmp_path / next(iter(RECIPES)) / "checkpoint-2"
    if config == "fsdp2":  # training checkpoints stay sharded (fsdp_state_dict_type: SHARDED_STATE_DICT)
        assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and not (checkpoint / "model.safetensors").exists()
    if config.startswith("deepspeed"):  # DeepSpeed's own checkpoint (optimizer partitions) beside the model
        assert (checkpoint / "global_step2").is_dir() and (checkpoint / "latest").read_text().strip() == "global_step2"
    _, resumed = _losses(tmp_path / "resumed")
    assert not (tmp_path / "resumed" / "checkpoint-2").exists()  # it started at step 2, not from scratch
    full = run_losses[next(iter(RECIPES))]
    assert resumed == full, (resumed, full)  # steps 1-2 from the checkpoint, 3-4 recomputed from its state: exact

    # FSDP2 and ZeRO-2 compute on each rank what DDP does: with the configs that ran in this session, step-1
    # losses agree as float32 sums in two orders do. Later steps: see the module docstring (no tighter bound holds).
    # Each config's losses go into a file of this test run, so the configs compare wherever pytest-xdist ran them.
    shared = run_root(tmp_path_factory)
    written = shared / f".distributed-losses-{config}.json.tmp"
    written.write_text(json.dumps(run_losses))
    os.replace(written, shared / f"distributed-losses-{config}.json")
    for path in shared.glob("distributed-losses-*.json"):
        other, losses = path.name[len("distributed-losses-"):-len(".json")], json.loads(path.read_text())
        for recipe in RECIPES:
            assert abs(losses[recipe][0] - run_losses[recipe][0]) <= STEP1_ATOL, (recipe, other, config)


ZERO3_RECIPES = ("int8_mixed_precision", "fp8_mixed_precision")  # QLoRA and QAT are refused under ZeRO-3


@pytest.mark.slow
@NEEDS_DEEPSPEED
def test_deepspeed_zero3_trains_int8_and_fp8_like_one_process_and_resumes(tmp_path):
    """accelerate_configs/deepspeed_zero3.yaml: the model is built already partitioned (zero.Init; so a model built
    from a config is initialised differently from one process's: both load the same saved model here), the recipes
    swap linears whose weights are empty placeholders, and DeepSpeed gathers them around each forward and backward.
    Same checks as the other configs; the final model is gathered whole, the step-2 checkpoint resumes."""
    from conftest import ARITH_TOKENIZER, save_tiny_model

    from hf_lowbit.data import arithmetic_records

    model = save_tiny_model(str(tmp_path / "model"), ARITH_TOKENIZER, 64, seed=0)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in arithmetic_records(400, 1, seed=0)[0]))
    common = [*RUN, "--model_name_or_path", model, "--dataset", str(data), "--eval_fraction", "0",
              "--completion_only_loss", "False", "--learning_rate", "1e-3"]
    per_rank = ["--per_device_train_batch_size", str(GLOBAL_BATCH // PROCESSES), "--save_strategy", "steps",
                "--save_steps", "2"]
    runs = []
    for recipe in ZERO3_RECIPES:
        runs += common + RECIPES[recipe] + per_rank + ["--output_dir", str(tmp_path / recipe), "---"]
    runs += common + RECIPES[ZERO3_RECIPES[0]] + per_rank + [
        "--output_dir", str(tmp_path / "resumed"), "--resume_from_checkpoint", str(tmp_path / ZERO3_RECIPES[0] / "checkpoint-2")]
    proc = _accelerate("deepspeed_zero3", runs, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + _errors(proc.stderr)
    for recipe in ZERO3_RECIPES:
        metrics, losses = _losses(tmp_path / recipe)
        assert (metrics["distributed_type"], metrics["num_processes"]) == ("DEEPSPEED", PROCESSES)
        ref = main(common + RECIPES[recipe] + ["--per_device_train_batch_size", str(GLOBAL_BATCH), "--save_strategy",
                                               "no", "--output_dir", str(tmp_path / f"one-{recipe}")])["train_losses"]
        assert len(losses) == len(ref) == STEPS and abs(losses[0] - ref[0]) <= STEP1_ATOL, (recipe, losses, ref)
        assert all(abs(a - b) <= later_atol(ref, k) for k, (a, b) in enumerate(zip(losses, ref))), (recipe, losses, ref)
        state = load_file(tmp_path / recipe / "model.safetensors")  # gathered whole (zero3_save_16bit_model)
        assert state["model.layers.1.mlp.down_proj.weight"].shape == (128, 384) and state["lm_head.weight"].shape == (16, 128)
    _, resumed = _losses(tmp_path / "resumed")
    _, full = _losses(tmp_path / ZERO3_RECIPES[0])
    assert resumed == full, (resumed, full)  # restored partitions, the same arithmetic: exact


@pytest.mark.parametrize("flags, setting", [({"lora_base_quant": "nf4", "int8_mixed_precision": True}, "lora_base_quant"),
                                            ({"lora_base_quant": "int8"}, "lora_base_quant"),
                                            ({"qat_scheme": "8da4w", "qat_group_size": 32}, "qat_scheme")])
def test_deepspeed_zero3_refuses_qlora_and_qat_at_construction(flags, setting, tmp_path):
    """What ZeRO-3 cannot run is refused by LowBitTrainer's constructor, before any swap, in one line naming the
    argument, the DeepSpeed setting and FSDP2; ZeRO-2 (and no DeepSpeed) take it. The plugin is accelerate's own
    (what TrainingArguments builds from a DeepSpeed launch config), so this runs without deepspeed installed."""
    from accelerate.utils import DeepSpeedPlugin
    from conftest import tiny_model
    from peft import LoraConfig

    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments
    from hf_lowbit.integrations.distributed import check_deepspeed, deepspeed_zero_stage
    from hf_lowbit.warnings import UnsupportedSetupError

    args = LowBitTrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to="none", **flags)
    assert deepspeed_zero_stage(args) is None
    check_deepspeed(args)
    peft = LoraConfig(r=4, target_modules="all-linear") if "lora_base_quant" in flags else None
    for config in ({"zero_optimization": {"stage": 2}}, {"zero_optimization": {"stage": 1}}):
        args.deepspeed_plugin = DeepSpeedPlugin(hf_ds_config=config)
        assert deepspeed_zero_stage(args) == config["zero_optimization"]["stage"]
        check_deepspeed(args)
    args.deepspeed_plugin = DeepSpeedPlugin(zero_stage=3)
    model = tiny_model()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(UnsupportedSetupError) as refused:
        LowBitTrainer(model, args=args, peft_config=peft)
    message = str(refused.value)
    assert "\n" not in message and f"{setting}=" in message and "ZeRO-3" in message and "FSDP2" in message, message
    assert {n: type(m) for n, m in model.named_modules()} == before  # refused before any swap


@NEEDS_DEEPSPEED
def test_cli_refuses_qlora_under_a_zero3_launch_config_in_one_line():
    """hf-lowbit-sft under an accelerate DeepSpeed ZeRO-3 config (the environment accelerate launch sets) with
    --lora_base_quant: one line naming the flag and FSDP2, exit status 2, before the data and model load."""
    env = dict(os.environ, ACCELERATE_USE_DEEPSPEED="true", ACCELERATE_DEEPSPEED_ZERO_STAGE="3",
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "sft.py"), "--lora_base_quant", "nf4"],
                          capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("hf-lowbit-sft: error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert "--lora_base_quant='nf4' under DeepSpeed ZeRO-3" in lines[0] and "FSDP2" in lines[0], lines[0]
