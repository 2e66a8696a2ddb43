"""Layer 1, the mechanism: the per-thread mode stack, the modes, torch's registration hooks,
parameter copying, the skip rule and the build recorder. Imports nothing above it."""
