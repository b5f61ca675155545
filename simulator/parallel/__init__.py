"""From (operator graph, plan) to the work of one representative rank per pipeline stage.

Sharding (tensor, sequence, context and expert parallelism), the collectives that sharding implies, the
placement of every communication group on the cluster's tiers, the partition of layers into pipeline
stages and chunks, and the pipeline schedule. Nothing here is timed.
"""
