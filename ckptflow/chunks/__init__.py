"""Content-addressed chunks over a ``Store``: encodings, byte planes, lossy codecs, save leases."""
