"""Where each KV block lives in the mapped KV cache memory.

vLLM gives the connector one ``[num_blocks, ...]`` tensor per attention layer; on the CPU all
layers are views of one storage. A ``LayerSpan`` records, for one layer, which shared region
holds it, the byte offset of block 0, the byte stride between blocks and the bytes of one
block. Only whole blocks are ever copied: inside a block the CPU attention kernels pack K and
V in an ISA-specific order, so partial-block copies would be wrong.

The wire order of a transfer is layer-major: for each layer, the requested blocks in the
order given. Runs of consecutive block ids are merged into one contiguous view.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class LayerSpan:
    region: int
    offset: int
    block_stride: int
    block_bytes: int


@dataclass(frozen=True)
class Layout:
    region_sizes: tuple[int, ...]
    layers: tuple[LayerSpan, ...]
    num_blocks: int

    @property
    def layer_bytes(self) -> tuple[int, ...]:
        """Bytes of one block in each layer, in wire order."""
        return tuple(layer.block_bytes for layer in self.layers)

    @property
    def bytes_per_block(self) -> int:
        """Bytes of one block over all layers."""
        return sum(self.layer_bytes)

    def to_json(self) -> dict[str, object]:
        return {
            "region_sizes": list(self.region_sizes),
            "layers": [asdict(layer) for layer in self.layers],
            "num_blocks": self.num_blocks,
        }

    @classmethod
    def from_json(cls, data: dict[str, object]) -> Layout:
        layers = tuple(LayerSpan(**layer) for layer in data["layers"])  # type: ignore[attr-defined]
        sizes = tuple(int(s) for s in data["region_sizes"])  # type: ignore[attr-defined]
        return cls(region_sizes=sizes, layers=layers, num_blocks=int(data["num_blocks"]))  # type: ignore[call-overload]

    def check_blocks(self, block_ids: Sequence[int]) -> None:
        bad = [b for b in block_ids if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"block ids out of range 0..{self.num_blocks - 1}: {bad[:5]}")

    def views(
        self, regions: Sequence[memoryview], block_ids: Sequence[int]
    ) -> Iterator[memoryview]:
        """Memoryviews of the given blocks in wire order (layer-major, runs merged)."""
        runs = list(_runs(block_ids))
        for layer in self.layers:
            memory = regions[layer.region]
            contiguous = layer.block_stride == layer.block_bytes
            for start, count in runs:
                if contiguous:
                    lo = layer.offset + start * layer.block_stride
                    yield memory[lo : lo + count * layer.block_bytes]
                    continue
                for block in range(start, start + count):
                    lo = layer.offset + block * layer.block_stride
                    yield memory[lo : lo + layer.block_bytes]


def _runs(block_ids: Sequence[int]) -> Iterator[tuple[int, int]]:
    """(first id, length) of each run of consecutive ids, in order."""
    start, count = -1, 0
    for block in block_ids:
        if count and block == start + count:
            count += 1
            continue
        if count:
            yield start, count
        start, count = block, 1
    if count:
        yield start, count
