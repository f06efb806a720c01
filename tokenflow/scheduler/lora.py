"""LoRA adapters as the scheduler sees them: a name and a directory, and the slots they run in.

The workers hold `max_loras` slots of adapter weights per pipeline stage. The scheduler decides
which adapter sits in which slot (`LoRASlots.assign`, once a step, for the adapters of the
requests it scheduled) and tells the workers only what changed (`SchedulerOutput.lora_loads`),
so every stage agrees without asking and the loads and evictions are counted in one place.
A step never runs more than `max_loras` adapters (`Scheduler._schedule_waiting` holds back a
request whose adapter would exceed it), so the slots always suffice.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class LoRAAdapter:
    """One registered adapter: its name (what requests say) and its PEFT directory. Equal
    name and path are the same weights: a name registered again with another path loads anew."""

    name: str
    path: str


class LoRASlots:
    """Owns the adapter -> slot table of the workers' `max_loras` slots (least recently used
    evicted first) and the counts of loads into slots and of evictions."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self._slots: OrderedDict[LoRAAdapter, int] = OrderedDict()  # LRU first
        self.num_loads = 0
        self.num_evictions = 0

    def assign(self, adapters: Iterable[LoRAAdapter]) -> dict[int, LoRAAdapter]:
        """Slots for this step's adapters (at most `max_loras` distinct ones): those already
        in a slot stay there; each other one takes a free slot or the least recently used
        one's not needed this step. Returns the loads {slot: adapter} the workers must do."""
        wanted = dict.fromkeys(adapters)
        if len(wanted) > self.max_loras:
            raise RuntimeError(f"{len(wanted)} adapters in one step; max_loras={self.max_loras}")
        for adapter in wanted:
            if adapter in self._slots:
                self._slots.move_to_end(adapter)
        loads: dict[int, LoRAAdapter] = {}
        for adapter in wanted:
            if adapter in self._slots:
                continue
            used = set(self._slots.values())
            free = next((s for s in range(self.max_loras) if s not in used), None)
            if free is None:
                victim = next(a for a in self._slots if a not in wanted)
                free = self._slots.pop(victim)
                self.num_evictions += 1
            self._slots[adapter] = free
            loads[free] = adapter
            self.num_loads += 1
        return loads

    def forget(self, name: str) -> None:
        """Drop a removed adapter's slot (its weights stay until the slot is reused)."""
        for adapter in [a for a in self._slots if a.name == name]:
            del self._slots[adapter]

    def reset(self) -> None:
        """New workers hold nothing: every adapter loads again."""
        self._slots.clear()
