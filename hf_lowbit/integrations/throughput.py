"""Training tokens per second and MFU for the Trainer's logs (``LowBitTrainerMixin.log``).

Tokens are counted from the shape of each micro-batch's ``input_ids`` (host metadata: no device sync),
so every micro-batch of a gradient-accumulation step counts, padding included (it is computed), and a
packed row counts all its tokens. Model FLOPs per token (PaLM appendix B convention, not hardware FLOPs:
activation recomputation is not counted):

    6 · N_trainable + 4 · N_frozen + 12 · n_layers · hidden · seq

``N_*``: the weights of the matmul layers (``nn.Linear`` and the quantized bases, LM head included,
input embeddings not); a trainable weight costs the forward (2), the input gradient (2) and the weight
gradient (2) per token, a frozen one (LoRA/QLoRA bases) no weight gradient. The attention term is the
QKᵀ and AV matmuls of causal attention over the whole row (not halved for causality; packed documents
count as one row), with ``seq`` the micro-batch's sequence length. MFU is those FLOPs per second over
the dense bf16 peak of all processes' accelerators.
"""

from __future__ import annotations

import time

from torch import nn

from ..qlora.base import QuantizedBaseLinear

# Dense (no sparsity) bf16 tensor-core peaks in TFLOP/s, from the vendors' data sheets; the first
# name that is a substring of torch.cuda.get_device_name() wins, so the longer names come first.
PEAK_BF16_TFLOPS = (
    ("B200", 2250.0), ("H200", 989.0), ("H100 PCIe", 756.0), ("H100 NVL", 835.0), ("H100", 989.0),
    ("GH200", 989.0), ("A100", 312.0), ("L40S", 362.0), ("L40", 181.0), ("L4", 121.0),
)


def peak_tflops(device) -> float | None:
    """The dense bf16 peak of ``device`` (a ``torch.device``) from the table, or None if unknown (CPU, …)."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    name = torch.cuda.get_device_name(device)
    return next((peak for key, peak in PEAK_BF16_TFLOPS if key in name), None)


def matmul_params(model: nn.Module) -> tuple[int, int]:
    """(trainable, frozen) weight elements of the model's matmul layers (logical sizes, also for NF4/INT8)."""
    trainable = frozen = 0
    for m in model.modules():
        if isinstance(m, QuantizedBaseLinear):
            frozen += m.in_features * m.out_features
        elif isinstance(m, nn.Linear):
            if m.weight.requires_grad:
                trainable += m.weight.numel()
            else:
                frozen += m.weight.numel()
    return trainable, frozen


class ThroughputMeter:
    """Counts the tokens of every micro-batch and turns them into rates when the Trainer logs.

    ``clock`` is injectable for tests; the interval starts at the first micro-batch after a reset and then
    at each read, so consecutive reads cover the wall time between them (evaluation and checkpointing
    included, as in the Trainer's own speed metrics).
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.flops = None
        self.reset()

    def reset(self) -> None:
        self.start = None
        self.tokens = 0
        self.token_seq = 0  # Σ tokens · sequence length, for the attention term

    def count(self, input_ids) -> None:
        if self.start is None:
            self.start = self.clock()
        n = input_ids.numel()
        self.tokens += n
        self.token_seq += n * (input_ids.shape[-1] if input_ids.dim() else 1)

    def read(self, model: nn.Module, peak: float | None, processes: int = 1, reduce=None) -> dict[str, float]:
        """``train_tokens_per_second`` (all processes) and, with a known ``peak``, ``train_mfu``; restarts the
        interval. ``reduce`` sums ``[tokens, token_seq]`` over processes (one collective at log time)."""
        if self.start is None:
            return {}
        now = self.clock()
        elapsed, counts = now - self.start, [self.tokens, self.token_seq]
        self.start, self.tokens, self.token_seq = now, 0, 0
        if reduce is not None and processes > 1:
            counts = reduce(counts)
        tokens, token_seq = counts
        if elapsed <= 0:
            return {}
        logs = {"train_tokens_per_second": tokens / elapsed}
        if peak:
            if self.flops is None:  # the model's shape does not change during training: count once
                self.flops = model_flops(model)
            logs["train_mfu"] = mfu(self.flops, tokens, token_seq, elapsed, peak, processes)
        return logs


def mfu(flops: tuple[int, int], tokens: int, token_seq: int, seconds: float, peak: float, processes: int = 1) -> float:
    """Model FLOPs utilization of ``tokens`` (``token_seq``: Σ tokens · sequence length) trained in ``seconds`` on
    ``processes`` accelerators of ``peak`` TFLOP/s each; ``flops``: :func:`model_flops` of the model."""
    per_token, per_token_seq = flops
    return (per_token * tokens + per_token_seq * token_seq) / seconds / (peak * 1e12 * processes)


def model_flops(model: nn.Module) -> tuple[int, int]:
    """Training FLOPs (per token, per token · sequence length) of ``model``: see the module docstring."""
    trainable, frozen = matmul_params(model)
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden = getattr(text, "num_hidden_layers", 0) or 0, getattr(text, "hidden_size", 0) or 0
    return 6 * trainable + 4 * frozen, 12 * layers * hidden


__all__ = ["PEAK_BF16_TFLOPS", "ThroughputMeter", "matmul_params", "mfu", "model_flops", "peak_tflops"]
