"""Pipeline: the user-facing object that trains a layer list under any schedule.

    pipe = Pipeline(model, schedule="zbv", microbatches=8, loss_fn=loss_fn)
    result = pipe.step(inputs, targets)      # the same call on every rank
    result.loss                               # the batch loss, on every rank

Inside an initialised ``torch.distributed`` job each process hosts one rank of the pipeline
group; with ``local_ranks=N`` one process hosts all N ranks (debugging, tests, one device) and
runs exactly the same action lists.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.engine import Engine
from pipetrain.parallel.parallelize import Gathering, held_parameter, join, parallelize_stages
from pipetrain.pipeline_args import (
    asynchronous_fits,
    auto_balance,
    carries_rng,
    device_of,
    pipeline_ranks,
    resolve_schedule,
)
from pipetrain.pipeline_config import PipelineConfig
from pipetrain.result import StepResult
from pipetrain.runtime.async_steps import AsyncSteps
from pipetrain.runtime.compiled import compile_stages
from pipetrain.runtime.executor import (
    Executor,
    GradsReady,
    TokenFeedback,
    grad_links,
)
from pipetrain.runtime.failure.watchdog import Watchdog
from pipetrain.runtime.recompute import Policy, layer_flags
from pipetrain.runtime.stage import Stage
from pipetrain.runtime.tied import LocalCopies, TiedGrads, find_tied
from pipetrain.runtime.transport.comm import P2P
from pipetrain.runtime.transport.routes import linear_routes
from pipetrain.schedules.action import Action
from pipetrain.schedules.schedule import Schedule
from pipetrain.split.balance import BalancePlan
from pipetrain.split.capture import on_model_device
from pipetrain.split.eval_graph import depends_on_mode, eval_split, eval_stages
from pipetrain.split.layers import Layers, packed, trace_stages
from pipetrain.split.lazy import LayerSpec
from pipetrain.split.partition import check_balance, even_balance, stage_bounds
from pipetrain.split.trace import TracedSplit
from pipetrain.step_kinds import DecodeStep, EvalStep, StepHooks, StepKind, TrainStep, WindowStep
from pipetrain.stepper import Feed, Stepper

__all__ = ["Pipeline", "StepResult"]

_MOVED_TO_ENGINE = {"transport": "transport", "executor": "executor", "watchdog": "watchdog",
                    "evaluator": "evaluator", "windows": "async_steps"}
"""The engine's parts that were a pipeline's attributes until 0.1.0 (``pipe.windows``: its
``async_steps``); the old names work, with a DeprecationWarning, for one more release."""


def _moved(name: str) -> Any:
    """The deprecated ``Pipeline.<name>``: the engine's part."""
    part = _MOVED_TO_ENGINE[name]

    def get(self: Pipeline) -> Any:
        warnings.warn(f"Pipeline.{name} is Pipeline.engine.{part} now (a caller needs "
                      "Pipeline.asynchronous, Pipeline.running() or StepResult.gave_grads); "
                      "the old name goes in the next release", DeprecationWarning, stacklevel=2)
        return getattr(self.engine, part)

    return property(get, doc=f"Deprecated: ``engine.{part}``.")


class Pipeline:
    """Train ``model`` (an ``nn.Sequential`` or a list of layers) with a pipeline schedule.

    Args:
        model: the full model, or a list of layers that may be :class:`LayerSpec` or live on
            the ``meta`` device; this rank keeps (and builds) only its stages' layers. With
            ``split_points`` the model may be built on ``meta`` too (:mod:`pipetrain.split.layers`).
        the others: the fields of :class:`~pipetrain.pipeline_config.PipelineConfig`, each
            documented there; the pipeline builds one of them (:attr:`config`), and
            :meth:`from_config` takes one.

    Raises:
        ValueError, TypeError: for settings that do not go together (the config's rules),
            an unknown schedule or integers outside its constraints.
        PartitionError: when the layers do not fit the stages.
    """

    def __init__(
        self, model: nn.Module | Sequence[nn.Module | LayerSpec], schedule: str | Schedule = "1f1b",
        microbatches: int | None = None, loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        *, balance: Sequence[int] | str | Callable[..., float] | None = None,
        stages_per_rank: int | None = None,
        group: dist.ProcessGroup | None = None, local_ranks: int | None = None,
        device: torch.device | str | None = None, split_dim: int = 0,
        loss_reduction: str = "mean", timeout: float = 60.0, max_message_bytes: int = 1 << 36,
        recompute: Policy = "never", init_seed: int = 0,
        split_points: Sequence[str] | str | None = None, example_inputs: Any = None,
        dynamic: bool = True, parallelize: Callable[[int, list[nn.Module]], None] | None = None,
        rng: bool | None = None, compile: bool | str = False,
        optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer] | None = None,
    ) -> None:
        self._build(model, PipelineConfig(
            schedule, microbatches, loss_fn, balance, stages_per_rank, group, local_ranks,
            device, split_dim, loss_reduction, timeout, max_message_bytes, recompute,
            init_seed, split_points, example_inputs, dynamic, parallelize, rng, compile,
            optimizer))

    @classmethod
    def from_config(cls, model: nn.Module | Sequence[nn.Module | LayerSpec],
                    config: PipelineConfig) -> Pipeline:
        """The pipeline of ``model`` that ``config`` describes (what the constructor makes of
        its arguments)."""
        pipe = cls.__new__(cls)
        pipe._build(model, config)
        return pipe

    def _build(self, model: nn.Module | Sequence[nn.Module | LayerSpec], c: PipelineConfig
               ) -> None:
        self.config = c
        """The settings this pipeline was built with (frozen, checked)."""
        self.loss_fn, self.split_dim, self.loss_reduction = c.loss_fn, c.split_dim, \
            c.loss_reduction
        self.local = c.local_ranks is not None
        n_ranks, self.rank = pipeline_ranks(c.group, c.local_ranks)
        self.schedule = resolve_schedule(c.schedule, n_ranks, c.microbatches, c.stages_per_rank)
        self.device = device_of(c.device, c.group)
        example_inputs = c.example_inputs
        if isinstance(model, nn.Module) and example_inputs is not None:
            example_inputs = on_model_device(model, example_inputs)  # captured, profiled there
        self._share = None if self.local else c.group or dist.group.WORLD  # one export for all
        source = self._capture(model, c.split_points, example_inputs, c.balance, c.dynamic,
                               c.parallelize, c.init_seed, c.rng, c.example_inputs)
        balance = "params" if c.split_points == "auto" and c.balance is None else c.balance
        self._lay_out(source.items, balance, example_inputs, c.group, n_ranks)
        untied, gathering = self._place(source, c.recompute, c.parallelize, c.compile)
        self._connect(c, n_ranks, untied, gathering)
        self._closer = weakref.finalize(self, self.engine.stepper.close)

    def _capture(self, model: nn.Module | Sequence[nn.Module | LayerSpec],
                 split_points: Sequence[str] | str | None, example_inputs: Any,
                 balance: Any, dynamic: bool, parallelize: Any, init_seed: int,
                 rng: bool | None, given: Any) -> Layers:
        """The model as layers: a layer list as given, or any module cut by tracing (one
        export for the group; ``parallelize=`` works on the stages, after the capture;
        ``given``: ``example_inputs`` as the user gave them)."""
        self.traced: TracedSplit | None = None if split_points is None else trace_stages(
            model, split_points, example_inputs, balance, self.schedule.n_stages, self._share,
            dynamic, init_seed, given)
        self._modal: tuple[nn.Module, Any, TracedSplit] | None = None  # eval graph: when used
        if isinstance(model, nn.Module) and self.traced is not None and parallelize is None \
                and depends_on_mode(model, self.traced):
            self._modal = (model, example_inputs, self.traced)
        source = Layers(model, self.traced, init_seed)
        self.rng = carries_rng(rng, self.traced, source.items)
        return source

    def _lay_out(self, layers: list[tuple[str, nn.Module | LayerSpec]], balance: Any,
                 example_inputs: Any, group: dist.ProcessGroup | None, n_ranks: int) -> None:
        """Layers per stage (given, even, or measured), the routes between stages, and which
        ranks this process hosts."""
        n_stages = self.schedule.n_stages
        self.balance_plan: BalancePlan | None = None
        if isinstance(balance, str) or callable(balance):
            sample = example_inputs if self.traced is None else packed(self.traced,
                                                                       example_inputs)
            self.balance_plan = auto_balance(layers, balance, sample, self.schedule,
                                             self.local, self.rank, group)
            sizes = self.balance_plan.balance
        else:
            sizes = (even_balance(len(layers), n_stages) if balance is None
                     else check_balance(balance, len(layers), n_stages))
        self.balance = sizes
        self.routes = linear_routes(n_stages) if self.traced is None else self.traced.routes(sizes)
        self.hosted = list(range(n_ranks)) if self.local else [self.rank]

    def _place(self, source: Layers, recompute: Policy, parallelize: Any, compile: bool | str
               ) -> tuple[dict[str, Any], Any]:
        """This rank's stages built (the others' layers released), tied weights found,
        ``parallelize=`` and ``compile=`` applied; (the ties it untied, its gathering)."""
        layers = source.items
        self._stage_layers: dict[int, list[tuple[str, nn.Module]]] = {}
        self.stages: dict[int, Stage] = {}
        # ties and names follow Parameter identity, which materialising replaces: read them first
        self.tied = find_tied([[(n, m) for n, m in layers[lo:hi] if isinstance(m, nn.Module)]
                               for lo, hi in stage_bounds(self.balance)], self.schedule.placement,
                               source.names(layers))
        self._build_stages(layers, layer_flags(recompute, self.balance), source)
        hosted = {id(p) for _, m in self._hosted_layers() for p in m.parameters()}
        self._canonical = {i: n for i, n in source.names(layers).items() if i in hosted}
        self._buffer_names, self._source = source.buffer_names(self._hosted_layers()), source
        source.release()  # the other ranks' layers: each rank holds its own stages only
        gathering = parallelize if isinstance(parallelize, Gathering) else None
        untied = {} if parallelize is None else parallelize_stages(
            parallelize, self._stage_layers, self.tied, self._canonical)
        for stage in self.stages.values():
            stage.gathering = gathering
        compile_stages(self.stages, compile, recompute, parallelize,
                       self.schedule.split_backward, self.rng)
        self._copies = LocalCopies(untied, gathering.gathered if gathering else lambda p: p)
        return untied, gathering

    def _connect(self, c: PipelineConfig, n_ranks: int, untied: dict[str, Any],
                 gathering: Any) -> None:
        """The engine: the transport to the other ranks, tied weights' gradient exchange, the
        executor (an asynchronous schedule's windows), the watchdog and the stepper."""
        transport = None if self.local else P2P(c.group, self.rank, n_ranks, self.device,
                                                c.timeout, c.max_message_bytes)
        held = held_parameter(self._stage_layers, self._canonical, gathering)
        tied_grads = None if transport is None else TiedGrads(
            self.tied, self.rank, c.group, held, transport.spare_tag, c.timeout)
        linked, deferred = grad_links(self.tied, self.local)
        deferred |= {s for t in self.tied if t.name in untied for s in t.stages}  # merged last
        steps: AsyncSteps | None = None
        if self.schedule.update is not None:
            asynchronous_fits(self.schedule, self.tied)
            optimizers = None if c.optimizer is None else {
                s: c.optimizer(st.parameters()) for s, st in self.stages.items()}
            steps = AsyncSteps(self.schedule, self.stages, self.hosted, transport, linked,
                               self.routes, optimizers)
        executor = steps.steady if steps else Executor(
            self.schedule, self.stages, self.hosted, transport, linked, deferred,
            routes=self.routes)
        watchdog = None if transport is None else Watchdog.of(transport, executor.activity)
        m = self.schedule.n_microbatches
        stepper = Stepper(
            Feed(self.rank, self.schedule, self.traced, self.rng, self.device, c.loss_fn,
                 c.split_dim, c.loss_reduction),
            self.stages, executor, transport, watchdog, self._copies, tied_grads,
            carry=None if steps is None else lambda: (steps.previous, m),
            on_failure=None if steps is None else steps.versions.restore)
        self.engine = Engine(transport, executor, watchdog, steps, stepper)
        """What runs this pipeline's steps on this rank (:mod:`pipetrain.engine`): for tools
        and tests that look inside; its parts may change between releases."""

    transport = _moved("transport")
    executor = _moved("executor")
    watchdog = _moved("watchdog")
    evaluator = _moved("evaluator")
    windows = _moved("windows")

    @property
    def asynchronous(self) -> bool:
        """Whether the schedule never flushes (``pipedream-2bw``, ``pipedream``): a step's
        gradients are the step before's (:attr:`StepResult.gave_grads`), its loss comes a step
        late on most ranks (:attr:`StepResult.previous_loss`), and :meth:`drain` ends a run."""
        return self.engine.async_steps is not None

    def running(self) -> Action | None:
        """The action this process runs now (None between actions): for a hook that counts
        what runs in forwards only, say, and not in a recomputation before a backward."""
        executor = self.engine.stepper.running  # the step's: an eval, decoding or fill one too
        current = None if executor is None else executor.current
        return None if current is None else current[1]

    def close(self) -> None:
        """End what this pipeline started on this rank: its watchdog thread, its connections
        and groups (the last sends complete first, bounded by the timeout), the activations
        its stages hold. Also at the end of ``with Pipeline(...) as pipe:``, and when the last
        reference to the pipeline goes. Parameters stay usable; a later step raises
        :class:`~pipetrain.errors.PipelineError`."""
        self._closer()

    def __enter__(self) -> Pipeline:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def _draws_in_eval(self) -> bool:
        """Whether ``eval_step``'s stages carry random streams: not those of a traced model's
        eval graph (it draws nothing); a layer list's do (in eval mode they draw nothing)."""
        return self.engine.evaluator is None and self._modal is None

    def _evaluating(self) -> Executor | None:
        """The eval graph's executor, captured now if this is the first eval step (the model
        is kept until then, and let go after): its stages on this rank's tensors."""
        if self._modal is not None:
            model, example_inputs, traced = self._modal
            split = eval_split(model, traced, example_inputs, self._share,
                               traced.captured.dynamic)
            stages = eval_stages(split, self.balance, self.stages, self._stage_layers,
                                 self.device, self.loss_fn, self.split_dim)
            self.engine.evaluator = Executor(self.schedule, stages, self.hosted,
                                             self.engine.transport,
                                             routes=split.routes(self.balance))
            # the activity the watchdog reads
            self.engine.evaluator.activity = self.engine.executor.activity
            self._modal = None
        return self.engine.evaluator

    def _build_stages(self, layers: list[tuple[str, nn.Module | LayerSpec]],
                      replay: Sequence[bool], source: Layers) -> None:
        """Build (or materialise) the layers of hosted stages; others stay as they are."""
        last = self.schedule.n_stages - 1
        for s, (lo, hi) in enumerate(stage_bounds(self.balance)):
            if self.schedule.rank_of(s) not in self.hosted:
                continue
            chunk = [(name, source.build(layer, i, self.device))
                     for i, (name, layer) in enumerate(layers[lo:hi], start=lo)]
            layers[lo:hi] = chunk
            self._stage_layers[s] = chunk
            self.stages[s] = Stage(s, [m for _, m in chunk], is_last=s == last,
                                   loss_fn=self.loss_fn, device=self.device,
                                   recompute=replay[lo:hi], split_dim=self.split_dim,
                                   ports=self.routes.ports[s] if self.routes.keyed else None,
                                   carry_rng=self.rng)

    # -- parameters ----------------------------------------------------------------------
    def named_parameters(self, stage: int | None = None) -> Iterator[tuple[str, nn.Parameter]]:
        """This rank's parameters under their names in the original model (``"3.weight"``);
        only those of ``stage`` when it is given (a weight tied between two stages is in both)."""
        seen: set[int] = self._copies.skipped()  # a tied weight's copies: its first only
        for s in sorted(self._stage_layers) if stage is None else [stage]:
            for name, layer in self._stage_layers.get(s, []):
                for pname, p in layer.named_parameters():
                    if id(p) not in seen:
                        seen.add(id(p))
                        yield self._canonical.get(id(p), join(name, pname)), p

    def named_buffers(self, stage: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
        """This rank's buffers under their names in the original model (BatchNorm's running
        statistics, rotary tables); only those of ``stage`` when it is given."""
        seen: set[int] = set()
        for s in sorted(self._stage_layers) if stage is None else [stage]:
            for _, layer in self._stage_layers.get(s, []):
                for b in layer.buffers():
                    if id(b) not in seen and id(b) in self._buffer_names:
                        seen.add(id(b))
                        yield self._buffer_names[id(b)], b

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's part of ``model.state_dict()``, under the model's own keys: its
        parameters and persistent buffers (detached, not copies)."""
        state = {name: p.detach() for name, p in self.named_parameters()}
        state.update({name: b.detach() for name, b in self.named_buffers()
                      if self._source.is_persistent(name)})
        return state

    def _hosted_layers(self) -> list[tuple[str, nn.Module]]:
        return [layer for s in sorted(self._stage_layers) for layer in self._stage_layers[s]]

    def pack(self, *args: Any, **kwargs: Any) -> Any:
        """The inputs of a traced model's ``forward`` as the payload ``step`` takes."""
        if self.traced is None:
            raise ValueError("pack() is for pipelines built with split_points=; pass the input "
                             "of the first layer to step() directly")
        return self.traced.pack(*args, **kwargs)

    def parameters(self) -> Iterator[nn.Parameter]:
        for _, p in self.named_parameters():
            yield p

    # -- steps ---------------------------------------------------------------------------
    def step(self, inputs: Any = None, targets: Any = None, *, return_outputs: bool = False,
             on_grads_ready: GradsReady | None = None, step: int | None = None) -> StepResult:
        """One training step: forward and backward of every micro-batch as scheduled.

        Gradients accumulate into ``.grad`` exactly as running the micro-batches one after
        another through the whole model would. ``inputs`` is needed on the rank holding
        stage 0, ``targets`` on the rank holding the last stage; others may pass None.

        ``on_grads_ready(stage)`` is called once per stage this process holds, as soon as that
        stage's gradients are final for the step: right after the last action that writes
        them (its last W, or last B where the backward is not split), or at the end of the
        step for a stage with a weight tied to another rank. While the schedule's cool-down
        goes on, a data-parallel all-reduce of that stage's gradients can already start::

            pipe.step(x, y, on_grads_ready=lambda s: reduce(pipe.named_parameters(s)))

        Under ``pipedream-2bw`` it is called at the end of the step, for the gradients of the
        step before; under ``pipedream``, after each backward of the stage, for that
        micro-batch's gradient in ``.grad``, before the stage's optimizer steps (m calls per
        stage and step: the same hook averages PipeDream's updates across replicas).
        A hook that raises fails the step like a stage error.

        ``step`` is the caller's number for this step (a training loop's, which goes on
        after a resume), the same on every rank: errors name it, and so do the step's
        messages on the wire, where a rank that ran another step is caught. Default: the
        count of this pipeline's earlier steps and eval steps.
        """
        return self.engine.stepper.run(self._training(), inputs, targets,
                                 StepHooks(on_grads_ready, return_outputs), step)

    def drain(self, *, on_grads_ready: GradsReady | None = None,
              step: int | None = None) -> StepResult:
        """An asynchronous schedule (``pipedream-2bw``): finish the micro-batches the last
        step left in flight, without starting new ones. Their gradients, taken on the weights
        their forwards used, are then in ``.grad`` for a last ``optimizer.step()``; the next
        :meth:`step` fills the pipeline again. Its result has no loss.

        Raises:
            ValueError: for a synchronous schedule, or when no micro-batch is in flight.
        """
        if self.engine.async_steps is None or not self.engine.async_steps.in_flight:
            raise ValueError(f"[rank {self.rank}] drain() finishes the micro-batches an "
                             "asynchronous schedule's step left in flight; "
                             + ("none are" if self.engine.async_steps else
                                f"{self.schedule.name!r} flushes every step"))
        assert self.engine.async_steps is not None  # checked above
        return self.engine.stepper.run(WindowStep(self.engine.async_steps, drain=True), None,
                                       None, StepHooks(on_grads_ready), step)

    def in_flight_state(self) -> dict[str, Any]:
        """``pipedream-2bw`` between steps: what an exact resume needs beside
        :meth:`state_dict` and the optimizer's: the older weight version, on which the last
        step's micro-batches in flight run, with the step counters (save it with them).

        Raises:
            ValueError: under another schedule, or with nothing in flight.
        """
        if self.engine.async_steps is None:
            raise ValueError(f"in_flight_state() is for pipedream-2bw; {self.schedule.name!r} "
                             "keeps nothing in flight between steps")
        return self.engine.async_steps.state({id(p): n for n, p in self.named_parameters()})

    def refill(self, inputs: Any, targets: Any, state: dict[str, Any], *,
               step: int | None = None) -> StepResult:
        """Resume ``pipedream-2bw`` exactly where :meth:`in_flight_state` was saved: with
        ``state_dict()`` and the optimizer loaded, run the saved step's micro-batches
        (``inputs``, ``targets``: the same batch) forward again on the saved version, and its
        first backwards, as that step did; the next :meth:`step` then goes on bitwise as the
        uninterrupted run. Its loss is the saved step's again.

        Raises:
            ValueError: under another schedule, with micro-batches in flight, or for a state
                of other stages.
        """
        if self.engine.async_steps is None:
            raise ValueError(f"refill() is for pipedream-2bw, not {self.schedule.name!r}")
        self.engine.async_steps.restore(state, dict(self.named_parameters()))
        return self.engine.stepper.run(self._training(), inputs, targets, StepHooks(), step)

    def eval_step(self, inputs: Any = None, targets: Any = None, *,
                  step: int | None = None) -> StepResult:
        """Forward only, without autograd: the loss (if targets are given) and the outputs.

        It runs what ``model.eval()`` runs: a layer list in eval mode while it lasts; a model
        captured in training mode whose graph draws (dropout) or normalises by the batch, its
        eval graph (``engine.evaluator``, :mod:`pipetrain.split.eval_graph`), captured by the first
        eval step (the pipeline keeps a reference to the model until then), except under
        ``parallelize=``, where the stages it wraps are the training graph's. ``step`` as in
        :meth:`step` (several eval steps may share one number).
        """
        with torch.no_grad():
            return self.engine.stepper.run(self._evaluation(), inputs, targets,
                                     StepHooks(keep_outputs=True), step)

    def decode(self, schedule: Schedule, inputs: Sequence[Any], loop: TokenFeedback, *,
               step: int | None = None) -> StepResult:
        """Run a decoding schedule (:mod:`pipetrain.schedules.generators.decode`): forward
        only, the last stage's tokens fed back to stage 0 through ``loop``.

        ``inputs[mb]`` is stage 0's input of every micro-batch not fed back (prefill slices);
        the rest come from ``loop.feed``. :class:`pipetrain.generation.Generator` drives it.

        Raises:
            ValueError: for a schedule without feedback or placed otherwise than this one.
        """
        if schedule.feedback is None or schedule.placement != self.schedule.placement:
            raise ValueError(f"decode() runs a decoding schedule placed like the pipeline's "
                             f"({self.schedule.placement}); got {schedule.name!r} placed "
                             f"{schedule.placement} with feedback {schedule.feedback}")
        with torch.no_grad():
            kind = DecodeStep(self._decoding(schedule), loop, self._modal_layers())
            return self.engine.stepper.run(kind, list(inputs), None, StepHooks(), step)

    def _training(self) -> StepKind:
        """A training step's kind: an asynchronous schedule's window, in the phase it is in."""
        steps = self.engine.async_steps
        return TrainStep(self.engine.executor) if steps is None else WindowStep(steps,
                                                                               drain=False)

    def _evaluation(self) -> StepKind:
        """An eval step's kind: on the eval graph where the model has one (captured now if
        this is the first eval step), with a layer list in eval mode while it runs."""
        evaluator = self._evaluating()
        return EvalStep(self.engine.executor if evaluator is None else evaluator,
                        None if evaluator is None else "eval", self._modal_layers(),
                        self._draws_in_eval)

    def _modal_layers(self) -> list[nn.Module]:
        """What a forward-only step puts in eval mode: a layer list's layers (a traced
        model's graph has its mode captured)."""
        return [] if self.traced is not None else [m for _, m in self._hosted_layers()]

    def _decoding(self, schedule: Schedule) -> Executor:
        """The executor of a decoding ``schedule``, kept for the next call with the same."""
        engine = self.engine
        if engine.decoder is None or engine.decoder.schedule != schedule:
            engine.decoder = Executor(schedule, self.stages, self.hosted, engine.transport,
                                      routes=self.routes)
            if engine.watchdog is not None:
                engine.decoder.activity = engine.executor.activity  # what the watchdog reads
        return engine.decoder
