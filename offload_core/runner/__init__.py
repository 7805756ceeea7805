"""The runner, cut by stage: the edge (cli, config, settings, overrides, validate, options, sweep, inputs), plan/
(the prepare step: model, batches, plan, prediction, report) and modes/ (the measured dispatch context and the
single, batched, encoder and pipeline runs); job.run reads the steps in order."""
