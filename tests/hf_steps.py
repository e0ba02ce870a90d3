"""AdamW steps of a Hugging Face causal LM on random tokens below `vocab`, and what the mapping tests
compare after them (tests/test_mapping_moe.py, tests/test_mapping_deepseek.py and the tests built on
them); each module binds its own vocabulary (`functools.partial(..., vocab=VOCAB)`)."""

from __future__ import annotations

import torch


def trained(model, steps: int = 2, seed: int = 100, *, vocab: int):
    """A fresh AdamW over `model`, after `steps` steps (seeds `seed`, `seed` + 1, ...)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for i in range(steps):
        train_step(model, opt, seed + i, vocab=vocab)
    return opt


def train_step(model, opt, seed: int, *, vocab: int) -> None:
    torch.manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 12))
    model(input_ids=tokens, labels=tokens).loss.backward()
    opt.step()
    opt.zero_grad()


def logits(model, seed: int = 7, *, vocab: int) -> torch.Tensor:
    torch.manual_seed(seed)
    tokens = torch.randint(0, vocab, (2, 10))
    with torch.no_grad():
        return model(input_ids=tokens).logits


def moments_by_name(model, opt) -> dict:
    names = {id(p): n for n, p in model.named_parameters()}
    return {k: {names[id(p)]: s[k] for p, s in opt.state.items()} for k in ("exp_avg", "exp_avg_sq")}
