"""The on-disk format: layout and names, sealed JSON records, the manifest, checksums.

Pure: no store, no torch.distributed. Everything above reads and writes through these types."""
