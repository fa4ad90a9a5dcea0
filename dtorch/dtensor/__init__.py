"""The DTensor symbol and everything that issues its ops: the op-issuing path, factories,
recording for backward, autocast, aliasing, in-place ops, indexing, compile's capture and the
sync-debug mode of reads."""
