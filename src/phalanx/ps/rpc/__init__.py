"""gRPC calls between the chief, workers and ps tasks."""
