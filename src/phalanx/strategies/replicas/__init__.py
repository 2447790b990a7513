"""Replicas in one process: threads, the in-process rendezvous, gradients, variable policy."""
