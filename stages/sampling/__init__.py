"""Sampling: seeds and noise, the Euler ODE and Flow-GRPO SDE samplers, and batched rollouts."""
