"""`equinox_dsv4.ckpt`: checkpoints.

Saving and loading a model in this project's format (`save`, `load`: orbax pieces under the
release's canonical names, sharded on load), the map between canonical names and a model's
leaves (`canonical_to_path`, `assign`, `fill`), and the writer a converter streams pieces
into (`PieceWriter`, `temporary_sibling` / `publish`, `write_metadata`).

May import: config, quant, execution, nn, parallel.
"""

from ._names import (
    CheckpointError as CheckpointError,
    Slot as Slot,
    assign as assign,
    block_path as block_path,
    canonical_pieces as canonical_pieces,
    canonical_to_path as canonical_to_path,
    fill as fill,
)
from ._orbax import (
    PieceWriter as PieceWriter,
    load as load,
    publish as publish,
    quantized_meta as quantized_meta,
    read_config as read_config,
    save as save,
    shardings_of as shardings_of,
    skeleton_of as skeleton_of,
    temporary_sibling as temporary_sibling,
    write_metadata as write_metadata,
)


__all__ = [
    "save",
    "load",
    "CheckpointError",
    "read_config",
    "skeleton_of",
    "canonical_pieces",
    "canonical_to_path",
    "block_path",
    "assign",
    "fill",
    "Slot",
    "PieceWriter",
    "temporary_sibling",
    "publish",
    "write_metadata",
    "quantized_meta",
    "shardings_of",
]
