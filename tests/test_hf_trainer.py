"""Hugging Face ``Trainer`` with a model compiled in place by ``offload_remat``.

Needs the ``integration`` extra (transformers, accelerate); skipped without it. A tiny GPT-2
is built from a ``GPT2Config`` with random weights (nothing is downloaded), compiled with
``model.compile(backend="offload_remat")`` under a budget set in ``compile_offload.config``,
trained by ``Trainer`` for a few steps on the CPU, and its losses are compared with the same
Trainer run without our backend (same seed, same data, dropout off). The environment-variable
route (``COMPILE_OFFLOAD_MEMORY_BUDGET``) is run by ``tests/test_examples.py`` through
``examples/train_hf_trainer.py``. A plain ``Accelerator`` loop gets the same treatment, and
the tests that accelerate refuses our backend's name (Trainer's ``torch_compile_backend``,
``ACCELERATE_DYNAMO_BACKEND``) fail when that changes, so the guide can be updated.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

import compile_offload  # noqa: E402

VOCAB, SEQ, BATCH, STEPS = 128, 32, 4, 4


def make_model():
    config = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=2, n_head=2,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)
    return transformers.GPT2LMHeadModel(config)


def training_args(output_dir, **overrides):
    options = dict(output_dir=str(output_dir), max_steps=STEPS, per_device_train_batch_size=BATCH, learning_rate=1e-3,
                   logging_steps=1, save_strategy="no", report_to="none", seed=0, disable_tqdm=True, use_cpu=True)
    return transformers.TrainingArguments(**(options | overrides))


def dataset():
    tokens = torch.randint(0, VOCAB, (STEPS * BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": row, "labels": row} for row in tokens]


def train(output_dir, compile_model: bool) -> list[float]:
    losses = []

    class RecordLosses(transformers.TrainerCallback):
        def on_log(self, _args, _state, _control, logs=None, **_kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    transformers.set_seed(0)
    model = make_model()
    if compile_model:
        model.compile(backend="offload_remat")
    trainer = transformers.Trainer(model=model, args=training_args(output_dir), train_dataset=dataset(),
                                   callbacks=[RecordLosses()])
    trainer.train()
    return losses


def test_trainer_trains_a_model_compiled_in_place_like_trainer_without_it(tmp_path, captured_plans):
    with compile_offload.config.patch(memory_budget=0.5, inner_compiler="eager"):
        losses = train(tmp_path, compile_model=True)
    expected = train(tmp_path, compile_model=False)

    # Our partitioner planned the training graphs under the configured budget ...
    assert captured_plans, "offload_remat never partitioned a graph"
    largest = max(captured_plans, key=lambda plan: plan.baseline_peak_bytes)
    # 0.5 of the saved activations: at least half the unconstrained peak, below all of it
    assert 0.5 * largest.baseline_peak_bytes <= largest.budget_bytes < largest.baseline_peak_bytes
    assert largest.count("recompute") + largest.count("offload") > 0
    assert largest.predicted_peak_bytes < largest.baseline_peak_bytes
    # ... and Trainer's losses are those of the run without it.
    assert len(losses) == STEPS
    assert losses == pytest.approx(expected, abs=1e-4)
    assert losses[0] != pytest.approx(losses[-1], abs=1e-6)  # the weights changed between steps


def test_accelerate_rejects_our_backend_name_in_training_arguments(tmp_path):
    """Why the guide says to compile in place: Trainer hands ``torch_compile_backend`` to
    accelerate, which accepts only the names of its ``DynamoBackend`` enum. If this starts
    passing, the guide's Hugging Face section is out of date."""
    args = training_args(tmp_path, torch_compile_backend="offload_remat")
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        transformers.Trainer(model=make_model(), args=args, train_dataset=dataset())


def accelerate_losses(compile_model: bool) -> list[float]:
    """A plain ``Accelerator`` loop (no Trainer): ``prepare``, ``backward``, ``step``."""
    from accelerate import Accelerator

    transformers.set_seed(0)
    model = make_model()
    if compile_model:
        model.compile(backend="offload_remat")  # before prepare: accelerate's dynamo backend stays "no"
    accelerator = Accelerator(cpu=True)
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    losses = []
    for row in range(0, STEPS * BATCH, BATCH):
        batch = torch.stack([item["input_ids"] for item in dataset()[row:row + BATCH]])
        loss = model(input_ids=batch, labels=batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerator_trains_a_model_compiled_in_place_like_accelerate_without_it(captured_plans, monkeypatch):
    monkeypatch.delenv("ACCELERATE_DYNAMO_BACKEND", raising=False)
    with compile_offload.config.patch(memory_budget=0.5, inner_compiler="eager"):
        losses = accelerate_losses(compile_model=True)
    assert captured_plans and all(plan.budget_bytes is not None for plan in captured_plans)
    assert losses == pytest.approx(accelerate_losses(compile_model=False), abs=1e-4)


def test_accelerate_rejects_our_backend_name_in_its_environment_variable(monkeypatch):
    """``ACCELERATE_DYNAMO_BACKEND`` (what ``accelerate config``/``accelerate launch
    --dynamo_backend`` set) goes through the same ``DynamoBackend`` enum, so a registered
    backend's name is refused there too. If this starts passing, the guide is out of date."""
    from accelerate import Accelerator

    monkeypatch.setenv("ACCELERATE_DYNAMO_BACKEND", "offload_remat")
    with pytest.raises(ValueError, match="not a valid DynamoBackend"):
        Accelerator(cpu=True)
