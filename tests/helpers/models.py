"""Small models shared by the runtime tests (deterministic from a seed)."""

from __future__ import annotations

import torch
from torch import nn

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1", "zb-h2", "zbv", "dualpipev",
             "looped-bfs", "zb-auto", "v-half", "v-min"]
MULTI = {"interleaved-1f1b", "zbv", "dualpipev", "looped-bfs", "v-half", "v-min"}  # v = 2
SOME = SCHEDULES[:7]  # for the slower multi-process tests; test_runtime_dist runs them all


def mlp(n_layers: int = 8, width: int = 8, seed: int = 1) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh())
                           for _ in range(n_layers)])


def batch(n: int = 12, width: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)


class Split(nn.Module):
    """Returns a dict with a differentiable tensor, a non-differentiable one and a plain value."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> dict[str, object]:
        return {"h": self.lin(x), "mask": (x > 0).float(), "scale": 0.5}


class Join(nn.Module):
    """Consumes Split's dict; returns a tuple (tensor, count)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, d: dict[str, object]) -> tuple[torch.Tensor, int]:
        h, mask, scale = d["h"], d["mask"], d["scale"]
        assert isinstance(h, torch.Tensor) and isinstance(mask, torch.Tensor)
        return self.lin(h * mask * float(scale)), 3  # type: ignore[arg-type]


class Unpack(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, t: tuple[torch.Tensor, int]) -> torch.Tensor:
        return self.lin(t[0]) * t[1]


def structured(width: int = 8, seed: int = 2) -> nn.Sequential:
    """Stage boundaries carry dicts, tuples and plain values (balance [1, 1, 1, 1])."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), Split(width), Join(width), Unpack(width))
