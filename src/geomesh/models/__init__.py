"""The models that train (training layer): the built-in GPT and ``transformers`` causal LMs, behind one interface
(``model(idx, targets) -> (logits, loss)``, ``num_params()``).

- :mod:`.gpt`: the built-in decoder-only GPT (RMSNorm, RoPE, SwiGLU, tied embedding), its
  :class:`ModelConfig`, :func:`model_config` (a named preset, with overrides) and :func:`build_model` (a
  :class:`GPT` from a seed, the caller's RNG untouched);
- :mod:`.hf`: the ``transformers`` adapter (extra ``hf``): :class:`HFCausalLM` wraps any
  ``AutoModelForCausalLM`` to the built-in interface; :func:`build_hf_model` builds one from
  ``model.hf_config`` or loads ``model.hf_pretrained``;
- :mod:`.build`: :func:`build_proxy_model`, the one entry point that builds a scenario's model of either
  kind, and the helpers that treat both alike (:func:`model_name`, :func:`transformer_blocks`,
  :func:`enable_activation_checkpointing`).

The preset table (:data:`MODEL_PRESETS`) lives one layer down in :mod:`geomesh.model_presets` (facts, no
torch), so that scenario validation can read it without importing a model; it is re-exported here.
Imports point down only: to facts (:mod:`geomesh.model_presets`, :mod:`geomesh.errors`,
:mod:`geomesh.extras`), never to the methods, runtimes or faces.
"""

from ..model_presets import MODEL_PRESETS
from .build import build_proxy_model, enable_activation_checkpointing, model_name, transformer_blocks
from .gpt import GPT, INIT_STD, Block, CausalSelfAttention, ModelConfig, SwiGLU, apply_rope, build_model, model_config
from .hf import HFCausalLM, build_hf_model, clone_model, hf_config_from_mapping, max_positions

__all__ = [
    "MODEL_PRESETS",
    "GPT",
    "INIT_STD",
    "Block",
    "CausalSelfAttention",
    "ModelConfig",
    "SwiGLU",
    "apply_rope",
    "build_model",
    "model_config",
    "build_proxy_model",
    "model_name",
    "transformer_blocks",
    "enable_activation_checkpointing",
    "HFCausalLM",
    "build_hf_model",
    "clone_model",
    "hf_config_from_mapping",
    "max_positions",
]
