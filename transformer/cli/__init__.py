"""The commands: one module per command, the flags they share, one way to end."""
