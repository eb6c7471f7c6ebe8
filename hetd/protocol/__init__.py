"""Wire protocol v1: message framing, typed messages in both directions, and the worker's plan."""
