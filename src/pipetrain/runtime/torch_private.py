"""Private torch: every internal of torch outside torch.distributed that pipetrain reaches.

No other module of pipetrain reaches into torch's private names: each dependency is a name
here (the private ones of torch.distributed are in :mod:`pipetrain.runtime.torch_distributed`),
listed in :data:`DEPENDENCIES`, which ``tests/test_torch_private.py`` imports and resolves on
the installed torch (and which fails naming the symbol and this file when a release moves
one), and no module outside these two names a private part of torch (the same test). A name
whose import was lazy where it was used stays lazy here: functorch's AOT (dynamo with it,
seconds) is imported at the first compiled stage, not at ``import pipetrain``.

The table, one row per dependency: the symbol, the name pipetrain reaches it by, what it uses
it for, the public alternative considered and why it does not serve, and the torch versions
it was checked on.

- ``torch.utils._pytree``: :data:`pytree`. Use: flattening and rebuilding batches, stage
  inputs and outputs and a capture's signature, with every node type torch knows (tuples,
  lists, dicts, namedtuples, and a Hugging Face ``ModelOutput``, which transformers registers
  with this module). Public: none in torch 2.13 (there is no ``torch.utils.pytree``); the
  ``optree`` package is not a torch dependency and does not see the types registered here.
  Checked: 2.13.
- ``torch._functorch.aot_autograd.aot_function``: :func:`aot_function`. Use: ``compile=True``
  traces a stage's forward and backward as two graphs (``runtime/compiled.py``), the backward
  then cut into I and W. Public: ``torch.compile`` never hands the backward graph back;
  ``functorch.compile.aot_function`` is this same function under functorch's experimental
  namespace, no steadier. Imported at the first call. Checked: 2.13.
- ``torch._functorch.partitioners.default_partition``: :func:`default_partition`. Use: the
  split of the joint graph into forward and backward (the forward saves what the backward
  reads) that ``compiled.py`` wraps to keep both graphs. Public: as for ``aot_function``
  (``functorch.compile.default_partition`` is the same function). Imported at the first call.
  Checked: 2.13.
- ``torch.export.ExportedProgram._state_dict`` and
  ``torch.export.ExportedProgram._constants``: :func:`program_state`,
  :func:`program_state_swapped`. Use: shared capture saves rank 0's program with meta tensors
  in place of the model's (each rank binds its own), then puts the real ones back. Public: the
  ``state_dict`` and ``constants`` properties, whose setters raise; editing their dicts in
  place would change, while saving, the dicts the program and its capture share. Checked:
  2.13.
- ``torch.Tensor._is_view``: :func:`is_view`. Use: ``compiled.py`` copies a stage output that
  is a view, which AOTAutograd would otherwise regenerate outside the graph without a gradient
  input of its own. Public: none (``Tensor._base`` is private too). Checked: 2.13.
- ``torch._ops.OpOverload._schema``: :func:`op_schema`. Use: an op's arguments by name: which
  random op is a no-op (``runtime/rng.py``), which inputs an op writes into and what a view is
  of (``split/provenance.py``). Public: none on an ``OpOverload`` in 2.13. Checked: 2.13.
- ``torch.nn.Module._parameters``, ``torch.nn.Module._buffers`` and
  ``torch.nn.Module._modules``: :func:`parameters_dict`, :func:`buffers_dict`,
  :func:`modules_dict`, :func:`set_parameters_dict`, :data:`MODULE_DICTS`. Use: tensors put
  into a module where a parameter or buffer was (weight versions, lazy initialisation's real
  tensors, a compiled stage's weights, expert-parallel shards), a ``Sequential``'s children
  with a layer used twice, and a module's own attributes apart from its tensors (capture
  reuse). Public: ``setattr``, ``register_parameter`` and ``register_buffer`` refuse a plain
  tensor under a parameter's name and run ``__setattr__``'s checks at every swap;
  ``named_children()`` and ``named_parameters()`` hide a repeat. Checked: 2.13.
- ``torch.nn.modules.dropout._DropoutNd``: :data:`DropoutNd`. Use: whether a module draws
  random numbers (``runtime/rng.py``): every dropout, a user's subclass of the base too.
  Public: the six dropout classes, which miss such a subclass. Checked: 2.13.
- ``torch._C._profiler._EventType.Allocation``: :func:`profiler_event_type`. Use: the peak of
  a step's own CPU allocations, from the profiler's event tree (``train/memory.py``). Public:
  ``key_averages()`` sums memory per op, with no timeline to take a peak from;
  ``torch.cuda.max_memory_allocated`` is CUDA's. Imported at the call (an ``ImportError`` is
  the caller's to handle). Checked: 2.13.
- ``torch._foreach_norm`` and ``torch._foreach_mul_``: :data:`foreach_norm`,
  :data:`foreach_mul_`. Use: the gradients' norm (each tensor's norm, in one kernel, whose
  squares the ranks sum) and their clipping and unscaling (``train/optim.py``,
  ``train/precision.py``). Public: ``torch.nn.utils.get_total_norm`` returns the total, not
  each tensor's norm (squaring it rounds differently); ``clip_grads_with_norm_`` multiplies
  even by 1; a loop of ``linalg.vector_norm`` or ``mul_`` runs a kernel per tensor. Checked:
  2.13.
- ``torch.ops.aten._to_copy.default``: :data:`aten_to_copy`. Use: ``split/capture.py`` casts
  the integer input of a ``histc`` to float32 on CPU, with the node export itself records for
  a ``.to(dtype)``. Public: ``aten.to.dtype`` is a composite that export's graphs never hold
  (it decomposes into this op). Checked: 2.13.
- ``torch.ops.aten._assert_tensor_metadata.default`` and
  ``torch.ops.aten._assert_scalar.default``: :data:`EXPORT_ASSERTS` (their names). Use:
  ``split/capture.py`` drops the checks export writes into its graphs (pipetrain checks a
  stage's inputs itself). Public: none found in 2.13. Checked: 2.13.
- ``torch.ops.aten._native_batch_norm_legit.default`` and
  ``torch.ops.aten._native_batch_norm_legit_functional.default``: :data:`BATCH_NORM_LEGIT`
  (their names). Use: a graph that normalises by the batch (``split/eval_graph.py``): a
  training batch norm as export decomposes it. Public: ``aten.batch_norm`` and
  ``aten.native_batch_norm``, matched too, which decomposed graphs do not hold. Checked: 2.13.
- ``_guards_fn`` (written by ``torch.export._unlift``): :data:`GUARDS_FN`. Use:
  ``split/capture.py`` drops the call of the guard submodule ``ExportedProgram.module()``
  inserts. Public: ``ExportedProgram.module(check_guards=False)`` (2.13) inserts none; taking
  it changes how the module is built, which a move does not. Checked: 2.13.
- ``torch._dynamo`` and ``torch.export._trace``: :data:`DYNAMO`, :data:`EXPORT_TRACE`. Use:
  modules the forkserver imports once for every rank (``runtime/launch.py``'s
  ``RANK_MODULES``): capture exports with them. Public: ``torch.export`` and ``torch.compiler``
  are imported with torch and import these only at their first export or compile. Checked:
  2.13.
- ``torch._export.non_strict_utils``: :data:`EXPORT_NON_STRICT_LOGGER` (its logger's name).
  Use: ``generation.py`` quiets its warning while a generator's fixed-batch capture runs.
  Public: none (``torch._logging.set_logs`` is private too). Checked: 2.13.

A new dependency goes into this module or :mod:`pipetrain.runtime.torch_distributed`: its
accessor, its row in the table and its entry in :data:`DEPENDENCIES` (CONTRIBUTING.md:
private torch).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import fx, nn
from torch.utils import _pytree as pytree

if TYPE_CHECKING:
    from torch._C._profiler import _EventType

__all__ = ["BATCH_NORM_LEGIT", "DEPENDENCIES", "DYNAMO", "Dependency", "DropoutNd",
           "EXPORT_ASSERTS", "EXPORT_NON_STRICT_LOGGER", "EXPORT_TRACE", "GUARDS_FN",
           "MODULE_DICTS", "aot_function", "aten_to_copy", "buffers_dict", "default_partition",
           "foreach_mul_", "foreach_norm", "is_view", "modules_dict", "op_schema",
           "parameters_dict", "profiler_event_type", "program_state", "program_state_swapped",
           "pytree", "set_parameters_dict"]


@dataclass(frozen=True)
class Dependency:
    """One private part of torch: ``name`` (a dotted path; empty: the module itself) resolved
    in the imported ``module``, or with ``in_source``, the string ``name`` in its source (a
    name torch writes into what it builds)."""

    module: str
    name: str = ""
    in_source: bool = False

    @property
    def symbol(self) -> str:
        """How the table names it: ``torch.utils._pytree``, ``torch.Tensor._is_view``."""
        if self.in_source:
            return self.name
        return f"{self.module}.{self.name}" if self.name else self.module


# -- functorch's AOT (imported at the first call) ----------------------------------------------
def aot_function(fn: Callable[..., Any], **kwargs: Any) -> Callable[..., Any]:
    """``torch._functorch.aot_autograd.aot_function(fn, **kwargs)``."""
    from torch._functorch.aot_autograd import aot_function as aot

    return aot(fn, **kwargs)


def default_partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any
                      ) -> tuple[fx.GraphModule, fx.GraphModule]:
    """``torch._functorch.partitioners.default_partition(joint, joint_inputs, **kwargs)``."""
    from torch._functorch.partitioners import default_partition as partition

    return partition(joint, joint_inputs, **kwargs)


# -- export ------------------------------------------------------------------------------------
def program_state(program: torch.export.ExportedProgram
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """The dicts ``program`` holds its state and its constants in (not copies)."""
    return program._state_dict, program._constants


@contextlib.contextmanager
def program_state_swapped(program: torch.export.ExportedProgram, state: dict[str, Any],
                          constants: dict[str, Any]) -> Iterator[None]:
    """``program`` holding ``state`` and ``constants`` inside the block, its own after."""
    held = program._state_dict, program._constants
    program._state_dict, program._constants = state, constants
    try:
        yield
    finally:
        program._state_dict, program._constants = held


aten_to_copy = torch.ops.aten._to_copy.default
"""The op export records for a ``.to(dtype)``."""
EXPORT_ASSERTS = ("aten._assert_tensor_metadata.default", "aten._assert_scalar.default")
"""The names of the checks export writes into a graph."""
BATCH_NORM_LEGIT = ("aten._native_batch_norm_legit.default",
                    "aten._native_batch_norm_legit_functional.default")
"""The names of a training batch norm's ops once export decomposed it."""
GUARDS_FN = "_guards_fn"
"""The submodule ``ExportedProgram.module()`` calls with the inputs to check its guards."""
DYNAMO = "torch._dynamo"
EXPORT_TRACE = "torch.export._trace"
EXPORT_NON_STRICT_LOGGER = "torch._export.non_strict_utils"


# -- tensors, ops, modules ---------------------------------------------------------------------
def is_view(t: torch.Tensor) -> bool:
    """Whether ``t`` is a view of another tensor."""
    return t._is_view()


def op_schema(target: Any) -> Any:
    """The schema of an op (an ``OpOverload``); None for anything else."""
    return getattr(target, "_schema", None)


MODULE_DICTS = ("_parameters", "_buffers", "_modules")
"""The attributes an ``nn.Module`` holds its own parameters, buffers and children in."""


def parameters_dict(module: nn.Module) -> dict[str, nn.Parameter | None]:
    """The dict ``module`` holds its own parameters in (not a copy)."""
    return module._parameters


def set_parameters_dict(module: nn.Module, params: dict[str, nn.Parameter | None]) -> None:
    """Replace the dict ``module`` holds its own parameters in."""
    module._parameters = params


def buffers_dict(module: nn.Module) -> dict[str, torch.Tensor | None]:
    """The dict ``module`` holds its own buffers in (not a copy)."""
    return module._buffers


def modules_dict(module: nn.Module) -> dict[str, nn.Module | None]:
    """The dict ``module`` holds its children in, a child used twice under each name."""
    return module._modules


DropoutNd = nn.modules.dropout._DropoutNd
"""The base class of torch's dropout modules."""

foreach_norm = torch._foreach_norm
foreach_mul_ = torch._foreach_mul_


def profiler_event_type() -> type[_EventType]:
    """The kinds of the profiler's events (``.Allocation``); ImportError where it has none."""
    from torch._C._profiler import _EventType

    return _EventType


DEPENDENCIES = (
    Dependency("torch.utils._pytree"),
    Dependency("torch._functorch.aot_autograd", "aot_function"),
    Dependency("torch._functorch.partitioners", "default_partition"),
    Dependency("torch.export", "ExportedProgram._state_dict"),
    Dependency("torch.export", "ExportedProgram._constants"),
    Dependency("torch", "Tensor._is_view"),
    Dependency("torch._ops", "OpOverload._schema"),
    *(Dependency("torch.nn", f"Module.{name}") for name in MODULE_DICTS),
    Dependency("torch.nn.modules.dropout", "_DropoutNd"),
    Dependency("torch._C._profiler", "_EventType.Allocation"),
    Dependency("torch", "_foreach_norm"),
    Dependency("torch", "_foreach_mul_"),
    Dependency("torch", "ops.aten._to_copy.default"),
    *(Dependency("torch", f"ops.{name}") for name in (*EXPORT_ASSERTS, *BATCH_NORM_LEGIT)),
    Dependency("torch.export._unlift", GUARDS_FN, in_source=True),
    Dependency(DYNAMO),
    Dependency(EXPORT_TRACE),
    Dependency(EXPORT_NON_STRICT_LOGGER),
)
"""What this module reaches in torch (the table's rows, one entry per symbol)."""
