"""``transformers`` causal language models as the model that trains (extra ``hf``).

Any causal LM that ``transformers`` can build (``AutoModelForCausalLM``) trains in place of the built-in
model: from a config written in the scenario (``model: {hf_config: {model_type: llama, hidden_size: 64,
...}}``, random weights from the run's seed) or from a folder that ``save_pretrained`` wrote
(``model: {hf_pretrained: path}``; a hub id works where the hub can be reached). :class:`HFCausalLM` wraps
it so that it has the built-in model's interface, ``forward(idx, targets) -> (logits, loss)`` (``targets``
are the next tokens, already shifted, as in :class:`~geomesh.models.GPT`) and ``num_params()``, so the
runtimes, the worker, evaluation and the codec use it unchanged. Parameters are float32 (the proxy trains
on the CPU in the emulated runtime); the wrapped model is ``wrapper.hf`` (``save_pretrained`` it).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..errors import ConfigError
from ..extras import require

__all__ = ["HFCausalLM", "build_hf_model", "hf_config_from_mapping", "max_positions"]

_POSITION_FIELDS = ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length", "n_ctx")
_SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id")


def max_positions(config: Any) -> int | None:
    """The longest sequence a transformers config allows (``None`` when it names no limit)."""
    for name in _POSITION_FIELDS:
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


class HFCausalLM(nn.Module):
    """A ``transformers`` causal LM with the built-in model's interface.

    ``forward(idx, targets=None)`` returns ``(logits [B, T, V], loss)`` with ``loss`` the mean
    cross-entropy of ``logits`` against ``targets`` (next tokens, aligned with ``idx``: no shift inside),
    exactly as :class:`~geomesh.models.GPT` does. ``seq_len`` is the training sequence length;
    ``max_length`` the longest input the model accepts (its position limit, else ``seq_len``).
    """

    def __init__(self, model: nn.Module, seq_len: int):
        super().__init__()
        self.hf = model
        self.seq_len = seq_len
        limit = max_positions(model.config)
        if limit is not None and seq_len > limit:
            raise ConfigError(
                f"model.seq_len: {seq_len} is not allowed; the transformers model ({model.config.model_type}) "
                f"accepts at most {limit} positions"
            )
        self.max_length = limit or seq_len

    @property
    def config(self) -> Any:
        return self.hf.config

    @property
    def vocab_size(self) -> int:
        return int(self.hf.get_input_embeddings().num_embeddings)

    def num_params(self) -> int:
        """Number of parameters (tied matrices counted once)."""
        return sum(p.numel() for p in self.parameters())

    def forward(
        self, idx: torch.Tensor, targets: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        if idx.shape[1] > self.max_length:
            raise ValueError(f"sequence length {idx.shape[1]} exceeds the model's limit of {self.max_length}")
        logits = self.hf(input_ids=idx, use_cache=False, return_dict=True).logits
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), targets.reshape(-1))
        return logits, loss

    def save_pretrained(self, path: str | Path, **kwargs: Any) -> None:
        """Write the wrapped model as a transformers folder (loadable with ``model.hf_pretrained``)."""
        self.hf.save_pretrained(str(path), **kwargs)


def hf_config_from_mapping(mapping: dict[str, Any], vocab_size: int | None = None) -> Any:
    """A transformers config from a mapping with ``model_type`` (scenario field ``model.hf_config``).

    ``vocab_size`` (the corpus tokenizer's) fills the config's vocabulary when it names none; one smaller
    than the corpus's is refused. Special token ids that the model type's defaults put outside the
    vocabulary (e.g. GPT-2's 50256 in a 512-token model) are cleared unless the mapping sets them.
    """
    transformers = require("transformers", "model.hf_config (a transformers model)")
    fields = dict(mapping)
    model_type = fields.pop("model_type", None)
    try:
        defaults = transformers.AutoConfig.for_model(model_type)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"model.hf_config.model_type: {model_type!r} is not allowed; {exc}") from None
    if vocab_size is not None:
        given = fields.get("vocab_size")
        if given is None:
            fields["vocab_size"] = vocab_size
        elif not isinstance(given, int) or given < vocab_size:
            raise ConfigError(
                f"model.hf_config.vocab_size: {given!r} is not allowed; the corpus tokenizer has {vocab_size} "
                "tokens (leave vocab_size out to use it)"
            )
    vocab = fields.get("vocab_size", getattr(defaults, "vocab_size", None))
    for name in _SPECIAL_IDS:
        default = getattr(defaults, name, None)
        if name not in fields and isinstance(default, int) and vocab is not None and not 0 <= default < vocab:
            fields[name] = None
    try:
        return transformers.AutoConfig.for_model(model_type, **fields)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"model.hf_config: {exc}") from None


def _load_pretrained(source: str) -> nn.Module:
    transformers = require("transformers", "model.hf_pretrained (a transformers model)")
    local = Path(source).expanduser()
    try:
        if local.exists():
            if not (local / "config.json").is_file():
                raise ConfigError(f"model.hf_pretrained: {source!r} has no config.json (write it with save_pretrained)")
            model = transformers.AutoModelForCausalLM.from_pretrained(str(local), local_files_only=True)
        else:
            model = transformers.AutoModelForCausalLM.from_pretrained(source)
    except (OSError, ValueError, KeyError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"model.hf_pretrained: cannot load {source!r}: {first}") from None
    return model


def build_hf_model(cfg: Any, vocab_size: int, seed: int) -> HFCausalLM:
    """The scenario's transformers model, wrapped: ``model.hf_config`` (random init from ``seed``, the
    caller's RNG untouched) or ``model.hf_pretrained``; float32, in training mode."""
    if getattr(cfg, "hf_pretrained", None):
        model = _load_pretrained(cfg.hf_pretrained)
        have = int(model.get_input_embeddings().num_embeddings)
        if have < vocab_size:
            raise ConfigError(
                f"model.hf_pretrained: the model's vocabulary ({have} tokens) is smaller than the corpus "
                f"tokenizer's ({vocab_size}); use the model's tokenizer (data.tokenizer: {cfg.hf_pretrained}) "
                "or a smaller data.vocab_size"
            )
    else:
        transformers = require("transformers", "model.hf_config (a transformers model)")
        config = hf_config_from_mapping(cfg.hf_config, vocab_size)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            try:
                model = transformers.AutoModelForCausalLM.from_config(config)
            except ValueError as exc:  # e.g. a model type that is not a causal LM
                raise ConfigError(f"model.hf_config: {str(exc).splitlines()[0]}") from None
    model = model.float()
    model.train()
    return HFCausalLM(model, cfg.seq_len)


def clone_model(model: nn.Module) -> nn.Module:
    """An independent copy (same parameters), e.g. a replica of a pretrained model loaded once."""
    return copy.deepcopy(model)
