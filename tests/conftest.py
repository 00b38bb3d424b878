import os
import sys
import warnings

import pytest

# One intra-op thread per process, this one and the subprocesses it starts (they inherit the variable): the suite's
# models and kernels are tiny, and on a 2-core machine two OpenMP threads per process spin against each other and
# against whatever else runs (a subprocess, a second pytest worker). Set OMP_NUM_THREADS to choose another count.
os.environ.setdefault("OMP_NUM_THREADS", "1")
# Inductor compiles its C++ kernels in this process, not in a pool of compile workers (one per core, each importing
# torch again in every process that compiles): on 2 cores already shared by 2 pytest workers the pool only adds
# work. Set TORCHINDUCTOR_COMPILE_THREADS to choose another count.
os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
import torch  # noqa: E402

torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
warnings.filterwarnings("ignore", message=".*register_constant.*")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config  # noqa: E402

VOCAB = 96


def _arith_tokenizer():
    from hf_lowbit.data import ARITHMETIC_CHARS, build_char_tokenizer

    return build_char_tokenizer(ARITHMETIC_CHARS)


ARITH_TOKENIZER = _arith_tokenizer()  # the character tokenizer of the embedded addition task


def tiny_config(arch: str = "llama", **kw):
    base = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=False)
    base.update(kw)
    return {"llama": LlamaConfig, "qwen2": Qwen2Config}[arch](**base)


def tiny_model(arch: str = "llama", seed: int = 0, **kw):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(tiny_config(arch, **kw))


def save_tiny_model(path, tokenizer, max_positions: int, seed: int | None = None):
    """A tiny ``scripts/sft.py`` Llama (``hf_lowbit.cli.sft.tiny_llama_config``) for ``tokenizer``, saved with it at
    ``path`` (a model directory ``--model_name_or_path`` can load); ``seed``: seed its init first."""
    from hf_lowbit.cli.sft import tiny_llama_config

    if seed is not None:
        torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(tiny_llama_config(len(tokenizer), max_positions)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def lowbit_args(output_dir, **kw):
    """``LowBitTrainingArguments`` for a test on the CPU: ``output_dir``, no reporting; ``kw`` adds or overrides (each
    test file binds its own defaults: ``_args = partial(lowbit_args, max_steps=4, ...)``)."""
    from hf_lowbit import LowBitTrainingArguments

    return LowBitTrainingArguments(**{"output_dir": str(output_dir), "report_to": "none", "use_cpu": True, **kw})


def arithmetic_blocks(n_blocks: int, block: int = 32):
    """A packed dataset of ``n_blocks`` blocks of generated addition problems (ARITH_TOKENIZER)."""
    from hf_lowbit.data import arithmetic_records, format_records, pack

    train, _ = arithmetic_records(n_blocks * block // 8, 1, seed=0)
    ds = pack(format_records(train, ARITH_TOKENIZER, "arith"), ARITH_TOKENIZER, block)
    ds.blocks = ds.blocks[:n_blocks]
    return ds


def saved_bytes(fn, free=()):
    """``fn()`` and the bytes of the distinct storages autograd saved for backward during it, those of
    the tensors in ``free`` (e.g. parameters) not counted."""
    skip = {t.untyped_storage().data_ptr() for t in free}
    seen = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in skip:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, sum(seen.values())


def snr_db(ref: torch.Tensor, actual: torch.Tensor) -> float:
    ref, actual = ref.double(), actual.double()
    return (20 * torch.log10(ref.norm() / (ref - actual).norm())).item()


def run_root(tmp_path_factory):
    """A directory of this test run that every pytest-xdist worker sees (their basetemps' parent; basetemp itself
    without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def once_per_run(tmp_path_factory, name: str, compute):
    """``compute()`` (JSON data) computed once per test run and shared by the pytest-xdist workers: the first to
    ask computes it under a file lock and writes it into :func:`run_root`, the others wait and read it."""
    import json

    from filelock import FileLock

    path = run_root(tmp_path_factory) / f"{name}.json"
    with FileLock(f"{path}.lock"):
        if path.is_file():
            return json.loads(path.read_text())
        data = compute()
        path.write_text(json.dumps(data))
        return data


@pytest.fixture(scope="session")
def sft_help(tmp_path_factory):
    """``scripts/sft.py --help`` in a fresh process (a quiet start shows only there), run once for the tests that
    read it (test_sft.py, test_cli_errors.py): ``returncode``, ``stdout``, ``stderr``."""
    import subprocess
    from types import SimpleNamespace

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "sft.py")

    def run():
        proc = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, timeout=300)
        return {"returncode": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr}

    return SimpleNamespace(**once_per_run(tmp_path_factory, "sft_help", run))


def pytest_configure(config):
    config.addinivalue_line("markers", "cuda: needs an NVIDIA GPU (run on the device; skipped elsewhere)")
    config.addinivalue_line("markers", "slow: end-to-end training runs")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
