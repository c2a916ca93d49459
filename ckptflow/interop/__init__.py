"""Other formats and systems: import from torch/DCP files, export to safetensors/HF/DCP, the registry."""
