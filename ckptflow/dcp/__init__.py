"""torch.distributed.checkpoint over a ckptflow store: the writer, the reader, their metadata."""
