"""A small mutation tester for the numerics (issue 19): does some test fail when a scale, a clamp
bound, a rounding or an operator in the quantization / linear code changes by one token?

Each mutant is one change on one code line (comments and docstrings are left alone), applied to a copy
of the repository in a temporary directory; the file's targeted tests then run there (``pytest -x``,
``PYTHONPATH`` pointing at the copy). A mutant *survives* when those tests pass. Run from the repository
root (CPU; about 10-20 s per mutant on 2 cores):

    python tools/mutate.py                      # every target below
    python tools/mutate.py hf_lowbit/kernels/int8.py --limit 20 --tests "tests/test_ops_int8.py"
    python tools/mutate.py --only before.json --which all --json after.json   # the same sample again

It prints one line per mutant and the survival rate per file and overall; ``--json`` writes them too.
Equivalent mutants (a change that cannot alter any result, e.g. a bound that is never reached) survive
by construction: read the survivors before writing a test for them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

NUMERICS = "tests/test_numerics.py"
LINEAR = f"{NUMERICS} tests/test_ops_int8.py tests/test_ops_fp8.py tests/test_mixed_precision_linear.py -k 'not compile'"
TARGETS = {
    "hf_lowbit/kernels/int8.py": LINEAR,
    "hf_lowbit/kernels/fp8.py": LINEAR,
    "hf_lowbit/kernels/quantize_t.py": LINEAR,
    "hf_lowbit/kernels/__init__.py": LINEAR,
    "hf_lowbit/mixed_precision/linear.py": LINEAR,
    "hf_lowbit/kernels/triton_quant.py": "tests/test_triton_int8.py",
    "hf_lowbit/kernels/fake_quant.py": f"{NUMERICS} tests/test_qat.py tests/test_qat_schemes.py "
                                       "tests/test_fake_quant_compile.py -k '(qat_linear_on or fake_quant or straight "
                                       "or computes_what or within_rounding) and not eager_bit_for_bit'",
    "hf_lowbit/kernels/nf4.py": f"{NUMERICS} tests/test_qlora.py -k 'qlora_base or nf4 and not peak_memory'",
    "hf_lowbit/qlora/base.py": f"{NUMERICS} tests/test_qlora.py -k 'qlora_base or quantized_linear or int8_compute "
                                   "or lora_grads or quantize_on_load or fused'",
}

# (pattern, replacement) pairs; each match on a code line is one mutant
OPERATORS = [
    (r"\b127(\.0)?\b", "126"), (r"\b448\b", "447"), (r"\b255\b", "254"), (r"1e-30", "1e-3"),
    (r"(?<![\w.])2 \*\* \(", "3 ** ("), (r"\b64\b", "32"),
    (r"\.round\(\)", ""), (r"torch\.round\(", "torch.trunc("), (r"_rne\(", "tl.floor("),
    (r"\bamax\(", "amin("), (r"\bamin\(", "amax("), (r"\.abs\(\)", ""),
    (r"\bmin=", "max="), (r"\bmax=", "min="), (r"\bmaximum\(", "minimum("), (r"\bminimum\(", "maximum("),
    (r"(?<=[\w)\]]) \* (?=[\w(])", " / "), (r"(?<=[\w)\]]) / (?=[\w(])", " * "),
    (r"(?<=[\w)\]]) \+ (?=[\w(])", " - "), (r"(?<=[\w)\]]) - (?=[\w(])", " + "),
    (r" < ", " <= "), (r" > ", " >= "), (r"\bdim=1\b", "dim=0"), (r"\bdim=0\b", "dim=1"),
    (r"\(-(?=[A-Z_a-z])", "("), (r"\.T\b", ""), (r"\bsw\b", "sw.mean()"),
    (r"(?<=\w), 0, (?=\w)", ", 1, "), (r"(?<=\w), 1, (?=\w)", ", 0, "),  # positional reduction dims
]


def code_lines(text: str) -> list[bool]:
    """True for lines that are code (not blank, comment or inside a docstring)."""
    out, in_doc = [], False
    for line in text.splitlines():
        s = line.strip()
        if in_doc:
            out.append(False)
            in_doc = not (s.endswith('"""') and s != '"""' or s == '"""')
            continue
        if s.startswith('"""'):
            out.append(False)
            in_doc = not (s.count('"""') >= 2 and len(s) > 3)
            continue
        out.append(bool(s) and not s.startswith("#") and not s.startswith(("import ", "from ", "def ", "class ", "@")))
    return out


def mutants(path: str):
    text = open(path).read()
    lines = text.splitlines(keepends=True)
    for i, (line, is_code) in enumerate(zip(lines, code_lines(text))):
        if not is_code:
            continue
        code = line.split("  #")[0]
        for pat, rep in OPERATORS:
            for m in re.finditer(pat, code):
                new = line[:m.start()] + m.expand(rep) + line[m.end():]
                if new == line:
                    continue
                text = "".join(lines[:i] + [new] + lines[i + 1:])
                try:
                    compile(text, path, "exec")
                except SyntaxError:
                    continue  # not a program: no test needed to reject it
                yield i + 1, line.strip(), new.strip(), text


def existing(root: str, tests: str) -> str:
    """``tests`` without the test files this tree lacks (to measure an older suite with the same command)."""
    return " ".join(t for t in re.split(r" (?=(?:[^']*'[^']*')*[^']*$)", tests)
                    if not t.startswith("tests/") or os.path.exists(os.path.join(root, t)))


def run(root: str, tests: str, timeout: float) -> bool:
    """True when the tests pass (the mutant survives)."""
    tests = existing(root, tests)
    env = dict(os.environ, PYTHONPATH=root, TRITON_INTERPRET=os.environ.get("TRITON_INTERPRET", ""))
    cmd = f"{sys.executable} -m pytest -x -q -p no:cacheprovider {tests}"
    try:
        proc = subprocess.run(cmd, shell=True, cwd=root, env=env, capture_output=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return False  # a hang is caught (killed)
    return proc.returncode == 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", default=list(TARGETS))
    p.add_argument("--tests", help="pytest arguments (default: the file's entry in TARGETS)")
    p.add_argument("--limit", type=int, default=0, help="at most this many mutants per file (evenly spread)")
    p.add_argument("--timeout", type=float, default=240)
    p.add_argument("--only", help="a JSON written by --json: re-run just the mutants that survived there")
    p.add_argument("--which", choices=("survived", "all"), default="survived",
                   help="with --only: the survivors, or every mutant that run tried (the same sample, new tests)")
    p.add_argument("--match", help="only mutants whose line (before or after) matches this regex; no --limit")
    p.add_argument("--json")
    a = p.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        root = os.path.join(tmp, "repo")
        shutil.copytree(".", root, ignore=shutil.ignore_patterns(".git", ".venv", "__pycache__", "runs", "docs"))
        for f in a.files:
            tests = a.tests or TARGETS[f]
            original = open(f).read()
            ms = list(mutants(f))
            if a.only:  # the limit is not applied: the earlier run chose these
                keep = {(m["line"], m["to"]) for m in json.load(open(a.only)).get(f, {}).get(a.which, [])}
                ms = [m for m in ms if (m[0], m[2]) in keep]
            if a.match:  # e.g. only scale / clamp / rounding changes
                ms = [m for m in ms if re.search(a.match, m[1]) or re.search(a.match, m[2])]
            if a.only or a.match:
                pass
            elif a.limit and len(ms) > a.limit:
                ms = [ms[round(k * (len(ms) - 1) / (a.limit - 1))] for k in range(a.limit)]
            survived = []
            for line_no, old, new, text in ms:
                with open(os.path.join(root, f), "w") as fh:
                    fh.write(text)
                t0 = time.time()
                alive = run(root, tests, a.timeout)
                print(f"{'SURVIVED' if alive else 'killed  '} {f}:{line_no} ({time.time() - t0:.0f}s)  {old}  ->  {new}",
                      flush=True)
                if alive:
                    survived.append({"line": line_no, "from": old, "to": new})
            with open(os.path.join(root, f), "w") as fh:
                fh.write(original)
            results[f] = {"mutants": len(ms), "survived": survived,
                          "all": [{"line": m[0], "from": m[1], "to": m[2]} for m in ms]}
            print(f"== {f}: {len(survived)}/{len(ms)} survived", flush=True)
    total = sum(r["mutants"] for r in results.values())
    alive = sum(len(r["survived"]) for r in results.values())
    print(f"== total: {alive}/{total} survived ({alive / max(total, 1):.0%})")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(results, fh, indent=1)


if __name__ == "__main__":
    main()
