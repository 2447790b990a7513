"""The cluster token, the TLS certificates derived from it, and secure gRPC channels."""
