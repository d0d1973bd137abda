"""Run-time expert placement: a stage plan executed micro-step by micro-step on the EP shards."""
