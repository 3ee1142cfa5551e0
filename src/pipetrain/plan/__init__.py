"""Plan: predicted step time and memory per layout, and the search over layouts.

``planner.py`` predicts a layout's step time and peak bytes per rank and searches the layouts;
``shardcost.py`` adds what dp, FSDP and tensor parallelism cost, ``experts.py`` the
expert-parallel degrees; ``plan_command.py`` is ``pipetrain plan`` (``unit_profile.py``
profiles the model's units, ``measured.py`` calibrates on the ranks, ``limit.py`` reads the
memory limit, ``table.py`` prints the ranked layouts). ``module_plan.py`` plans a user's own
module (:func:`plan_module`; ``pipetrain plan --module``, ``module_command.py``);
``budget.py`` turns a memory budget in bytes into the stage-activations of a
:class:`~pipetrain.schedules.generators.Target` (:func:`memory_target`).

``pipetrain plan --cluster GPU`` (``cluster/``) plans for GPUs this machine does not have,
from first principles: ``arch.py`` (the model's shape and FLOPs), ``hardware.py`` (GPUs,
cited), ``kernels.py`` (measured kernel speeds, ``data/``), ``collectives.py`` (NCCL's
costs), ``layer_cost.py`` (a layer's F, I, W and bytes), ``job.py`` (a layout's step and
memory, through the schedule simulator), ``search.py`` and ``cluster_command.py``;
``published.py`` holds the published runs it is checked against.

May import: every rung below it, :mod:`pipetrain.train` included.
"""

from pipetrain.plan.budget import memory_target, stage_activations
from pipetrain.plan.module_command import read_plan
from pipetrain.plan.module_plan import ModulePlan, plan_module

__all__ = ["ModulePlan", "memory_target", "plan_module", "read_plan", "stage_activations"]
