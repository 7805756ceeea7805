"""The runner, cut by stage: the edge (cli, config, settings, overrides, validate, options, sweep, inputs) and modes/
(the measured dispatch context and the single, batched, encoder and pipeline runs); job.run reads the steps in order,
the plan's prepare step (offload_core.plan) first."""
