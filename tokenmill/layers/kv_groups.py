"""KV cache groups: which layers share a block table, and which cache tensor each layer uses.

A model whose layers attend differently (Gemma 3: five sliding-window layers to one global)
need not keep the same KV for all of them: a sliding layer never reads keys behind its window,
so its blocks there can go back to the pool. As vLLM's hybrid KV manager does, the layers are
split into groups of equal size `width`, one kind of attention a group (the full-attention
groups first); each group has its own block table over ONE block pool, and the j-th layer of
every group writes the j-th of `width` cache tensors. A block then holds `width` layers' KV,
and which group owns it decides which layers those are. The group that keeps every block
(group 0, full attention) is the request's primary table, the one everything else reads.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVGroupLayout:
    windows: tuple[int | None, ...]  # per group: its sliding window; None keeps every block
    layer_group: tuple[int, ...]  # per layer: its group
    layer_tensor: tuple[int, ...]  # per layer: which of the `width` cache tensors it writes
    width: int  # cache tensors, and layers a block holds

    @property
    def hybrid(self) -> bool:
        return len(self.windows) > 1

    @property
    def bounded(self) -> bool:
        """Whether some group keeps only its window's blocks."""
        return any(window is not None for window in self.windows)

    def blocks_per_seq(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks one sequence of `num_tokens` tokens holds, every group, while computing a
        chunk of `chunk` tokens (a sliding group holds the window before it and the chunk)."""
        full = -(-num_tokens // block_size)
        return sum(
            full if window is None else min(full, -(-(window - 2 + chunk) // block_size) + 1)
            for window in self.windows
        )


def single_group(num_layers: int) -> KVGroupLayout:
    """Every layer in one group keeping every block: one cache tensor a layer."""
    return KVGroupLayout((None,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_group_layout(layer_windows: Sequence[int | None] | None, num_layers: int) -> KVGroupLayout:
    """Groups for per-layer windows (None: full attention); a model whose layers all attend
    alike is one group, as before: one whose every layer has the same window (Mistral's
    model-wide `sliding_window`) a windowed one, its blocks behind the window freed too."""
    if layer_windows is not None and len(set(layer_windows)) == 1 and layer_windows[0]:
        return KVGroupLayout(
            (layer_windows[0],), (0,) * num_layers, tuple(range(num_layers)), num_layers
        )
    if layer_windows is None or len(set(layer_windows)) <= 1 or None not in layer_windows:
        return single_group(num_layers)
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        kinds.setdefault(window, []).append(layer)
    width = min(len(layers) for layers in kinds.values())
    windows: list[int | None] = []
    layer_group = [0] * num_layers
    layer_tensor = [0] * num_layers
    for window in sorted(kinds, key=lambda w: -1 if w is None else w):
        layers = kinds[window]
        for start in range(0, len(layers), width):
            for j, layer in enumerate(layers[start : start + width]):
                layer_group[layer], layer_tensor[layer] = len(windows), j
            windows.append(window)
    return KVGroupLayout(tuple(windows), tuple(layer_group), tuple(layer_tensor), width)
