"""Planners for agents people already have (the interface: tether/planners/planning.py, Planner)."""
