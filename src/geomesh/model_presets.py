"""Named sizes of the built-in GPT (facts layer: plain data, no torch), so that scenario validation
(:mod:`geomesh.config`) can check ``proxy.preset`` without importing the model.

``nano`` .. ``base`` are proxy models for the emulated runtime (vocabulary 4096, ``seq_len`` 128); the
``llama-*`` sizes are Llama-shaped GPU sizes for the distributed runtime (counts at vocabulary 32000).
:func:`geomesh.models.model_config` turns a name into a :class:`~geomesh.models.ModelConfig`.
"""

from __future__ import annotations

# Named sizes at vocab 4096, seq_len 128 (parameter counts with the tied embedding counted once).
MODEL_PRESETS: dict[str, dict] = {
    "nano": dict(d_model=96, n_layers=2, n_heads=4),  # ~0.61M
    "micro": dict(d_model=128, n_layers=4, n_heads=4),  # ~1.33M
    "mini": dict(d_model=256, n_layers=4, n_heads=4),  # ~4.26M
    "small": dict(d_model=384, n_layers=5, n_heads=6),  # ~10.4M
    "base": dict(d_model=512, n_layers=6, n_heads=8),  # ~21.1M
    # GPU sizes (Llama-shaped: RMSNorm, RoPE, SwiGLU, no biases; head dim 64-128), counts at vocab 32000:
    "llama-125m": dict(d_model=768, n_layers=14, n_heads=12, seq_len=1024),  # ~124M
    "llama-350m": dict(d_model=1024, n_layers=24, n_heads=16, seq_len=1024),  # ~336M
    "llama-1b": dict(d_model=2048, n_layers=18, n_heads=16, seq_len=2048),  # ~0.97B
}
