"""Train a Hugging Face model with ``transformers.Trainer`` and the ``offload_remat`` backend.

    pip install -e ".[integration]"        # transformers and accelerate
    python examples/train_hf_trainer.py                                    # tiny GPT-2, a few steps, CPU ok
    COMPILE_OFFLOAD_MEMORY_BUDGET=0.5 python examples/train_hf_trainer.py  # the budget from the environment
    python examples/train_hf_trainer.py --budget 2GiB --check              # and compare with Trainer without us

The model is compiled **in place**, ``model.compile(backend="offload_remat")``, before it
is handed to the Trainer; the budget comes from ``compile_offload.config`` (here
``--budget``, or the ``COMPILE_OFFLOAD_MEMORY_BUDGET`` variable when ``--budget`` is not
given). Trainer's own ``TrainingArguments(torch_compile_backend=...)`` cannot name this
backend: accelerate checks the name against its fixed list of backends
(``accelerate.utils.DynamoBackend``) and raises ``ValueError: 'OFFLOAD_REMAT' is not a
valid DynamoBackend``. Leave ``torch_compile`` off in the arguments; the model is compiled
already.

The GPT-2 is built from a tiny ``GPT2Config`` with random weights (nothing is downloaded)
and trained on random tokens. Prints the plan of each compiled graph (the
``compile_offload`` INFO log line) and the loss of each step.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile

import torch

import compile_offload

VOCAB = 128


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget", default=None,
                        help="memory budget of each compiled graph: a fraction ('0.5'), a size ('64MiB') or "
                             "'none'; default: compile_offload.config (COMPILE_OFFLOAD_MEMORY_BUDGET)")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", type=int, default=32)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--inner-compiler", choices=("inductor", "eager"), default=None,
                        help="default: compile_offload.config on a GPU, eager on the CPU "
                             "(Inductor's CPU code generation is slow on small machines)")
    parser.add_argument("--check", action="store_true",
                        help="also train with Trainer and no compile, same seed, and compare the losses")
    return parser.parse_args(argv)


def make_model(args: argparse.Namespace):
    """A tiny randomly initialised GPT-2. Dropout is off so that a run with our backend and
    one without it draw no random numbers and can be compared loss for loss."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(vocab_size=VOCAB, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                        n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                        bos_token_id=0, eos_token_id=0)
    return GPT2LMHeadModel(config)


def make_dataset(args: argparse.Namespace) -> list[dict]:
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, VOCAB, (args.steps * args.batch, args.seq), generator=generator)
    return [{"input_ids": row, "labels": row} for row in tokens]  # the model shifts the labels itself


def train(args: argparse.Namespace, *, compile_model: bool, output_dir: str) -> list[float]:
    """Train with ``transformers.Trainer``; the loss of each step."""
    from transformers import Trainer, TrainerCallback, TrainingArguments, set_seed

    class RecordLosses(TrainerCallback):
        def __init__(self) -> None:
            self.losses: list[float] = []

        def on_log(self, _args, _state, _control, logs=None, **_kwargs):
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))

    set_seed(0)
    model = make_model(args)
    if compile_model:
        model.compile(backend="offload_remat")  # in place: Trainer gets the module itself, already compiled
    training_args = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch,
        learning_rate=1e-3, logging_steps=1, save_strategy="no", report_to="none", seed=0,
        disable_tqdm=True, use_cpu=not torch.cuda.is_available(),
    )
    recorder = RecordLosses()
    trainer = Trainer(model=model, args=training_args, train_dataset=make_dataset(args), callbacks=[recorder])
    trainer.train()
    return recorder.losses


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.budget is not None:
        compile_offload.config.memory_budget = args.budget
    if args.inner_compiler is not None:
        compile_offload.config.inner_compiler = args.inner_compiler
    elif not torch.cuda.is_available():
        compile_offload.config.inner_compiler = "eager"
    if not torch.cuda.is_available():
        # On the CPU host memory is the device's own memory: an offloaded copy frees nothing.
        compile_offload.config.offload = False

    # The plan of each compiled graph is one INFO line of the "compile_offload" logger.
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("plan: %(message)s"))
    logger = logging.getLogger("compile_offload")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)

    print(f"GPT-2 {args.layers}x d{args.width} seq {args.seq} batch {args.batch}, "
          f"memory_budget {compile_offload.config.memory_budget!r}, "
          f"offload {compile_offload.config.offload}, inner compiler {compile_offload.config.inner_compiler}")
    with tempfile.TemporaryDirectory() as output_dir:
        losses = train(args, compile_model=True, output_dir=output_dir)
        logger.removeHandler(handler)
        for step, loss in enumerate(losses):
            print(f"offload_remat step {step}: loss {loss:.4f}")
        if args.check:
            expected = train(args, compile_model=False, output_dir=output_dir)
            for step, loss in enumerate(expected):
                print(f"eager step {step}: loss {loss:.4f}")
            difference = max(abs(a - b) for a, b in zip(losses, expected, strict=True))
            print(f"largest loss difference against Trainer without compile: {difference:.2e}")
            if difference > 1e-3:
                print("check failed: the losses differ", file=sys.stderr)
                return 1
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
