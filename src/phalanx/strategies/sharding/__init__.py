"""Sharding plans and meta-device initialisation for the sharded strategies."""
