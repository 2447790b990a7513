"""What multi-worker strategies share: worker setup, elastic groups, bucket sync, files."""
