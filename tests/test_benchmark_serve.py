"""benchmarks/benchmark_serve.py on the CPU: the plumbing (builds, fresh-process loads, both modes, error rows,
ratios per run, merging), not the timings."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import tiny_config
from transformers import AutoModelForCausalLM

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "benchmark_serve.py")
TINY = ["--device", "cpu", "--layers", "1", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv_heads", "2",
        "--vocab", "128", "--prefill", "16", "--prompt", "4", "--decode_tokens", "1,3", "--batches", "1",
        "--group_size", "32", "--qat_steps", "1", "--qat_seq", "8", "--reps", "1", "--compile_backend", "eager"]


def _script():
    spec = importlib.util.spec_from_file_location("benchmark_serve", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_serve_smoke_on_cpu(tmp_path):
    """bf16 and a QAT export, each built and then loaded by plain transformers in a fresh process, timed eagerly
    and through transformers' compiled path (static cache + compile_config; dynamo without Inductor here)."""
    out = tmp_path / "serve.json"
    # --timeout is per worker (build, measure); one that times out is an error row and fails the test. A margin,
    # not a bound under test: the whole run (4 processes) took 60-180 s on 2 busy cores, and 300 s per worker
    # timed out once under a CPU hog.
    cmd = [sys.executable, SCRIPT, *TINY, "--checkpoints", "qat_8da4w", "--json", str(out),
           "--markdown", str(tmp_path / "serve.md"), "--timeout", "900", "--profile", "--defer_stop_check",
           "--modes", "eager,compiled,compiled_unwrapped,compiled_lean,compiled_int4k,compiled_int4k_triton,compiled_fp8k"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=2700, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads(out.read_text())
    bf16, qat = data["rows"]
    assert [bf16["checkpoint"], qat["checkpoint"]] == ["bf16", "qat_8da4w"]
    assert "error" not in bf16 and "error" not in qat, (bf16.get("error"), qat.get("error"))
    assert bf16["weight_type"] == "Parameter"
    assert qat["weight_type"] == qat["build"]["weight_type"] == "IntxUnpackedToInt8Tensor"
    assert qat["lm_head_type"] == "IntxUnpackedToInt8Tensor"  # --lm_head int4 (the default)
    assert len(qat["build"]["qat_losses"]) == 1
    assert 0 < qat["safetensors_bytes"] < bf16["safetensors_bytes"] and qat["size_vs_bf16"] < 1
    for row in (bf16, qat):
        for mode in ("eager", "compiled", "compiled_unwrapped", "compiled_lean", "compiled_int4k",
                     "compiled_int4k_triton", "compiled_fp8k"):
            phase = row[mode]
            assert "error" not in phase, (row["checkpoint"], mode, phase.get("error"))
            assert phase["prefill_ms"] > 0 and len(phase["decode_ms_b1"]) == 2
            assert phase["prefill_vs_bf16"] > 0
            # --profile: the per-token differences of two profiled generate calls (no GPU here: no kernels, no
            # busy share), and no CUDA graphs tried by the eager backend
            prof = phase["decode_profile_b1"]
            # (the wall time per token, a difference of two calls, can come out negative on a loaded CPU too)
            assert isinstance(prof["wall_ms_per_token"], float)
            assert prof["device_ms_per_token"] == 0 and prof["busy"] is None
            assert prof["syncs_per_token"] == prof["graph_replays_per_token"] == 0
            # the host's side per token: CPU ops' self time, the top ones named (a difference of two profiled calls:
            # on a loaded CPU it can come out negative, so only its presence is checked)
            assert isinstance(prof["host_self_ms_per_token"], float)
            assert prof["top_host_ops_per_token"] and all(o["name"] for o in prof["top_host_ops_per_token"])
            # the kernels a decoded token adds: CUDA kernels only, none profiled on a CPU
            assert prof["top_kernels_per_token"] == [] and prof["top_kernels"] == []
            assert "host_ops" not in phase["prefill_profile"] and "kernels" not in phase["prefill_profile"]
            assert phase["prefill_profile"]["wall_ms"] > 0 and phase["cudagraph_skips"] == 0
            # --defer_stop_check: timed again under deferred_stop_check (a no-op on the CPU: no events), same tokens
            assert len(phase["decode_ms_b1_deferred"]) == 2 and phase["deferred_same_tokens_b1"] is True
            assert phase["deferred_agree_b1"] == phase["plain_repeat_agree_b1"] == 1.0
    assert bf16["eager"]["prefill_vs_bf16"] == 1.0
    # unwrap_tensor_subclass: plain tensors for Dynamo, the same quantized weights rebuilt in the graph
    assert qat["compiled_unwrapped"]["parameter_types"] == bf16["compiled_unwrapped"]["parameter_types"] == ["Parameter"]
    # compiled_lean: a fresh load (compiled_unwrapped changed the model), every quantized weight (7 linears and the
    # LM head) unwrapped by hf_lowbit/qat/serving.py, and fewer guards than the plain compiled path checks
    lean, compiled = qat["compiled_lean"], qat["compiled"]
    assert lean["reloaded"] and "reloaded" not in compiled
    assert lean["unwrapped"] == {"IntxUnpackedToInt8Tensor": 8} and bf16["compiled_lean"]["unwrapped"] == {}
    assert lean["parameter_types"] == ["Parameter"]
    assert len(lean["guards"]) == len(compiled["guards"]) >= 2  # the prefill and the decode step
    assert max(lean["guards"]) < min(compiled["guards"])
    # compiled_int4k: no tinygemm weight here, so hf_lowbit's int4 kernels swap nothing and say why, per linear
    for row, wtype in ((bf16, "Parameter"), (qat, "IntxUnpackedToInt8Tensor")):
        # (compiled_int4k_triton: the same swap with decode="triton", our tile GEMV for decode too)
        for mode, decode in (("compiled_int4k", "tinygemm"), ("compiled_int4k_triton", "triton")):
            int4k = row[mode]
            assert int4k["reloaded"] and int4k["imports_hf_lowbit"]
            assert int4k["kernel_kwargs"] == {"decode": decode, "stack_siblings": False}  # stacking is the default
            assert int4k["int4_kernels"] == {
                "swapped": 0, "stacked": 0, "not_stacked": [], "skipped": {f"weight is {wtype}, not Int4TilePackedTo4dTensor": 8,
                                          "a lookup, not a matmul": 1}}, int4k["int4_kernels"]
        fp8k = row["compiled_fp8k"]  # and no Float8Tensor either (FP8 exports are built on sm_89+ GPUs only)
        assert fp8k["reloaded"] and fp8k["imports_hf_lowbit"]
        assert fp8k["fp8_kernels"] == {
            "swapped": 0, "stacked": 0, "not_stacked": [], "skipped": {f"weight is {wtype}, not a torchao Float8Tensor": 8,
                                      "a lookup, not a matmul": 1}}, fp8k["fp8_kernels"]
    meta = data["meta"]
    assert meta["config"]["modes"] == ["eager", "compiled", "compiled_unwrapped", "compiled_lean", "compiled_int4k",
                                       "compiled_int4k_triton", "compiled_fp8k"]
    import torchao
    import transformers

    # the record every benchmark writes (benchmarks.driver.meta), plus the versions serving depends on
    assert {"commit", "gpu", "torch", "python", "command", "params"} <= set(meta) and meta["commit"]
    assert meta["torch"] == torch.__version__ and meta["transformers"] == transformers.__version__
    assert meta["torchao"] == torchao.__version__ and "--checkpoints qat_8da4w" in meta["command"]
    assert "| qat_8da4w | IntxUnpackedToInt8Tensor |" in (tmp_path / "serve.md").read_text()
    assert "| qat_8da4w | compiled |" in (tmp_path / "serve.md").read_text()  # the --profile table
    assert "Kernels per decoded token" not in (tmp_path / "serve.md").read_text()  # none on a CPU
    assert meta["config"]["profile"] is True and meta["config"]["defer_stop_check"] is True
    assert "stop check deferred" in (tmp_path / "serve.md").read_text() or not any(
        "decode_tok_s_b1_deferred" in row[m] for row in (bf16, qat) for m in meta["config"]["modes"])


def test_serve_build_worker_reports_a_scheme_it_cannot_convert_in_one_line(tmp_path, capsys, monkeypatch):
    """A GPU scheme on a machine without the GPU: the build worker prints an error row (one line), no traceback."""
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_config(vocab_size=128)).save_pretrained(tmp_path / "base")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", *TINY, "--worker", "build", "--kind", "qat", "--scheme",
                                      "fp8_rowwise", "--base_dir", str(tmp_path / "base"), "--out_dir",
                                      str(tmp_path / "q")])
    _script().main()
    row = json.loads(capsys.readouterr().out.strip().splitlines()[-1][len("RESULT "):])
    assert row["error"].startswith("RuntimeError: convert_qat: qat_scheme='fp8_rowwise' cannot be converted here")
    assert "\n" not in row["error"] and not (tmp_path / "q").exists()


@pytest.mark.parametrize("lm_head", ["int4", "bf16"])
def test_serve_ptq_checkpoint_loads_with_the_same_layers_quantized(tmp_path, lm_head):
    """torchao's PTQ row: quantize_ on the same linears as the QAT export (the LM head only with --lm_head int4),
    saved with a TorchAoConfig that plain from_pretrained loads back to the same tensors."""
    import argparse

    from torchao.quantization import quantize_

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(tiny_config(vocab_size=128))
    base.save_pretrained(tmp_path / "base")
    script = _script()
    a = argparse.Namespace(base_dir=str(tmp_path / "base"), out_dir=str(tmp_path / "q"), device="cpu", group_size=32,
                           lm_head=lm_head, seed=0, vocab=128)
    assert script.build_quantized(a, "ptq", "8da4w")["weight_type"] == "IntxUnpackedToInt8Tensor"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    head = type(loaded.lm_head.weight).__name__
    assert head == ("IntxUnpackedToInt8Tensor" if lm_head == "int4" else "Parameter")
    from hf_lowbit.qat import QATConfig

    reference = AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.bfloat16)  # as the build loads it
    quantize_(reference, QATConfig("8da4w", 32).base_config(), filter_fn=script._quantized_filter(a))
    ids = torch.randint(0, 128, (2, 9))
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, reference(ids).logits)


def test_serve_runner_keeps_what_a_crashed_or_timed_out_worker_printed():
    script = _script()
    crash = "import sys; print('RESULT {\"load_s\": 1.5}', flush=True); sys.exit('kernel missing: no mslk')"
    got, err = script._run([sys.executable, "-c", crash], timeout=60)
    assert got == {"load_s": 1.5} and err == "kernel missing: no mslk"
    hang = "import time; print('RESULT {\"eager\": {\"prefill_ms\": 2.0}}', flush=True); time.sleep(60)"
    got, err = script._run([sys.executable, "-c", hang], timeout=3)
    assert got == {"eager": {"prefill_ms": 2.0}} and err == "timed out after 3 s"
    got, err = script._run([sys.executable, "-c", "print('ok')"], timeout=60)
    assert got is None and err is None


def _row(name, run, prefill, decode, size, **extra):
    return {"checkpoint": name, "run": run, "safetensors_bytes": size, "weight_type": "T", "load_s": 1.0,
            "compiled": {"prefill_ms": prefill, "decode_tok_s_b1": decode}, **extra}


def test_serve_merge_keeps_ratios_within_each_run(tmp_path, monkeypatch):
    """Runs split over device calls each carry their own bf16 row; a row is compared with its own run's."""
    meta = {"config": {"layers": 8, "hidden": 4096, "prefill": 2048, "decode_tokens": [16, 80], "prompt": 128,
                       "lm_head": "int4", "batches": [1]}, "command": "x"}
    parts = [[_row("bf16", 0, 10.0, 100.0, 4000), _row("qat_int4_tinygemm", 0, 8.0, 200.0, 1200)],
             [_row("bf16", 0, 20.0, 50.0, 4000), _row("qat_fp8_rowwise", 0, 10.0, 60.0, 2100),
              {"checkpoint": "ptq_fp8_rowwise", "run": 0, "stage": "build", "error": "AssertionError: no sm_89"}]]
    probe = [{"config": "Int4WeightOnlyConfig(plain)", "needs": "mslk", "ok": False, "error": "ImportError: Requires mslk"}]
    files = []
    for i, rows in enumerate(parts):
        files.append(tmp_path / f"part{i}.json")
        files[-1].write_text(json.dumps({"meta": meta, "rows": rows, **({"probe": probe} if i else {})}))
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", "--merge", *map(str, files), "--json",
                                      str(tmp_path / "all.json"), "--markdown", str(tmp_path / "all.md")])
    _script().main()
    rows = {r["checkpoint"] + r["run"]: r for r in json.loads((tmp_path / "all.json").read_text())["rows"]}
    int4, fp8 = rows["qat_int4_tinygemm0:0"], rows["qat_fp8_rowwise1:0"]
    assert int4["compiled"]["decode_vs_bf16_b1"] == 2.0 and int4["compiled"]["prefill_vs_bf16"] == 1.25
    assert fp8["compiled"]["decode_vs_bf16_b1"] == 1.2 and fp8["compiled"]["prefill_vs_bf16"] == 2.0
    assert int4["size_vs_bf16"] == 0.3
    md = (tmp_path / "all.md").read_text()
    assert "| ptq_fp8_rowwise | error (build): AssertionError: no sm_89 |" in md
    assert "| Int4WeightOnlyConfig(plain) | mslk | no: ImportError: Requires mslk |" in md  # the probe of a part


def test_serve_merge_leaves_out_a_call_that_wrote_nothing(tmp_path, monkeypatch, capsys):
    """Stage serve_merge names every call's file; one that did not run (or was cut before its first row) is left
    out, said so, and absent from the merged record; none at all is an error, not an empty table."""
    meta = {"config": {"layers": 8, "hidden": 4096, "prefill": 2048, "decode_tokens": [16, 80], "prompt": 128,
                       "lm_head": "int4", "batches": [1]}, "command": "eager call"}
    eager = tmp_path / "serve_eager_all_h200.json"
    eager.write_text(json.dumps({"meta": meta, "rows": [_row("bf16", 0, 10.0, 100.0, 4000),
                                                        _row("qat_int4_tinygemm", 0, 8.0, 200.0, 1200)]}))
    missing = tmp_path / "serve_compiled_int4_h200.json"
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", "--merge", str(eager), str(missing), "--json",
                                      str(tmp_path / "all.json")])
    _script().main()
    assert f"--merge: {missing} does not exist; merging the others" in capsys.readouterr().out
    data = json.loads((tmp_path / "all.json").read_text())
    assert data["meta"]["merged"] == [{"file": eager.name, "command": "eager call"}]
    assert [r["run"] for r in data["rows"]] == ["0:0", "0:0"]
    assert data["rows"][1]["compiled"]["decode_vs_bf16_b1"] == 2.0
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", "--merge", str(missing), "--json", str(tmp_path / "x.json")])
    with pytest.raises(SystemExit, match="none of .*serve_compiled_int4_h200.json exists"):
        _script().main()
    assert not (tmp_path / "x.json").exists()


def _fake_profile(wall, kernels, host):
    """``_profiled``'s return, made up: name -> (ms, calls) of the kernels and of the host's CPU ops."""
    return {"wall_ms": wall, "device_ms": sum(ms for ms, _ in kernels.values()), "syncs": 2, "graph_replays": 0,
            "kernel_launches": sum(c for _, c in kernels.values()), "kernels": kernels,
            "top_kernels": [{"name": k, "ms": ms, "calls": c} for k, (ms, c) in kernels.items()],
            "host_self_ms": sum(ms for ms, _ in host.values()), "host_ops": host}


def test_serve_decode_profile_attributes_kernels_per_token(monkeypatch):
    """top_kernels_per_token: each kernel's ms and calls in the long call less the short one's, per decoded token,
    by ms: the prefill (in both calls) cancels; a kernel of the long call only counts whole, one of the short call
    only negative (last)."""
    script = _script()
    per = script.per_token({"gemv": (9.0, 40), "prefill_gemm": (5.0, 1), "dequant": (2.0, 8)},
                           {"gemv": (3.0, 16), "prefill_gemm": (5.0, 1), "warmup": (0.5, 2)}, 4, 24)
    assert per == [{"name": "gemv", "ms": 1.5, "calls": 6.0}, {"name": "dequant", "ms": 0.5, "calls": 2.0},
                   {"name": "prefill_gemm", "ms": 0.0, "calls": 0.0}, {"name": "warmup", "ms": -0.125, "calls": -0.5}]
    assert [k["name"] for k in script.per_token({f"k{i}": (float(i), 1) for i in range(30)}, {}, 1, 24)] == [
        f"k{i}" for i in range(29, 5, -1)]  # the top 24 by ms
    profiles = {2: _fake_profile(10.0, {"gemv": (3.0, 16), "prefill_gemm": (5.0, 1)}, {"aten::mm": (1.0, 10)}),
                6: _fake_profile(18.0, {"gemv": (9.0, 40), "prefill_gemm": (5.0, 1), "dequant": (2.0, 8)},
                                 {"aten::mm": (3.0, 30), "aten::copy_": (0.4, 4)})}
    monkeypatch.setattr(script, "_profiled", lambda fn, device: profiles[fn()])
    d = script.decode_profile(lambda n: n, 2, 6, "cuda")
    assert d["top_kernels_per_token"] == [{"name": "gemv", "ms": 1.5, "calls": 6.0},
                                          {"name": "dequant", "ms": 0.5, "calls": 2.0},
                                          {"name": "prefill_gemm", "ms": 0.0, "calls": 0.0}]
    assert d["top_kernels"] == profiles[6]["top_kernels"]  # the long call's, as before
    assert d["top_host_ops_per_token"] == [{"name": "aten::mm", "ms": 0.5, "calls": 5.0},
                                           {"name": "aten::copy_", "ms": 0.1, "calls": 1.0}]
    assert d["device_ms_per_token"] == 2.0 and d["wall_ms_per_token"] == 2.0 and d["busy"] == 1.0


def test_serve_markdown_lists_kernels_per_token_where_recorded(tmp_path, monkeypatch):
    """The markdown's per-token kernel listing: the rows whose decode profile has top_kernels_per_token (the top 12,
    names cut to 80 characters), none for a record written before it was, which still renders its profile line."""
    meta = {"config": {"layers": 8, "hidden": 4096, "prefill": 2048, "decode_tokens": [16, 80], "prompt": 128,
                       "lm_head": "int4", "batches": [1]}, "command": "x"}
    old = {"wall_ms_per_token": 5.0, "device_ms_per_token": 4.0, "busy": 0.8, "syncs_per_token": 0.0,
           "graph_replays_per_token": 1.0, "kernel_launches_per_token": 0.0, "host_self_ms_per_token": 0.5,
           "top_kernels": [{"name": "gemm", "ms": 300.0}]}
    new = {**old, "top_kernels_per_token": [{"name": f"k{i}_" + "x" * 100, "ms": 1.0 - i / 100, "calls": 32.0}
                                            for i in range(24)]}
    rows = [_row("bf16", 0, 10.0, 100.0, 4000), _row("qat_int4_tinygemm", 0, 8.0, 200.0, 1200)]
    rows[0]["compiled"]["decode_profile_b1"], rows[1]["compiled"]["decode_profile_b1"] = old, new
    (tmp_path / "part.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", "--merge", str(tmp_path / "part.json"), "--json",
                                      str(tmp_path / "all.json"), "--markdown", str(tmp_path / "all.md")])
    _script().main()
    md = (tmp_path / "all.md").read_text()
    assert "| bf16 | compiled | – | 1 | 5.00 | 4.00 | 80% |" in md  # the old record's profile line
    listed = [line for line in md.splitlines() if line.startswith("| qat_int4_tinygemm | compiled | 1 |")]
    assert listed[0] == f"| qat_int4_tinygemm | compiled | 1 | 1.0000 | 32.00 | {('k0_' + 'x' * 100)[:80]} |"
    assert len(listed) == 12 and "Kernels per decoded token" in md
    assert not any(line.startswith("| bf16 | compiled | 1 |") for line in md.splitlines())


def test_serve_markdown_lists_deferred_decodes_with_ratios_in_their_run(tmp_path, monkeypatch):
    """``--defer_stop_check`` records: a line per checkpoint, mode and batch, the deferred rate against the bf16
    row's deferred rate of the same run, and the deferred/plain ratio; none for a row without them."""
    meta = {"config": {"layers": 8, "hidden": 4096, "prefill": 2048, "decode_tokens": [16, 80], "prompt": 128,
                       "lm_head": "int4", "batches": [1]}, "command": "x"}
    rows = [_row("bf16", 0, 10.0, 100.0, 4000), _row("qat_int4_tinygemm", 0, 8.0, 200.0, 1200),
            _row("qat_fp8_rowwise", 0, 9.0, 150.0, 2000)]
    rows[0]["compiled"] |= {"decode_tok_s_b1_deferred": 150.0, "deferred_agree_b1": 1.0, "plain_repeat_agree_b1": 1.0}
    rows[1]["compiled"] |= {"decode_tok_s_b1_deferred": 360.0, "deferred_agree_b1": 0.875}
    (tmp_path / "part.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    monkeypatch.setattr(sys, "argv", ["benchmark_serve.py", "--merge", str(tmp_path / "part.json"), "--json",
                                      str(tmp_path / "all.json"), "--markdown", str(tmp_path / "all.md")])
    _script().main()
    md = (tmp_path / "all.md").read_text()
    assert "| bf16 | compiled | 1 | 100 | 1.00x | 150 | 1.00x | 1.50x | 100.0% | 100.0% |" in md
    assert "| qat_int4_tinygemm | compiled | 1 | 200 | 2.00x | 360 | 2.40x | 1.80x | 87.5% | – |" in md
    assert "| qat_fp8_rowwise | compiled | 1 |" not in md
    rows[2]["compiled"] = {"prefill_ms": 9.0, "decode_tok_s_b1_deferred": 180.0}  # the plain timing resolved no rate
    (tmp_path / "part.json").write_text(json.dumps({"meta": meta, "rows": rows}))
    _script().main()
    line = "| qat_fp8_rowwise | compiled | 1 | – | – | 180 | 1.20x | – | – | – |"
    assert line in (tmp_path / "all.md").read_text()
    merged = json.loads((tmp_path / "all.json").read_text())["rows"][1]["compiled"]
    assert merged["decode_vs_bf16_b1_deferred"] == 2.4


def test_serve_rejects_bad_arguments():
    for args, msg in ((["--decode_tokens", "80,16"], "two lengths T1 < T2"),
                      (["--modes", "fast"], "choose from eager, compiled"),
                      (["--batches", "one"], "comma-separated integers")):
        proc = subprocess.run([sys.executable, SCRIPT, "--device", "cpu", *args], capture_output=True, text=True,
                              timeout=300, cwd=ROOT)
        assert proc.returncode != 0 and msg in proc.stderr, proc.stderr[-2000:]
    from hf_lowbit.qat import QAT_SCHEMES

    parse = _script().parse_checkpoint
    assert parse("ptq_fp8_rowwise", QAT_SCHEMES) == ("ptq", "fp8_rowwise") and parse("bf16", QAT_SCHEMES)[1] is None
    with pytest.raises(SystemExit, match="unknown checkpoint 'qat_int3'.*int4_tinygemm"):
        parse("qat_int3", QAT_SCHEMES)


def test_serve_plot(tmp_path):
    pytest.importorskip("matplotlib")
    script = _script()
    rows = [_row("bf16", 0, 10.0, 100.0, 4000), _row("qat_int4_tinygemm", 0, 8.0, 200.0, 1200)]
    script.add_ratios(rows, ["compiled"])
    script.plot(rows, ["compiled"], [1], str(tmp_path / "p.png"), "title")
    assert (tmp_path / "p.png").stat().st_size > 1000


def test_serve_kernel_probe_on_cpu():
    """The probe's rows: the unpacked int4 configs run anywhere; mslk's packings need the mslk package (not on the
    GPU image either), and say so in one line instead of stopping the probe."""
    import argparse
    import importlib.util as util

    rows = {r["config"]: r for r in _script().probe_kernels(argparse.Namespace(device="cpu", seed=0,
                                                                                compile_backend="eager"))}
    assert len(rows) == 9
    for name in ("Int8DynamicActivationIntxWeightConfig(int4, PerGroup(128))", "IntxWeightOnlyConfig(int4, PerGroup(128))"):
        assert rows[name]["ok"] and rows[name]["weight_type"] == "IntxUnpackedToInt8Tensor"
        assert 15 < rows[name]["snr_db_eager"] < 30 and rows[name]["snr_db_compiled"] == rows[name]["snr_db_eager"]
    if util.find_spec("mslk") is None:
        for name in ("Int4WeightOnlyConfig(plain)", "Int4WeightOnlyConfig(preshuffled)",
                     "Float8DynamicActivationInt4WeightConfig(preshuffled)"):
            assert not rows[name]["ok"] and "mslk" in rows[name]["error"] and "\n" not in rows[name]["error"]
    if not torch.cuda.is_available():
        assert not rows["Int4WeightOnlyConfig(tile_packed_to_4d)"]["ok"]


def test_serve_host_calls_counts_each_kind(tmp_path):
    """benchmarks/serve_host_calls.py: one row per kind with its Python calls per new token, the guards of its
    compiled decode step and their check time (the plumbing; the figures are torch's and torchao's, only their
    order is asserted); an unknown kind is refused in one line."""
    script = os.path.join(ROOT, "benchmarks", "serve_host_calls.py")
    out = tmp_path / "calls.json"
    kinds = ["bf16", "int4", "int4_unwrapped", "int4_lean"]
    proc = subprocess.run([sys.executable, script, "--backend", "aot_eager", "--layers", "1", "--tokens", "4",
                           "--kinds", ",".join(kinds), "--json", str(out)], capture_output=True, text=True, timeout=600,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["kind"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == kinds
    assert all(r["calls_per_token"] > 0 and r["most_called"] and r["cache_lookup_ms_per_token"] > 0
               and r["guards"] == sum(r["guards_by_type"].values()) for r in rows.values())
    # unwrapping turns each quantized weight into its plain inner tensors: more, plain parameters
    assert rows["int4_unwrapped"]["parameters"] == rows["int4_lean"]["parameters"] > rows["int4"]["parameters"]
    assert rows["int4"]["parameters"] == rows["bf16"]["parameters"]
    # torchao's unwrap adds guards (its parametrizations' metadata); the guard filter takes the modules' all away
    guards = [rows[k]["guards"] for k in ("int4_unwrapped", "int4", "bf16", "int4_lean")]
    assert guards == sorted(guards, reverse=True) and len(set(guards)) == 4, guards
    assert rows["int4_lean"]["tokens"] == rows["int4"]["tokens"]  # the same weights, the same greedy tokens
    bad = subprocess.run([sys.executable, script, "--kinds", "fp4"], capture_output=True, text=True, timeout=120,
                         cwd=ROOT)
    assert bad.returncode != 0 and "--kinds fp4: choose from bf16, int4, int4_unwrapped, int4_filtered" in bad.stderr


def test_serve_checkpoint_modes_and_ratios_against_bf16_served_alike():
    """``NAME@m1+m2`` runs a checkpoint in its own modes (the PTQ peer on torchao's path beside our export on our
    kernels, one run); bf16 runs ``--modes``, and a lean-alike mode it did not run is compared with its phase in
    one it did (the kernel modes swap nothing of a bf16 model), said so in the row; other modes get no ratio."""
    serve = _script()
    assert serve.checkpoint_modes("ptq_int4_tinygemm@compiled_lean", ["compiled_int4k_mma"]) == (
        "ptq_int4_tinygemm", ["compiled_lean"])
    assert serve.checkpoint_modes("qat_fp8_rowwise", ["eager"]) == ("qat_fp8_rowwise", ["eager"])
    assert serve.checkpoint_modes("qat_8da4w@eager+compiled", []) == ("qat_8da4w", ["eager", "compiled"])
    for bad in ("qat_8da4w@fast", "qat_8da4w@", "bf16@eager"):
        with pytest.raises(SystemExit, match="after '@' give modes joined by"):
            serve.checkpoint_modes(bad, ["eager"])
    phase = lambda prefill, decode: {"prefill_ms": prefill, "decode_tok_s_b1": decode}  # noqa: E731
    rows = [{"checkpoint": "bf16", "run": 0, "safetensors_bytes": 4, "compiled_int4k_mma": phase(10.0, 100.0)},
            {"checkpoint": "qat_int4_tinygemm", "run": 0, "safetensors_bytes": 1,
             "compiled_int4k_mma": phase(8.0, 250.0)},
            {"checkpoint": "ptq_int4_tinygemm", "run": 0, "safetensors_bytes": 1, "compiled_lean": phase(10.0, 150.0),
             "eager": phase(20.0, 50.0)}]
    serve.add_ratios(rows, ["compiled_int4k_mma", "compiled_lean", "eager"])
    ours, peer = rows[1]["compiled_int4k_mma"], rows[2]["compiled_lean"]
    assert ours["decode_vs_bf16_b1"] == 2.5 and "bf16_mode" not in ours
    assert peer["decode_vs_bf16_b1"] == 1.5 and peer["prefill_vs_bf16"] == 1.0
    assert peer["bf16_mode"] == "compiled_int4k_mma"
    assert "decode_vs_bf16_b1" not in rows[2]["eager"]  # bf16 ran no eager phase: nothing to compare with
