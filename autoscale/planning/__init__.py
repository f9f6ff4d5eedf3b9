"""Capacity planning in modelled time: one replica on the simulator, the planner, a simulated day, calibration, scheduler A/B."""
