"""How much memory a run needs: the plan before the first step, and the measured peak beside it."""
