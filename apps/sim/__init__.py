"""Planet-scale models on paper: a discrete-event goodput simulator and a WAN bandwidth model."""
