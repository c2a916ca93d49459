"""Export options every caller may name, without importing torch (the CLI builds its
``--help`` from these)."""

FLOAT_DTYPES = ("bf16", "fp16", "fp32")
EXPORT_DTYPES = ("", *FLOAT_DTYPES, "int8")  # "": as saved
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' "5GB" (decimal, as it counts)
