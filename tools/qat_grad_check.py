#!/usr/bin/env python
"""One step's gradients of a QAT-prepared Llama: compiled vs eager vs the straight-through expectation (issue 26).

    python tools/qat_grad_check.py                                   # the H200 model of qat_ptq_hurts, on CUDA if any
    python tools/qat_grad_check.py --shape 2,256,768,4,2,1024 --group_size 128 --tokens 4x64   # a quick CPU check

A model of the given shape (layers, hidden, MLP, heads, KV heads, vocab; random weights with noise added), prepared
with ``--scheme`` / ``--group_size``, the LM head too, one backward under bf16 autocast as ``eval_qat.py`` trains:

* ``compiled vs eager``: the prepared model under ``torch.compile`` (Inductor) against eager, per parameter;
* ``eager vs STE``: eager against the plain model holding the fake-quantized weights (what the straight-through
  estimator should give; ``_QATLinearFn`` applies no clamp mask);
* ``plain compiled vs eager``: the unquantized model compiled against eager, the reduction-order floor the first
  comparison is to be read against.

Prints the loss of each and the parameters with the lowest cosine similarity; ``--json`` keeps all of it. On the CPU
(the quick check above): compiled vs eager 0.99994 at worst, the plain model's floor 0.99994, eager vs STE 1.0; at the
H200 shape (12 x 1024, MLP 2816, vocab 8192, 2 x 256 tokens, int4_tinygemm group 256) the same comparisons, made by
this tool's first version, gave >= 0.9996 and 1.0 (docs/qat.md, "Where PTQ hurts"). Not yet run on a GPU.
"""

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: E402

from hf_lowbit.qat import QAT_SCHEMES, QATConfig, QATLinear, prepare_qat  # noqa: E402


def grads(model, fwd, ids, device):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss = fwd(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.item(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def cosines(a: dict, b: dict) -> dict:
    return {n: F.cosine_similarity(a[n].flatten().double(), b[n].flatten().double(), dim=0).item() for n in a}


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="12,1024,2816,16,4,8192", help="layers,hidden,intermediate,heads,kv_heads,vocab")
    p.add_argument("--tokens", default="2x256", help="batch x sequence length")
    p.add_argument("--scheme", default="int4_tinygemm", choices=list(QAT_SCHEMES))
    p.add_argument("--group_size", type=int, default=256)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--show", type=int, default=6, help="how many of the lowest-cosine parameters to print")
    p.add_argument("--json", default=None)
    a = p.parse_args()
    layers, hidden, inter, heads, kv, vocab = (int(v) for v in a.shape.split(","))
    batch, seq = (int(v) for v in a.tokens.split("x"))
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv, vocab_size=vocab, max_position_embeddings=seq,
                         tie_word_embeddings=False, use_cache=False)
    base = AutoModelForCausalLM.from_config(config).to(a.device)
    with torch.no_grad():
        for t in base.parameters():
            t.add_(torch.randn_like(t) * 0.02)
    ids = torch.randint(0, vocab, (batch, seq), device=a.device)
    qc = QATConfig(a.scheme, a.group_size, include_lm_head=True)
    qat = copy.deepcopy(base)
    prepare_qat(qat, qc, include_lm_head=True)
    loss, eager = grads(qat, qat, ids, a.device)
    loss_c, compiled = grads(qat, torch.compile(qat), ids, a.device)
    ste = copy.deepcopy(base)
    spec = qc.spec
    with torch.no_grad():
        for n, m in qat.named_modules():
            if isinstance(m, QATLinear):
                g = m.weight.shape[1] if a.group_size == -1 else a.group_size
                wq = spec.fake_quant_weight(m.weight.to(spec.weight_dtype or torch.bfloat16), g)
                ste.get_submodule(n).weight.copy_(wq.float())
    loss_s, expected = grads(ste, ste, ids, a.device)
    plain_loss, plain = grads(base, base, ids, a.device)
    plain_loss_c, plain_c = grads(base, torch.compile(base), ids, a.device)
    rows = {"compiled vs eager": cosines(compiled, eager), "eager vs STE": cosines(eager, expected),
            "plain compiled vs eager": cosines(plain_c, plain)}
    losses = {"eager": loss, "compiled": loss_c, "STE (plain at fake-quantized weights)": loss_s, "plain eager": plain_loss,
              "plain compiled": plain_loss_c}
    print(f"{a.scheme} {qc.granularity}, shape {a.shape}, {a.tokens} tokens, {a.device}")
    print("losses: " + ", ".join(f"{k} {v:.6f}" for k, v in losses.items()))
    for label, cos in rows.items():
        worst = sorted(cos.items(), key=lambda kv: kv[1])[: a.show]
        print(f"{label}: min cosine {worst[0][1]:.6f} over {len(cos)} parameters; lowest: "
              + ", ".join(f"{n} {c:.6f}" for n, c in worst))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "losses": losses, "cosines": rows}, f, indent=1)


if __name__ == "__main__":
    main()
