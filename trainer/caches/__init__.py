"""What a learner keeps beside JAX's compilation cache: Θ₀ and the lowered steps, so a restart trains at once."""
