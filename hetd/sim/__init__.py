"""The simulator: the engine and policies under a virtual clock, simulated workers, scenarios and results."""
