"""Degrees: the layout dimension a ``pipetrain train`` command leaves open, taken from the world.

The world is ``pp x dp x fsdp x cp x tp`` ranks. A command line names some of them and the world
size (``--nproc``, or torchrun's ``WORLD_SIZE``) fixes the product, so one left open follows,
as torchtitan's ``-1`` does. Which one, in this order:

=====================  ================  ==============================================
given                  inferred          ``--nproc 8``
=====================  ================  ==============================================
no ``--pp``            ``--pp``          ``--dp 2`` -> pp 4 (what every run did before)
``--pp``, no ``--dp``  ``--dp``          ``--pp 2`` -> dp 4; ``--pp 2 --fsdp 2`` -> dp 2
``--pp`` and ``--dp``  ``--fsdp``        ``--pp 2 --dp 2`` -> fsdp 2
=====================  ================  ==============================================

``--tp`` and ``--cp`` are never inferred (1 unless given): they split layers and sequences,
choices of the model's and the data's.
:func:`open_degree` says what it inferred, so the command can print it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["open_degree", "said"]


def open_degree(given: Mapping[str, Any], world: int) -> dict[str, int]:
    """The ``dp`` or ``fsdp`` that ``world`` ranks imply for the settings ``given`` (the flags
    and ``--config`` keys a user set), as ``{name: degree}``; empty when ``--pp`` is open
    (the layout infers it, :func:`pipetrain.train.mesh.layout`) or every degree is given.

    Under ``--ft --ft-replica-id`` the world is one replica, ``given`` must name ``--dp`` and
    ``world`` is that replica's ranks times ``--dp``.

    Raises:
        ValueError: the world does not divide by the degrees given, naming them and the flag
            to change.
    """
    if given.get("pp") is None:
        return {}
    pp, tp, cp = int(given["pp"]), int(given.get("tp", 1)), int(given.get("cp", 1))
    if "dp" not in given:
        open_name, fixed = "dp", {"pp": pp, "fsdp": int(given.get("fsdp", 1)), "cp": cp,
                                  "tp": tp}
    elif "fsdp" not in given:
        open_name, fixed = "fsdp", {"pp": pp, "dp": int(given["dp"]), "cp": cp, "tp": tp}
    else:
        return {}
    if min(fixed.values()) < 1:  # refused, naming the flag, by the command's checks
        return {}
    product = math.prod(fixed.values())
    named = " x ".join(f"{k}={v}" for k, v in fixed.items() if v != 1 or k == "pp")
    if world % product:
        raise ValueError(f"the world has {world} ranks, which {named} does not divide, so "
                         f"--{open_name} cannot be inferred; start a multiple of {product} "
                         f"processes (--nproc) or give --{open_name}")
    return {open_name: world // product}


def said(inferred: Mapping[str, int], world: int, given: Mapping[str, Any]) -> str:
    """The line that says what was inferred, from what: ``--dp 2 (inferred: 4 ranks / pp=2;
    give --dp to set it)``."""
    (name, degree), = inferred.items()
    fixed = [f"{k}={given[k]}" for k in ("pp", "dp", "fsdp", "cp", "tp")
             if given.get(k) is not None and k != name and (k not in ("tp", "cp")
                                                             or given[k] != 1)]
    return (f"--{name} {degree} (inferred: {world} ranks / {' x '.join(fixed)}; give "
            f"--{name} to set it)")
