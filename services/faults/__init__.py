"""The fault suite (issue 15): hostile input, cancel storms, worker and Redis loss, load, run
against a real flashpd stack (Ray Serve + Redis + the tiny model, loopback only).

    stack.py      FaultStack: Redis (pausable, killable), Ray Serve app, replica kill, worker stats
    scenarios.py  one function per fault, each returning counts (a ScenarioResult)
    cli.py        `flashpd faults`: the full counts, results in bench/results/faults.md

tests/faults/ runs the same scenarios with smaller counts (pytest marker `faults`).
"""
