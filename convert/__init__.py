"""Checkpoint conversion: Hugging Face DeepSeek-V4 safetensors -> `equinox_dsv4.DeepseekV4`.

- `load_hf(hf_dir, dtype=..., mesh=..., load_mtp=...)`: straight into a (sharded) model. A
  transformers-saved checkpoint has no MTP block: it loads without one (`MTPSkippedWarning`).
- `convert(hf_dir, out_dir, ...)` / `python -m convert HF_DIR OUT_DIR`: into a saved model that
  `equinox_dsv4.load(out_dir, mesh=...)` reads.
"""

from equinox_dsv4.ckpt import CheckpointError as CheckpointError, fill as fill

from .load import convert as convert, load_hf as load_hf
from .names import hf_to_canonical as hf_to_canonical
from .plan import MTPSkippedWarning as MTPSkippedWarning, plan as plan
