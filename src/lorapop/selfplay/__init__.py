"""The self-play loop: a step is the five phase calls; the policy update; step records."""
