"""Checkpoint conversion: Hugging Face DeepSeek-V4 safetensors -> `equinox_dsv4.DeepseekV4`."""

from ._load import fill as fill
from ._names import canonical_to_path as canonical_to_path, hf_to_canonical as hf_to_canonical
