"""The layer plan: which decoder layers run unrolled and which are stacked and scanned.

Layers are grouped by structure (attention type and routing type, the `kind`). A run of layers
whose kinds repeat with some period `p` at least `scan_min_repeats` times becomes one stacked
segment: `p` blocks, each holding `repeats` layers' weights along a leading axis, run by one
`lax.scan` whose body applies the `p` blocks in order. Every other layer stays a plain block.
Among all such covers of the layer list the plan minimises the number of blocks traced (an
unrolled layer costs 1, a scanned segment costs its period), then the number of segments.

For V4-Flash (`[sliding, sliding, CSA, (HCA, CSA) x 20]`, the first three hash-routed) this gives
three unrolled layers and one scan of length 20 over (HCA, CSA) pairs.
"""

import dataclasses
import functools

from ._config import Config


Kind = tuple[str, str]  # (layer_type, mlp_type)


@dataclasses.dataclass(frozen=True)
class Segment:
    """Layers `start .. start + len(period) * repeats - 1`, the kinds repeating `period`."""

    start: int
    period: tuple[Kind, ...]
    repeats: int

    @property
    def scanned(self) -> bool:
        return self.repeats > 1

    @property
    def num_layers(self) -> int:
        return len(self.period) * self.repeats

    def layer(self, position: int, repeat: int) -> int:
        """Index of the decoder layer at `position` within the period, in repeat `repeat`."""
        return self.start + repeat * len(self.period) + position


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """An ordered cover of the decoder layers by unrolled layers and scanned segments."""

    segments: tuple[Segment, ...]

    @classmethod
    def from_config(cls, config: Config) -> "LayerPlan":
        kinds = tuple(zip(config.layer_types, config.mlp_layer_types, strict=True))
        return cls(_best_cover(kinds, config.scan_min_repeats))

    @property
    def num_layers(self) -> int:
        return sum(s.num_layers for s in self.segments)

    def locate(self, layer: int) -> tuple[int, int, int]:
        """`(segment, position, repeat)` of decoder layer `layer`."""
        for i, seg in enumerate(self.segments):
            offset = layer - seg.start
            if 0 <= offset < seg.num_layers:
                repeat, position = divmod(offset, len(seg.period))
                return i, position, repeat
        raise IndexError(f"layer {layer} is not in the plan ({self.num_layers} layers)")

    def describe(self) -> str:
        """One line per segment, e.g. `layers 3-42: scan x20 of (heavily_compressed_attention/moe,
        compressed_sparse_attention/moe)`."""
        lines = []
        for seg in self.segments:
            end = seg.start + seg.num_layers - 1
            kinds = ", ".join(f"{a}/{m}" for a, m in seg.period)
            if seg.scanned:
                lines.append(f"layers {seg.start}-{end}: scan x{seg.repeats} of ({kinds})")
            else:
                lines.append(f"layer {seg.start}: {kinds}")
        return "\n".join(lines)


def _best_cover(kinds: tuple[Kind, ...], min_repeats: int) -> tuple[Segment, ...]:
    n = len(kinds)

    @functools.cache
    def best(i: int) -> tuple[tuple[int, int], tuple[Segment, ...]]:
        # ((traced blocks, segments), segments) for layers i..n-1.
        if i == n:
            return (0, 0), ()
        (cost, count), rest = best(i + 1)
        choice = ((cost + 1, count + 1), (Segment(i, (kinds[i],), 1), *rest))
        for p in range(1, (n - i) // min_repeats + 1):
            end = i + p
            while end < n and kinds[end] == kinds[end - p]:
                end += 1
            max_repeats = (end - i) // p
            for r in range(min_repeats, max_repeats + 1):
                (cost, count), rest = best(i + p * r)
                option = ((cost + p, count + 1), (Segment(i, kinds[i : i + p], r), *rest))
                if option[0] < choice[0]:
                    choice = option
        return choice

    return best(0)[1]
