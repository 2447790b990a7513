"""Distributed input: how batches reach replicas."""
