"""Layer 4: doctor, the originals of torch's functions, the global-state snapshot, summary."""
