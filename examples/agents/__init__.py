"""Agents of your own as Tether planners (docs/model-planner.md): they propose, Tether decides."""
