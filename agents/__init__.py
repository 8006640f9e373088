"""Code that runs on GPU nodes: what a probe is, how it is timed and checked."""
