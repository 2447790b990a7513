"""The gradient engine: backward rounds and DDP-style gradient buckets."""
