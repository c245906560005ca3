"""Model definitions and named shapes, shared by the control plane (planning) and workers."""
