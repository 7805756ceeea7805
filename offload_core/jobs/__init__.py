"""The ways a run goes once planned: one dispatched model, measured and always released, then a single prompt, a
prompts file in batches, an encoder's forward or a diffusers pipeline; the results and figures they record."""
