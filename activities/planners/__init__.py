"""Planners for agents people already have (the interface: activities/planning.py, Planner)."""
