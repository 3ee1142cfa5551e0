"""Quickstart: train a small MLP under ZB-V on 2 CPU processes and check it against one device.

    python -m pipetrain.examples.quickstart [--schedule zbv] [--ranks 2] [--steps 30]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn

import pipetrain as pt
from pipetrain.testing import grad_mismatches, reference_step


def build_model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*[nn.Sequential(nn.Linear(256, 256), nn.Tanh()) for _ in range(8)],
                         nn.Linear(256, 1))


def data(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(256, 256, generator=g)
    return x, x[:, :1].sin() + 0.1 * x[:, 1:2]


def train(ctx: pt.RankContext, schedule: str, steps: int) -> str:
    model, reference = build_model(), build_model()
    pipe = pt.Pipeline(model, schedule=schedule, microbatches=8, loss_fn=nn.MSELoss())
    opt = torch.optim.AdamW(pipe.parameters(), lr=3e-3)
    mismatches: list[str] = []
    for step in range(steps):
        x, y = data(step)
        result = pipe.step(x, y)  # the same call on every rank
        if step == 0:  # gradients equal single-device training, bitwise
            reference_step(reference, x, y, nn.MSELoss(), 8)
            mismatches = grad_mismatches(pipe, reference)  # on every rank: a collective
        opt.step()
        opt.zero_grad()
        if ctx.rank == 0 and (step % 10 == 0 or step == steps - 1):
            print(f"step {step:3d}  loss {result.loss.item():.4f}  "  # type: ignore[union-attr]
                  f"measured bubble {result.bubble_fraction:.2f}", flush=True)
    return "gradients identical to one device" if not mismatches else "; ".join(mismatches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schedule", default="zbv")
    parser.add_argument("--ranks", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    results = pt.launch(train, args.ranks, args.schedule, args.steps, timeout=600)
    for rank, text in enumerate(results):
        print(f"rank {rank}: {text}")


if __name__ == "__main__":
    main()
