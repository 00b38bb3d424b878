"""The benchmark scripts run end to end (tiny shapes, CPU, eager: a smoke test, not a measurement)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_benchmark_train_smoke_on_cpu(tmp_path):
    out = tmp_path / "train.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_train.py"), "--device", "cpu", "--no_compile",
           "--recipes",
           "bf16,int8,fp8,int8_cache,int8_dual,int8_xcodes,int8_fga,int8_adamw,int8_cache_adamw,bf16_adamw",
           "--hidden", "64",
           "--intermediate", "128", "--heads", "4",
           "--kv_heads", "2", "--vocab", "96", "--layers", "2", "--batch", "2", "--seq", "32", "--warmup", "1",
           "--steps", "2", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["bf16", "int8", "fp8", "int8_cache", "int8_dual", "int8_xcodes", "int8_fga",
                                           "int8_adamw", "int8_cache_adamw", "bf16_adamw"]
    # the weight cache, the dual quantization of dY and X's codes kept from the forward change where the codes are
    # computed, not which; the fused accumulation of one micro-batch rounds the same product once, as autograd does;
    # LowBitAdamW leaves every parameter to torch's step on a CPU (no Triton kernel there): the same losses as INT8
    # without them (and bf16's with bf16_adamw)
    assert all(r["losses"] == rows[1]["losses"] for r in rows[3:-1]) and rows[-1]["losses"] == rows[0]["losses"]
    assert all("error" not in r and r["tokens_per_s"] > 0 for r in rows), rows
    # same init and data: the low-bit recipes start from bf16's loss
    assert all(abs(r["first_loss"] - rows[0]["first_loss"]) < 0.05 for r in rows)
    assert "| int8 |" in proc.stdout


def test_benchmark_regimes_trainer_path_smoke_on_cpu(tmp_path):
    """benchmarks/benchmark_regimes.py over the Trainer path with gradient accumulation: stock Trainer (bf16)
    beside LowBitTrainer with no recipe (bf16_lbt) and with int8 (its weight cache on by itself); records in the
    documented form; the profile sees the stock loop's host sync per micro-batch, which LowBitTrainer's has not."""
    out = tmp_path / "regimes.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_regimes.py"), "--blocks", "trainer_b1_ga8_loop",
           "--seq", "32", "--json", str(out), "--device", "cpu", "--no_compile", "--hidden", "64", "--intermediate",
           "128", "--heads", "4", "--kv_heads", "2", "--vocab", "96", "--layers", "2", "--warmup", "1", "--steps", "2",
           "--min_features", "16", "--grad_accum", "2", "--profile"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = json.loads(out.read_text())["records"]
    assert all("error" not in r for r in records), records
    assert [r["recipe"] for r in records] == ["bf16", "bf16_lbt", "int8", "fp8"], records
    # --profile: two more Trainer steps profiled (CPU ops here), their losses not among the timed ones
    assert all(r["profile"]["device_ms_per_step"] > 0 and r["profile"]["top_kernels"] for r in records), records
    # logging_nan_inf_filter's isnan/isinf test: two host reads per micro-batch in the stock loop, none in ours
    syncs = [sum(r["profile"]["host_syncs_per_step"].values()) for r in records]
    assert syncs[0] - syncs[1] >= 2 * 2 and syncs[1] == syncs[2] == syncs[3], syncs
    assert all(r["path"] == "trainer" and r["micro_batch_tokens"] == 32 and r["grad_accum"] == 2 and r["tok_s"] > 0
               for r in records)
    assert records[0]["vs_bf16"] == 1.0 and records[1]["chosen"]["weight_cache"] is False
    assert records[2]["chosen"]["weight_cache"] is True
    assert records[2]["chosen"]["fused_grad_accum"] is False  # opt-in
    assert records[2]["chosen"]["cuda_graphs"] is False  # a CPU run: no CUDA graphs
    assert records[2]["chosen"]["non_blocking"] is False  # nor pinned, non-blocking batch copies
    assert records[1]["first_loss"] == records[0]["first_loss"]  # the same model, data and loop but for the sync
    assert abs(records[2]["first_loss"] - records[0]["first_loss"]) < 0.05
    assert all(r["cudagraph_skips"] == [] for r in records)  # nothing compiled for CUDA graphs on the CPU


def test_sft_default_seeds_smoke(tmp_path):
    """benchmarks/sft_default_seeds.py: one scripts/sft.py process per (recipe, seed), shortened to 10 steps; every
    row trains from the same model (INT8's forward moves its first evaluation a little) and its held-out loss falls;
    the summary has a line per recipe; an unknown recipe is refused in one line."""
    out, md = tmp_path / "seeds.json", tmp_path / "seeds.md"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "sft_default_seeds.py"), "--recipes", "fp32,int8_no_dx",
           "--seeds", "0", "--steps", "10", "--json", str(out), "--markdown", str(md)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["seed"]) for r in rows] == [("fp32", 0), ("int8_no_dx", 0)], rows
    # the same init and held-out data; INT8's forward (on in int8_no_dx) moves the first evaluation a little
    assert 0 < abs(rows[0]["initial_eval_loss"] - rows[1]["initial_eval_loss"]) < 0.01, rows
    assert all(r["eval_loss"] < r["initial_eval_loss"] and 0 <= r["eval_accuracy"] <= 1 for r in rows), rows
    text = md.read_text()
    assert "| fp32 | 1 |" in text and "| int8_no_dx | 1 |" in text
    bad = subprocess.run([*cmd[:2], "--recipes", "int9"], capture_output=True, text=True, cwd=ROOT)
    assert bad.returncode == 2 and "--recipes: unknown int9" in bad.stderr


def test_kernel_categories_of_the_h200_profiles():
    """Kernel names from the H200 profiles land in their categories (first match wins: the optimizer's and the
    FP8 matmul's names before the generic ones); autograd's .grad adds apart from "other"."""
    from benchmarks.driver import kernel_category

    assert kernel_category("nvjet_sm90_qqtst_128x128_128x6_1x1_h_bz_coopA_algo2_ovscale_TNT") == "fp8 matmul (cuBLAS)"
    assert kernel_category("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT") == "bf16 matmul (cuBLAS)"
    assert kernel_category("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous "
                           "namespace)::FusedOptimizerTensorListMetadata<4>>") == "optimizer"
    assert kernel_category("triton_red_fused__to_copy_abs_amax_clamp_div_mul_round_silu_view_8") == \
        "Inductor fused: norms, activations, quantize"
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<c10::BFloat16>>"
    assert kernel_category(add) == "aten elementwise (.grad adds, casts, copies)"
    assert kernel_category("_scaled_mm_accumulate_kernel") == "low-bit matmul into .grad (ours, Triton)"
    assert kernel_category("Memset (Device)") == "memset"
    assert kernel_category("some_unknown_kernel") == "other"


def test_profile_summary_leaves_out_its_callers_final_sync():
    """``host_syncs_per_step`` counts a step's own waits, not the one ``cudaDeviceSynchronize`` the profiling code
    makes inside the profile to wait for the kernels (0.5 a step of two before); the kernels land in categories."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from benchmarks.driver import profile_summary

    def event(key, device, count, cpu_ms=0.0, gpu_ms=0.0):
        return SimpleNamespace(key=key, device_type=device, count=count, self_cpu_time_total=cpu_ms * 1000,
                               self_device_time_total=gpu_ms * 1000)

    cpu, gpu = DeviceType.CPU, DeviceType.CUDA
    prof = SimpleNamespace(key_averages=lambda: [
        event("aten::mm", cpu, 4, cpu_ms=1.0), event("cudaLaunchKernel", cpu, 4, cpu_ms=0.2),
        event("cudaStreamSynchronize", cpu, 2, cpu_ms=3.0), event("cudaDeviceSynchronize", cpu, 1, cpu_ms=5.0),
        event("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", gpu, 4, gpu_ms=8.0)])
    out = profile_summary(prof, steps=2)
    assert out["host_syncs_per_step"] == {"cudaStreamSynchronize": 1.0, "cudaDeviceSynchronize": 0.0}
    assert out["categories_ms"] == {"bf16 matmul (cuBLAS)": 4.0} and out["device_ms_per_step"] == 4.0
    assert out["host_ms_per_step"] == 0.6 and out["host_wait_ms_per_step"] == 4.0


def test_gpu_telemetry_reads_nvidia_smi(tmp_path, monkeypatch):
    """GpuTelemetry: the field list this nvidia-smi accepts (newer drivers' clocks_event_reasons, else the older
    name), its loop-mode lines parsed into [min, median, max] a field and the non-zero reasons; None without
    nvidia-smi."""
    import time as _time

    from benchmarks.driver import GpuTelemetry

    monkeypatch.setenv("PATH", str(tmp_path))
    assert GpuTelemetry().start().stop() is None  # no nvidia-smi (a CPU machine)
    fake = tmp_path / "nvidia-smi"
    fake.write_text("#!/bin/bash\n"
                    "case \"$*\" in *clocks_event_reasons*) exit 2;; esac\n"  # an older driver: its old name only
                    "echo \"$*\" >> " + str(tmp_path / "calls") + "\n"
                    "case \"$*\" in *-lms=*) printf '1980, 690.5, 61, 0x0000000000000000\\n"
                    "1755, 700.1, 63, 0x0000000000000004\\n1830, [N/A], 62, 0x0000000000000004\\nnot a sample\\n"
                    "1900, 650.0, 62, [Not Supported]\\n'; sleep 30;; esac\n")
    fake.chmod(0o755)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")  # the fake first; sleep from the system
    telemetry = GpuTelemetry(ms=50).start()
    deadline = _time.time() + 20
    while len(telemetry.lines) < 5 and _time.time() < deadline:
        _time.sleep(0.05)
    out = telemetry.stop()
    # the line that is no sample is left out, a reason field nvidia-smi could not fill is no reason
    assert out == {"samples": 4, "every_ms": 50, "sm_mhz": [1755.0, 1900.0, 1980.0],
                   "power_w": [650.0, 690.5, 700.1], "temp_c": [61.0, 62.0, 63.0],
                   "clock_event_reasons": ["0x0000000000000004"]}
    calls = (tmp_path / "calls").read_text().splitlines()
    assert calls[-1].startswith("--id=0 --query-gpu=clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active")
    assert calls[-1].endswith("-lms=50")


def test_cudagraph_skips_collects_inductor_reasons():
    """The records' ``cudagraph_skips``: each reason Inductor logs for running a graph without CUDA graphs."""
    from torch._inductor.cudagraph_utils import log_cudagraph_skip_and_bump_counter

    from benchmarks.driver import cudagraph_skips

    from torch._inductor.cudagraph_utils import cudagraphs_log

    reasons = cudagraph_skips()
    log_cudagraph_skip_and_bump_counter("skipping cudagraphs due to mutated inputs (1 instances)")
    log_cudagraph_skip_and_bump_counter("graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_"
                                        "graphs=True.")  # a skip whose message says neither "skip" nor "cudagraph"s
    cudagraphs_log.warning("CUDAGraph supports dynamic shapes by recording a new graph for each distinct input size")
    assert reasons == ["skipping cudagraphs due to mutated inputs (1 instances)",
                       "graph with symbolic shapes inputs and config.triton.cudagraph_skip_dynamic_graphs=True."]


def _train_main_refuses(argv: list[str], message: str) -> None:
    """benchmark_train.py's main() on ``argv`` stops with ``message`` before starting any recipe process; in process
    (the script itself runs in test_benchmark_train_*_smoke_on_cpu; a subprocess only to see an argument refused
    spent ~8 s importing)."""
    from unittest import mock

    from benchmarks import benchmark_train

    with mock.patch.object(sys, "argv", ["benchmark_train.py", *argv]), \
            mock.patch.object(benchmark_train, "run_worker", side_effect=AssertionError("a recipe process started")), \
            pytest.raises(SystemExit, match=message):
        benchmark_train.main()


def test_benchmark_train_liger_is_for_the_trainer_path():
    _train_main_refuses(["--device", "cpu", "--liger", "both"], "--liger: the trainer path only")


def test_benchmark_train_rejects_unknown_recipe():
    _train_main_refuses(["--device", "cpu", "--recipes", "int4"], "unknown recipe 'int4'")


def test_benchmark_quality_smoke_on_cpu(tmp_path):
    out = tmp_path / "quality.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_quality.py"), "--device", "cpu",
           "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv_heads", "2",
           "--seq", "64", "--batch", "4", "--steps", "4", "--warmup", "2", "--vocab", "400", "--max_docs", "150",
           "--min_features", "16", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["recipe"] for r in data["rows"]] == ["bf16", "int8", "fp8"]
    assert all(len(r["losses"]) == 4 and abs(r["eval_loss_vs_bf16"]) < 0.05 for r in data["rows"])
    assert data["meta"]["corpus"]["train_tokens"] > 0 and data["meta"]["corpus"]["eval_tokens"] > 0


def test_benchmark_quality_parallel_with_packages_on_cpu(tmp_path):
    """``--parallel`` (one process per recipe, as the H200 parity stage runs it) with ``--corpus_packages``: the
    children train (their progress lines show) and their rows come back in order; a package that is not
    installed stops the run before any child starts."""
    out = tmp_path / "quality.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_quality.py"), "--device", "cpu", "--parallel",
           "--recipes", "bf16,int8", "--corpus_packages", "typing_extensions", "--layers", "1", "--hidden", "64",
           "--intermediate", "128", "--heads", "4", "--kv_heads", "2", "--seq", "64", "--batch", "4", "--steps", "3",
           "--warmup", "1", "--vocab", "400", "--max_docs", "150", "--min_features", "16", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert [r["recipe"] for r in data["rows"]] == ["bf16", "int8"]
    assert list(data["meta"]["corpus"]["packages"]) == ["typing_extensions"]
    assert all(len(r["losses"]) == 3 for r in data["rows"]) and "[int8] step 3/3" in proc.stdout
    # the same command with a package that is not installed, in process (a subprocess spent ~10 s importing): it
    # stops before starting any child
    import importlib.util
    from unittest import mock

    spec = importlib.util.spec_from_file_location("benchmark_quality", cmd[1])
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    argv = [os.path.basename(cmd[1]), *cmd[2:-2], "--corpus_packages", "no_such_package_hf_lowbit"]
    with mock.patch.object(sys, "argv", argv), \
            mock.patch("subprocess.Popen", side_effect=AssertionError("a child was started")), \
            pytest.raises(SystemExit, match="--corpus_packages: package 'no_such_package_hf_lowbit' is not installed"):
        bench.main()


@pytest.fixture(scope="module")
def stdlib_corpus():
    """The standard library's corpus, parsed once for the tests that read it (~4 s a parse)."""
    from benchmarks.corpus import python_docs_corpus

    return python_docs_corpus()


def test_python_docs_corpus_is_real_prose(stdlib_corpus):
    from benchmarks.corpus import python_docs_corpus

    docs = stdlib_corpus
    assert len(docs) > 1000 and sum(map(len, docs)) > 1_000_000
    assert any("division" in d.lower() for d in docs) and all(len(d) >= 200 for d in docs[100:])
    # max_docs (--max_docs of the benchmarks): the same first documents, without parsing the files after them
    for n in (40, 300):
        assert python_docs_corpus(max_docs=n) == docs[:n]


def test_python_docs_corpus_packages(stdlib_corpus):
    """``packages`` adds an installed package's docstrings, each once; a package that is not installed is refused
    (a long run must not silently train on less text than it asked for)."""
    from benchmarks.corpus import python_docs_corpus

    base = stdlib_corpus
    more = python_docs_corpus(packages=("peft",))
    assert more[:len(base)] == base and len(more) > len(base) + 100
    added = more[len(base):]
    assert len(set(added)) == len(added) and any("adapter" in d.lower() for d in added)
    with pytest.raises(ValueError, match="'no_such_package_hf_lowbit' is not installed"):
        python_docs_corpus(packages=("no_such_package_hf_lowbit",))
    # a single-module package is read alone, not the directory it sits in (site-packages)
    single = python_docs_corpus(packages=("typing_extensions",))[len(base):]
    assert 0 < len(single) < 400


def test_corpus_cache_round_trip(tmp_path, monkeypatch):
    """``cache_dir``: the second call reads back what the first built (same blocks, same tokenizer, record saying
    where it came from); other arguments get their own entry; an interrupted save leaves nothing to read."""
    import torch

    import benchmarks.corpus as corpus

    first = corpus.corpus_blocks(32, 300, max_docs=60, cache_dir=str(tmp_path))
    entries = [p for p in tmp_path.iterdir()]
    assert len(entries) == 1 and (entries[0] / "info.json").is_file()

    def not_again(*args):
        raise AssertionError("rebuilt although cached")

    monkeypatch.setattr(corpus, "_build_blocks", not_again)
    tok, train, held, info = corpus.corpus_blocks(32, 300, max_docs=60, cache_dir=str(tmp_path))
    assert torch.equal(train, first[1]) and torch.equal(held, first[2]) and train.dtype == torch.long
    assert tok.encode("def f(x): return x") == first[0].encode("def f(x): return x") and len(tok) == len(first[0])
    assert info["cache"] == str(entries[0]) and info["documents"] == 60 and "built_on" in info
    with pytest.raises(AssertionError, match="rebuilt"):  # another vocabulary: another entry, built
        corpus.corpus_blocks(32, 280, max_docs=60, cache_dir=str(tmp_path))
    monkeypatch.undo()

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(first[0], "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        corpus._save_cached(str(tmp_path / "other"), *first)
    assert sorted(p.name for p in tmp_path.iterdir()) == [entries[0].name]  # no entry, no temporary left


def test_benchmark_refuses_a_recipe_that_is_not_active():
    from conftest import tiny_model

    from benchmarks import driver as bench

    model = tiny_model().bfloat16()
    with pytest.raises(RuntimeError, match="not active"):
        bench.check_recipe_active(model, "int8", "cpu")  # nothing swapped yet
    bench.apply_recipe(model, "int8", min_features=16)
    bench.check_recipe_active(model, "int8", "cpu")


@pytest.mark.parametrize("suffix, field", [("dual", "dual_grad_quant"), ("xcodes", "save_x_codes")])
def test_benchmark_switch_recipes_on_both_paths(tmp_path, suffix, field):
    """int8_dual / fp8_dual, int8_xcodes / fp8_xcodes (issue 25): known recipes whose arguments switch
    lowbit_dual_grad_quant / lowbit_save_x_codes on, on the layers path (apply_recipe, checked active) and the
    trainer path (LowBitTrainer from recipe_args); the regimes blocks that compare them with int8 / fp8."""
    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS
    from hf_lowbit import LowBitLinear, LowBitTrainer, LowBitTrainingArguments

    for recipe, fmt in ((f"int8_{suffix}", "int8"), (f"fp8_{suffix}", "fp8")):
        assert recipe in bench.OURS and recipe in bench.FULL_RECIPES
        assert bench.recipe_args(recipe) == {f"{fmt}_mixed_precision": True, f"lowbit_{field}": True}
        model = tiny_model().bfloat16()
        bench.apply_recipe(model, recipe, min_features=16)
        bench.check_recipe_active(model, recipe, "cpu")
        args = LowBitTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                       lowbit_min_features=16, **bench.recipe_args(recipe))
        layers = [m for m in LowBitTrainer(tiny_model(), args=args).model.modules() if isinstance(m, LowBitLinear)]
        assert layers and all(getattr(m.lowbit_config, field) and m.lowbit_config.format == fmt for m in layers)
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8", min_features=16)
    with pytest.raises(RuntimeError, match=f"{field} is off"):
        bench.check_recipe_active(model, f"int8_{suffix}", "cpu")
    recipes = f"bf16,int8,int8_{suffix},fp8,fp8_{suffix}"
    blocks = {"dual": {"layers_b1_dual": ("layers", 1, 1), "layers_b8_dual": ("layers", 8, 1),
                       "trainer_b1_ga8_dual": ("trainer", 1, 8)},
              "xcodes": {"layers_b8_xcodes": ("layers", 8, 1), "trainer_b8_xcodes": ("trainer", 8, 1)}}[suffix]
    assert {name: BLOCKS[name][:5] for name in blocks} == {
        name: (*shape, "default", recipes) for name, shape in blocks.items()}


def test_benchmark_head_recipes_trainer_path_only(tmp_path):
    """int8_head / fp8_head (issue 25's directions): lowbit_include_lm_head on; LowBitTrainer swaps the head and
    check_recipe_active says so (and refuses the plain recipe's model under the head's name); the layers path, which
    keeps the head bf16, refuses them (apply_recipe, check_recipes); the regimes blocks pin them."""
    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS
    from hf_lowbit import LowBitTrainer, LowBitTrainingArguments, MixedPrecisionLinear

    assert bench.HEAD_VARIANTS == ("int8_head", "fp8_head")
    for recipe, fmt in (("int8_head", "int8"), ("fp8_head", "fp8")):
        assert recipe in bench.OURS and recipe in bench.FULL_RECIPES
        assert bench.recipe_args(recipe) == {f"{fmt}_mixed_precision": True, "lowbit_include_lm_head": True}
        args = LowBitTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True,
                                       lowbit_min_features=16, **bench.recipe_args(recipe))
        model = LowBitTrainer(tiny_model().bfloat16(), args=args).model
        assert isinstance(model.lm_head, MixedPrecisionLinear) and model.lm_head.lowbit_config.format == fmt
        bench.check_recipe_active(model, recipe, "cpu")
        with pytest.raises(ValueError, match=f"apply_recipe: '{recipe}' swaps the LM head"):
            bench.apply_recipe(tiny_model().bfloat16(), recipe, min_features=16)
        with pytest.raises(SystemExit, match=f"{recipe} swaps the LM head, which the layers path keeps bf16"):
            bench.check_recipes(["bf16", recipe], bench.FULL_RECIPES, "layers")
        bench.check_recipes(["bf16", recipe], bench.FULL_RECIPES, "trainer")
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8", min_features=16)
    with pytest.raises(RuntimeError, match="'int8_head' is not active: up_proj's include_lm_head is off"):
        bench.check_recipe_active(model, "int8_head", "cpu")
    args = LowBitTrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, lowbit_min_features=16,
                                   **bench.recipe_args("fp8_head"))
    model = LowBitTrainer(tiny_model(vocab_size=100).bfloat16(), args=args).model  # FP8 skips a vocab of 100
    with pytest.raises(RuntimeError, match="'fp8_head' is not active: the LM head is Linear"):
        bench.check_recipe_active(model, "fp8_head", "cpu")
    head = "bf16,int8,int8_head,fp8,fp8_head"
    assert {name: BLOCKS[name][:5] for name in ("trainer_b8_head", "trainer_b1_ga8_head")} == {
        "trainer_b8_head": ("trainer", 8, 1, "default", head), "trainer_b1_ga8_head": ("trainer", 1, 8, "default", head)}


def test_benchmark_recompute_recipes_on_both_paths():
    """bf16_recompute / int8_recompute / fp8_recompute (issue 25): their base recipe's swap and arguments (bf16 through
    the stock Trainer), with the partitioner's ban on recomputing materialized activations lifted by build_model before
    anything compiles (refused as not active without it); the regimes blocks that compare them."""
    import torch._functorch.config as functorch_config
    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    # torch's own patch, not monkeypatch: pytest 9's monkeypatch undoes a config-module attribute with delattr, which
    # hides the entry and breaks every later compile in this process ("... does not exist")
    with functorch_config.patch(ban_recompute_materialized_backward=True):
        _check_recompute_recipes(bench, functorch_config, tiny_model)
    assert functorch_config.ban_recompute_materialized_backward  # the default is back, the entry still readable
    recipes = "bf16,bf16_recompute,int8,int8_recompute,fp8_recompute"
    assert BLOCKS["layers_b8_recompute"][:5] == ("layers", 8, 1, "default", recipes)
    assert BLOCKS["trainer_b8_recompute"][:5] == ("trainer", 8, 1, "default", recipes)


def _check_recompute_recipes(bench, functorch_config, tiny_model):
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8_recompute", min_features=16)
    with pytest.raises(RuntimeError, match="not active: the partitioner"):
        bench.check_recipe_active(model, "int8_recompute", "cpu")
    assert not bench.apply_process_setting("int8") and functorch_config.ban_recompute_materialized_backward
    assert bench.apply_process_setting("int8_recompute") and not functorch_config.ban_recompute_materialized_backward
    bench.check_recipe_active(model, "int8_recompute", "cpu")
    _same_as_base(bench, tiny_model, "recompute")


def _same_as_base(bench, tiny_model, suffix: str) -> None:
    """bf16_<suffix>, int8_<suffix>, fp8_<suffix> (a process setting on a base recipe): listed, the base's arguments,
    the base's swap (checked active, the setting being on)."""
    for base in ("bf16", "int8", "fp8"):
        recipe = f"{base}_{suffix}"
        assert recipe in bench.FULL_RECIPES and (recipe in bench.OURS) is (base in bench.OURS)
        assert bench.recipe_args(recipe) == bench.recipe_args(base)
        swapped = []
        for name in (recipe, base):
            model = tiny_model().bfloat16()
            bench.apply_recipe(model, name, min_features=16)
            bench.check_recipe_active(model, name, "cpu")
            swapped.append([type(m).__name__ for m in model.modules()])
        assert swapped[0] == swapped[1], recipe


def test_benchmark_multikernel_recipes():
    """bf16_multikernel / int8_multikernel / fp8_multikernel (issue 25): their base recipe's swap and arguments (bf16
    through the stock Trainer), with Inductor's multi-kernel switched on for the process before anything compiles
    (refused as not active without it); the regimes blocks that compare them."""
    import torch._inductor.config as inductor_config
    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    before = inductor_config.triton.multi_kernel
    with inductor_config.patch({"triton.multi_kernel": 0}):  # torch's own patch: restored after
        model = tiny_model().bfloat16()
        bench.apply_recipe(model, "int8_multikernel", min_features=16)
        with pytest.raises(RuntimeError, match="not active: Inductor's multi-kernel is off"):
            bench.check_recipe_active(model, "int8_multikernel", "cpu")
        assert not bench.apply_process_setting("int8") and not inductor_config.triton.multi_kernel
        assert bench.apply_process_setting("int8_multikernel") and inductor_config.triton.multi_kernel == 1
        bench.check_recipe_active(model, "int8_multikernel", "cpu")
        _same_as_base(bench, tiny_model, "multikernel")
    assert inductor_config.triton.multi_kernel == before  # the setting is back
    recipes = "bf16,bf16_multikernel,int8,int8_multikernel,fp8,fp8_multikernel"
    assert BLOCKS["layers_b8_multikernel"][:5] == ("layers", 8, 1, "default", recipes)
    assert BLOCKS["layers_b1_multikernel"][:5] == ("layers", 1, 1, "default", recipes)


def test_benchmark_swiglu_recipes():
    """int8_swiglu / fp8_swiglu (issue 25, lowbit_fused_swiglu): their arguments, the swap (each decoder MLP a
    LowBitSwiGLUMLP; refused as not active where it is not), and the regimes blocks that compare them."""
    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    for fmt in ("int8", "fp8"):
        recipe = f"{fmt}_swiglu"
        assert recipe in bench.OURS and recipe in bench.FULL_RECIPES
        assert bench.mixed_precision_args(recipe) == {f"{fmt}_mixed_precision": True, "lowbit_fused_swiglu": True,
                                                      "lowbit_fused_adamw": False}
        model = tiny_model().bfloat16()
        bench.apply_recipe(model, recipe, min_features=16)
        assert all(type(layer.mlp).__name__ == "LowBitSwiGLUMLP" for layer in model.model.layers)
        bench.check_recipe_active(model, recipe, "cpu")
        plain = tiny_model().bfloat16()
        bench.apply_recipe(plain, fmt, min_features=16)
        with pytest.raises(RuntimeError, match="not active: the MLP is a LlamaMLP"):
            bench.check_recipe_active(plain, recipe, "cpu")
        # off CUDA the default keeps the MLP per linear: a fused one is refused under the plain recipe's name
        with pytest.raises(RuntimeError, match="not active: the MLP is a LowBitSwiGLUMLP"):
            bench.check_recipe_active(model, fmt, "cpu")
        assert bench.mixed_precision_args(f"{fmt}_plain") == {f"{fmt}_mixed_precision": True,
                                                              "lowbit_fused_adamw": False, "lowbit_fused_swiglu": False}
        assert bench.levers(f"{fmt}_plain", "cpu") == bench.levers(fmt, "cpu") == (False, False)
        assert bench.levers(f"{fmt}_adamw", "cpu") == (True, False) and bench.levers(recipe, "cpu") == (False, True)
    assert bench.levers("bf16_adamw", "cpu") == (True, False) and bench.levers("bf16", "cpu") == (False, False)
    combined = bench.mixed_precision_args("fp8_swiglu_adamw")
    assert combined == {"fp8_mixed_precision": True, "lowbit_fused_swiglu": True, "lowbit_fused_adamw": True}
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8_swiglu_adamw", min_features=16)
    bench.check_recipe_active(model, "int8_swiglu_adamw", "cpu")
    with pytest.raises(RuntimeError, match="not active: the MLP is a LlamaMLP"):
        bench.check_recipe_active(plain, "fp8_swiglu_adamw", "cpu")
    levers = "bf16,bf16_adamw,int8_plain,int8_adamw,int8_swiglu,int8,fp8_plain,fp8"
    assert {k: BLOCKS[k][:5] for k in BLOCKS if k.endswith("_levers")} == {
        "layers_b1_levers": ("layers", 1, 1, "default", levers), "layers_b8_levers": ("layers", 8, 1, "default", levers),
        "layers_b1_ga8_levers": ("layers", 1, 8, "default", levers)}
    recipes = "bf16,int8_plain,int8_swiglu,fp8_plain,fp8_swiglu"
    assert {k: BLOCKS[k][:5] for k in BLOCKS if k.endswith("_swiglu")} == {
        "layers_b8_swiglu": ("layers", 8, 1, "default", recipes), "layers_b1_swiglu": ("layers", 1, 1, "default", recipes),
        "layers_b1_ga8_swiglu": ("layers", 1, 8, "default", recipes),
        "trainer_b1_ga8_swiglu": ("trainer", 1, 8, "default", recipes),
        "trainer_b8_swiglu": ("trainer", 8, 1, "default", recipes)}


def test_benchmark_unshared_recipes(monkeypatch):
    """int8_unshared / fp8_unshared (issue 25): their base recipe's swap and arguments, with X's column codes no longer
    shared (hf_lowbit.kernels.shares_codes always False, set by build_model; refused as not active without it); the
    regimes blocks that compare them."""
    import torch
    from conftest import tiny_model

    import hf_lowbit.kernels as K
    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    monkeypatch.setattr(K, "shares_codes", K.shares_codes)  # a plain module attribute: restored after the test
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8_unshared", min_features=16)
    with pytest.raises(RuntimeError, match="still shared"):
        bench.check_recipe_active(model, "int8_unshared", "cpu")
    assert bench.apply_process_setting("int8_unshared") and not K.shares_codes(torch.empty(1, device="meta"))
    bench.check_recipe_active(model, "int8_unshared", "cpu")
    for recipe, base in (("int8_unshared", "int8"), ("fp8_unshared", "fp8")):
        assert recipe in bench.FULL_RECIPES and recipe in bench.OURS
        assert bench.mixed_precision_args(recipe) == bench.mixed_precision_args(base)
    shared, forced = "bf16,int8,int8_unshared,fp8,fp8_unshared", "bf16,int8,int8_shared,fp8,fp8_shared"
    names = ("layers_b8_shared", "layers_b1_shared", "trainer_b8_shared", "trainer_b1_ga8_shared")
    assert {name: BLOCKS[name][:5] for name in names} == {
        "layers_b8_shared": ("layers", 8, 1, "default", shared), "layers_b1_shared": ("layers", 1, 1, "default", forced),
        "trainer_b8_shared": ("trainer", 8, 1, "default", shared),
        "trainer_b1_ga8_shared": ("trainer", 1, 8, "default", forced)}


def test_benchmark_shared_recipes(monkeypatch):
    """int8_shared / fp8_shared (issue 25): their base recipe's swap and arguments, with X's column codes shared on
    CUDA at any number of rows (the default shares from SHARE_MIN_ROWS rows); refused as not active without it."""
    import torch
    from conftest import tiny_model
    from torch._subclasses.fake_tensor import FakeTensorMode

    import hf_lowbit.kernels as K
    from benchmarks import driver as bench
    from hf_lowbit.kernels.quantize_t import SHARE_MIN_ROWS

    monkeypatch.setattr(K, "shares_codes", K.shares_codes)  # a plain module attribute: restored after the test
    few = torch.empty(SHARE_MIN_ROWS - 1, 8, device="meta")
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "fp8_shared", min_features=16)
    with pytest.raises(RuntimeError, match="only from SHARE_MIN_ROWS"):
        bench.check_recipe_active(model, "fp8_shared", "cpu")
    assert bench.apply_process_setting("fp8_shared")
    bench.check_recipe_active(model, "fp8_shared", "cpu")
    assert not K.shares_codes(few) and not K.shares_codes(torch.empty(1, 8))  # CUDA only: meta / CPU tensors never
    with FakeTensorMode():  # a CUDA tensor without a GPU: forced, any rows
        assert K.shares_codes(torch.empty(1, 8, device="cuda"))
    for recipe, base in (("int8_shared", "int8"), ("fp8_shared", "fp8")):
        assert recipe in bench.FULL_RECIPES and recipe in bench.OURS
        assert bench.mixed_precision_args(recipe) == bench.mixed_precision_args(base)


def test_benchmark_quant_variant_recipes(monkeypatch):
    """int8_two_kernel / int8_atomic / int8_atomic_rcp / fp8_* (issue 25): their base recipe's swap and arguments,
    with activations quantized by the named quantize_t_triton variant (ACTIVATION_VARIANT[fmt] set for the process;
    refused as not active without it; atomic_rcp's stochastic rounding falls back to atomic); the regimes blocks that
    compare each format's default with the other variant."""
    import importlib

    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    Q = importlib.import_module("hf_lowbit.kernels.quantize_t")  # the package's attribute quantize_t is the op
    monkeypatch.setattr(Q, "ACTIVATION_VARIANT", dict(Q.ACTIVATION_VARIANT))  # restored after the test
    assert Q.ACTIVATION_VARIANT == {"int8": "atomic_rcp", "fp8": "atomic_rcp"}
    assert Q._activation_variant("int8", False) == "atomic_rcp" and Q._activation_variant("int8", True) == "atomic"
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "int8_two_kernel", min_features=16)
    with pytest.raises(RuntimeError, match="another quantize_t variant"):
        bench.check_recipe_active(model, "int8_two_kernel", "cpu")
    assert bench.apply_process_setting("int8_two_kernel") and Q.ACTIVATION_VARIANT["int8"] == "two_kernel"
    bench.check_recipe_active(model, "int8_two_kernel", "cpu")
    assert Q.ACTIVATION_VARIANT["fp8"] == "atomic_rcp"  # the other format's untouched
    with pytest.raises(RuntimeError, match="another quantize_t variant"):
        bench.check_recipe_active(model, "fp8_two_kernel", "cpu")
    assert bench.apply_process_setting("fp8_two_kernel") and Q._activation_variant("fp8", False) == "two_kernel"
    assert Q._activation_variant("fp8", True) == "two_kernel"
    for fmt in ("int8", "fp8"):
        for variant in ("two_kernel", "atomic", "atomic_rcp"):
            recipe = f"{fmt}_{variant}"
            assert recipe in bench.FULL_RECIPES and recipe in bench.OURS
            assert bench.mixed_precision_args(recipe) == bench.mixed_precision_args(fmt)
    atomic = "bf16,int8,int8_two_kernel,fp8,fp8_two_kernel"
    assert {name: BLOCKS[name][:5] for name in ("layers_b8_atomic", "layers_b1_atomic", "trainer_b1_ga8_atomic")} == {
        "layers_b8_atomic": ("layers", 8, 1, "default", atomic), "layers_b1_atomic": ("layers", 1, 1, "default", atomic),
        "trainer_b1_ga8_atomic": ("trainer", 1, 8, "default", atomic)}


def test_fp8_tensorwise_recipes_and_blocks():
    """fp8_tensorwise (ours: fp8_tensorwise_mixed_precision) and torchao_float8_tensorwise (torchao's "tensorwise"
    float8 recipe) are recipes; check_recipe_active tells each FP8 scaling from the other; the blocks pin them."""
    import importlib.util

    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    assert {"fp8_tensorwise", "torchao_float8_tensorwise"} <= set(bench.FULL_RECIPES)
    assert "fp8_tensorwise" in bench.OURS and bench.mixed_precision_args("fp8_tensorwise") == {
        "fp8_tensorwise_mixed_precision": True}
    for ours, other in (("fp8_tensorwise", "fp8"), ("fp8", "fp8_tensorwise")):
        model = tiny_model().bfloat16()
        bench.apply_recipe(model, ours, min_features=16)
        assert model.model.layers[0].mlp.up_proj.lowbit_config.format == ours
        bench.check_recipe_active(model, ours, "cpu")
        with pytest.raises(RuntimeError, match=f"computes in {ours!r}"):
            bench.check_recipe_active(model, other, "cpu")
    if importlib.util.find_spec("torchao") is not None:  # torchao's recipes (CPU: the module and its config only)
        for peer, other in (("torchao_float8_tensorwise", "torchao_float8"), ("torchao_float8", "torchao_float8_tensorwise")):
            model = tiny_model().bfloat16()
            bench.apply_recipe(model, peer, min_features=16)
            with pytest.raises(RuntimeError, match="scaling"):
                bench.check_recipe_active(model, other, "cpu")
    tensorwise = "bf16,fp8,fp8_tensorwise,torchao_float8,torchao_float8_tensorwise"
    assert {name: BLOCKS[name][:5] for name in ("layers_b8_tensorwise", "layers_b1_tensorwise",
                                                "trainer_b1_ga8_tensorwise", "trainer_b8_tensorwise")} == {
        "layers_b8_tensorwise": ("layers", 8, 1, "default", tensorwise),
        "layers_b1_tensorwise": ("layers", 1, 1, "default", tensorwise),
        "trainer_b1_ga8_tensorwise": ("trainer", 1, 8, "default", "bf16,fp8,fp8_tensorwise"),
        "trainer_b8_tensorwise": ("trainer", 8, 1, "default", "bf16,int8,fp8,fp8_tensorwise")}


def test_activation_memory_probe_partition_xcodes_keeps_what_int8_keeps(tmp_path):
    """benchmarks/activation_memory_probe.py --mode partition (a tiny layer): compiled, lowbit_save_x_codes keeps the same
    tensors as INT8 without it (the partitioner places X's codes), down_proj's input among them as codes; with the
    CUDA graph's Triton ops where triton imports (a stand-in target), else opaque custom ops. On the CUDA graph,
    sibling linears (q/k/v, gate/up) quantize their shared input once (hf_lowbit::quantize_t_shared, merged by CSE)
    when there are --share_min_rows rows (here exactly: 2 x 32)."""
    import importlib.util

    from benchmarks import activation_memory_probe as probe

    kernels = "cuda" if importlib.util.find_spec("triton") else "opaque"
    out = tmp_path / "probe.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "activation_memory_probe.py"), "--mode", "partition",
           "--kernels", kernels, "--recipes", "int8,int8_xcodes", "--hidden", "64", "--intermediate", "128", "--heads",
           "4", "--kv_heads", "2", "--batch", "2", "--seq", "32", "--min_features", "16", "--share_min_rows", "64",
           "--json", str(out)]  # 64 rows: CUDA's rule, with the threshold at this model's rows
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r for r in rows), rows
    kept = [sorted((tuple(t["shape"]), t["dtype"]) for t in r["rows"] if not t["param"]) for r in rows]
    assert kept[0] == kept[1] and rows[0]["saved_bytes_per_token"] == rows[1]["saved_bytes_per_token"]
    assert ((128, 64), "int8") in kept[0], kept[0]  # down_proj's input [64 tokens, 128] kept as its column codes
    if kernels == "cuda":  # X quantized per column once per distinct input (q/k/v's, o's, gate/up's, down's), not 7x
        for r in rows:
            calls = r["quantize_calls"]
            shared = sum(c.get("hf_lowbit.quantize_t_shared.default", 0) for c in calls.values())
            per_call = sum(c.get(k, 0) for c in calls.values() for k in probe.QUANTIZE_PASS_KERNELS)
            assert (shared, per_call) == (4, 7), calls  # 7: each linear's own dY


def test_benchmark_mm_smoke_on_cpu(tmp_path):
    out = tmp_path / "mm.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_mm.py"), "--device", "cpu", "--tokens", "32",
           "--shapes", "32x16", "--reps", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert {(r["layout"], r["recipe"]) for r in data["matmuls"]} >= {("wgrad", "int8 quantize+matmul"),
                                                                      ("dgrad", "fp8 kernel"), ("fwd", "bf16")}
    assert [q["kernel"] for q in data["quantize"]][0] == "copy (bf16)"


def test_benchmark_mm_quant_sweep_refuses_without_cuda(tmp_path):
    """--quant_sweep needs a GPU: without one it says so and writes nothing (its code path on the CPU interpreter:
    test_triton_int8.py::test_quant_sweep_candidates_interpreted)."""
    from unittest import mock

    from benchmarks import benchmark_mm

    out = tmp_path / "sweep.json"  # in process, as test_benchmark_mm_dual_refuses_without_cuda
    argv = ["benchmark_mm.py", "--quant_sweep", "--json", str(out)]
    with mock.patch.object(sys, "argv", argv), mock.patch("torch.cuda.is_available", return_value=False), \
            pytest.raises(SystemExit, match="needs a CUDA GPU"):
        benchmark_mm.main()
    assert not out.exists()


def test_benchmark_mm_dual_refuses_without_cuda(tmp_path):
    """--dual needs a GPU: without one it says so and writes nothing (its code path on the CPU interpreter:
    test_triton_int8.py::test_triton_quantize_dual_interpreted)."""
    from unittest import mock

    from benchmarks import benchmark_mm

    out = tmp_path / "dual.json"  # in process: a subprocess spent ~20 s importing on a loaded 2-core CPU
    argv = ["benchmark_mm.py", "--dual", "--json", str(out)]
    with mock.patch.object(sys, "argv", argv), mock.patch("torch.cuda.is_available", return_value=False), \
            pytest.raises(SystemExit, match="needs a CUDA GPU"):
        benchmark_mm.main()
    assert not out.exists()


def test_benchmark_train_lora_recipes_smoke_on_cpu(tmp_path):
    out = tmp_path / "lora.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_train.py"), "--device", "cpu", "--no_compile",
           "--recipes", "lora_nf4_int8", "--hidden", "256", "--intermediate", "512",
           "--heads", "4", "--kv_heads", "2", "--vocab", "96", "--layers", "1", "--batch", "1", "--seq", "32",
           "--warmup", "1", "--steps", "1", "--lora_r", "4", "--grad_checkpointing", "--autocast", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["config"]["autocast"] is True
    rows = result["rows"]
    assert [r["recipe"] for r in rows] == ["lora_nf4_int8"] and "error" not in rows[0], rows
    assert rows[0]["reference"] == "lora_nf4_int8" and 4 < rows[0]["first_loss"] < 5  # ~ln(96) at init


def test_benchmark_lora_peers_and_checks_in_process():
    import torch
    from conftest import tiny_model

    from benchmarks import driver as bench

    ids = torch.randint(0, 96, (2, 16))
    losses = {}
    for recipe in ("lora_nf4", "lora_torchao_nf4", "lora_torchao_nf4_int8"):
        model = bench.apply_lora_recipe(tiny_model(hidden_size=128, intermediate_size=256, num_attention_heads=2,
                                                   num_key_value_heads=2).bfloat16(), recipe, 16, 4)
        bench.check_recipe_active(model, recipe, "cpu")
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        assert any(p.grad is not None for p in model.parameters() if p.requires_grad)
        losses[recipe] = loss.item()
    # ours and torchao's NF4 store the same codes: same loss at init (LoRA B = 0)
    assert losses["lora_nf4"] == losses["lora_torchao_nf4"]
    assert abs(losses["lora_torchao_nf4_int8"] - losses["lora_nf4"]) < 0.05


def test_benchmark_nf4_workers_on_cpu():
    """benchmark_nf4.py's two measurements, in process (tiny shapes; CPU peaks are RSS growth, not asserted)."""
    import argparse
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_nf4", os.path.join(ROOT, "benchmarks", "benchmark_nf4.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = argparse.Namespace(device="cpu", rows=512, cols=256, reps=1, load_layers=1, hidden=128, intermediate=256,
                           heads=4, kv_heads=2, vocab=128, min_features=16, method="hf_lowbit")
    row = bench.quantize_worker(a)
    assert row["codes_equal_torchao"] == 1.0 and row["scales_equal_torchao"] and row["seconds"] > 0
    a.method = "torchao"
    assert bench.quantize_worker(a)["peak_total_vs_input"] >= 1.0
    load = bench.load_worker(a)
    assert load["swapped"] == 7 and load["nf4_model_gib"] < load["checkpoint_gib"]


def test_benchmark_nf4_decode_on_cpu():
    """benchmark_nf4_decode.py in process on tiny shapes: every method timed, bytes counted (no speed asserted)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("benchmark_nf4_decode",
                                                  os.path.join(ROOT, "benchmarks", "benchmark_nf4_decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rows = bench.bench(((32, 128),), "cpu")
    assert [r["method"] for r in rows] == ["kernel", "kernel_t", "ours", "ours_t", "two_step", "copy"]
    assert all(r["us"] > 0 and r["gb_s"] > 0 for r in rows)


def test_benchmark_quality_lora_recipes_in_process():
    """The lora_* recipes of benchmark_quality.py on random tokens: a bf16 pre-trained base, then LoRA over it."""
    import argparse
    import importlib.util

    import torch

    spec = importlib.util.spec_from_file_location("benchmark_quality", os.path.join(ROOT, "benchmarks", "benchmark_quality.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    a = argparse.Namespace(seed=0, hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, seq=32, device="cpu",
                           min_features=16, compile=False, compile_layers=False, lr=1e-3, lora_lr=None, warmup=1, steps=3,
                           batch=4, lora_r=4)
    gen = torch.Generator().manual_seed(0)
    train, held_out = torch.randint(0, 64, (16, 32), generator=gen), torch.randint(0, 64, (4, 32), generator=gen)
    pre = bench.train_one("bf16", a, train, held_out, 64, steps=3, keep_state=True)
    rows = [bench.train_one(r, a, train, held_out, 64, init_state=pre["state"]) for r in ("lora_bf16", "lora_nf4_int8")]
    assert all(len(r["losses"]) == 3 for r in rows)
    # LoRA starts from the pre-trained base (B = 0): its first loss is the base's loss on that batch, near pre's last
    assert abs(rows[0]["losses"][0] - pre["losses"][-1]) < 0.2
    assert abs(rows[1]["eval_loss"] / rows[0]["eval_loss"] - 1) < 0.02
    # the untrained-adapter row (the bar's reference): no steps, B = 0, so exactly the base's held-out loss
    untrained = bench.train_one("lora_bf16", a, train, held_out, 64, init_state=pre["state"], steps=0)
    assert untrained["losses"] == [] and untrained["final_train_loss"] is None
    assert abs(untrained["eval_loss"] - pre["eval_loss"]) < 1e-6


def test_benchmark_quality_head_recipes_in_process():
    """int8_head / fp8_head of benchmark_quality.py (the LM head's loss parity, stage quality_parity): the recipe's
    lowbit_include_lm_head makes prepare_model convert the head to the format, two steps give finite losses and the row
    says which head it trained; bf16 and int8 keep the head a plain nn.Linear; a head the recipe left alone (FP8 and a
    vocab of 100) stops the run with one line."""
    import argparse
    import importlib.util
    import math
    from unittest import mock

    import torch

    from hf_lowbit import MixedPrecisionLinear

    spec = importlib.util.spec_from_file_location("benchmark_quality", os.path.join(ROOT, "benchmarks", "benchmark_quality.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    assert {"int8_head", "fp8_head"} <= set(bench.RECIPES)
    a = argparse.Namespace(seed=0, hidden=64, intermediate=128, layers=1, heads=4, kv_heads=2, seq=32, device="cpu",
                           min_features=16, compile=False, compile_layers=False, lr=1e-3, warmup=1, steps=2, batch=4)
    gen = torch.Generator().manual_seed(0)
    train, held_out = torch.randint(0, 64, (16, 32), generator=gen), torch.randint(0, 64, (4, 32), generator=gen)
    prepared = []
    real = bench.prepare_model

    def spy(*args, **kwargs):
        prepared.append(real(*args, **kwargs))
        return prepared[-1]

    with mock.patch.object(bench, "prepare_model", spy):
        rows = {r: bench.train_one(r, a, train, held_out, 64) for r in ("bf16", "int8", "int8_head", "fp8_head")}
    heads = dict(zip(rows, (m.lm_head for m in prepared)))
    assert type(heads["bf16"]) is torch.nn.Linear and type(heads["int8"]) is torch.nn.Linear
    for recipe, fmt in (("int8_head", "int8"), ("fp8_head", "fp8")):
        assert isinstance(heads[recipe], MixedPrecisionLinear) and heads[recipe].lowbit_config.format == fmt
    assert {r: row["lm_head"] for r, row in rows.items()} == {"bf16": "bf16", "int8": "bf16", "int8_head": "int8",
                                                              "fp8_head": "fp8"}
    assert all(len(row["losses"]) == 2 and all(map(math.isfinite, [*row["losses"], row["eval_loss"]]))
               for row in rows.values())
    assert abs(rows["int8_head"]["eval_loss"] / rows["bf16"]["eval_loss"] - 1) < 0.02  # same init and data
    with pytest.raises(SystemExit, match="recipe 'int8_head' is not active: the LM head is Linear with bf16 matmuls, "
                                         "not int8$"):
        bench.lm_head_format(prepared[1], "int8_head")  # int8's model under the head recipe's name
    with pytest.raises(SystemExit, match="recipe 'fp8_head' is not active: .* not fp8 \\(FP8 skips a vocab not a "
                                         "multiple of 16"):
        bench.train_one("fp8_head", a, train, held_out, 100)


def test_benchmark_quality_arithmetic_task_holds_out_operand_pairs():
    """The LoRA fine-tuning task: additions in the corpus tokenizer; held-out problems never occur in training."""
    import argparse
    import importlib.util

    from benchmarks.corpus import build_bpe_tokenizer

    spec = importlib.util.spec_from_file_location("benchmark_quality", os.path.join(ROOT, "benchmarks", "benchmark_quality.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    tok = build_bpe_tokenizer(["def f(x):\n    return x + 1  # 12 = 3 * 4, 7 + 5 = 12"] * 20, 300)
    a = argparse.Namespace(steps=10, batch=4, seq=32, seed=0)
    task = bench.arithmetic_task(tok, a, n_eval=200)
    assert task["train"].shape[1] == task["eval"].shape[1] == 32 and task["eval"].shape[0] >= 10
    text = tok.decode(task["eval"][0])
    assert "+" in text and "=" in text
    train_text = tok.decode(task["train"].reshape(-1))
    held_out = [p for p in tok.decode(task["eval"].reshape(-1)).split("</s>")[1:-1]]
    assert held_out and not any(p + "</s>" in train_text for p in held_out)


def test_benchmark_fsdp2_smoke_on_cpu(tmp_path):
    """benchmarks/benchmark_fsdp2.py: FSDP2 through accelerate in 1 and 2 gloo processes, same data per step."""
    out = tmp_path / "fsdp2.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_fsdp2.py"), "--device", "cpu", "--no_compile",
           "--gpus", "1,2", "--recipes", "int8", "--hidden", "64", "--intermediate", "128", "--heads", "4",
           "--kv_heads", "2", "--vocab", "96", "--layers", "2", "--batch", "2", "--seq", "32", "--warmup", "1",
           "--steps", "2", "--min_features", "16", "--timeout", "300", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=700, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["recipe"], r["gpus"]) for r in rows] == [("int8", 1), ("int8", 2)], rows
    assert all("error" not in r for r in rows), rows
    one, two = rows
    assert (one["grad_accum"], two["grad_accum"]) == (2, 1)  # fixed global batch of 2 micro-batches
    # step 1: the same weights and micro-batches, only the reduction differs
    assert abs(one["losses"][0] - two["losses"][0]) < 1e-5, (one["losses"], two["losses"])
    assert two["scaling_efficiency"] > 0 and "vs_ref" not in two  # no bf16 row in this run to compare with
    assert one["max_loss_diff_vs_fewest_gpus"] is None and two["max_loss_diff_vs_fewest_gpus"] < 0.1
    assert "| int8 | 2 |" in proc.stdout


def test_benchmark_fsdp2_trainer_path_smoke_on_cpu(tmp_path):
    """benchmarks/benchmark_fsdp2.py --path trainer (the fsdp2_regimes stage): LowBitTrainer under FSDP2 in 2 gloo
    processes, with gradient accumulation; the sharded run keeps the weight cache off."""
    out = tmp_path / "fsdp2_trainer.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_fsdp2.py"), "--path", "trainer", "--device", "cpu",
           "--no_compile", "--gpus", "2", "--recipes", "int8", "--hidden", "64", "--intermediate", "128", "--heads", "4",
           "--kv_heads", "2", "--vocab", "96", "--layers", "2", "--batch", "1", "--grad_accum", "2", "--seq", "32",
           "--warmup", "1", "--steps", "2", "--min_features", "16", "--timeout", "300", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=700, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert all("error" not in r for r in rows), rows
    assert [(r["recipe"], r["gpus"], r["path"], r["grad_accum"]) for r in rows] == [("int8", 2, "trainer", 2)]
    assert rows[0]["tok_s"] > 0 and rows[0]["chosen"]["weight_cache"] is False


def test_results_name_the_commit_measured(tmp_path, monkeypatch):
    """Every benchmark JSON (bench.write_results) and its markdown header record the commit of the code measured."""
    from benchmarks.driver import git_commit, write_results

    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:  # a git checkout (CI clones one)
        assert git_commit().split("+")[0] == head.stdout.strip()
    monkeypatch.setenv("HF_LOWBIT_COMMIT", "abc1234")  # a copy without .git (a lent GPU machine) is told it
    write_results({"meta": {"device": "cpu"}, "rows": []}, ["| x |"], "cpu", str(tmp_path / "r.json"), str(tmp_path / "r.md"))
    assert json.loads((tmp_path / "r.json").read_text())["meta"] == {"device": "cpu", "commit": "abc1234"}
    assert (tmp_path / "r.md").read_text().startswith("cpu, commit abc1234\n")


def _parsed_flags(script: str, argv: list[str]):
    """``script``'s command-line parser applied to ``argv``, nothing run: the script's ``main`` up to its
    ``parse_args`` (or ``parse_known_args``), which hands back ``(flags, unrecognised words)`` by an exception."""
    import argparse
    import importlib.util
    from unittest import mock

    class Parsed(Exception):
        pass

    def stop(self, args=None, namespace=None):
        raise Parsed(argparse.ArgumentParser.parse_known_args.__wrapped__(self, args, namespace))

    spec = importlib.util.spec_from_file_location(f"_flags_{os.path.basename(script)[:-3]}", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    real = argparse.ArgumentParser.parse_known_args
    stop.__wrapped__ = real
    with mock.patch.object(argparse.ArgumentParser, "parse_known_args", stop), \
            mock.patch.object(sys, "argv", [script, *argv]), pytest.raises(Parsed) as got:
        module.main()
    return got.value.args[0]


def test_trainer_grad_check_smoke_on_cpu(tmp_path):
    """benchmarks/trainer_grad_check.py end to end (CPU, eager): inside LowBitTrainer's loop the weight cache equals a
    fresh quantization and the loss and gradients equal the same recipe's eager uncached run."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "trainer_grad_check.py"), "--device", "cpu", "--no_compile",
           "--configs", "bf16,fp8:atomic_rcp+refresh2k", "--hidden", "64", "--intermediate", "128", "--heads", "4",
           "--kv_heads", "2", "--vocab", "96", "--seq", "32", "--batch", "2", "--grad_accum", "2", "--steps", "3",
           "--min_features", "16", "--lr", "3e-3", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    bf16, fp8 = json.loads(out.read_text())["rows"]
    assert len(bf16["losses"]) == len(fp8["losses"]) == 3 and "steps" not in bf16
    assert fp8["chosen"]["weight_cache"] is True and len(fp8["steps"]) == 3
    assert fp8["cache_differ"] == 0 and fp8["steps"][0]["cache"]["layers"] == 14
    assert fp8["max_loss_rel_diff"] == 0 and min(fp8["min_cos_same"], fp8["min_cos_acc_same"]) > 0.99999
    assert 0.9 < min(fp8["min_cos_bf16"], fp8["min_cos_acc_bf16"]) < 1  # FP8 is not bf16
    assert "| fp8:atomic_rcp+refresh2k | 0 |" in proc.stdout


def test_trainer_grad_check_sees_a_stale_weight_cache(monkeypatch):
    """The check's point: a weight cache left stale after the optimizer steps (here: refreshed once only) shows as
    cache elements that differ from a fresh quantization, a loss and gradients off the same recipe's eager run."""
    import argparse
    import importlib

    from benchmarks import trainer_grad_check as check
    from hf_lowbit.mixed_precision import linear as L

    Q = importlib.import_module("hf_lowbit.kernels.quantize_t")
    monkeypatch.setattr(Q, "ACTIVATION_VARIANT", Q.ACTIVATION_VARIANT)  # the worker sets it for its process
    refresh = L.MixedPrecisionLinear.refresh_weight_cache

    def once(self, force=False):
        return False if self._cache_key is not None else refresh(self, force)

    monkeypatch.setattr(L.MixedPrecisionLinear, "refresh_weight_cache", once)
    a = argparse.Namespace(config="int8:two_kernel", device="cpu", no_compile=True, hidden=64, intermediate=128,
                           heads=4, kv_heads=2, vocab=96, layers=2, seq=32, batch=2, grad_accum=2, steps=3,
                           min_features=16, lr=3e-3)
    row = check.worker(a)
    first, *later = row["steps"]
    assert sum(v for k, v in first["cache"].items() if k != "layers") == 0 and first["loss"] == first["loss_same"]
    assert all(s["cache"]["q"] > 0 and s["cache"]["q_t"] > 0 and s["cache"]["q_t_vs_q"] == 0 for s in later)
    assert row["max_loss_rel_diff"] > 1e-4 and row["min_cos_same"] < 0.999 and row["min_cos_acc_same"] < 0.999


def test_every_stage_command_runs_its_script_with_flags_it_has():
    """benchmarks/run.py's table: every command names a script that exists, with flags that script parses (each
    committed result's command stays runnable); ``$OUT`` and the stages' variables filled in."""
    import re
    import shlex

    from benchmarks.run import STAGES

    env = {"OUT": "/tmp/out", "BLOCKS": "layers_b1", "BATCH": "1", "GA": "8", "GPUS": "1", "RECIPES": "bf16,int8",
           "MODES": "compiled", "CHECKPOINTS": "qat_int4_tinygemm", "TAG": "int4", "FIRST": "1",
           "SCHEME": "int4_tinygemm", "GROUP": "256", "PRETRAIN_LR": "2e-3", "FINETUNE_LR": "3e-4",
           "CORPUS_CACHE": ".corpus_cache", "WORKERS": "8", "SWEEP": "--sweep", "GEMLITE": "--gemlite_autotune max", "CONFIGS": "s6x512_lr1e-2", "BATCHES": "1", "LAYERS": "32", "TIMEOUT": "420",
           "EXTRA": "--device cpu --override layers=1,steps=3 --deadline_s 0"}
    checked = 0
    for stage, (_, _, commands) in STAGES.items():
        for command in commands:
            words = shlex.split(re.sub(r"\$\{?(\w+)(?::[-?][^}]*)?\}?", lambda m: env[m.group(1)], command))
            words = words[:words.index("2>&1")] if "2>&1" in words else words
            words = words[2:] if words[0] == "timeout" else words
            if words[0] == "bash":  # a runner script of its own
                assert os.path.exists(os.path.join(ROOT, words[1])), (stage, command)
                continue
            if words[:3] == ["python3", "-m", "pytest"]:
                continue
            assert words[0] == "python3" and words[1].startswith("benchmarks/"), (stage, command)
            parsed, unknown = _parsed_flags(os.path.join(ROOT, words[1]), words[2:])
            # only benchmark_regimes.py passes flags through (to benchmark_train.py, which must know them)
            assert not unknown or words[1].endswith("benchmark_regimes.py"), (stage, unknown)
            checked += 1
    assert checked >= 18
    # what the check catches: a flag a script does not have, a value a flag does not take
    train = os.path.join(ROOT, "benchmarks", "benchmark_train.py")
    assert _parsed_flags(train, ["--no_such_flag"])[1] == ["--no_such_flag"]
    with pytest.raises(SystemExit):
        _parsed_flags(train, ["--batch", "eight"])


def test_serve_merge_joins_what_the_serve_calls_write():
    """benchmarks/run.py: serve_merge names the files serve_probe and the three serve calls (as the serve stage
    lists them) write; a name that drifted would be left out of the merge with only a printed line."""
    import shlex

    from benchmarks.run import STAGES

    def words(stage, **env):  # the stage's command as run.py's bash expands it
        (command,) = STAGES[stage][2]
        echo = subprocess.run(["bash", "-c", f"echo {command}"], env={"PATH": os.environ["PATH"], "OUT": "/o", **env},
                              capture_output=True, text=True, check=True)
        return shlex.split(echo.stdout)

    calls = [{}, {"MODES": "compiled", "TAG": "int4", "CHECKPOINTS": "qat_int4_tinygemm,ptq_int4_tinygemm"},
             {"MODES": "compiled", "TAG": "fp8", "CHECKPOINTS": "qat_fp8_rowwise,ptq_fp8_rowwise"}]
    for call in calls[1:]:  # the serve stage's description spells out each call
        assert " ".join(f"{k}={v}" for k, v in call.items()) in STAGES["serve"][0]
    written = [(w := words("serve", **call))[w.index("--json") + 1] for call in calls]
    written.append((w := words("serve_probe"))[w.index("--json") + 1])
    merge = words("serve_merge")
    assert merge[merge.index("--merge") + 1:merge.index("--json")] == written
    assert len(set(written)) == 4 and merge[merge.index("--json") + 1] not in written


def test_qat_ptq_hurts_merge_joins_what_the_seed_calls_write():
    """benchmarks/run.py: qat_ptq_hurts runs one model seed per call (FIRST=0, 1, 2, the default 0), each into its
    own file; qat_ptq_hurts_merge joins exactly those files into one it does not overwrite them with."""
    import shlex

    from benchmarks.run import STAGES

    def words(stage, **env):  # the stage's command as run.py's bash expands it
        (command,) = STAGES[stage][2]
        command = command.split(" 2>&1 |")[0]  # echo the command, not into its tee
        echo = subprocess.run(["bash", "-c", f"echo {command}"], env={"PATH": os.environ["PATH"], "OUT": "/o", **env},
                              capture_output=True, text=True, check=True)
        return shlex.split(echo.stdout)

    calls = [words("qat_ptq_hurts", **({"FIRST": str(k)} if k else {})) for k in range(3)]
    assert [(w[w.index("--repeats") + 1], w[w.index("--repeat_from") + 1]) for w in calls] == [
        ("1", "0"), ("1", "1"), ("1", "2")]
    written = [w[w.index("--json") + 1] for w in calls]
    merge = words("qat_ptq_hurts_merge")
    assert merge[merge.index("--merge") + 1:merge.index("--json")] == written
    assert len(set(written)) == 3 and merge[merge.index("--json") + 1] not in written
    assert "FIRST=1 and FIRST=2" in STAGES["qat_ptq_hurts"][0]


def test_ptq_sensitivity_stage_runs_the_default_configs_and_extra_comes_last():
    """benchmarks/run.py: ptq_sensitivity runs the script's default configurations in its order (each named in the
    description), compiled, with a deadline before its timeout; EXTRA's flags come after the ones they override
    (the CPU dry run the description gives)."""
    import shlex

    from benchmarks.run import STAGES

    what, _, (command,) = STAGES["ptq_sensitivity"]
    command = command.split(" 2>&1 |")[0]
    extra = "--device cpu --deadline_s 0 --eval_blocks 8 --vocab 512"
    echo = subprocess.run(["bash", "-c", f"echo {command}"], capture_output=True, text=True, check=True,
                          env={"PATH": os.environ["PATH"], "OUT": "/o", "EXTRA": extra})
    words = shlex.split(echo.stdout)
    assert words[:4] == ["timeout", "540", "python3", "benchmarks/ptq_sensitivity.py"]
    script = os.path.join(ROOT, "benchmarks", "ptq_sensitivity.py")
    parsed, unknown = _parsed_flags(script, words[4:])
    assert not unknown and parsed.compile and parsed.device == "cpu" and parsed.deadline_s == 0
    assert (parsed.eval_blocks, parsed.vocab) == (8, 512)
    default, _ = _parsed_flags(script, [])
    assert parsed.configs == default.configs and parsed.variants == default.variants
    assert all(name in what for name in parsed.configs.split(","))
    stage_default, _ = _parsed_flags(script, shlex.split(subprocess.run(
        ["bash", "-c", f"echo {command}"], capture_output=True, text=True, check=True,
        env={"PATH": os.environ["PATH"], "OUT": "/o"}).stdout)[4:])
    assert stage_default.deadline_s and stage_default.deadline_s < 540 and stage_default.json == "/o/ptq_sensitivity_h200.json"


def test_benchmark_fp8_softcast_recipe(monkeypatch):
    """fp8_softcast (issue 25): fp8's swap and arguments with FP8's activation codes rounded in float32 before the
    cast (quantize_t.FP8_CAST = "soft" for the process; refused as not active without it), passed to the Triton
    launcher only for FP8 on the atomic variants; the regimes blocks that compare it with the hardware cast."""
    import importlib

    from conftest import tiny_model

    from benchmarks import driver as bench
    from benchmarks.benchmark_regimes import BLOCKS

    Q = importlib.import_module("hf_lowbit.kernels.quantize_t")
    monkeypatch.setattr(Q, "FP8_CAST", Q.FP8_CAST)  # restored after the test
    monkeypatch.setattr(Q, "ACTIVATION_VARIANT", dict(Q.ACTIVATION_VARIANT))
    assert Q.FP8_CAST is None and Q._triton_kwargs("fp8", False) == {"variant": "atomic_rcp"}
    model = tiny_model().bfloat16()
    bench.apply_recipe(model, "fp8_softcast", min_features=16)
    with pytest.raises(RuntimeError, match="hardware cast"):
        bench.check_recipe_active(model, "fp8_softcast", "cpu")
    assert bench.apply_process_setting("fp8_softcast") and Q.FP8_CAST == "soft"
    bench.check_recipe_active(model, "fp8_softcast", "cpu")
    assert Q._triton_kwargs("fp8", False) == {"variant": "atomic_rcp", "fp8_cast": "soft"}
    assert Q._triton_kwargs("int8", False) == {"variant": "atomic_rcp"}  # INT8 has no cast to choose
    Q.ACTIVATION_VARIANT["fp8"] = "two_kernel"  # nor do the other variants (quantize_t_triton would refuse it)
    assert Q._triton_kwargs("fp8", False) == {"variant": "two_kernel"}
    assert "fp8_softcast" in bench.FULL_RECIPES and "fp8_softcast" in bench.OURS
    assert bench.mixed_precision_args("fp8_softcast") == bench.mixed_precision_args("fp8")
    cast = "bf16,int8,fp8,fp8_softcast"
    assert {name: BLOCKS[name][:5] for name in ("layers_b8_cast", "layers_b1_cast", "trainer_b1_ga8_cast")} == {
        "layers_b8_cast": ("layers", 8, 1, "default", cast), "layers_b1_cast": ("layers", 1, 1, "default", cast),
        "trainer_b1_ga8_cast": ("trainer", 1, 8, "default", cast)}


def test_benchmark_swiglu_smoke_interpreted(tmp_path):
    """benchmarks/benchmark_swiglu.py under Triton's interpreter on shrunk shapes: every path runs (Inductor's
    eagerly: no compile on a CPU), ours at a looped and a one-tile config and with the column absmax, each checked
    against the reference's codes; the table and JSON are written (timings meaningless)."""
    out = tmp_path / "swiglu.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_swiglu.py"), "--device", "cpu", "--scale", "256",
           "--tokens", "2048", "--tiles", "2x16x4,1x64x4", "--col_tiles", "4x16x4", "--json", str(out), "--markdown",
           str(tmp_path / "swiglu.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    for fmt in ("int8", "fp8"):
        mine = {(r["direction"], r["impl"], r["tiles"]) for r in rows if r["fmt"] == fmt and r["tokens"] == 8}
        assert mine == {("forward", "bf16", ""), ("forward", "inductor", ""), ("backward", "bf16", ""),
                        ("backward", "inductor", ""), ("forward", "ours", "2x16x4"), ("forward", "ours", "1x64x4"),
                        ("backward", "ours", "2x16x4"), ("backward", "ours", "1x64x4"),
                        ("columns_forward", "quantize_t", ""), ("columns_backward", "quantize_t", ""),
                        ("forward", "ours_col_amax", "4x16x4"), ("columns_forward", "encode_only", "4x16x4"),
                        ("backward", "ours_col_amax", "4x16x4"), ("columns_backward", "encode_only", "4x16x4")}, mine
    assert all(r["codes_exact"] for r in rows if "codes_exact" in r) and all(r["gpu_ms"] > 0 for r in rows)
    md = (tmp_path / "swiglu.md").read_text()
    assert "| int8 | 8 | backward |" in md and "| fp8 | 8 | forward |" in md and "| 4x16x4 |" in md
    assert md.count("| 4x16x4 |") == 4  # the column tables: both formats, both directions
    bad = subprocess.run(cmd[:2] + ["--device", "cpu", "--tiles", "2x16"], capture_output=True, text=True, cwd=ROOT,
                         env=env, timeout=120)
    assert bad.returncode != 0 and "--tiles '2x16': give BLOCK_RxBLOCK_NxWARPS triples" in bad.stderr


def test_benchmark_refresh_smoke_interpreted(tmp_path):
    """benchmarks/benchmark_refresh.py under Triton's interpreter on shrunk shapes: every part runs (the AdamW
    kernel in the interpreter; quantize_weight is plain torch on a CPU, so the bit check compares like with like
    here, the kernels' own are tests/_triton_checks.py's), the table, tile sweep and JSON are written (on a CPU the
    "GPU" columns are one call's wall time: meaningless)."""
    out = tmp_path / "refresh.json"
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": ROOT}
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "benchmark_refresh.py"), "--device", "cpu", "--scale", "256",
           "--warmup", "1", "--tiles", "2x16x1", "--json", str(out), "--markdown",
           str(tmp_path / "refresh.md")]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["fmt"], r["name"], r["per"]) for r in rows][:5] == [
        ("int8", "q, o", "layer"), ("int8", "k, v", "layer"), ("int8", "gate, up", "layer"), ("int8", "down", "layer"),
        ("int8", "embedding, LM head", "model")] and len(rows) == 10
    assert all(r["refresh_bits_equal"] and r["plain_adamw_gpu_ms"] > 0 for r in rows)
    md = (tmp_path / "refresh.md").read_text()
    assert "**a layer**" in md and "| 2x16x1 |" in md and "**AdamW a step of the regimes' model** (8 layers" in md
    assert all(set(r["adamw_tiles_gpu_ms"]) == {"2x16x1"} for r in rows)
