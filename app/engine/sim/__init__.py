"""The simulated runner (a cost model in place of a forward) and its hardware and model profiles."""
