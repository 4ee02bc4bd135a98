"""A tiny byte-level GPT with int8 fake-quantizable factor weights and a JEPA head.

Small enough that a CPU step takes milliseconds (2 blocks, width 64 by default),
shaped like nanoGPT's ``model.py``: token + position embedding, pre-norm blocks of
causal self-attention and an MLP, a final norm, logits tied to the embedding.

What is *not* in ``state_dict()`` is the compute setting: whether the factor
matrices (every ``QLinear``) run int8 fake-quantized. It is a plain attribute
set by :func:`apply_compute_settings`, which the trainer calls after building
the model and again after every restore (design record, "the forward path is
re-applied after the load").

Invariants:
    * Building a model draws no randomness: parameters start empty and
      :meth:`GPT.init_weights` fills them from an explicit ``torch.Generator``.
    * The forward is deterministic on CPU: plain matmuls and softmax, no
      fused attention kernel, no dropout.
"""

from __future__ import annotations

import copy
import math

import torch
import torch.nn.functional as F
from torch import nn

from ._config import ModelConfig

__all__ = ["GPT", "QLinear", "apply_compute_settings", "fake_quant", "make_teacher"]

VOCAB = 256  # one token per byte value


def fake_quant(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Symmetric per-row fake quantization with a straight-through gradient.

    The forward sees ``round(w / scale) * scale`` with ``scale = max|row| / (2**(bits-1) - 1)``;
    the backward treats the rounding as the identity, so the fp32 master weights learn.
    """
    qmax = 2 ** (bits - 1) - 1
    w0 = w.detach()
    scale = w0.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / qmax
    q: torch.Tensor = torch.round(w0 / scale).clamp(-qmax, qmax) * scale
    return w + (q - w0)


class QLinear(nn.Module):
    """A bias-free linear layer (a "factor" matrix) that can run int8 fake-quantized."""

    def __init__(self, d_in: int, d_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(d_out, d_in))
        # Compute setting, not state: None = fp32, 8 = int8. Set by apply_compute_settings.
        self.quant_bits: int | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.weight if self.quant_bits is None else fake_quant(self.weight, self.quant_bits)
        return F.linear(x, w)

    @torch.no_grad()
    def quant_error(self, bits: int, weight: torch.Tensor | None = None) -> float:
        """Relative error of the quantized weight, ``|q(W) - W| / |W|`` (Frobenius).

        ``weight``: the whole matrix, when this layer's own is a shard (FSDP2).
        """
        w = self.weight if weight is None else weight
        return float(torch.linalg.vector_norm(fake_quant(w, bits) - w) / torch.linalg.vector_norm(w).clamp_min(1e-12))


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = QLinear(cfg.d_model, 3 * cfg.d_model)
        self.proj = QLinear(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        # Written out rather than F.scaled_dot_product_attention: one obvious,
        # deterministic kernel path on every build.
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~causal, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.fc = QLinear(cfg.d_model, 4 * cfg.d_model)
        self.proj = QLinear(4 * cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """The student network.

    Args:
        cfg: the model table of the config.
        predictor: also build the JEPA parts (a learned mask embedding and a
            predictor head from student hidden states to teacher hidden states).
    """

    def __init__(self, cfg: ModelConfig, *, predictor: bool) -> None:
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Parameter(torch.empty(VOCAB, cfg.d_model))
        self.wpe = nn.Parameter(torch.empty(cfg.block_size, cfg.d_model))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        if predictor:
            self.mask_emb = nn.Parameter(torch.empty(cfg.d_model))
            self.predictor = QLinear(cfg.d_model, cfg.d_model)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """Fill every parameter from ``generator`` (never torch's global RNG).

        nanoGPT's scheme: normal(0, 0.02), residual projections scaled by
        1/sqrt(2 * n_layer), layer norms at (1, 0). Parameters are visited in
        registration order, so the draws are a function of the generator alone.
        """
        resid_std = 0.02 / math.sqrt(2 * self.cfg.n_layer)
        for name, p in self.named_parameters():
            if ".ln_" in name or name.startswith("ln_"):
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith(("attn.proj.weight", "mlp.proj.weight")):
                p.normal_(0.0, resid_std, generator=generator)
            else:
                p.normal_(0.0, 0.02, generator=generator)

    def hidden(self, idx: torch.Tensor, *, depth: int, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Final-norm hidden states ``(B, T, d)`` after the first ``depth`` blocks.

        Args:
            idx: ``(B, T)`` byte values.
            depth: blocks to run, ``1 ..= n_layer`` (rand-depth runs fewer).
            mask: optional ``(B, T)`` bool (or ``(T,)``, shared by the batch); masked
                positions see the mask embedding instead of their byte (the JEPA
                student's view).
        """
        T = idx.size(1)
        x = F.embedding(idx, self.wte)
        if mask is not None:
            x = torch.where(mask.expand(idx.shape)[:, :, None], self.mask_emb, x)
        x = x + self.wpe[:T]
        for block in self.blocks[:depth]:
            x = block(x)
        return self.ln_f(x)

    def forward(
        self, idx: torch.Tensor, *, depth: int, bias: torch.Tensor | None = None, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The student's whole step in one call, the entry point DDP and FSDP2 hook.

        Returns:
            The next-byte logits of ``idx`` (``bias`` added, see :meth:`logits`) and,
            given a ``mask``, the predictor's outputs at the masked positions (the
            student's view with the mask embedding there); else None.
        """
        logits = self.logits(self.hidden(idx, depth=depth), idx, bias)
        if mask is None:
            return logits, None
        return logits, self.predictor(self.hidden(idx, depth=depth, mask=mask)[mask])

    def logits(self, h: torch.Tensor, idx: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """Next-byte logits from hidden states, tied to the embedding; ``bias[idx]``
        (the n-gram table's row for each input byte) is added when given."""
        out = h @ self.wte.t()
        return out if bias is None else out + bias[idx]

    def factor_layers(self) -> list[QLinear]:
        """Every quantizable factor matrix, in registration order."""
        return [m for m in self.modules() if isinstance(m, QLinear)]


def apply_compute_settings(student: GPT, teacher: GPT | None, *, quant: str, fp32_latched: bool) -> None:
    """Set the forward's compute format; call after building and after every restore.

    The student runs int8 fake-quantized factors when ``quant == "int8"`` and the
    one-way fallback has not latched; otherwise fp32. The teacher always runs the
    fp32 forward: it is a target network and its weights are an average of fp32
    masters.
    """
    bits = 8 if quant == "int8" and not fp32_latched else None
    for layer in student.factor_layers():
        layer.quant_bits = bits
    if teacher is not None:
        for layer in teacher.factor_layers():
            layer.quant_bits = None


def make_teacher(student: GPT) -> GPT:
    """The EMA teacher at init: a frozen copy of the student.

    Only at the start of a fresh run. A resume restores the teacher as the run
    left it (design record item 1); it is never rebuilt from the student.
    """
    teacher = copy.deepcopy(student)
    teacher.requires_grad_(False)
    return teacher
