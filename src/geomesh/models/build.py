"""The scenario's model, whichever kind it is: :func:`build_proxy_model` is the one entry point that the
runtimes, the profiler and the faces call; it builds the built-in :class:`~geomesh.models.gpt.GPT` of a preset
or a ``transformers`` causal LM (:mod:`geomesh.models.hf`). The helpers here treat both kinds alike
(summary name, repeated blocks, activation checkpointing).
"""

from __future__ import annotations

import torch.nn as nn

from .gpt import GPT, build_model, model_config


def build_proxy_model(cfg, vocab_size: int, seed: int) -> nn.Module:
    """The scenario's model (``cfg``: its :class:`~geomesh.config.ModelConfig`): the built-in
    :class:`GPT` of ``cfg.preset``, or a ``transformers`` causal LM when ``cfg.hf_config`` or
    ``cfg.hf_pretrained`` is set (:mod:`geomesh.models.hf`; same interface, extra ``hf``)."""
    if getattr(cfg, "hf_config", None) is not None or getattr(cfg, "hf_pretrained", None):
        from .hf import build_hf_model

        return build_hf_model(cfg, vocab_size, seed)
    return build_model(model_config(cfg.preset, vocab_size=vocab_size, seq_len=cfg.seq_len), seed)


def model_name(cfg, model: nn.Module) -> str:
    """What trains, for summaries: ``"micro (built-in)"``, ``"llama (transformers)"`` or
    ``"llama (transformers, FOLDER)"`` for a pretrained folder."""
    if getattr(cfg, "hf_config", None) is not None or getattr(cfg, "hf_pretrained", None):
        kind = getattr(getattr(model, "config", None), "model_type", None) or "causal LM"
        return f"{kind} (transformers)" if cfg.hf_config is not None else f"{kind} (transformers, {cfg.hf_pretrained})"
    return f"{cfg.preset} (built-in)"


def transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the built-in GPT's ``blocks``, or the longest ``ModuleList`` of a
    ``transformers`` model (its decoder layers). These are the units of sharding and checkpointing."""
    if isinstance(model, GPT):
        return list(model.blocks)
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return list(max(lists, key=len)) if lists else []


def enable_activation_checkpointing(model: nn.Module) -> None:
    """Recompute each block's activations in backward instead of keeping them (less memory, about a third
    more compute): the built-in GPT checkpoints its blocks, a ``transformers`` model uses its own switch."""
    if isinstance(model, GPT):
        model.activation_checkpointing = True
        return
    hf = getattr(model, "hf", model)
    if not getattr(hf, "supports_gradient_checkpointing", False):
        raise ValueError(f"{type(hf).__name__} does not support activation checkpointing")
    hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
