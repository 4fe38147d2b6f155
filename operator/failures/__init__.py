"""Pods and what befalls them: losses, refusals, capacity waits, gangs, restarts, chaos kills."""
