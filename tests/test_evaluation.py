"""Validation loss and the held-out zero-shot multiple-choice task."""

from __future__ import annotations

import torch

from geomesh.evaluation import ChoiceTask, build_choice_task, zero_shot

VOCAB = 50


def decode(ids):
    return "".join(chr(97 + i % 26) for i in ids)


class Oracle(torch.nn.Module):
    """Knows each passage's true continuation (looked up by its context) and puts its mass there."""

    def __init__(self, task: ChoiceTask, truth: dict, sign: float = 1.0):
        super().__init__()
        self.c, self.truth, self.sign = task.context_len, truth, sign

    def forward(self, idx, targets=None):
        logits = torch.zeros(*idx.shape, VOCAB)
        for r, row in enumerate(idx):
            cont = self.truth[tuple(row[: self.c].tolist())]
            for k, tok in enumerate(cont):
                logits[r, self.c - 1 + k, tok] = 8.0 * self.sign
        return logits, None


def make(items=30):
    gen = torch.Generator().manual_seed(0)
    val = torch.randint(0, VOCAB, (20_000,), generator=gen)
    task = build_choice_task(val, decode, items=items, context_len=12, continuation_len=4)
    truth = {}
    for i in range(items):
        row = task.tokens[i, int(task.answer[i])]
        truth[tuple(row[:12].tolist())] = row[12:].tolist()
    return task, truth


def test_task_shape_and_determinism():
    task, _ = make()
    assert task.tokens.shape == (30, 4, 16)
    again, _ = make()
    assert torch.equal(task.tokens, again.tokens) and torch.equal(task.answer, again.answer)
    # every item's contexts are shared by its choices, continuations differ
    assert all(torch.equal(task.tokens[i, 0, :12], task.tokens[i, j, :12]) for i in range(30) for j in range(4))
    assert 0 < task.answer.float().mean() < 3  # answers are shuffled across positions


def test_scores_follow_the_log_likelihood():
    task, truth = make()
    assert zero_shot(Oracle(task, truth), task)["acc"] == 1.0
    assert zero_shot(Oracle(task, truth, sign=-1.0), task)["acc"] == 0.0
    result = zero_shot(Oracle(task, truth), task)
    assert result["acc_norm"] == 1.0 and result["items"] == 30 and result["choices"] == 4


def test_acc_norm_divides_by_characters():
    # one item, two choices; hand-made log-likelihoods through a model that returns fixed scores
    task = ChoiceTask(tokens=torch.zeros(1, 2, 3, dtype=torch.long), context_len=2, answer=torch.tensor([1]),
                      choice_chars=torch.tensor([[1.0, 10.0]]))

    class Fixed(torch.nn.Module):
        def forward(self, idx, targets=None):
            logits = torch.zeros(*idx.shape, VOCAB)
            logits[0, 1, 0] = 5.0  # choice 0: high likelihood in total, over 1 character
            logits[1, 1, 0] = 4.0  # choice 1: a little lower in total, over 10 characters
            return logits, None

    r = zero_shot(Fixed(), task)
    assert r["acc"] == 0.0  # total log-likelihood: -0.29 (choice 0) beats -0.64 (choice 1)
    assert r["acc_norm"] == 1.0  # per character: -0.29 / 1 loses to -0.64 / 10
