"""Runtime: process groups, the sharded training program, launch (see the runtime issue)."""
