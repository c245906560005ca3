"""Degree math, memory and step-time models, the layout planner, and node-aware placement."""
