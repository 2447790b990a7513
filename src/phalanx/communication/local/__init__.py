"""In-process reduction: cross-device ops, packing, communication options, sparse sums."""
