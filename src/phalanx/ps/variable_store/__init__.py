"""A ps task's variables, their optimizer and write versions."""
