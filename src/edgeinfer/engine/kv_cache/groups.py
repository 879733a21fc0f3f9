"""KV groups: which layers share a block table. No torch.

A model whose layers all attend their whole context has one group: every layer reads every block of a
sequence, and a block holds every layer's K/V for its tokens (the layout before groups existed).

A model with sliding-window layers (Gemma 3: five of every six, window 512) splits its layers into groups
of one kind each (one window, or full attention). A windowed group needs only the blocks its window still
reaches, so it gives the others back as the sequence grows while the full-attention groups keep all of
theirs. All groups draw from one shared pool of blocks, so the memory a long sequence frees in windowed
groups serves anyone: each block holds `slots` layers' K/V, and every group has exactly `slots` layers (the
smallest kind's count; a kind with more layers is split into several groups, the last of which may leave
slots unused). Layer l of a group reads and writes slot `slot_of(l)` of the blocks in its group's table.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property


@dataclass(frozen=True)
class KVGroup:
    window: int | None  # None: full attention, every block kept
    layers: tuple[int, ...]

    def first_needed(self, num_computed: int) -> int:
        """The first token whose K/V a query at position `num_computed` or later can still see."""
        return 0 if self.window is None else max(0, num_computed - self.window + 1)


@dataclass(frozen=True)
class KVGroups:
    groups: tuple[KVGroup, ...]
    slots: int  # layers a block holds

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    @cached_property
    def _where(self) -> dict[int, tuple[int, int]]:
        return {layer: (i, slot) for i, g in enumerate(self.groups) for slot, layer in enumerate(g.layers)}

    def group_of(self, layer: int) -> int:
        return self._where[layer][0]

    def slot_of(self, layer: int) -> int:
        return self._where[layer][1]


def single_group(num_layers: int) -> KVGroups:
    """Every layer in one full-attention group (a block holds them all)."""
    return KVGroups((KVGroup(None, tuple(range(num_layers))),), num_layers)


def plan_groups(windows: Sequence[int | None], max_len: int, hybrid: bool = True) -> KVGroups:
    """Groups for layers with these windows (None: full attention). A window that covers `max_len` never
    lets a key go, so its layer counts as full; without `hybrid`, every layer is in one group."""
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kept = window if hybrid and window is not None and window < max_len else None
        kinds.setdefault(kept, []).append(layer)
    if len(kinds) == 1:
        ((window, layers),) = kinds.items()
        return KVGroups((KVGroup(window, tuple(layers)),), len(layers))
    slots = min(len(layers) for layers in kinds.values())
    groups = [
        KVGroup(window, tuple(layers[i : i + slots]))
        for window, layers in kinds.items()
        for i in range(0, len(layers), slots)
    ]
    return KVGroups(tuple(groups), slots)


def mirror_groups(
    target: KVGroups, windows: Sequence[int | None], max_len: int, hybrid: bool = True
) -> KVGroups:
    """Groups for another model's layers (a draft model's, with these windows) over `target`'s block
    tables: each layer goes to a group of its own kind, the layers of a kind dealt `target.slots` at a time
    to its groups in turn; a kind the target lacks goes to a full-attention group, whose blocks cover any
    window. The same windows give the same groups."""
    kinds: dict[int | None, list[int]] = {}
    for i, g in enumerate(target.groups):
        kinds.setdefault(g.window, []).append(i)
    layers: list[list[int]] = [[] for _ in target.groups]
    seen: dict[int | None, int] = {}
    for layer, window in enumerate(windows):
        kept = window if hybrid and window is not None and window < max_len else None
        kind = kept if kept in kinds else None
        if kind not in kinds:
            raise ValueError(f"no KV group to mirror for a layer of window {window} (have {target.windows})")
        order = seen.get(kind, 0)
        seen[kind] = order + 1
        own = kinds[kind]
        layers[own[order // target.slots % len(own)]].append(layer)
    groups = tuple(KVGroup(g.window, tuple(ls)) for g, ls in zip(target.groups, layers, strict=True))
    return KVGroups(groups, max(1, *(len(ls) for ls in layers)))
