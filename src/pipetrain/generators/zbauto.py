"""zb-auto: Zero Bubble's automatic schedule search under a memory limit."""
