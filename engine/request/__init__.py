"""What a request is inside the engine: the Sequence, its sampling parameters, limits, errors, the builder and incremental detokenizer."""
