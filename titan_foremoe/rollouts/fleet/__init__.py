"""The engine fleet: how many inference engines a job runs, where, who feeds each its weights (``layout``), and
which engine serves each prompt's samples (``dealing``). Pure functions of the config and the step's requests,
shared by the runtime (``rollouts/sources``) and the simulator (``simulator/rollout.py``), so the simulator
charges the fleet the runtime drives."""
