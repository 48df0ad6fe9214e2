"""Evaluation of the global model: validation loss, and zero-shot multiple choice on held-out text."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .models import GPT


@torch.no_grad()
def evaluate(model: GPT, x: torch.Tensor, y: torch.Tensor, batch: int = 64) -> float:
    """Mean validation cross-entropy over the fixed validation set."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for xs, ys in zip(x.split(batch), y.split(batch)):
        _, loss = model(xs, ys)
        total += loss.item() * ys.numel()
        count += ys.numel()
    model.train(was_training)
    return total / max(count, 1)


@dataclass(frozen=True)
class ChoiceTask:
    """A multiple-choice task built from held-out text: pick the true continuation of a passage.

    ``tokens[i, j]`` is item i's context followed by choice j (all the same length); ``answer[i]`` the index
    of the true continuation; ``choice_chars[i, j]`` the choice's length in characters (for acc_norm).
    """

    tokens: torch.Tensor  # [items, choices, context + continuation]
    context_len: int
    answer: torch.Tensor  # [items]
    choice_chars: torch.Tensor  # [items, choices]


def build_choice_task(val_tokens: torch.Tensor, decode, *, items: int = 400, choices: int = 4,
                      context_len: int = 48, continuation_len: int = 16, seed: int = 1234) -> ChoiceTask:  # fmt: skip
    """Items from disjoint windows of the validation tokens; distractors are continuations taken from other
    windows (so they are fluent text, just not this passage's), in a seeded order.

    ``decode(list[int]) -> str`` turns a continuation back into text to measure its length in characters.
    """
    window = context_len + continuation_len
    n_windows = val_tokens.numel() // window
    items = min(items, n_windows)
    if items < 1 or n_windows < choices:
        raise ValueError(f"held-out text too short for a {choices}-choice task of {window}-token windows")
    gen = torch.Generator().manual_seed(seed)
    windows = val_tokens[: n_windows * window].view(n_windows, window)
    picked = torch.randperm(n_windows, generator=gen)[:items]
    contexts = windows[picked, :context_len]
    truths = windows[picked, context_len:]
    rows, answers, chars = [], [], []
    for i in range(items):
        others = torch.randint(0, n_windows, (choices * 4,), generator=gen)
        others = [int(o) for o in others if int(o) != int(picked[i])][: choices - 1]
        conts = [truths[i]] + [windows[o, context_len:] for o in others]
        order = torch.randperm(choices, generator=gen).tolist()
        conts = [conts[k] for k in order]
        answers.append(order.index(0))
        rows.append(torch.stack([torch.cat([contexts[i], c]) for c in conts]))
        chars.append([max(len(decode(c.tolist())), 1) for c in conts])
    return ChoiceTask(torch.stack(rows), context_len, torch.tensor(answers), torch.tensor(chars, dtype=torch.float32))


@torch.no_grad()
def zero_shot(model: GPT, task: ChoiceTask, batch: int = 256) -> dict[str, float]:
    """acc and acc_norm as lm-evaluation-harness scores multiple choice: the choice with the highest
    log-likelihood given the context (acc), or the highest log-likelihood per character (acc_norm)."""
    was_training = model.training
    model.eval()
    items, choices, length = task.tokens.shape
    flat = task.tokens.view(items * choices, length)
    # the task is built on the CPU; the model may be on a GPU (one without parameters scores on the CPU)
    device = next(model.parameters(), torch.empty(0)).device
    scores = []
    for seqs in flat.split(batch):
        seqs = seqs.to(device)
        logits, _ = model(seqs[:, :-1])
        logp = torch.log_softmax(logits.float(), dim=-1)
        target = seqs[:, 1:]
        token_lp = logp.gather(-1, target.unsqueeze(-1)).squeeze(-1)
        scores.append(token_lp[:, task.context_len - 1 :].sum(dim=1).cpu())
    model.train(was_training)
    ll = torch.cat(scores).view(items, choices)
    acc = (ll.argmax(dim=1) == task.answer).float().mean().item()
    acc_norm = ((ll / task.choice_chars).argmax(dim=1) == task.answer).float().mean().item()
    return {"acc": acc, "acc_norm": acc_norm, "items": items, "choices": choices}


def heldout_zero_shot(model: GPT, corpus, seq_len: int, items: int) -> dict[str, float] | None:
    """Zero-shot multiple choice on ``items`` items from ``corpus``'s held-out text (``training.zero_shot_items``;
    0: None), with contexts and continuations sized to ``seq_len``: what both runtimes report at the end."""
    if items == 0:
        return None
    continuation = min(16, seq_len // 4)  # the model sees context + continuation - 1 tokens
    task = build_choice_task(corpus.val_tokens, corpus.tokenizer.decode, items=items,
                             context_len=min(48, seq_len + 1 - continuation), continuation_len=continuation)  # fmt: skip
    return zero_shot(model, task)
