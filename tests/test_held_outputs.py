"""The model's outputs held through the backward (issue 49, item 5).

In the usual loop the caller keeps the model's outputs until ``backward()`` ends
(``out = model(x); loss = loss_fn(out, y); loss.backward()``, or Hugging Face's
``outputs.loss.backward()``): for a language model the logits, batch x sequence x vocabulary.
The plan counts every output of the compiled forward as alive until the backward ends, so
the budget holds in that loop; a loss computed outside the compiled graph allocates outside
the budget (its own softmax and the logits' gradient, docs/reliability.md).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import compile_offload


class _LogitsModel(nn.Module):
    def __init__(self, vocab: int = 2048, d: int = 64) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.f = nn.Sequential(nn.Linear(d, 256), nn.GELU(), nn.Linear(256, d))
        self.head = nn.Linear(d, vocab)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.f(self.emb(tokens)))


@pytest.mark.inductor
@pytest.mark.slow
@pytest.mark.parametrize("budget", ["4MiB", 0.5])
def test_logits_held_through_the_backward_stay_within_the_plan(budget, captured_plans):
    torch.manual_seed(0)
    model, tokens = _LogitsModel(), torch.randint(0, 2048, (4, 64))
    compiled = torch.compile(model, backend=compile_offload.offload_remat(memory_budget=budget))
    compiled(tokens).sum().backward()
    plan = captured_plans[-1]
    logits_bytes = 4 * 64 * 2048 * 4
    # The plan counts the logits as alive when the step ends (with the parameters' gradients).
    assert plan.timeline_bytes[-1] >= logits_bytes
    grad = torch.full((4, 64, 2048), 1e-3)  # the loss's gradient, made before the step as a loss would
    with compile_offload.measure_peak("cpu") as measured:
        out = compiled(tokens)
        out.backward(grad)  # ``out`` held through the backward, as the usual loop holds it
    assert measured.peak_bytes <= plan.scheduled_peak_bytes * 1.01, (measured.peak_bytes, plan.scheduled_peak_bytes)
    if plan.meets_budget():
        assert measured.peak_bytes <= plan.budget_bytes * 1.01
