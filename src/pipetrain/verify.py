"""Verify: one pipelined float64 step of any model against one process, gradient by gradient.

    result = pt.verify(model, example_inputs, schedule="zbv", ranks=2, microbatches=4)
    print(result.table())        # parameter group, max relative difference, pass/fail
    result.check()               # raises VerificationFailed unless every gradient matches

:func:`verify` copies the model twice in float64: one copy is split and stepped once by a
:class:`~pipetrain.Pipeline` in local mode (every rank in this process, running the action
lists a distributed run executes), the other runs the same micro-batches one after another
through :func:`pipetrain.testing.reference_step`, both under the same seed. Every parameter of
the model is then accounted for: its gradient in the pipeline against the reference's, as the
largest difference relative to the reference's largest magnitude. :func:`verify_with` does the
same with a pipeline built by the caller (``pipetrain verify --hf`` builds ``train``'s).
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pipetrain.pipeline import Pipeline
from pipetrain.pipeline_config import PipelineConfig
from pipetrain.runtime.torch_private import pytree
from pipetrain.split.lazy import NamedInit, is_meta
from pipetrain.testing import reference_step

__all__ = ["Row", "Verification", "VerificationFailed", "default_loss", "default_tolerance",
           "group_of", "verify", "verify_with"]

Build = Callable[[nn.Module], Pipeline]
"""Makes the pipeline to check from the float64 copy of the model it is given."""


class VerificationFailed(AssertionError):
    """The pipeline's loss or a gradient differs from one process beyond the tolerance."""


@dataclass(frozen=True)
class Row:
    """One line of the table: a parameter group, or a stage."""

    name: str
    """The group (``model.layers.*.mlp.up_proj.weight``) or ``stage 3``."""
    stages: tuple[int, ...]
    """The stages holding its parameters (a weight tied between stages: all of them)."""
    tensors: int
    numel: int
    difference: float
    """Largest ``max|pipeline - reference| / max|reference|`` over its parameters' gradients
    (0 where both are zero or absent; inf where one side has none, or for NaN)."""
    worst: str
    """The parameter with that difference."""
    note: str
    """Why it failed beyond the number ("no gradient in the pipeline", ...); empty if none."""
    passed: bool


@dataclass(frozen=True)
class Verification:
    """What :func:`verify` found: per group and per stage, the loss, and the layout."""

    rows: tuple[Row, ...]
    """One per parameter group (:func:`group_of`), in the model's order."""
    stages: tuple[Row, ...]
    """One per stage; a stage's ``tensors`` count a tied weight in each stage holding it."""
    loss: float
    """The pipeline's batch loss."""
    reference_loss: float
    """The loss of the same micro-batches on one process."""
    tolerance: float
    schedule: str
    ranks: int
    microbatches: int
    balance: tuple[int, ...]
    """Units per stage, as the pipeline split them."""
    placement: tuple[int, ...]
    """The rank of each stage."""
    dtype: torch.dtype
    seconds: float

    @property
    def loss_difference(self) -> float:
        """``|loss - reference_loss| / |reference_loss|``."""
        return _relative(abs(self.loss - self.reference_loss), abs(self.reference_loss))

    @property
    def passed(self) -> bool:
        """Every group within the tolerance, and the loss too."""
        return all(r.passed for r in self.rows) and self.loss_difference <= self.tolerance

    @property
    def failed(self) -> list[Row]:
        """The groups outside the tolerance."""
        return [r for r in self.rows if not r.passed]

    def check(self) -> None:
        """Raise :class:`VerificationFailed`, naming what differs, unless :attr:`passed`."""
        if self.passed:
            return
        what = [f"{r.name} ({_number(r.difference)}{', ' + r.note if r.note else ''}; worst "
                f"{r.worst})" for r in self.failed]
        if self.loss_difference > self.tolerance:
            what.append(f"the loss ({_number(self.loss_difference)})")
        raise VerificationFailed(f"the pipeline ({self.schedule}, {self.ranks} ranks) differs "
                                 f"from one process beyond {self.tolerance:g} in: "
                                 + "; ".join(what))

    def table(self) -> str:
        """The groups, the stages, the loss and the verdict as plain text."""
        head = (f"{self.schedule}, {self.ranks} ranks, {len(self.stages)} stages (units per "
                f"stage {','.join(map(str, self.balance))}), {self.microbatches} "
                f"micro-batches, {str(self.dtype).removeprefix('torch.')}; one step against "
                "one process")
        groups = _grid(("parameter group", "stages", "tensors", "params", "max rel diff",
                        "result"), [_cells(r, r.name) for r in self.rows])
        stages = _grid(("stage", "rank", "tensors", "params", "max rel diff", "result"),
                       [_cells(r, str(r.stages[0]), str(self.placement[r.stages[0]]))
                        for r in self.stages])
        return "\n".join([head, "", *groups, "", *stages, "", self.loss_line(), self.verdict()])

    def loss_line(self) -> str:
        return (f"loss {self.loss:.6g} pipelined, {self.reference_loss:.6g} on one process: "
                f"relative difference {_number(self.loss_difference)}")

    def verdict(self) -> str:
        tensors = sum(r.tensors for r in self.rows)
        numel = sum(r.numel for r in self.rows)
        if self.passed:
            return (f"PASS: the loss and all {tensors} gradients ({numel:,} parameters) are "
                    f"within {self.tolerance:g} of one process ({self.seconds:.1f} s)")
        return (f"FAIL: {len(self.failed)} of {len(self.rows)} parameter groups differ beyond "
                f"{self.tolerance:g} ({self.seconds:.1f} s)")

    def __str__(self) -> str:
        return self.table()


def verify(
    model: nn.Module | Sequence[nn.Module], example_inputs: Any, *, schedule: str = "zbv",
    ranks: int = 2, microbatches: int = 4, split_points: Sequence[str] | str | None = "auto",
    balance: Sequence[int] | str | None = None, stages_per_rank: int | None = None,
    recompute: Any = "never", loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
    targets: Any = None, tolerance: float | None = None, dtype: torch.dtype = torch.float64,
    seed: int = 0,
) -> Verification:
    """Step ``model`` once pipelined and once on one process; compare every gradient.

    Args:
        model: any ``nn.Module`` (cut by tracing, as ``Pipeline(split_points=...)`` cuts it),
            or with ``split_points=None`` an ``nn.Sequential`` or list of layers. It is copied
            (twice, converted to ``dtype``) and left as it is. A model on ``meta`` is
            materialised by name from ``seed``, as the pipeline materialises its stages.
        example_inputs: one batch, as ``forward`` takes it: a tensor, a tuple of positional
            arguments, or a dict of keyword arguments (floating tensors become ``dtype``). It
            is split into ``microbatches`` along dim 0.
        schedule, ranks, microbatches, split_points, balance, stages_per_rank, recompute:
            the :class:`~pipetrain.Pipeline`'s (``local_ranks=ranks``).
        loss_fn: ``loss_fn(outputs, targets)`` per micro-batch; default
            :func:`default_loss` (the output's ``.loss``, else the mean square of every
            floating-point tensor of the output).
        targets: the loss's second argument; default: zeros, one per sample.
        tolerance: the largest relative difference that passes (default:
            :func:`default_tolerance`: 1e-9 in float64).
        seed: the random state of both steps (dropout), and of a ``meta`` model's values.

    Raises:
        ValueError, TypeError, PartitionError: when the pipeline cannot be built, or the
            model fails on one process (the message says why).
        PipelineError: when the pipelined step fails where one process did not.
    """
    if schedule == "pipedream":
        raise ValueError("verify compares one step's gradients with one device's, and "
                         "'pipedream' applies them inside its step (an update after every "
                         "backward): verify 'pipedream-2bw' or a synchronous schedule; "
                         "PipeDream's rule is checked by pipetrain.testing.ReferenceStash")
    layers = not isinstance(model, nn.Module) or split_points is None
    module = nn.Sequential(*model) if not isinstance(model, nn.Module) else model
    inputs = example_inputs if layers else _as_forward_inputs(module, example_inputs)
    example = _cast(inputs if layers or isinstance(inputs, dict) else (inputs,), dtype)

    config = PipelineConfig(schedule, microbatches, loss_fn or default_loss, balance=balance,
                            stages_per_rank=stages_per_rank, local_ranks=ranks,
                            recompute=recompute, init_seed=seed,
                            split_points=None if layers else split_points,
                            example_inputs=example)  # its rules, checked before any copy

    def build(copied: nn.Module) -> Pipeline:
        return Pipeline.from_config(copied, config)

    return verify_with(build, module, inputs, targets, tolerance=tolerance, dtype=dtype,
                       seed=seed)


def verify_with(build: Build, model: nn.Module, inputs: Any, targets: Any = None, *,
                tolerance: float | None = None, dtype: torch.dtype = torch.float64,
                seed: int = 0) -> Verification:
    """:func:`verify` with the pipeline that ``build`` makes of a ``dtype`` copy of ``model``;
    ``inputs`` as its :meth:`~pipetrain.Pipeline.step` takes them, ``targets`` (default:
    zeros) for its ``loss_fn``, which the reference uses too.

    Raises:
        ValueError: when the model (or the loss) fails on one process, before any pipelining.
        PipelineError: when the pipelined step fails where one process did not.
    """
    start = time.perf_counter()
    pipe = build(_copy(model, dtype))
    loss_fn = pipe.loss_fn
    if loss_fn is None:
        raise ValueError("the pipeline to verify has no loss_fn: give it one")
    inputs = _cast(inputs, dtype)
    if targets is None:
        targets = torch.zeros(_batch_size(inputs, pipe.split_dim))
    targets = _cast(targets, dtype)
    reference = _reference(model, dtype, seed)
    want = _one_process(reference, pipe, loss_fn, inputs, targets, seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        result = pipe.step(inputs, targets)
        if pipe.asynchronous:  # PipeDream-2BW: its drain leaves the step's gradients
            pipe.drain()
    if result.loss is None:
        raise ValueError("the pipeline returned no loss")
    found = _compare(pipe, reference)
    by_stage = [(f"stage {s}", c) for c in found for s in c.stages]
    tolerance = default_tolerance(dtype) if tolerance is None else tolerance
    return Verification(
        _rows([(group_of(c.name), c) for c in found], tolerance),
        _rows(sorted(by_stage, key=lambda item: int(item[0].split()[1])), tolerance),
        float(result.loss.detach()), float(want.detach()), tolerance, pipe.schedule.name,
        pipe.schedule.n_ranks, pipe.schedule.n_microbatches, tuple(pipe.balance),
        tuple(pipe.schedule.placement), dtype, time.perf_counter() - start)


def default_tolerance(dtype: torch.dtype) -> float:
    """The relative difference that passes by default: 1e-9 in float64, 1e-5 in float32."""
    return {torch.float64: 1e-9, torch.float32: 1e-5}.get(dtype, 1e-2)


def _one_process(reference: nn.Module, pipe: Pipeline, loss_fn: Callable[[Any, Any], Any],
                 inputs: Any, targets: Any, seed: int) -> torch.Tensor:
    """The reference step, its gradients left in ``reference``; its failure as a ValueError."""
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return reference_step(reference, inputs, targets, loss_fn,
                                  pipe.schedule.n_microbatches, split_dim=pipe.split_dim,
                                  loss_reduction=pipe.loss_reduction, rng=pipe.rng,
                                  split=_splitter(pipe))
    except Exception as e:  # the model's own error, said to be so
        raise ValueError(f"{type(reference).__name__} fails on one process, before any "
                         f"pipelining: {type(e).__name__}: {e}") from e


def _splitter(pipe: Pipeline) -> Callable[[Any, int, int], list[Any]] | None:
    """How ``pipe`` puts a batch into micro-batches, where not by rows alone (an image-text
    model's images go with the rows that show them)."""
    traced = pipe.traced
    if traced is None or traced.prefix is None:
        return None

    def split(inputs: Any, m: int, dim: int) -> list[Any]:
        return [dict(x) for x in traced.split(traced.payload(inputs), m, dim)]
    return split


def default_loss(outputs: Any, targets: Any) -> torch.Tensor:
    """The output's ``.loss`` when it has one (a Hugging Face model given ``labels``), else
    the sum over every floating-point tensor of the output of its mean square.

    Raises:
        TypeError: when the output holds no floating-point tensor.
    """
    loss = getattr(outputs, "loss", None)
    if isinstance(loss, torch.Tensor):
        return loss
    leaves = [t for t in pytree.tree_leaves(outputs)
              if isinstance(t, torch.Tensor) and t.is_floating_point()]
    if not leaves:
        raise TypeError(f"the model's output ({type(outputs).__name__}) holds no floating-point "
                        "tensor to take a loss of; pass loss_fn=")
    return torch.stack([t.pow(2).mean() for t in leaves]).sum()


def group_of(name: str) -> str:
    """A parameter's group: its name with every layer index as ``*``
    (``model.layers.3.mlp.up_proj.weight`` -> ``model.layers.*.mlp.up_proj.weight``)."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1*", name)


# -------------------------------------------------------------------------- the copies


def _copy(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    copied = copy.deepcopy(model).to(dtype)
    copied.train()
    return copied


def _reference(model: nn.Module, dtype: torch.dtype, seed: int) -> nn.Module:
    """The unsplit copy; a ``meta`` model materialised by name as a pipeline's stages are."""
    reference = _copy(model, dtype)
    return NamedInit(reference, seed).materialize(reference) if is_meta(reference) else reference


def _as_forward_inputs(model: nn.Module, inputs: Any) -> Any:
    """A tensor, or a dict of keyword arguments: a tuple of positional ones is bound to
    ``forward``'s names (one process calls ``model(**inputs)``, the pipeline takes it too)."""
    if not isinstance(inputs, tuple):
        return inputs
    if len(inputs) == 1 and isinstance(inputs[0], torch.Tensor):
        return inputs[0]
    try:
        bound = inspect.signature(model.forward).bind(*inputs)
    except TypeError as e:
        raise TypeError(f"example_inputs: {len(inputs)} positional arguments do not fit "
                        f"{type(model).__name__}.forward ({e}); pass a dict of keyword "
                        "arguments") from None
    return dict(bound.arguments)


def _cast(value: Any, dtype: torch.dtype) -> Any:
    return pytree.tree_map(
        lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.is_floating_point() else t,
        value)


def _batch_size(inputs: Any, dim: int) -> int:
    from pipetrain.runtime.microbatch import batch_size

    return batch_size(inputs, dim)


# ------------------------------------------------------------------------- comparison


@dataclass(frozen=True)
class _Check:
    name: str
    stages: tuple[int, ...]
    numel: int
    difference: float
    note: str


def _compare(pipe: Pipeline, reference: nn.Module) -> list[_Check]:
    """Every parameter of the reference against the pipeline's, in the model's order."""
    held = dict(pipe.named_parameters())
    stages: dict[str, list[int]] = {}
    for s in sorted(pipe.stages):
        for name, _ in pipe.named_parameters(s):
            stages.setdefault(name, []).append(s)
    checks = []
    for name, q in reference.named_parameters():
        p = held.pop(name, None)
        if p is None:
            checks.append(_Check(name, (), q.numel(), math.inf, "missing from the pipeline"))
            continue
        difference, note = _difference(p.grad, q.grad)
        checks.append(_Check(name, tuple(stages.get(name, ())), q.numel(), difference, note))
    checks += [_Check(name, tuple(stages.get(name, ())), p.numel(), math.inf,
                      "not a parameter of the model") for name, p in held.items()]
    return checks


def _difference(got: torch.Tensor | None, want: torch.Tensor | None) -> tuple[float, str]:
    if got is None or want is None:
        if got is None and want is None:
            return 0.0, ""
        return math.inf, "no gradient in the " + ("pipeline" if got is None else "reference")
    if got.shape != want.shape:
        return math.inf, f"gradient shape {tuple(got.shape)}, not {tuple(want.shape)}"
    got = got.detach().to("cpu", torch.float64)
    want = want.detach().to("cpu", torch.float64)
    error = float((got - want).abs().max()) if got.numel() else 0.0
    if not math.isfinite(error):
        return math.inf, "not finite"
    return _relative(error, float(want.abs().max()) if want.numel() else 0.0), ""


def _relative(error: float, scale: float) -> float:
    if error == 0.0:
        return 0.0
    return error / scale if scale > 0 else math.inf


def _rows(keyed: Iterable[tuple[str, _Check]], tolerance: float) -> tuple[Row, ...]:
    """One row per key, in the order the keys first come."""
    grouped: dict[str, list[_Check]] = {}
    for key, c in keyed:
        grouped.setdefault(key, []).append(c)
    return tuple(_row(key, checks, tolerance) for key, checks in grouped.items())


def _row(name: str, checks: list[_Check], tolerance: float) -> Row:
    worst = max(checks, key=lambda c: c.difference)
    stages = tuple(sorted({s for c in checks for s in c.stages}))
    if name.startswith("stage "):
        stages = (int(name.split()[1]),)
    return Row(name, stages, len(checks), sum(c.numel for c in checks), worst.difference,
               worst.name, worst.note, passed=worst.difference <= tolerance)


# ---------------------------------------------------------------------------- output


def _number(x: float) -> str:
    return "0" if x == 0 else "inf" if math.isinf(x) else f"{x:.1e}"


def _span(stages: tuple[int, ...]) -> str:
    if not stages:
        return "-"
    if list(stages) == list(range(stages[0], stages[-1] + 1)) and len(stages) > 2:
        return f"{stages[0]}-{stages[-1]}"
    return ",".join(map(str, stages))


def _cells(row: Row, *first: str) -> list[str]:
    why = [row.note] if row.note else []
    why += [f"worst {row.worst}"] if row.tensors > 1 else []
    verdict = "pass" if row.passed else "FAIL" + (f" ({'; '.join(why)})" if why else "")
    middle = [] if row.name.startswith("stage ") else [_span(row.stages)]
    return [*first, *middle, str(row.tensors), f"{row.numel:,}", _number(row.difference),
            verdict]


def _grid(header: tuple[str, ...], rows: list[list[str]]) -> list[str]:
    widths = [max(len(r[i]) for r in (list(header), *rows)) for i in range(len(header))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip()
            for r in (list(header), *rows)]
