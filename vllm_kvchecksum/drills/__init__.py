"""The drills of `make demo` and `make soak`: faults made on purpose, the fault-injecting
connector that makes them in a real transfer, and the ground truth that judges the checksums.

Never needed to run the checksums; builds on the core and the engine side.
"""
