"""The gloo transport: signed collectives over torch's ProcessGroupGloo."""
