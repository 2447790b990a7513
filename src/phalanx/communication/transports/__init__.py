"""How bytes move between workers: one sub-package per transport, and the choice of one."""
