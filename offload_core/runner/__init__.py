"""The runner: the command line and its config (cli, config, settings, overrides, validate, options, sweep, inputs,
console) and job.run, which composes a run's steps in order: the plan's prepare step (offload_core.plan), then the
run mode (offload_core.jobs) or the server (offload_core.serve)."""
