"""Elasticity at scale, by simulation: the coordinator's real policy and planner against
simulated cluster traces (`raytrain-dt simulate`)."""
