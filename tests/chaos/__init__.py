"""Fault-injection suite: real servers, three `relay run` replicas, randomized faults
from a printed seed, and a checker over the recorded history (see README, Reliability).

    .venv/bin/python -m tests.chaos [--long | --medium] [--seed N]
"""
