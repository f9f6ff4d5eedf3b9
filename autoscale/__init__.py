"""Autoscaling policies (per pool and app-level elasticity) and the capacity planner.

Not built yet: this package arrives with issue #6.
"""
