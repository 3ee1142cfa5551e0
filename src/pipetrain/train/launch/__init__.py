"""Train launch: starting the workers (locally or under torchrun), injected faults, the
console's quiet, and fault-tolerant replicas over torchft."""
