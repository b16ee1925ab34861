"""Resilience: what keeps a job going when a process, a node or a collective fails, and what it
costs (docs/resilience.md): the hang watchdog (watchdog.py), the goodput ledger (goodput.py), the
reading of a lost session's files (incidents.py); the hook that journals restarts is orchestrator/restarts.py.
"""
