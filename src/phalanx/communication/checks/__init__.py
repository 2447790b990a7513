"""Checks on collectives: signatures, call sites, the stall inspector, heartbeats."""
