"""Foresight planner: per-micro-step expert placement from known loads."""
