"""The parameter-server cluster: wire format, gRPC transport, variable store and worker service."""
