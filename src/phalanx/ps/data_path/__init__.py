"""The ps tasks' data path: reads and pushes outside gRPC."""
