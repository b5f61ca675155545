"""Searching layouts: enumerating the parallel layouts of a job (:mod:`.layouts`) and the auto-planner that ranks
them through the engine (:mod:`.planner`)."""
