"""Where modules find their parameters: a parameter's places (``ParamSlot``, ``module.<name>``,
several for tied parameters) and, for the compiled step, every place of a call's parameters at once
(:class:`RegistrySwap`). Eager puts each parameter's sharded or unsharded form in its places
(fsdp2.runtime.sharded_param's ``hold_all_*``); while dynamo traces a call, its modules' registries
are swapped whole for ones holding the gathered tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn as nn

from fsdp2 import compat


@dataclass(frozen=True)
class ParamSlot:
    """One place a parameter is registered, ``module.<name>``. Tied parameters have several."""

    module: nn.Module
    name: str

    def hold(self, tensor: nn.Parameter) -> None:
        # Straight into the registry: setattr would re-run nn.Module's checks on every swap.
        compat.module_parameters(self.module)[self.name] = tensor

    def current(self) -> nn.Parameter:
        return compat.module_parameters(self.module)[self.name]


class RegistrySwap:
    """The ``_parameters`` dicts of the modules holding some parameters' slots, swapped whole for
    dicts holding other tensors (``swap_in``) and put back (``restore``): a compiled step's modules
    see the gathered parameters, so the trace never reads the DTensor parameters and dynamo installs
    no guard (a Python DTensor spec check) on them. What goes where is decided once, eagerly."""

    __slots__ = ("_places", "_swapped")

    def __init__(self, slots_per_param: Sequence[Sequence[ParamSlot]]):
        # Per module: {managed name: its parameter's index}, and [(name, that index, or None for a
        # parameter not among them)] in the module's order.
        by_module: dict[nn.Module, dict[str, int]] = {}
        for i, slots in enumerate(slots_per_param):
            for slot in slots:
                by_module.setdefault(slot.module, {})[slot.name] = i
        self._places = [
            (module, managed, [(name, managed.get(name)) for name in compat.held_parameter_registry(module)])
            for module, managed in by_module.items()
        ]
        self._swapped: list[tuple[nn.Module, dict]] = []

    def swap_in(self, tensors: Sequence[torch.Tensor]) -> None:
        """Every module sees ``tensors[i]`` in the places of parameter ``i`` (the others unchanged)."""
        for module, managed, entries in self._places:
            original = compat.held_parameter_registry(module)
            if len(original) != len(entries):  # a parameter registered on the module since fully_shard
                entries = [(name, managed.get(name)) for name in original]
            registry = {}
            for name, index in entries:  # in the module's order
                registry[name] = original[name] if index is None else tensors[index]
            compat.set_parameter_registry(module, registry)
            self._swapped.append((module, original))

    def restore(self) -> None:
        for module, original in self._swapped:
            compat.set_parameter_registry(module, original)
        self._swapped = []
