"""Layer 2, the public contexts and materialize(), built on :mod:`metamode._core`."""
