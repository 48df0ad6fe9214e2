"""lm-evaluation-harness for trained models: an ``LM`` adapter, a task runner and the ``geomesh eval`` face.

:class:`GeoMeshLM` is an ``lm_eval.api.model.LM`` (extra ``eval``) around any causal model with the built-in
model's interface (``model(idx) -> (logits, ...)``: the built-in GPT, the transformers wrapper of
:mod:`geomesh.models.hf`) or a raw ``transformers`` model (``.logits``), and a tokenizer (a
``tokenizers.Tokenizer``, e.g. the corpus's, or a ``transformers`` tokenizer):

- ``loglikelihood``: log P(continuation | context) and whether greedy decoding gives the continuation; the
  context's trailing spaces move to the continuation and the pair is tokenised together, as lm-eval's HF
  model does; an empty context is the separator token; inputs longer than the model's window are cut
  from the left;
- ``loglikelihood_rolling``: the whole text's log-likelihood in disjoint windows, each with as much context
  as fits (lm-eval's rolling scheme), the first token conditioned on the separator;
- ``generate_until``: greedy decoding until a stop string, the separator or ``max_gen_toks`` tokens.

The scoring needs only torch: without lm-eval installed the class is a plain object whose three methods take
lm-eval ``Instance`` objects or bare argument tuples. :func:`evaluate_tasks` runs lm-eval tasks (local YAML
tasks through ``include_path``, e.g. a JSONL multiple-choice task with ``dataset_path: json``).
:func:`cmd_eval` runs ``geomesh eval``, whose arguments live in :mod:`geomesh.cli.eval` (so that the ``geomesh``
parser is built without importing torch and lm-eval).
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ConfigError
from ..extras import require

try:  # lm-eval is optional: without it the adapter still scores (tests, notebooks)
    from lm_eval.api.model import LM as _LMBase

    HAVE_LM_EVAL = True
except ImportError:  # pragma: no cover - exercised where lm-eval is not installed
    _LMBase = object  # type: ignore[assignment,misc]
    HAVE_LM_EVAL = False

__all__ = ["GeoMeshLM", "TextTokenizer", "evaluate_tasks", "cmd_eval", "HAVE_LM_EVAL"]

SEPARATORS = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>", "[SEP]")


class TextTokenizer:
    """``encode``/``decode`` over a ``tokenizers.Tokenizer`` or a ``transformers`` tokenizer, and the
    separator id (``eot_id``) used as the context of an empty prompt and as the end of generation."""

    def __init__(self, tokenizer: Any, eot_id: int | None = None):
        self.inner = tokenizer
        self._fast = hasattr(tokenizer, "encode_batch") and hasattr(tokenizer, "token_to_id")
        if not hasattr(tokenizer, "encode"):
            raise ConfigError("lm-eval needs a tokenizer that encodes text (set data.tokenizer for token files)")
        if eot_id is None:
            eot_id = getattr(tokenizer, "eos_token_id", None)
            lookup = tokenizer.token_to_id if self._fast else getattr(tokenizer, "convert_tokens_to_ids", None)
            for token in SEPARATORS if eot_id is None and lookup is not None else ():
                i = lookup(token)
                if isinstance(i, int) and i >= 0 and (self._fast or i != getattr(tokenizer, "unk_token_id", None)):
                    eot_id = i
                    break
        self.eot_id = 0 if eot_id is None else int(eot_id)

    def encode(self, text: str) -> list[int]:
        if self._fast:
            return list(self.inner.encode(text, add_special_tokens=False).ids)
        return list(self.inner.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.inner.decode(list(ids))


def _args(request: Any) -> tuple:
    return tuple(request.args) if hasattr(request, "args") else tuple(request)


def _window_of(model: Any) -> int:
    for obj, name in ((model, "max_length"), (getattr(model, "cfg", None), "seq_len"), (model, "seq_len")):
        value = getattr(obj, name, None) if obj is not None else None
        if isinstance(value, int) and value > 0:
            return value
    config = getattr(model, "config", None)
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    raise ConfigError("cannot tell the model's context length: pass max_length=")


class GeoMeshLM(_LMBase):
    """An lm-evaluation-harness ``LM`` for a GeoMesh-trained (or any causal) model; see the module docstring.

    Args:
        model: ``model(idx)`` returns logits ``[B, T, V]``, a tuple whose first item they are, or an object
            with ``.logits``.
        tokenizer: a ``tokenizers.Tokenizer``, a ``transformers`` tokenizer, or a :class:`TextTokenizer`.
        max_length: the longest input (default: the model's ``max_length`` / ``cfg.seq_len`` / position limit).
        batch_size: sequences per forward pass when scoring.
        max_gen_toks: default cap on generated tokens.
    """

    def __init__(self, model: torch.nn.Module, tokenizer: Any, *, max_length: int | None = None,
                 batch_size: int = 16, max_gen_toks: int = 64, device: str | torch.device = "cpu"):  # fmt: skip
        if HAVE_LM_EVAL:
            super().__init__()
        self.model = model.to(device)
        self.tok = tokenizer if isinstance(tokenizer, TextTokenizer) else TextTokenizer(tokenizer)
        self.max_length = max_length or _window_of(model)
        self.batch_size = max(1, int(batch_size))
        self.max_gen_toks = max_gen_toks
        self._device = torch.device(device)

    @property
    def eot_token_id(self) -> int:
        return self.tok.eot_id

    @property
    def tokenizer_name(self) -> str:
        return type(self.tok.inner).__name__

    # ---- the forward pass -----------------------------------------------------------------------
    @torch.no_grad()
    def _logprobs(self, inputs: list[list[int]]) -> list[torch.Tensor]:
        """log-softmax over the vocabulary at every position of each input (right-padded in batches)."""
        was_training = self.model.training
        self.model.eval()
        out: list[torch.Tensor] = [torch.empty(0)] * len(inputs)
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        try:
            for k in range(0, len(order), self.batch_size):
                idx = order[k : k + self.batch_size]
                width = max(len(inputs[i]) for i in idx)
                x = torch.zeros(len(idx), width, dtype=torch.long)
                for row, i in enumerate(idx):
                    x[row, : len(inputs[i])] = torch.tensor(inputs[i], dtype=torch.long)
                res = self.model(x.to(self._device))
                logits = res[0] if isinstance(res, tuple) else getattr(res, "logits", res)
                logp = torch.log_softmax(logits.float(), dim=-1).cpu()
                for row, i in enumerate(idx):
                    out[i] = logp[row, : len(inputs[i])]
        finally:
            self.model.train(was_training)
        return out

    def _score(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """(log P(cont | ctx), greedy) for token pairs; the input is cut from the left to the window."""
        inputs, spans = [], []
        for ctx, cont in pairs:
            seq = (ctx + cont)[-(self.max_length + 1) :]
            n = min(len(cont), len(seq) - 1)
            inputs.append(seq[:-1])
            spans.append((seq[len(seq) - n :], n))
        results = []
        for logp, (target, n) in zip(self._logprobs(inputs), spans):
            if n == 0:
                results.append((0.0, True))
                continue
            rows = logp[-n:]
            t = torch.tensor(target, dtype=torch.long)
            ll = float(rows.gather(1, t.unsqueeze(1)).sum())
            results.append((ll, bool((rows.argmax(dim=1) == t).all())))
        return results

    # ---- lm-eval's three requests -----------------------------------------------------------------
    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = []
        for request in requests:
            context, continuation = _args(request)[:2]
            if context == "":
                pairs.append(([self.tok.eot_id], self.tok.encode(continuation)))
                continue
            spaces = len(context) - len(context.rstrip(" "))
            if spaces:
                context, continuation = context[:-spaces], context[-spaces:] + continuation
            whole = self.tok.encode(context + continuation)
            ctx = self.tok.encode(context)
            if whole[: len(ctx)] != ctx:  # the join changed the context's last token: split at its length
                ctx = whole[: len(ctx)]
            pairs.append((ctx, whole[len(ctx) :]))
        results = self._score(pairs)
        for request, result in zip(requests, results):
            self._cache("loglikelihood", request, result)
        return results

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False) -> list[float]:
        results = []
        for request in requests:
            (text,) = _args(request)[:1]
            full = [self.tok.eot_id] + self.tok.encode(text)
            L = self.max_length
            pairs = []
            for a in range(1, len(full), L):  # predict full[a:b] with the longest context that fits
                b = min(a + L, len(full))
                lo = max(0, b - 1 - L)
                pairs.append((full[lo:a], full[a:b]))
            total = sum(ll for ll, _ in self._score(pairs)) if pairs else 0.0
            results.append(total)
            self._cache("loglikelihood_rolling", request, total)
        return results

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        outputs = []
        for request in requests:
            args = _args(request)
            context, kwargs = args[0], (args[1] if len(args) > 1 and args[1] else {})
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            limit = int(kwargs.get("max_gen_toks", self.max_gen_toks))
            ids = self.tok.encode(context) or [self.tok.eot_id]
            new: list[int] = []
            text = ""
            for _ in range(limit):
                (logp,) = self._logprobs([(ids + new)[-self.max_length :]])
                nxt = int(logp[-1].argmax())
                if nxt == self.tok.eot_id:
                    break
                new.append(nxt)
                text = self.tok.decode(new)
                if any(u in text for u in until):
                    break
            for u in until:
                if u in text:
                    text = text[: text.index(u)]
            outputs.append(text)
            self._cache("generate_until", request, text)
        return outputs

    def _cache(self, kind: str, request: Any, result: Any) -> None:
        hook = getattr(self, "cache_hook", None)
        if hook is not None and hasattr(request, "args"):
            hook.add_partial(kind, request.args, result)


def evaluate_tasks(lm: GeoMeshLM, tasks: Sequence[str], *, include_path: str | Path | Sequence[str] | None = None,
                   limit: int | float | None = None, num_fewshot: int | None = None,
                   seed: int = 1234) -> dict[str, Any]:  # fmt: skip
    """Run lm-eval ``tasks`` on ``lm``; returns ``{"results": {task: {metric: value}}, "versions", "n-shot"}``.

    ``include_path``: folder(s) of task YAML files (e.g. a local JSONL task, ``dataset_path: json``)."""
    lm_eval = require("lm_eval", "lm-eval evaluation (geomesh eval)")
    from lm_eval.tasks import TaskManager

    paths = [str(include_path)] if isinstance(include_path, (str, Path)) else list(include_path or []) or None
    # local tasks alone first: indexing lm-eval's own ~15k task files takes seconds, needed only when a task
    # asked for is not a local one
    manager = TaskManager(include_path=paths, include_defaults=False) if paths else None
    if manager is None or any(t not in manager.all_tasks for t in tasks):
        manager = TaskManager(include_path=paths)
    unknown = [t for t in tasks if t not in manager.all_tasks]
    if unknown:
        raise ConfigError(f"--tasks: unknown lm-eval task(s) {', '.join(unknown)} (local tasks need --include-path)")
    out = lm_eval.simple_evaluate(model=lm, tasks=list(tasks), task_manager=manager, limit=limit,
                                  num_fewshot=num_fewshot, log_samples=False, bootstrap_iters=0,
                                  random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed,
                                  fewshot_random_seed=seed)  # fmt: skip
    if out is None:  # a non-zero rank in a distributed evaluation
        return {}
    clean = {task: {k: v for k, v in metrics.items() if isinstance(v, (int, float, str)) and k != "alias"}
             for task, metrics in out["results"].items()}  # fmt: skip
    return {"results": clean, "versions": dict(out.get("versions", {})), "n-shot": dict(out.get("n-shot", {}))}


# ---- geomesh eval ---------------------------------------------------------------------------------


def _load_checkpoint(model: torch.nn.Module, path: str) -> None:
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except (OSError, RuntimeError, ValueError) as exc:
        raise ConfigError(f"--checkpoint {path}: cannot read ({exc})") from None
    if isinstance(state, dict):
        for key in ("model", "global_params", "state_dict"):
            if isinstance(state.get(key), dict):
                state = state[key]
                break
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ConfigError(f"--checkpoint {path}: expected a state_dict (name -> tensor)")
    missing, unexpected = model.load_state_dict(state, strict=False)
    named = dict(model.named_parameters())
    missing = [k for k in missing if k in named]  # tied duplicates are filled by their twin
    if missing or unexpected:
        raise ConfigError(f"--checkpoint {path}: does not fit the scenario's model (missing "
                          f"{', '.join(missing[:3]) or 'none'}; unexpected {', '.join(unexpected[:3]) or 'none'})")  # fmt: skip


def _model_from_args(args: argparse.Namespace) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
    """(model, tokenizer, facts) for the model source the arguments name."""
    if args.hf_model:
        transformers = require("transformers", "--hf-model (a transformers model)")
        path = Path(args.hf_model).expanduser()
        local = path.exists()
        try:
            model = transformers.AutoModelForCausalLM.from_pretrained(str(path) if local else args.hf_model,
                                                                      local_files_only=local)  # fmt: skip
            tok = transformers.AutoTokenizer.from_pretrained(args.tokenizer or (str(path) if local else args.hf_model),
                                                             local_files_only=local)  # fmt: skip
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--hf-model {args.hf_model}: cannot load ({str(exc).splitlines()[0]})") from None
        return model.float(), tok, {"model": args.hf_model}
    if not args.scenario:
        raise ConfigError("geomesh eval: give a SCENARIO (trained now, or with --checkpoint) or --hf-model DIR")
    from ..config import load_scenario, parse_overrides
    from ..data import load_corpus
    from ..models import build_proxy_model

    scenario = load_scenario(args.scenario, parse_overrides(args.set))
    if args.checkpoint:
        corpus = load_corpus(scenario.data)
        model = build_proxy_model(scenario.model, corpus.vocab_size, scenario.training.seed)
        _load_checkpoint(model, args.checkpoint)
        facts = {"scenario": scenario.name, "checkpoint": args.checkpoint}
    else:
        from ..methods import get_method
        from ..runtime.emulated import EmulatedRun, RunOptions

        run = EmulatedRun(scenario, get_method(args.method), RunOptions(out_dir=Path(args.run_out) if args.run_out
                          else None, tokens=args.tokens, seed=args.seed, progress=False))  # fmt: skip
        summary = run.run()
        corpus, model = run.cluster.corpus, run.cluster.global_model
        facts = {"scenario": scenario.name, "method": args.method, "tokens": summary["tokens"],
                 "final_val_loss": summary["final_val_loss"]}  # fmt: skip
        if args.save_checkpoint:
            Path(args.save_checkpoint).parent.mkdir(parents=True, exist_ok=True)
            torch.save(model.state_dict(), args.save_checkpoint)
    if args.tokenizer:
        from ..data import load_tokenizer

        return model, load_tokenizer(args.tokenizer), facts
    return model, corpus.tokenizer, facts


def cmd_eval(args: argparse.Namespace, print_fn: Callable[..., None] = print) -> int:
    require("lm_eval", "geomesh eval (lm-evaluation-harness)")
    tasks = [t.strip() for t in args.tasks.split(",") if t.strip()]
    if not tasks:
        raise ConfigError("--tasks: give at least one task name")
    model, tokenizer, facts = _model_from_args(args)
    lm = GeoMeshLM(model, tokenizer, batch_size=args.batch_size)
    limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
    results = evaluate_tasks(lm, tasks, include_path=args.include_path, limit=limit, num_fewshot=args.num_fewshot)
    results["model"] = facts
    for task, metrics in results["results"].items():
        shown = ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in metrics.items())
        print_fn(f"{task}: {shown}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(results, indent=2, default=str) + "\n")
    return 0
