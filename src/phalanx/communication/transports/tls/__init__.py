"""The mutual-TLS ring transport between machines."""
