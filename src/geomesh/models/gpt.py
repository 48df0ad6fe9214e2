"""The proxy model: a small decoder-only language model that really trains in the emulated runtime.

A modern GPT in the nanoGPT spirit, small enough to train several replicas on a laptop CPU:

- token embedding tied to the output head (one matrix, counted once),
- pre-norm residual blocks: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``, RMSNorm, no biases,
- causal self-attention with rotary position embeddings (RoPE) through
  ``F.scaled_dot_product_attention(is_causal=True)``,
- a SwiGLU MLP (hidden size about 8/3·d_model, rounded up to a multiple of 32),
- scaled init: every weight ~ N(0, 0.02²), residual output projections ~ N(0, (0.02/sqrt(2·n_layers))²).

``MODEL_PRESETS`` (:mod:`geomesh.model_presets`) names sizes from about 0.6M to 21M parameters at
vocabulary 4096 (proxy models for the emulated runtime) and Llama-shaped sizes of about 125M, 350M and 1B
parameters at vocabulary 32000 (for GPU clusters in the distributed runtime);
:func:`model_config` turns a preset into a :class:`ModelConfig` and :func:`build_model` builds a
:class:`GPT` deterministically from a seed without touching the caller's random state.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

from ..model_presets import MODEL_PRESETS

INIT_STD = 0.02


@dataclass
class ModelConfig:
    """Shape of the proxy model. ``mlp_hidden=None`` means the SwiGLU default (see :attr:`hidden_dim`)."""

    vocab_size: int = 4096
    n_layers: int = 4
    d_model: int = 128
    n_heads: int = 4
    seq_len: int = 128
    mlp_hidden: int | None = None
    rope_base: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def hidden_dim(self) -> int:
        """SwiGLU hidden size: ``mlp_hidden`` or 8/3·d_model rounded up to a multiple of 32."""
        if self.mlp_hidden is not None:
            return self.mlp_hidden
        return 32 * math.ceil(8 * self.d_model / 3 / 32)

    def validate(self) -> "ModelConfig":
        """Raise ValueError naming the first bad field; return self so calls can chain."""
        for name in ("vocab_size", "n_layers", "d_model", "n_heads", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"ModelConfig.{name} = {value!r}: must be a positive integer")
        if self.mlp_hidden is not None and (not isinstance(self.mlp_hidden, int) or self.mlp_hidden <= 0):
            raise ValueError(
                f"ModelConfig.mlp_hidden = {self.mlp_hidden!r}: must be a positive integer or None (default)"
            )
        if self.d_model % self.n_heads != 0:
            raise ValueError(
                f"ModelConfig.d_model = {self.d_model}: must be divisible by n_heads = {self.n_heads}"
            )
        if self.head_dim % 2 != 0:
            raise ValueError(
                f"ModelConfig.n_heads = {self.n_heads}: head dim d_model/n_heads = {self.head_dim} "
                "must be even for rotary embeddings"
            )
        if not self.rope_base > 0:
            raise ValueError(f"ModelConfig.rope_base = {self.rope_base!r}: must be positive")
        return self




def model_config(preset: str, **overrides) -> ModelConfig:
    """The validated :class:`ModelConfig` of a named preset, with any field overridden."""
    if preset not in MODEL_PRESETS:
        raise ValueError(f"unknown model preset {preset!r}; known presets: {', '.join(MODEL_PRESETS)}")
    known = {f.name for f in fields(ModelConfig)}
    unknown = sorted(set(overrides) - known)
    if unknown:
        raise ValueError(f"unknown ModelConfig field(s) {', '.join(unknown)}; fields: {', '.join(sorted(known))}")
    return ModelConfig(**{**MODEL_PRESETS[preset], **overrides}).validate()


def _rms_norm(dim: int) -> nn.Module:
    """RMSNorm with a learned scale (``torch.nn.RMSNorm`` where this torch has it)."""
    if hasattr(nn, "RMSNorm"):
        return nn.RMSNorm(dim, eps=1e-6)
    return _RMSNorm(dim, eps=1e-6)


class _RMSNorm(nn.Module):
    """Fallback RMSNorm for torch versions without ``nn.RMSNorm``."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate pairs (x[i], x[i + D/2]) of the last dim of ``x`` [B, H, T, D] by position angles [T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with rotary position embeddings."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.head_dim
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model, bias=False)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # [B, T, 3C] -> three tensors [B, H, T, D]
        q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class SwiGLU(nn.Module):
    """Gated MLP: down(silu(gate(x)) * up(x)); gate and up share one fused matmul."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up = nn.Linear(cfg.d_model, 2 * cfg.hidden_dim, bias=False)
        self.down = nn.Linear(cfg.hidden_dim, cfg.d_model, bias=False)  # residual projection

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm transformer block."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = _rms_norm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.mlp_norm = _rms_norm(cfg.d_model)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class GPT(nn.Module):
    """Decoder-only language model; ``forward(idx, targets)`` returns ``(logits, loss)``."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg.validate()
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = _rms_norm(cfg.d_model)
        self.lm_head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.tok_emb.weight  # tied input/output embedding

        # RoPE angles for every position; non-persistent, so state_dict() holds only parameters.
        inv_freq = cfg.rope_base ** (-torch.arange(0, cfg.head_dim, 2, dtype=torch.float32) / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.seq_len, dtype=torch.float32), inv_freq)  # [T, D/2]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)
        self.register_buffer("rope_sin", angles.sin(), persistent=False)

        self.activation_checkpointing = False  # see enable_activation_checkpointing
        self.apply(self._init_weights)
        residual_std = INIT_STD / math.sqrt(2 * cfg.n_layers)
        for block in self.blocks:
            nn.init.normal_(block.attn.proj.weight, mean=0.0, std=residual_std)
            nn.init.normal_(block.mlp.down.weight, mean=0.0, std=residual_std)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=INIT_STD)

    def num_params(self) -> int:
        """Number of parameters (the tied embedding counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Logits [B, T, vocab] for token ids [B, T]; loss = mean cross-entropy against ``targets``."""
        T = idx.shape[1]
        if T > self.cfg.seq_len:
            raise ValueError(f"sequence length {T} exceeds ModelConfig.seq_len = {self.cfg.seq_len}")
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        x = self.tok_emb(idx)
        for block in self.blocks:
            if self.activation_checkpointing and torch.is_grad_enabled():
                # keep only each block's input; its activations are recomputed in backward
                x = torch.utils.checkpoint.checkpoint(block, x, cos, sin, use_reentrant=False)
            else:
                x = block(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def build_model(cfg: ModelConfig, seed: int) -> GPT:
    """A :class:`GPT` initialised from ``seed``: same seed, bit-identical parameters; caller's RNG untouched."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return GPT(cfg)
