"""Testing: the single-device reference a pipeline must match, and the comparison of gradients.

(And :func:`train_tokenizer`, the small tokenizer tests and benchmarks save beside a tiny
Hugging Face model.)

The reference runs the same micro-batches one after another through the unsplit model, each
loss weighted as the pipeline weights it, so on fp32 CPU the pipeline's loss and every
parameter's gradient must be *bitwise* equal to it. Inside a ``torch.distributed`` job the
comparison also gathers which parameters each rank of the pipeline holds, so that a stage no
rank holds fails it too.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Collection, Iterable, Sequence
from contextlib import nullcontext
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from pipetrain.pipeline import Pipeline
from pipetrain.runtime import microbatch
from pipetrain.runtime import rng as streams

__all__ = ["reference_step", "Reference2BW", "ReferenceStash", "grad_mismatches",
           "reload_mismatches", "train_tokenizer"]


def reference_step(
    model: nn.Module, inputs: Any, targets: Any, loss_fn: Callable[[Any, Any], torch.Tensor],
    microbatches: int, *, split_dim: int = 0, loss_reduction: str = "mean",
    rng: bool = False, device: torch.device | str = "cpu",
    split: Callable[[Any, int, int], list[Any]] | None = None,
) -> torch.Tensor:
    """Accumulate ``model``'s gradients over the micro-batches in order; return the batch loss.

    ``inputs`` is the model's one argument, or a dict of keyword arguments (what
    ``Pipeline.pack`` makes, or a dict a captured model is stepped with). With ``rng`` (a
    pipeline whose ``rng`` is True), each micro-batch runs on its own random stream, started
    as the pipeline starts it on stage 0's rank (:mod:`pipetrain.runtime.rng`), and ``device``'s
    generator is put back after it. ``split``: how the inputs go into micro-batches (default
    by rows, :func:`pipetrain.runtime.microbatch.split`; a pipeline of an image-text model
    gives each micro-batch the images its rows show).
    """
    xs = (split or microbatch.split)(inputs, microbatches, split_dim)
    ys = microbatch.split(targets, microbatches, split_dim)
    total_size = microbatch.batch_size(targets, split_dim)
    sizes = microbatch.sizes(total_size, microbatches)
    dev = torch.device(device)
    base = streams.draw_base() if rng else 0
    total: torch.Tensor | None = None
    for i, (x, y, n) in enumerate(zip(xs, ys, sizes)):
        weight = n / total_size if loss_reduction == "mean" else 1.0
        with streams.stream(dev, streams.start(base, i, dev), []) if rng else nullcontext():
            out = model(**x) if _keywords(model, x) else model(x)
            loss = loss_fn(out, y) * weight
            loss.backward()  # type: ignore[no-untyped-call]
        total = loss.detach() if total is None else total + loss.detach()
    if total is None:
        raise ValueError("no micro-batches")
    return total


class Reference2BW:
    """PipeDream-2BW's update rule on one process: W(t+1) = W(t) - lr * grad f(W(t-1)).

    Step ``t`` returns batch ``t``'s loss on ``model``'s weights of the moment, W(t), and
    leaves in ``.grad`` the gradient of batch ``t - 1`` on the weights it was run with,
    W(t-1) (None at ``t = 0``): what ``Pipeline.step`` under ``pipedream-2bw`` returns and
    leaves. :meth:`drain` leaves the last batch's. The caller's optimizer step between two
    calls makes W(t+1). Each gradient is :func:`reference_step`'s (the micro-batches one
    after another, weighted as the pipeline weights them), on fp32 CPU bitwise the
    pipeline's.
    """

    def __init__(self, model: nn.Module, loss_fn: Callable[[Any, Any], torch.Tensor],
                 microbatches: int, **kwargs: Any) -> None:
        self.model, self.loss_fn, self.m, self.kwargs = model, loss_fn, microbatches, kwargs
        self._pending: tuple[dict[str, torch.Tensor], Any, Any] | None = None

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        now = self._weights()
        grads = self._finish_pending()
        self._load(now)
        self.model.zero_grad(set_to_none=True)
        loss = reference_step(self.model, inputs, targets, self.loss_fn, self.m, **self.kwargs)
        self._set_grads(grads)  # its own gradients wait for the next step, as the pipeline's
        self._pending = (now, inputs, targets)
        return loss

    def drain(self) -> None:
        now = self._weights()
        grads = self._finish_pending()
        self._load(now)
        self._set_grads(grads)

    def _finish_pending(self) -> dict[str, torch.Tensor | None] | None:
        if self._pending is None:
            return None
        weights, inputs, targets = self._pending
        self._pending = None
        self._load(weights)
        self.model.zero_grad(set_to_none=True)
        reference_step(self.model, inputs, targets, self.loss_fn, self.m, **self.kwargs)
        grads = {n: p.grad for n, p in self.model.named_parameters()}
        self.model.zero_grad(set_to_none=True)  # the next backward makes new tensors
        return grads

    def _weights(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.model.named_parameters()}

    def _load(self, weights: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for n, p in self.model.named_parameters():
                p.copy_(weights[n])

    def _set_grads(self, grads: dict[str, torch.Tensor | None] | None) -> None:
        for n, p in self.model.named_parameters():
            p.grad = None if grads is None else grads[n]


class ReferenceStash:
    """PipeDream's weight stashing on one process, micro-batch by micro-batch.

    ``stages`` are the pipeline's stages as modules (one per rank, in order). Stage ``s``
    updates after every backward with that micro-batch's gradient, taken on the version its
    forward used, applied to its newest version (``optimizer``, one per stage). With ``d =
    len(stages) - 1 - s`` micro-batches in flight above it, micro-batch ``n`` runs on stage
    ``s``'s version ``max(0, n - d)``: the one made by the updates of micro-batches ``0 .. n -
    d - 1`` (counted from the last drain, after which the pipeline fills again). Each
    micro-batch runs forward and backward through the stages at those versions
    (:func:`torch.func.functional_call`); :meth:`step` returns the batch's loss as
    :func:`reference_step` weights it, and :meth:`drain` applies the updates still owed, so
    the stages then hold what ``Pipeline(..., "pipedream", optimizer=...)`` holds after its
    own ``drain()``.

    ``replicas`` > 1: data parallelism. The batch is cut into that many equal parts along
    dimension 0 (replica ``r`` takes the ``r``-th), each replica's micro-batch ``n`` runs on
    the same versions, and each update applies their gradients' mean (summed in replica
    order, then divided), as an all-reduce in ``on_grads_ready`` does; :meth:`step` returns
    the mean of the replicas' losses.
    """

    def __init__(self, stages: Sequence[nn.Module], loss_fn: Callable[[Any, Any], torch.Tensor],
                 microbatches: int,
                 optimizer: Callable[[list[nn.Parameter]], torch.optim.Optimizer],
                 replicas: int = 1) -> None:
        self.stages, self.loss_fn, self.m = list(stages), loss_fn, microbatches
        self.replicas = replicas
        self.optimizers = [optimizer(list(s.parameters())) for s in self.stages]
        self.versions: list[list[dict[str, torch.Tensor]]] = [[_state(s)] for s in self.stages]
        self.grads: list[list[dict[str, torch.Tensor | None]]] = [[] for _ in self.stages]
        self.count = 0  # micro-batches run
        self.start = 0  # the first micro-batch after the last drain (which filled again)

    def step(self, inputs: Any, targets: Any) -> torch.Tensor:
        parts = zip(microbatch.split(inputs, self.replicas, 0),
                    microbatch.split(targets, self.replicas, 0))
        runs = [self._weighted(x, y) for x, y in parts]
        totals: list[torch.Tensor] = []
        for n in range(self.m):
            per_replica = [self._microbatch(*run[n]) for run in runs]
            for s in range(len(self.stages)):
                self.grads[s].append(_mean([grads[s] for grads, _ in per_replica]))
            losses = [loss for _, loss in per_replica]
            totals = losses if not totals else [t + x for t, x in zip(totals, losses)]
            self.count += 1
        if not totals:
            raise ValueError("no micro-batches")
        return totals[0] if len(totals) == 1 else sum(totals[1:], totals[0]) / len(totals)

    def _weighted(self, inputs: Any, targets: Any) -> list[tuple[Any, Any, float]]:
        """A replica's micro-batches, each with the weight of its loss."""
        xs, ys = microbatch.split(inputs, self.m, 0), microbatch.split(targets, self.m, 0)
        total_size = microbatch.batch_size(targets, 0)
        sizes = microbatch.sizes(total_size, self.m)
        return [(x, y, n / total_size) for x, y, n in zip(xs, ys, sizes)]

    def _microbatch(self, x: Any, y: Any, weight: float
                    ) -> tuple[list[dict[str, torch.Tensor | None]], torch.Tensor]:
        """Forward and backward of one micro-batch on each stage's version for it: the
        gradients per stage, and the weighted loss."""
        leaves = []
        last = len(self.stages) - 1
        for s in range(len(self.stages)):
            version = self.start + max(0, self.count - self.start - (last - s))
            self._make(s, version)
            leaves.append({k: v.clone().requires_grad_(True)
                           for k, v in self.versions[s][version].items()})
            x = torch.func.functional_call(self.stages[s], leaves[s], (x,))
        loss = self.loss_fn(x, y) * weight
        loss.backward()  # type: ignore[no-untyped-call]
        return [{k: v.grad for k, v in own.items()} for own in leaves], loss.detach()

    def drain(self) -> None:
        for s in range(len(self.stages)):
            self._make(s, self.count)
        self.start = self.count  # the next micro-batches fill the pipeline again

    def _make(self, stage: int, version: int) -> None:
        """Apply stage ``stage``'s updates in order until ``version`` exists."""
        module, made = self.stages[stage], self.versions[stage]
        while len(made) <= version:
            k = len(made) - 1
            with torch.no_grad():
                for name, p in module.named_parameters():
                    p.copy_(made[k][name])
            for name, p in module.named_parameters():
                p.grad = self.grads[stage][k][name]
            self.optimizers[stage].step()
            self.optimizers[stage].zero_grad(set_to_none=True)
            made.append(_state(module))


def _mean(grads: list[dict[str, torch.Tensor | None]]) -> dict[str, torch.Tensor | None]:
    """The replicas' gradients summed in order, then divided by their number (one: as is)."""
    if len(grads) == 1:
        return grads[0]
    mean: dict[str, torch.Tensor | None] = {}
    for name in grads[0]:
        got = [g[name] for g in grads]
        present = [g for g in got if g is not None]
        if len(present) < len(got):
            mean[name] = None
            continue
        total = present[0]
        for g in present[1:]:
            total = total + g
        mean[name] = total / len(present)
    return mean


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _keywords(model: Callable[..., Any], x: Any) -> bool:
    """Whether ``x`` is a dict of a module's keyword arguments (else its one argument; a
    function, such as ``lambda x: ref(**x)``, always gets the dict whole)."""
    if not isinstance(x, dict) or not isinstance(model, nn.Module):
        return False
    try:
        inspect.signature(model.forward).bind(**x)
    except (TypeError, ValueError):
        return False
    return True


def grad_mismatches(
    pipeline: Pipeline | Iterable[tuple[str, nn.Parameter]], reference: nn.Module, *,
    skip: Collection[str] = (), group: dist.ProcessGroup | None = None,
) -> list[str]:
    """Problems with the pipeline's gradients against the reference model's, one line each.

    ``pipeline`` is a :class:`~pipetrain.Pipeline` (its ``named_parameters()``) or this
    process's ``(name, parameter)`` pairs. Each line names a parameter whose ``.grad``
    differs (bitwise) from the reference's, a name the reference lacks, or a reference
    parameter that no stage holds (a stage left out). ``skip`` names parameters the caller
    compares itself (a tied weight whose parts add in another order); they count as held.

    Which stages must hold every parameter between them:

    * one process holding every stage (no ``torch.distributed`` job, or a pipeline built
      with ``local_ranks``): the parameters given here;
    * a pipeline in a job: the parameters of all its ranks, gathered over its own process
      group, so this is a collective: every rank of the pipeline calls it, each with its own
      parameters, and each gets the parameters that no rank holds. Data-parallel replicas
      each check their own pipeline;
    * pairs in a job: those of every rank of ``group`` (default: the world), all of which
      call it. With data-parallel replicas pass the pipeline itself, or its group: over the
      world, one replica's parameters would cover another's missing ones.

    Raises:
        ValueError: ``group`` given with a Pipeline (which checks over its own group).
    """
    named: Iterable[tuple[str, nn.Parameter]]
    if isinstance(pipeline, Pipeline):
        if group is not None:
            raise ValueError("grad_mismatches: pass group= only with (name, parameter) pairs; "
                             "a Pipeline is checked over its own process group")
        named, one_process = pipeline.named_parameters(), pipeline.local
        transport = pipeline.engine.transport
        if transport is not None:
            group = transport.cpu_group  # gloo (under NCCL too): the pipeline's ranks
    else:
        named = pipeline
        one_process = not (dist.is_available() and dist.is_initialized())
    ref = dict(reference.named_parameters())
    bad = []
    seen = set(skip)
    for name, p in named:
        seen.add(name)
        if name in skip:
            continue
        q = ref.get(name)
        if q is None:
            bad.append(f"{name}: not a parameter name of the reference model")
            continue
        if (p.grad is None) != (q.grad is None):
            bad.append(f"{name}: grad is None on one side only")
        elif p.grad is not None and q.grad is not None and not torch.equal(p.grad.cpu(), q.grad):
            diff = (p.grad.cpu() - q.grad).abs().max().item()
            bad.append(f"{name}: max abs difference {diff:.3g}")
    if one_process:
        return bad + [f"{name}: held by no stage" for name in ref if name not in seen]
    held = _held_by_ranks(sorted(seen), group)
    return bad + [f"{name}: held by no stage on the pipeline's ranks {sorted(held)}"
                  for name in ref if not any(name in names for names in held.values())]


def _held_by_ranks(names: list[str], group: dist.ProcessGroup | None) -> dict[int, set[str]]:
    """The names each rank of ``group`` holds, by its rank in the job (a collective)."""
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, names, group=group)
    return {r if group is None else dist.get_global_rank(group, r): set(g)
            for r, g in enumerate(gathered)}


def reload_mismatches(path: Any, want: dict[str, torch.Tensor],
                      pipelines: Iterable[tuple[str, Any, torch.optim.Optimizer]]) -> list[str]:
    """Load the checkpoint at ``path`` into each ``(label, pipeline, optimizer)`` (its model
    and optimizer state); the keys whose whole values then differ from ``want`` (whole
    tensors by key, as :func:`pipetrain.checkpoint.run.model_state` and ``optimizer_state`` name
    them), labelled."""
    from pipetrain.checkpoint import run as ck
    from pipetrain.runtime.dtensors import whole

    def state(pipe: Any, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
        named = list(pipe.named_parameters())
        return {**ck.model_state(named), **ck.optimizer_state(opt, named)}

    problems = []
    for label, pipe, opt in pipelines:
        into = state(pipe, opt)
        ck.load(path, into)
        ck.load_optimizer_state(opt, pipe.named_parameters(), into)
        got = state(pipe, opt)
        problems += [f"{label}: {k} differs" for k in want
                     if not torch.equal(whole(got[k]).detach(), want[k])]
    return problems


def train_tokenizer(text: str, vocab: int = 300) -> Any:
    """A byte-level BPE tokenizer trained on ``text`` (as GPT-2's, but ``vocab`` tokens), as a
    transformers ``PreTrainedTokenizerFast`` with ``<|endoftext|>`` as its end token: what
    tests and benchmarks save beside a tiny model (nothing is downloaded)."""
    import transformers as tf
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator([text], trainers.BpeTrainer(
        vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return tf.PreTrainedTokenizerFast(
        tokenizer_object=bpe, eos_token="<|endoftext|>")
